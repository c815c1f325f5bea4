"""A poisoned worker, with real processes over TLS and authentication on 127.0.0.1.

The liar is a registered worker (its key added to the live run) whose ClientApp is wrapped through its
PYTHONPATH (tests/e2e/poison/sitecustomize.py): it trains, then sends its experts scaled by 10 or replaced by
noise, with correct shapes and hashes. The best-loss bound must refuse every such reply, strike the
liar's key out, keep a good version of every expert, and finish the run with the honest worker.
Small shard pieces (128 KiB) make the shards travel as several real `query.shards` messages too.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

from soma_edge import checkpoint
from soma_edge.rundir import RunDir
from tests.helpers.federation import cli, finish, metric_lines, secure_federation, secure_join

POISON = Path(__file__).parent / "poison"
TOL = 0.5
CONFIG = f"""
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
guard_tolerance = {TOL}
max_strikes = 2
piece_bytes = 131072
# The lie is in the weights, for the guard to refuse: a weights reply. (In a log reply the same lie hashes
# to weights the log does not replay to, and is refused before the guard: tests/federation/test_replay.py.)
reply = "weights"
"""


def test_poisoned_worker_is_refused_struck_out_and_the_run_completes(tmp_path):
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
    cmd = secure_join(tmp_path, port, "liar")
    liar_env = dict(env, PYTHONPATH=os.pathsep.join([str(POISON), env.get("PYTHONPATH", "")]), SOMA_TEST_POISON="mixed")
    with open(tmp_path / "liar.log", "ab") as out:
        liar = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=liar_env, start_new_session=True)
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
    assert rejected and all(x["node"] == "liar" and x.get("guard") for x in rejected), rejected
    assert all(x["val_loss"] > 4.0 for x in rejected)  # the lies were bad, not borderline
    experts = metric_lines(rd, "expert")
    assert not any(m["accepted"] and m["node"] == "liar" for m in experts)
    out_round = next(m["round"] for m in rounds if "liar" in m["excluded"])
    # The round after the strike-out went ahead of that round's checks: the liar's part of it counts for
    # nothing; from the next one on, only the honest worker trains.
    assert all(m["node"] == "w0" and m["accepted"] for m in experts if m["round"] > out_round + 1)
    assert out_round + 1 < 5
    # Struck out by its registered key, which `soma-coord workers` reports.
    (fp,) = [w["fingerprint"] for w in json.loads((fed["run"] / "workers.json").read_text()) if w["name"] == "liar"]
    assert state.strikes[f"key:{fp}"]["count"] >= 2 and set(state.strikes) == {f"key:{fp}"}
    r = cli(tmp_path, env, "coordinator", "workers", str(fed["run"]))
    assert re.search(r"liar .* [2-9]\d* excluded", r.stdout), r.stdout
    # Every expert keeps a version no worse than its version 0, and its best is on disk.
    for e in range(4):
        v0 = checkpoint.load(rd.root / f"experts/{e}/v0.msgpack", "expert")["val_loss"]
        best = state.expert(e).best_or_current()
        assert best.val_loss <= v0 and state.expert(e).val_loss <= best.val_loss + TOL
        assert checkpoint.load(rd.root / best.path, "expert")["sha256"] == best.sha256
