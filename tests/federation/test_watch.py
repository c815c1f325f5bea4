"""Watching a run, with the fake Grid (real training): RUN/tb/, the TensorBoard event files written at
each commit, read back with TensorBoard's own EventAccumulator against metrics.jsonl; and a stop request
(`soma-coord stop`). Real processes: test_e2e_federation.py."""

from __future__ import annotations

import time

import pytest

from coordinator.board import Board
from coordinator.fleet import Fleet
from coordinator.loop import Coordinator, Loop
from soma_edge.wire import protocol
from tests.helpers.board import events
from tests.helpers.fakegrid import FakeGrid, set_fed


def test_event_files_hold_the_metrics_and_a_resume_purges_an_uncommitted_round(run, tmp_path):
    set_fed(run, rounds=2)
    Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main()
    # A crash after round 3's events went out but before its commit: they must not survive the resume.
    board = Board(run.tb, 2)
    board.commit([{"type": "round", "round": 3, "compute_share": 99.0, "rejected": []}])
    board.close()
    set_fed(run, rounds=3)
    Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main()

    assert len(list(run.tb.glob("events.out.tfevents.*"))) == 3  # one file per writer, none overwritten
    got = events(run.tb)
    lines = run.read_metrics()
    experts = [m for m in lines if m["type"] == "expert" and m["accepted"]]
    rounds = [m for m in lines if m["type"] == "round"]
    assert len(experts) == 12 and [m["round"] for m in rounds] == [1, 2, 3]
    for m in experts:
        for key in ("train_loss", "val_loss", "steps_per_s", "lr", "eps"):
            assert got[(f"expert_{m['expert']}/{key}", m["round"])] == [pytest.approx(m[key], rel=1e-6)], (key, m)
        assert got[(f"expert_{m['expert']}/node", m["round"])] == [m["node"]]
    for m in rounds:
        for tag, key in (
            ("mixture_val_loss", "mixture_val_loss"),
            ("compute_share", "compute_share"),
            ("bytes_up", "bytes_up"),
            ("seconds", "round_seconds_total"),
            ("accepted", "accepted"),
        ):
            assert got[(f"round/{tag}", m["round"])] == [pytest.approx(m[key], rel=1e-6)], (tag, m)
        assert got[("round/rejected", m["round"])] == [len(m["rejected"])]
    assert {step for tag, step in got} == {1, 2, 3}  # one value per tag and round: nothing doubled, nothing stale


def test_tensorboard_false_writes_no_event_files(run, tmp_path):
    set_fed(run, rounds=1, tensorboard=False)
    Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main()
    assert not run.tb.exists() and len(run.read_metrics()) == 5


@pytest.mark.parametrize("when,last", [("while round 2 collects", 2), ("when round 3 has gone ahead", 3)])
def test_a_stop_request_ends_the_run_after_the_round_in_progress(run, tmp_path, monkeypatch, when, last):
    set_fed(run, rounds=6)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    coord = Coordinator(grid, run)
    real_collect, real_commit = Loop.collect, Loop.commit

    def collect(self, ctx):
        if ctx.r == 2 and when.startswith("while"):
            run.request_stop()
        return real_collect(self, ctx)

    def commit(self, ctx, t_next):
        if ctx.r == 2 and when.startswith("when"):
            assert t_next is not None  # round 3 went ahead of this commit
            run.request_stop()
        return real_commit(self, ctx, t_next)

    monkeypatch.setattr(Loop, "collect", collect)
    monkeypatch.setattr(Loop, "commit", commit)
    state = coord.main()
    assert state.round == last and [m["round"] for m in run.read_metrics() if m["type"] == "round"] == list(
        range(1, last + 1)
    )
    trains = {
        protocol.unpack(m.content, protocol.KIND_TRAIN)["round"]
        for m in grid.sent
        if m.metadata.message_type == protocol.TRAIN
    }
    assert max(trains) == last  # nothing went out past the stop
    ends = [
        protocol.unpack(m.content, protocol.KIND_END)
        for m in grid.sent
        if m.metadata.message_type == protocol.QUERY_END
    ]
    assert len(ends) == 2 and all("soma-coord stop" in e["why"] for e in ends)
    assert run.read_status()["stopped"] and not run.stop_path.exists()
    assert Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main().round == 6  # and it resumes


def test_a_stop_request_ends_a_wait_for_workers_when_none_is_left(run, tmp_path, monkeypatch):
    """Every worker gone after round 1: round 2 waits for one (up to wait_seconds, then the run would fail);
    a stop request ends that wait, and the run stops after round 1 and resumes later."""
    set_fed(run, rounds=4, pipeline=False, wait_seconds=60.0)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    coord = Coordinator(grid, run)
    real_commit, real_wait, waits = Loop.commit, Fleet.wait_for_nodes, []

    def commit(self, ctx, t_next):
        real_commit(self, ctx, t_next)
        if ctx.r == 1:
            grid.gone.update(grid.nodes)

    def wait(self, want, grace=0.0, stoppable=False, busy=None):
        waits.append(want)
        if want == 1:
            run.request_stop()
        return real_wait(self, want, grace, stoppable)

    monkeypatch.setattr(Loop, "commit", commit)
    monkeypatch.setattr(Fleet, "wait_for_nodes", wait)
    t0 = time.monotonic()
    state = coord.main()
    assert state.round == 1 and waits[-1] == 1 and time.monotonic() - t0 < 30
    assert run.read_status()["stopped"] and not run.stop_path.exists()
    assert Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main().round == 4
