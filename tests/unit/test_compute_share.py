"""Compute share counted by when the training happened (soma_edge.wire.compute_share): speculated seconds count
in the span they fell in, nothing counts twice, no share passes 100%, and a result's `trained` is checked."""

from __future__ import annotations

import time

import numpy as np
import pytest

from soma_edge.config import from_dict
from soma_edge.expert import params
from soma_edge.rundir.metrics import RoundLine
from soma_edge.spsa import optim
from soma_edge.wire import compute_share, protocol
from worker import probe, task
from worker.trainer import train


def _round(r: int, planned_at: float, time: float, trained: dict, nodes=("a",)) -> RoundLine:
    return RoundLine(round=r, planned_at=planned_at, time=time, trained=trained, nodes=list(nodes))


def test_merged_joins_overlaps_and_caps_the_count_across_the_shortest_gaps():
    assert compute_share.merged([(3, 4), (0, 1), (0.5, 2)]) == [(0.0, 2.0), (3.0, 4.0)]
    assert compute_share.merged([(0, 1), (1.1, 2), (5, 6)], most=2) == [(0.0, 2.0), (5.0, 6.0)]
    assert compute_share.merged([(2, 2)]) == []  # an empty stretch is no training


def test_speculated_seconds_count_in_the_span_they_fell_in_not_the_round_they_answered():
    # Round 1: planned at 0, round 2 at 60, round 2 commits at 120. The worker trains round 1 over 2-58; then,
    # while its reply goes up, trains round 2's steps from 58 (before round 2's plan) to 118.
    r1 = _round(1, 0.0, 61.0, {"a": [[2.0, 58.0]]})
    r2 = _round(2, 60.0, 120.0, {"a": [[58.0, 118.0]]})
    shares = compute_share.shares([r1, r2])
    assert shares[1] == pytest.approx(58 / 60)  # 56 s of round 1's result and 2 s of round 2's
    assert shares[2] == pytest.approx(58 / 60)
    assert all(s <= 1.0 for s in shares.values())


def test_a_stretch_reported_twice_counts_once_and_lines_before_planned_at_are_left_out():
    old = RoundLine(round=1, time=10.0, nodes=["a"], compute_share=1.2)
    r2 = _round(2, 10.0, 20.0, {"a": [[10.0, 20.0], [12.0, 18.0]]})
    assert compute_share.shares([old, r2]) == {2: pytest.approx(1.0)}


def test_a_share_is_over_the_nodes_the_round_planned():
    r = _round(1, 0.0, 10.0, {"a": [[0.0, 10.0]], "b": [[0.0, 10.0]], "c": [[0.0, 10.0]]}, nodes=("a", "b"))
    assert compute_share.shares([r]) == {1: pytest.approx(1.0)}  # c was not planned: its seconds are not this round's


def test_a_worker_result_says_when_it_trained():
    """The stretches of a round's training, on the worker's epoch clock, in the result it sends."""
    cfg = from_dict({"model": {"embed": 8, "hidden": 16}, "data": {"batch": 4, "seq_len": 16}, "device": "cpu"})
    ev = probe.make_evaluator(cfg, "cpu", threads=1, spin=False, parallel=1)
    data = np.frombuffer(bytes(range(256)) * 4, dtype=np.uint8)
    state = optim.State(params.init(cfg.model, 0))
    before = time.time()
    rep = train(state, data, cfg, ev, steps=3)
    rep.add(train(state, data, cfg, ev, steps=2))  # a second stretch of the same round (the trainer's, claimed)
    after = time.time()
    t = {"expert": 0, "version": 0, "base_sha256": "0" * 64, "reply": "weights"}
    res = task.finish(t, cfg, state, 0, None, rep, "float32")
    spans = res["trained"]  # to the millisecond
    assert len(spans) in (1, 2) and before - 0.001 <= spans[0][0] and spans[-1][1] <= after + 0.001, spans
    assert sum(b - a for a, b in res["trained"]) == pytest.approx(rep.seconds, abs=0.05)


def test_the_coordinator_reads_when_any_result_trained_and_ignores_a_malformed_claim_of_it():
    assert protocol.trained_of({"trained": [[1.0, 2.0]]}) == [[1.0, 2.0]]
    assert protocol.trained_of({}) == []  # a worker of an earlier version
    assert protocol.trained_of({"trained": [[2.0, 1.0]]}) == []  # refused by check_result; counted as nothing


def test_the_share_at_commit_counts_only_training_inside_the_round_span():
    """The console's share at a commit: seconds its results trained before its plan (speculation, counted in
    the round before) are left out, so it never passes 100% as the reply-seconds count did."""
    from coordinator.records import share_at_commit
    from coordinator.round import Round
    from coordinator.scheduler import Plan

    rnd = Round(r=2, plan=Plan({0: 7, 1: 8}, {}, 0.0, []), deadline=0.0, t_sent=0.0, planned_at=100.0)
    rnd.trained = {7: [[90.0, 160.0]], 8: [[100.0, 130.0]], 9: [[100.0, 160.0]]}  # node 9 was not planned
    assert share_at_commit(rnd, 60.0) == pytest.approx((60 + 30) / (2 * 60))
    rnd.trained = {7: [[40.0, 170.0]], 8: [[95.0, 161.0]]}
    assert share_at_commit(rnd, 60.0) == pytest.approx(1.0)
