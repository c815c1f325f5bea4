"""A real federation whose worker trains with the population evaluator (spsa.evaluator = "population": one
ORT call per minibatch for its clean forward and 2K probes, the expert resident in the worker's update
graph) and replies with update logs: `soma-coord start` with a real flower-superlink and SuperNode, Flower's
ServerApp and ClientApp processes. The coordinator replays each log, audits sampled steps with the loop,
and accepts it; every version names the evaluator that made it, and the held-out loss falls."""

from __future__ import annotations

import os

from soma_edge.rundir.layout import RunDir
from tests.helpers.corpus import write_stdlib_corpus
from tests.helpers.federation import finish, leftovers, metric_lines, start_coordinator, val_loss, wait_until

CONFIG = """
seed = 5
[model]
embed = 16
hidden = 32
[data]
batch = 8
seq_len = 64
[spsa]
directions = 4
warmup_steps = 0
evaluator = "population"
[federation]
join_grace = 0.0
experts = 2
rounds = 2
round_seconds = 3.0
deadline_factor = 1.5
deadline_slack = 12.0
val_windows = 16
local_workers = 1
reply = "log"
audit_steps = 2
"""


def test_a_population_worker_trains_and_its_log_replies_are_accepted(tmp_path):
    (tmp_path / "pop.toml").write_text(CONFIG)
    fed = {
        "root": tmp_path,
        "run": tmp_path / "run",
        "corpus": write_stdlib_corpus(tmp_path / "corpus"),
        "config": tmp_path / "pop.toml",
        "env": dict(os.environ, SOMA_CACHE=str(tmp_path / "cache")),
    }
    finish(fed, start_coordinator(fed))
    rd = RunDir(fed["run"])
    state = rd.read_state()
    lines = metric_lines(rd, "expert")
    assert state.round == 2 and len(lines) == 4, lines
    for m in lines:  # each version: a log reply (no weights up), audited and accepted, made by the population
        assert m["accepted"] and m["evaluator"] == "population", m
        assert m["weights_bytes_up"] == 0 and m["log_bytes_up"], m
    assert not [x for m in metric_lines(rd, "round") for x in m["rejected"]]
    for e in range(2):
        assert state.expert(e).version == 2
        before, after = val_loss(rd, e, 0), val_loss(rd, e, 2)
        assert after < before, (e, before, after)
    wait_until(lambda: not leftovers(fed["run"]), 30, f"no processes of the run left: {leftovers(fed['run'])}")
