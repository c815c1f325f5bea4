"""Strikes outlive a real coordinator restart under `--auth`: they count against the worker's registered
key, never the Flower node id, and commit in state.msgpack.

Real processes over TLS with authentication on 127.0.0.1: `soma-coord start --tls --auth` with one local
(honest, registered) worker w0, and a registered liar (tests/e2e/poison) that is struck out in the first
run. The coordinator is then interrupted (Ctrl-C: everything it started stops) and started again on the
same run directory, which resumes it on a new SuperLink. The same key joins again through a new SuperNode,
so with a new node id: it must be refused at its capability reply, by its key and the committed count,
before it is given any work, while w0 trains on. Keyed on node ids, or lost on the restart, the liar would
be a stranger with no strikes: it would get experts, lie, and be struck again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

from soma_edge.rundir import RunDir
from tests.helpers.federation import (
    START_TIMEOUT,
    cli,
    leftovers,
    log_tails,
    metric_lines,
    secure_federation,
    secure_join,
    start_coordinator,
    wait_until,
)

POISON = Path(__file__).parent / "poison"
CONFIG = """
seed = 5
[model]
embed = 8
hidden = 16
[data]
batch = 4
seq_len = 32
[federation]
join_grace = 0.0  # the liar is in before round 1 (min_nodes = 2); the grace is tested in test_e2e_operator.py
experts = 4
rounds = 30  # never reached: each coordinator is interrupted once it has shown what the test needs
round_seconds = 2.0
deadline_factor = 1.0
deadline_slack = 8.0
val_windows = 16
local_workers = 1
min_nodes = 2
wait_seconds = 120
keep_versions = 10
# The liar's replies are > 4 nats/byte worse than any best; 0.5 keeps honest overshoots from striking w0.
guard_tolerance = 0.5
# 2, not the default 3: the liar gets two of the four experts in round 1, so both strikes come in the
# first round it trains, and it is out at once. What is under test is that the count outlives a restart.
max_strikes = 2
"""


def _liar(tmp_path: Path, env: dict, port: str, log: str) -> subprocess.Popen:
    """The registered liar's `soma-worker join` (a new SuperNode each time), its ClientApp poisoned."""
    env = dict(env, PYTHONPATH=os.pathsep.join([str(POISON), env.get("PYTHONPATH", "")]), SOMA_TEST_POISON="mixed")
    with open(tmp_path / log, "ab") as out:
        return subprocess.Popen(
            secure_join(tmp_path, port, "liar"), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def _interrupt(fed, proc: subprocess.Popen) -> int:
    """Ctrl-C on `start`: it stops the SuperLink, the ServerApp and its local workers; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("start did not stop within 60 s of Ctrl-C" + log_tails(fed)) from None


def _node_id(run: Path, name: str) -> int:
    (nid,) = [w["node_id"] for w in json.loads((run / "workers.json").read_text()) if w["name"] == name]
    return nid


def test_a_struck_key_stays_struck_after_the_coordinator_restarts(tmp_path):
    fed, proc, port = secure_federation(tmp_path, CONFIG, "liar")
    env, run, rd = fed["env"], fed["run"], RunDir(fed["run"])
    coord_log = run / "logs" / "coordinator.log"
    coords, liars = [proc], []
    try:
        pub = str(tmp_path / "liar" / "worker.pub")
        r = cli(tmp_path, env, "coordinator", "add-worker", str(run), pub, "--name", "liar")
        assert r.returncode == 0, r.stdout + r.stderr
        (fp,) = [w["fingerprint"] for w in json.loads((run / "workers.json").read_text()) if w["name"] == "liar"]
        key = f"key:{fp}"
        first_id = _node_id(run, "liar")
        liars.append(_liar(tmp_path, env, port, "liar-1.log"))

        # First run: the liar is struck out, and the strikes are committed with their round.
        def struck_out() -> bool:
            state = rd.read_state()
            return state is not None and state.strikes.get(key, {}).get("count", 0) >= 2

        wait_until(struck_out, START_TIMEOUT, "the liar's strikes to commit", fed)
        assert _interrupt(fed, proc) == 130
        before = rd.read_state()
        struck, stopped_at = before.strikes[key]["count"], before.round
        assert "weights replaced" in (tmp_path / "liar-1.log").read_text(errors="replace")  # the lie really ran
        assert any("liar" in m["excluded"] for m in metric_lines(rd, "round"))
        os.killpg(liars[0].pid, signal.SIGKILL)
        liars[0].wait()
        wait_until(lambda: not leftovers(run), 30, f"no processes of the run left: {leftovers(run)}", fed)

        # A real restart: a new `start` on the same RUN resumes it, with a new SuperLink and new node ids.
        # --min-nodes 1: the resumed run must not wait for the liar, whom it refuses, before its first round.
        proc = start_coordinator(fed, "--tls", str(tmp_path / "tls"), "--auth", "--min-nodes", "1")
        coords.append(proc)
        log = tmp_path / "start.log"
        wait_until(lambda: log.read_text(errors="replace").count("registered") >= 2, START_TIMEOUT, "the restart", fed)
        port = re.findall(r"SuperLink listening on 127\.0\.0\.1:(\d+)", log.read_text())[-1]
        wait_until(rd.is_locked, START_TIMEOUT, "the resumed ServerApp to hold the run", fed)
        second_id = _node_id(run, "liar")
        assert second_id != first_id  # the key is known to the new SuperLink under another node id
        liars.append(_liar(tmp_path, env, port, "liar-2.log"))

        # Refused at its capability reply, by its key and the committed count ...
        refused = f"node {second_id} (liar) is excluded from this run: {struck} strikes against {key}"
        wait_until(lambda: refused in coord_log.read_text(errors="replace"), START_TIMEOUT, refused, fed)
        # ... while the honest registered worker trains on in the resumed run.
        wait_until(
            lambda: any(m["round"] > stopped_at and m["accepted"] for m in metric_lines(rd, "expert")),
            START_TIMEOUT,
            "an accepted version after the restart",
            fed,
        )
        status = rd.read_status()
        assert status["nodes"][str(second_id)]["status"] == "excluded", status["nodes"]
        assert _interrupt(fed, proc) == 130
    finally:
        for p in liars:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in coords:
            if p.poll() is None:
                _interrupt(fed, p)

    after = rd.read_state()
    assert after.round > stopped_at
    # Refused before any work: no new strike, no reply, no version of the liar's after the restart.
    assert after.strikes[key]["count"] == struck and all(w.startswith("key:") for w in after.strikes), after.strikes
    later = [m for m in metric_lines(rd, "expert") if m["round"] > stopped_at]
    assert later and all(m["node"] == "w0" for m in later), later
    rejected = [x for m in metric_lines(rd, "round") if m["round"] > stopped_at for x in m["rejected"]]
    assert not any(x["node"] == "liar" for x in rejected), rejected
    assert "weights replaced" not in (tmp_path / "liar-2.log").read_text(errors="replace")
    r = cli(tmp_path, env, "coordinator", "workers", str(run))
    assert re.search(rf"liar +{fp} +{second_id} +{struck} excluded", r.stdout), r.stdout
