"""A federation across simulated boxes (tests/helpers/netboxes.py) as an operator meets it, with real Flower
processes: workers started 2 s apart both work in round 1, a worker whose box dies (SIGKILL of every
process in its namespace) early in round 2 holds the round for well under its deadline (~20 s, with the
10 s heartbeats the coordinator advises for a small expert), the console tells what
happened as it happens, and when the run ends every surviving `soma-worker join` exits 0 by itself.

The time bounds are liveness bounds with slack for a loaded 2-core machine, not performance figures.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from soma_edge.processes.launch import free_port
from soma_edge.rundir.layout import RunDir
from tests.helpers import netboxes
from tests.helpers.corpus import write_stdlib_corpus
from tests.helpers.federation import START_TIMEOUT

DEADLINE_SLACK = 60.0
CONFIG = f"""
seed = 6
[model]  # small: a version and a piece of shards cross even an unmeasured (1 Mbit/s) link within 10 s
embed = 16
hidden = 32
[data]
batch = 8
seq_len = 64
[federation]
experts = 3
rounds = 3
round_seconds = 6.0
deadline_factor = 1.5
deadline_slack = {DEADLINE_SLACK}
val_windows = 16
min_nodes = 1
wait_seconds = 120
"""


def _wait_for(what, timeout: float, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(every)
    return None


def _status(rd: RunDir) -> dict:
    try:
        return json.loads(rd.status_path.read_text())
    except (OSError, ValueError):
        return {}


def _round_line(rd: RunDir, r: int) -> dict | None:
    try:
        return next((m for m in rd.read_metrics() if m["type"] == "round" and m["round"] == r), None)
    except Exception:  # a metrics file being rewritten
        return None


def test_operator_story_across_namespaces(tmp_path):
    netboxes.require()
    src = write_stdlib_corpus(tmp_path / "corpus")
    (tmp_path / "fed.toml").write_text(CONFIG)
    env = dict(os.environ, SOMA_CACHE=str(tmp_path / "cache"))
    rd, port = RunDir(tmp_path / "run"), free_port()
    boxes = netboxes.Boxes()
    try:
        coord = boxes.add("coord")
        workers = {name: boxes.add(name, link_to=coord) for name in ("a", "b", "c")}
        start = boxes.popen(
            coord,
            [
                sys.executable,
                "-m",
                "coordinator",
                "start",
                "--run",
                str(rd.root),
                "--config",
                str(tmp_path / "fed.toml"),
                "--corpus",
                str(src),
                "--host",
                "0.0.0.0",
                "--port",
                str(port),
            ],
            tmp_path / "start.log",
            env=env,
            cwd=tmp_path,
        )
        joins = {}
        for name, box in workers.items():
            joins[name] = boxes.popen(
                box,
                [
                    sys.executable,
                    "-m",
                    "worker.cli",
                    "join",
                    "--coordinator",
                    f"{box.peer}:{port}",
                    "--name",
                    name,
                    "--cache",
                    str(tmp_path / name),
                    "--threads",
                    "1",
                    "--no-spin",
                    "--parallel",
                    "1",
                ],
                tmp_path / f"{name}.log",
                env=env,
            )
            if name == "a":
                time.sleep(2.0)  # b and c join 2 s after a; min_nodes = 1, so a alone could start round 1

        # As round 2 goes out (the workers report 10 s heartbeats from the capability query on, as the
        # coordinator advises for a small expert; the victim may not even have pulled its round-2 request yet):
        # kill the box of a worker that holds an expert in it. It must be declared gone within 30 s. At once,
        # not a moment later: a worker's speculating trainer may have run the whole round ahead, and its
        # ClientApp then replies as soon as the request comes (seen 5 s after the plan, and before a kill 2 s
        # after the status said round 2).
        st = _wait_for(
            lambda: (s := _status(rd)).get("phase") == "round" and s.get("round") == 2 and s, START_TIMEOUT, every=0.05
        )
        assert st, (tmp_path / "start.log").read_text(errors="replace")[-3000:]
        victim = sorted(set(st["assignment"].values()))[-1]
        t_kill = time.monotonic()
        for pid in boxes.pids(workers[victim]):
            os.kill(pid, signal.SIGKILL)
        r2 = _wait_for(lambda: _round_line(rd, 2), 120, every=0.5)
        t_round2 = time.monotonic()
        assert r2, (tmp_path / "start.log").read_text(errors="replace")[-3000:]

        assert start.wait(START_TIMEOUT) == 0, (tmp_path / "start.log").read_text(errors="replace")[-3000:]
        t_end = time.monotonic()
        survivors = [n for n in joins if n != victim]
        codes = {n: joins[n].wait(max(1.0, t_end + 30 - time.monotonic())) for n in survivors}
    finally:
        boxes.close()
    assert boxes.leftovers() == [] and all(p.poll() is not None for p in boxes.procs)
    console = (tmp_path / "start.log").read_text(errors="replace")

    # The join grace: b, joining 2 s after a, was in before round 1 was planned. (Whether b then gets an expert
    # is the scheduler's call on the probed rates, which three workers probing at once on 2 cores spread 3x.)
    lines = rd.read_metrics()
    r1 = {m["node"] for m in lines if m["type"] == "expert" and m["round"] == 1 and m["accepted"]}
    assert r1, r1
    assert 0 <= console.find("(b) active") < console.find("round 1/3:"), console[:3000]
    # The dead box held round 2 for well under its deadline (it was declared gone within 30 s of the kill),
    # and its experts trained again in round 3.
    deadline = 6.0 * 1.5 + DEADLINE_SLACK
    assert t_round2 - t_kill < 30 and r2["round_seconds_total"] < deadline - 20, (t_round2 - t_kill, r2)
    lost = [m["expert"] for m in lines if m["type"] == "expert" and m["round"] == 2 and m["node"] == victim]
    assert lost and all(
        not m["accepted"] for m in lines if m["type"] == "expert" and m["round"] == 2 and m["expert"] in lost
    )
    later = [m for m in lines if m["type"] == "expert" and m["round"] == 3]
    assert len(later) == 3 and all(m["accepted"] and m["node"] != victim for m in later), later
    # The console (piped to a file) told the story as it happened.
    assert "(a) active" in console and f"({victim}) is gone (no heartbeat)" in console
    assert f"run over (complete): {len(survivors)} worker(s) told" in console
    # Every surviving worker said the run ended and exited 0 within 30 s of it; no colour codes, no
    # per-message lines from Flower.
    assert codes == {n: 0 for n in survivors}, codes
    for n in survivors:
        out = (tmp_path / f"{n}.log").read_text(errors="replace")
        assert f"soma-worker {n}: the run ended (3/3 rounds, complete); exiting" in out, out[-2000:]
        assert "\x1b[" not in out and "Receiving:" not in out
