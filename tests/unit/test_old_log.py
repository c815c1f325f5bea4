"""Update logs as workers already send them: tests/fixtures/old_log/logs.msgpack holds three logs written
at commit 6f1aa2e, before any change to the estimator (the shipped Rademacher-sparse Adam step with the
delta-rule decoder coded in int8; the paper's expert with rank-1 noise; rank-1 noise with the RMS update
and an SPSA decoder), each with the version it started from and the sha256 its replay reached then.
Today's coordinator must still rebuild each one bit for bit and pass its audit: a change of the step that
breaks them breaks every log in flight and every run that resumes across an upgrade. Never regenerate it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coordinator import replay as coord_replay
from soma_edge import checkpoint
from soma_edge.config import SAVED_WITHOUT, Evaluator, from_dict
from soma_edge.engine.evaluator import evaluator_for
from soma_edge.spsa.log import UpdateLog
from soma_edge.spsa.optim import OptState, State
from soma_edge.wire.protocol import weights_sha256

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "old_log" / "logs.msgpack"
OLD = checkpoint.load(FIXTURE, "old_logs")


@pytest.mark.parametrize("name", sorted(OLD["logs"]))
def test_an_old_update_log_still_replays_to_its_version_and_passes_the_audit(name):
    job = OLD["logs"][name]
    # keys added since read as the run's own run.toml reads them: those it predates as it trained (SAVED_WITHOUT)
    cfg = from_dict({**job["config"], "spsa": SAVED_WITHOUT | job["config"].get("spsa", {})})
    base = State(job["weights"], step=job["step"], opt=OptState.from_record(job["opt"], job["weights"].size))
    log = UpdateLog.from_record(job["log"])
    got = coord_replay.rebuild(cfg, base, log, job["expert"])
    assert got.step == job["end_step"] and weights_sha256(got.weights) == job["end_sha256"]
    assert base.weights.tobytes() == job["weights"].tobytes()  # the replay leaves the version as it was
    data = np.frombuffer(OLD["data"], dtype=np.uint8)
    ev = evaluator_for(cfg, "cpu", threads=1, parallel=1, evaluator=Evaluator.LOOP)
    coord_replay.audit(cfg, base, log, job["expert"], data, ev, [0, log.steps // 2, log.steps - 1])
