"""A poisoned worker, with real processes over TLS and authentication on 127.0.0.1.

The liar is a registered worker (its key added to the live run) whose ClientApp is wrapped through its
PYTHONPATH (tests/e2e/poison/sitecustomize.py): it trains, then sends its experts scaled by 10 or replaced by
noise, with correct shapes and hashes. The best-loss bound must refuse every such reply, strike the
liar's key out, keep a good version of every expert, and finish the run with the honest worker.
Small shard pieces (128 KiB) make the shards travel as several real `query.shards` messages too.

Then the strikes must outlive a real coordinator restart: they count against the worker's registered key,
never the Flower node id, and commit in state.msgpack. A new `start` on the same run resumes it on a new
SuperLink; the same key joins again through a new SuperNode, so with a new node id. It must be refused at its
capability reply, by its key and the committed count, before it is given any work, while w0 trains on. Keyed
on node ids, or lost on the restart, the liar would be a stranger with no strikes: it would get experts, lie,
and be struck again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

from soma_edge import checkpoint
from soma_edge.rundir.layout import RunDir
from tests.helpers.federation import (
    START_TIMEOUT,
    cli,
    finish,
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
join_grace = 0.0  # every worker is there at once; the grace is tested in test_e2e_operator.py
experts = 4
rounds = 5
round_seconds = 3.0
deadline_factor = 1.0
deadline_slack = 8.0
val_windows = 16
local_workers = 1
min_nodes = 2
wait_seconds = 120
keep_versions = 10
max_strikes = 2
piece_bytes = 131072
# The lie is in the weights, for the guard to refuse: a weights reply. (In a log reply the same lie hashes
# to weights the log does not replay to, and is refused before the guard: tests/federation/test_replay.py.)
reply = "weights"
"""


