"""A failure belongs to its expert: an expert that cannot train (a shard too short for one window, an error
while it trains) fails alone, its reason said once, and it is not handed out again; the others of the same
request train and commit. A run whose experts never advanced says which and why; one where none can train
stops with an internal error."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest

from coordinator.loop import Coordinator, NoTrainableExpert
from coordinator.progress import experts_table, summary
from soma_edge.errors import ValidationError
from soma_edge.rundir.state import PrepareSummary
from soma_edge.wire import protocol
from tests.helpers.fakegrid import FakeGrid, equal_rates
from worker import task as worker_task

BAD = 1  # the expert made to fail


def _shrink_train_shard(run, expert: int, size: int) -> None:
    """Make `expert`'s train shard `size` bytes long, as a cluster of a few short documents is at large N."""
    prep = json.loads(run.prepare_json.read_text())
    for c in prep["clusters"]:
        if c["expert"] == expert:
            data = (run.root / "shards" / f"{c['shards']['train']}.bin").read_bytes()[:size]
            digest = hashlib.sha256(data).hexdigest()  # content-addressed: its new bytes get a new name
            (run.root / "shards" / f"{digest}.bin").write_bytes(data)
            c["shards"]["train"], c["bytes"]["train"] = digest, len(data)
    run.prepare_json.write_text(json.dumps(prep, indent=1) + "\n")
    PrepareSummary.from_dict(prep, "test")  # still a valid prepare.json


def test_an_expert_whose_shard_cannot_hold_a_window_is_left_out_once_and_the_others_train(
    run, tmp_path, monkeypatch, caplog
):
    equal_rates(monkeypatch)
    _shrink_train_shard(run, BAD, 20)  # fewer than seq_len + 1 = 33 bytes
    sent = []
    real = worker_task.run
    monkeypatch.setattr(worker_task, "run", lambda t, *a, **k: sent.append(t["expert"]) or real(t, *a, **k))
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    with caplog.at_level(logging.INFO, logger="soma.coord"):
        state = Coordinator(grid, run).main()
    assert BAD not in sent  # never handed out: every worker would fail it every round
    assert all(state.expert(e).version == 2 for e in range(4) if e != BAD)
    bad = state.expert(BAD)
    assert bad.version == 0 and bad.cannot_train == "its train shards hold 20 bytes, fewer than seq_len + 1 = 33"
    said = [r.getMessage() for r in caplog.records if r.name == "soma.coord" and "cannot train" in r.getMessage()]
    assert len(said) == 1 and f"expert {BAD}: 20" in said[0]  # once, with the expert and the reason
    last = [r.getMessage() for r in caplog.records if "never advanced" in r.getMessage()]
    assert last == [f"1 of 4 experts never advanced in this run: expert {BAD}: {bad.cannot_train}"]
    status = json.loads(run.status_path.read_text())
    assert status["phase"] == "done" and status["never_advanced"] == {str(BAD): bad.cannot_train}
    s = summary(run)  # `soma-coord status` reads it from state.msgpack
    assert s["experts"][str(BAD)]["cannot_train"] == bad.cannot_train
    assert f"left out, cannot train: expert {BAD}" in experts_table(s).caption


def test_an_expert_that_fails_on_its_worker_fails_alone_and_is_not_sent_again(run, tmp_path, monkeypatch, caplog):
    """A worker's error while one expert trains (here a graph error, made up): the other experts of the same
    request train and commit in that round; the coordinator says why once and does not send it again."""
    equal_rates(monkeypatch)
    real, sent = worker_task.run, []

    def run_task(t, *a, **k):
        sent.append(t["expert"])
        if t["expert"] == BAD:
            raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : a graph error\nwith a second line")
        return real(t, *a, **k)

    monkeypatch.setattr(worker_task, "run", run_task)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    with caplog.at_level(logging.INFO, logger="soma.coord"):
        state = Coordinator(grid, run).main()
    assert sent.count(BAD) == 1  # round 1 only
    assert all(state.expert(e).version == 2 for e in range(4) if e != BAD)  # its request's other expert too
    reason = state.expert(BAD).cannot_train
    assert reason.endswith("RuntimeError: [ONNXRuntimeError] : 1 : FAIL : a graph error with a second line")
    said = [r.getMessage() for r in caplog.records if r.name == "soma.coord" and "cannot train" in r.getMessage()]
    assert len(said) == 1 and "left out of the rounds that follow" in said[0]
    committed = [r.getMessage() for r in caplog.records if "committed" in r.getMessage()]
    assert committed[0].startswith("round 1/2 committed: 3/4 experts advanced")


def test_when_no_expert_can_train_the_coordinator_stops_with_an_internal_error(run, tmp_path, monkeypatch):
    equal_rates(monkeypatch)
    for e in range(4):
        _shrink_train_shard(run, e, 10)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    with pytest.raises(NoTrainableExpert, match=r"no expert can train: 4 experts \(0, 1, 2, 3\): its train shards"):
        Coordinator(grid, run).main()
    status = json.loads(run.status_path.read_text())
    assert status["phase"] == "failed" and status["user_error"] is False  # `soma-coord start` exits 1
    assert all(x["cannot_train"] for x in summary(run)["experts"].values())


def test_a_reply_names_only_experts_of_its_request_as_failed():
    exp = protocol.Expected(node=7, round=1, tasks={0: {}, 2: {}}, size=10, reply_dtype="float32")
    protocol.check_failures([protocol.failure(2, "x" * 1000)], exp)  # cut to MAX_REASON
    assert len(protocol.failure(2, "x" * 1000)["reason"]) == protocol.MAX_REASON
    for bad in ([{"expert": 1, "reason": "r"}], [{"expert": 0}], [protocol.failure(0, "a"), protocol.failure(0, "b")]):
        with pytest.raises(ValidationError):
            protocol.check_failures(bad, exp)
    with pytest.raises(ValidationError):
        protocol.check_failures("not a list", exp)


class _NoProcs:
    procs: list = []


def _follow(run, status: dict, capsys) -> tuple[int, str, str]:
    from coordinator import start

    run.logs.mkdir(parents=True, exist_ok=True)
    run.status_path.write_text(json.dumps({"pid": 0, "round": 2, "rounds": 2, "experts": {}, "nodes": {}, **status}))
    code = start.follow(run, _NoProcs(), "run-id", t_submit=0.0)
    out, err = capsys.readouterr()
    return code, out, err


def test_soma_coord_start_ends_with_one_line_for_what_went_wrong(run, capsys):
    """`soma-coord start` following a ServerApp that failed inside (no expert could train): one `error:` line
    and exit 1; one that completed with experts that never advanced: a `warning:` line naming them and why."""
    import time

    code, out, err = _follow(
        run,
        {"phase": "failed", "time": time.time(), "message": "NoTrainableExpert: no expert...", "user_error": False},
        capsys,
    )
    assert (
        code == 1
        and err.startswith("error: the coordinator (ServerApp) failed: NoTrainableExpert")
        and err.count("\n") == 1
    )
    left = {"1": "node b: RuntimeError: a graph error", "3": "node b: RuntimeError: a graph error"}
    experts = {str(e): {"version": 0, "sha256": "0" * 64, "path": None} for e in range(4)}
    code, out, err = _follow(
        run, {"phase": "done", "time": time.time(), "never_advanced": left, "experts": experts}, capsys
    )
    assert code == 0
    assert "warning: 2 of 4 experts never advanced in this run: 2 experts (1, 3): node b: RuntimeError" in out
