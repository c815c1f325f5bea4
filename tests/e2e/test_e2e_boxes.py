"""The federation across simulated boxes (tests/helpers/netboxes.py): the coordinator in one network namespace,
two workers in two others, one of them behind a 1 Mbit/s link. Workers reply with update logs, so after
the first round (weights and shards down) the slow link carries a few kilobytes per expert per round;
the slow worker trains on while its replies go up, the fast one is joined with --no-speculate.
"""

from __future__ import annotations

import os
import sys
import time

from soma_edge.expert import params
from soma_edge.processes.launch import free_port
from soma_edge.rundir.layout import RunDir
from tests.helpers import netboxes
from tests.helpers.corpus import write_stdlib_corpus
from tests.helpers.federation import START_TIMEOUT
from worker import speculation

CONFIG = """
seed = 6
[data]
batch = 8
seq_len = 64
[spsa]
decoder = "spsa"
[federation]
join_grace = 0.0  # every worker is there at once; the grace is tested in test_e2e_operator.py
experts = 2
rounds = 3
round_seconds = 5.0
deadline_factor = 1.5
deadline_slack = 40.0
val_windows = 16
min_nodes = 2
wait_seconds = 120
reply = "log"
"""


def test_log_replies_across_namespaces_with_a_slow_link(tmp_path):
    netboxes.require()
    src = write_stdlib_corpus(tmp_path / "corpus")
    (tmp_path / "fed.toml").write_text(CONFIG)
    env = dict(os.environ, SOMA_CACHE=str(tmp_path / "cache"))
    run = tmp_path / "run"
    port = free_port()
    boxes = netboxes.Boxes()
    try:
        coord = boxes.add("coord")
        slow = boxes.add("slow", link_to=coord, mbit=1)
        fast = boxes.add("fast", link_to=coord)
        start = boxes.popen(
            coord,
            [
                sys.executable,
                "-m",
                "coordinator",
                "start",
                "--run",
                str(run),
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
        for box in (slow, fast):
            name = box.name.rsplit("-", 1)[1]
            boxes.popen(
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
                ]
                + (["--no-speculate"] if name == "fast" else []),
                tmp_path / f"{name}.log",
                env=env,
            )
        code = start.wait(START_TIMEOUT)
        assert code == 0, (tmp_path / "start.log").read_text(errors="replace")[-3000:]
    finally:
        boxes.close()
    assert boxes.leftovers() == [] and all(p.poll() is not None for p in boxes.procs)

    rd = RunDir(run)
    assert rd.read_state().round == 3
    lines = rd.read_metrics()
    experts = [m for m in lines if m["type"] == "expert"]
    on_slow = [m for m in experts if m["node"] == "slow"]
    assert on_slow and all(m["accepted"] for m in on_slow if m["round"] >= 2), [
        (m["round"], m.get("reason")) for m in on_slow
    ]
    assert {m["round"] for m in on_slow} >= {2, 3}
    # Upstream, a log reply is under 1% of what weights mode sends for the same expert: its weights and
    # the Adam moments (float32 each).
    size = params.layout(rd.load_config().model).size
    for r in range(2, 4):
        line = next(m for m in lines if m["type"] == "round" and m["round"] == r)
        results = sum(1 for m in experts if m["round"] == r and m["accepted"])
        assert results == 2 and line["bytes_up"] < 0.01 * results * 3 * 4 * size, (line["bytes_up"], size)
    assert all(m["log_bytes_up"] and m["log_bytes_up"]["decoder"] == 0 for m in experts if m["accepted"])
    # The slow worker went on training while its replies went up (worker.speculation), and its trainer
    # stopped with the run; the fast one, joined with --no-speculate, never started one.
    assert "trained while the last reply went up" in (tmp_path / "slow.log").read_text(errors="replace")
    assert not (tmp_path / "fast" / speculation.FOLDER).exists()
    until = time.monotonic() + 20
    while speculation.running(tmp_path / "slow"):
        assert time.monotonic() < until, "a speculating trainer outlived the run"
        time.sleep(0.2)