def _liar(tmp_path: Path, env: dict, port: str, log: str) -> subprocess.Popen:
    """The registered liar's `soma-worker join` (a new SuperNode each time), its ClientApp poisoned."""
    env = dict(env, PYTHONPATH=os.pathsep.join([str(POISON), env.get("PYTHONPATH", "")]), SOMA_TEST_POISON="mixed")
    with open(tmp_path / log, "ab") as out:
        return subprocess.Popen(
            secure_join(port, "liar"),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
            start_new_session=True,
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


def test_poisoned_worker_is_refused_struck_out_and_stays_out_after_a_restart(tmp_path):
    fed, proc, port = secure_federation(tmp_path, CONFIG, "liar")
    env = fed["env"]
    r = cli(
        tmp_path,
        env,
        "coordinator",
        "add-worker",
        str(fed["run"]),
        str(tmp_path / "liar" / "worker.pub"),
        "--name",
        "liar",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    first_id = _node_id(fed["run"], "liar")
    liar = _liar(tmp_path, env, port, "liar.log")
    try:
        finish(fed, proc)
    finally:
        if liar.poll() is None:
            os.killpg(liar.pid, signal.SIGKILL)
    assert "weights replaced" in (tmp_path / "liar.log").read_text(errors="replace")  # the lie really ran

    rd = RunDir(fed["run"])
    state = rd.read_state()
    assert state.round == 5
    coord_log = (fed["run"] / "logs" / "coordinator.log").read_text()
    assert re.search(r"lacks [\d.]+ MiB of shards: [2-9]\d* pieces go before its experts", coord_log)
    rounds = metric_lines(rd, "round")
    rejected = [x for m in rounds for x in m["rejected"]]
    lies = [x for x in rejected if x["node"] == "liar"]
    assert lies and all(x.get("guard") and x["val_loss"] > 4.0 for x in lies), lies  # bad, not borderline
    # w0's steps on these tiny shards may overshoot now and then: a near miss the guard refuses, no strike
    assert all(x.get("guard") and x["strike"] == 0 for x in rejected if x["node"] != "liar"), rejected
    experts = metric_lines(rd, "expert")
    assert not any(m["accepted"] and m["node"] == "liar" for m in experts)
    out_round = next(m["round"] for m in rounds if "liar" in m["excluded"])
    # The round after the strike-out went ahead of that round's checks: the liar's part of it counts for
    # nothing; from the next one on, only the honest worker trains.
    later = [m for m in experts if m["round"] > out_round + 1]
    # (an honest near miss costs its expert that result, and the next one where that round went out from it;
    # on a loaded box w0 may miss a round's deadline, which costs it that round and is no lie)
    honest = re.compile(
        r"rejected: |trained from v\d+, which was refused|node w0 missed the round deadline|node lacked cached data"
    )
    odd = [(m["round"], m["expert"], m["node"], m.get("reason")) for m in later]
    assert all(m["node"] == "w0" and (m["accepted"] or honest.match(m["reason"])) for m in later), odd
    assert out_round + 1 < 5
    # Struck out by its registered key, which `soma-coord workers` reports.
    (fp,) = [w["fingerprint"] for w in json.loads((fed["run"] / "workers.json").read_text()) if w["name"] == "liar"]
    assert state.strikes[f"key:{fp}"]["count"] >= 2 and set(state.strikes) == {f"key:{fp}"}
    r = cli(tmp_path, env, "coordinator", "workers", str(fed["run"]))
    assert re.search(r"liar .* [2-9]\d* excluded", r.stdout), r.stdout
    # Every expert keeps a version no worse than its version 0 and within its margin of the guard's bar, and
    # its best is on disk.
    margin = max(m["guard_margin"] for m in experts if m["accepted"])
    for e in range(4):
        v0 = checkpoint.load(rd.root / f"experts/{e}/v0.msgpack", "expert")["val_loss"]
        x = state.expert(e)
        best = x.best_or_current()
        assert best.val_loss <= v0 and x.val_loss <= x.bar.val_loss + margin
        assert checkpoint.load(rd.root / best.path, "expert")["sha256"] == best.sha256
    _restart_refuses_the_struck_key(tmp_path, fed, fp, first_id)


def _restart_refuses_the_struck_key(tmp_path: Path, fed: dict, fp: str, first_id: int) -> None:
    env, run, rd = fed["env"], fed["run"], RunDir(fed["run"])
    key, stopped_at = f"key:{fp}", rd.read_state().round
    struck = rd.read_state().strikes[key]["count"]
    wait_until(lambda: not leftovers(run), 30, f"no processes of the run left: {leftovers(run)}", fed)
    # A real restart: a new `start` on the same RUN resumes it, with a new SuperLink and new node ids.
    # --min-nodes 1: the resumed run must not wait for the liar, whom it refuses, before its first round.
    proc = start_coordinator(fed, "--tls", str(tmp_path / "tls"), "--auth", "--min-nodes", "1", "--rounds", "30")
    log, coord_log, liar = tmp_path / "start.log", run / "logs" / "coordinator.log", None
    try:
        wait_until(lambda: log.read_text(errors="replace").count("registered") >= 2, START_TIMEOUT, "the restart", fed)
        port = re.findall(r"SuperLink listening on 127\.0\.0\.1:(\d+)", log.read_text())[-1]
        wait_until(rd.is_locked, START_TIMEOUT, "the resumed ServerApp to hold the run", fed)
        second_id = _node_id(run, "liar")
        assert second_id != first_id  # the key is known to the new SuperLink under another node id
        liar = _liar(tmp_path, env, port, "liar-2.log")
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
        # status.json is rewritten as rounds start and commit, so it says so by the next one at the latest.
        wait_until(
            lambda: (rd.read_status() or {}).get("nodes", {}).get(str(second_id), {}).get("status") == "excluded",
            START_TIMEOUT,
            "status.json to show the liar excluded",
            fed,
        )
        assert _interrupt(fed, proc) == 130
    finally:
        if liar is not None and liar.poll() is None:
            os.killpg(liar.pid, signal.SIGKILL)
        if proc.poll() is None:
            _interrupt(fed, proc)

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
