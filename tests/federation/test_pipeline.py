"""Pipelined rounds (`federation.pipeline`): the next round starts as soon as every reply of this one is
in, from the versions the replies claim, while the coordinator checks them and commits. With the fake
Grid (tests/helpers/fakegrid.py): real ClientApp, real ORT training."""

from __future__ import annotations

import shutil
import time

import pytest

from coordinator import guard
from coordinator.loop import Coordinator, Loop
from soma_edge import checkpoint
from soma_edge.wire import protocol
from tests.helpers.fakegrid import FakeGrid, equal_rates, set_fed, step_budgets_bind


def _trains(grid: FakeGrid) -> list[tuple[int, int, dict]]:
    """(index in grid.sent, node, body) of every train request."""
    return [
        (i, m.metadata.dst_node_id, protocol.unpack(m.content, protocol.KIND_TRAIN))
        for i, m in enumerate(grid.sent)
        if m.metadata.message_type == protocol.TRAIN
    ]


def _commits(run, grid: FakeGrid) -> list[int]:
    """Records len(grid.sent) at each save_state: which messages went before which commit."""
    marks: list[int] = []
    real = run.save_state

    def save_state(state):
        real(state)
        marks.append(len(grid.sent))

    run.save_state = save_state
    return marks


def test_pipelining_changes_when_rounds_start_not_what_they_compute(run, tmp_path, monkeypatch):
    """Rounds 2 and 3 go out before the commit of the round before, from the versions its replies claim
    (which their nodes hold: no weights travel); the experts end bit for bit where rounds that wait for
    each other's checks end; and the rounds' spans tile the run."""
    equal_rates(monkeypatch)
    # The step budgets bind (`step_budgets_bind`); a deadline far off, so that a slow step on a busy box
    # cannot make a reply late either (a late reply makes the next round wait for the commit).
    set_fed(run, rounds=3, deadline_slack=60.0)
    cfg = run.load_config()
    cfg.spsa.plateau = False  # pipelined, a plateau's lr decision would apply a round later
    run.save_config(cfg)
    ends = {}
    for pipeline in (True, False):
        rd = type(run)(tmp_path / f"copy-{pipeline}")
        shutil.copytree(run.root, rd.root)
        set_fed(rd, pipeline=pipeline)
        grid = FakeGrid(tmp_path / f"nodes-{pipeline}", ["a", "b"])
        step_budgets_bind(grid)
        marks = _commits(rd, grid)
        t0 = time.monotonic()
        state = Coordinator(grid, rd).main()
        took = time.monotonic() - t0
        ends[pipeline] = {e: x.sha256 for e, x in state.experts.items()}
        rounds = [m for m in rd.read_metrics() if m["type"] == "round"]
        assert all(m["accepted"] == 4 for m in rounds)
        assert [m["next_round_ahead"] for m in rounds] == [pipeline, pipeline, False]
        first = {r: min(i for i, _, b in _trains(grid) if b["round"] == r) for r in (2, 3)}
        commit = {r: marks[r] for r in (1, 2)}  # marks[0]: the initial state, before round 1
        if pipeline:
            assert first[2] < commit[1] and first[3] < commit[2]
            spans = [m["round_seconds_total"] for m in rounds]  # plan to next plan: they do not overlap
            assert all(x > 0 for x in spans) and sum(spans) < took
            lines = {(m["round"], m["expert"]): m for m in rd.read_metrics() if m["type"] == "expert"}
            for _, _, b in _trains(grid):
                for t in b["tasks"]:
                    if b["round"] > 1:  # from the claim of the round before, already on its node
                        assert (
                            t["weights"] is None and t["base_sha256"] == lines[(b["round"] - 1, t["expert"])]["sha256"]
                        )
        else:
            assert first[2] >= commit[1] and first[3] >= commit[2]
    assert ends[True] == ends[False]


def test_a_refused_claim_costs_its_expert_the_next_round_and_no_second_strike(run, tmp_path, monkeypatch, caplog):
    """The guard refuses one honest result of round 1. Round 2 was already training on from it on its node
    (which holds it): that result is dropped without a strike; round 3 trains from the kept version."""
    equal_rates(monkeypatch)
    set_fed(run, rounds=3, max_strikes=3)
    refused: list[bool] = []
    real = guard.judge

    def judge(*args):
        if not refused:
            refused.append(True)
            return guard.Verdict(refused="refused for the test", raises_bar=False, margin=0.0)
        return real(*args)

    monkeypatch.setattr(guard, "judge", judge)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    Coordinator(grid, run).main()
    lines = {(m["round"], m["expert"]): m for m in run.read_metrics() if m["type"] == "expert"}
    (e,) = [e for (r, e), m in lines.items() if r == 1 and not m["accepted"]]
    assert "refused for the test" in lines[(1, e)]["reason"]
    assert not lines[(2, e)]["accepted"] and "which was refused" in lines[(2, e)]["reason"]
    assert lines[(3, e)]["accepted"] and lines[(3, e)]["version"] == 1  # from v0 again
    assert all(m["accepted"] for (r, x), m in lines.items() if x != e)
    rejected = [(m["round"], x["expert"]) for m in run.read_metrics() if m["type"] == "round" for x in m["rejected"]]
    assert rejected == [(1, e)]  # one strike, for the refusal itself (a's next best then forgave it)
    # Round 2's request trained from the refused claim; round 3's from the version the run kept.
    tasks = {(b["round"], t["expert"]): t for _, _, b in _trains(grid) for t in b["tasks"]}
    v0 = checkpoint.load(run.root / f"experts/{e}/v0.msgpack", "expert")
    assert tasks[(2, e)]["version"] == 1 and tasks[(2, e)]["base_sha256"] != v0["sha256"]
    assert tasks[(3, e)]["version"] == 0 and tasks[(3, e)]["base_sha256"] == v0["sha256"] == lines[(1, e)]["sha256"]


def test_an_expert_moving_to_a_node_without_its_claimed_version_waits_for_the_commit(run, tmp_path, monkeypatch):
    """Node a is gone when round 2 is planned: its experts' claimed versions are on no other node, so b's
    request waits for round 1's commit and carries the committed weights."""
    equal_rates(monkeypatch)
    set_fed(run, rounds=2, min_nodes=1)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    marks = _commits(run, grid)
    coord = Coordinator(grid, run)
    real_start = Loop.start_round

    def start(self, r, ahead=None):
        grid.gone = {1000} if r == 2 else set()
        return real_start(self, r, ahead)

    monkeypatch.setattr(Loop, "start_round", start)
    state = coord.main()
    lines = {(m["round"], m["expert"]): m for m in run.read_metrics() if m["type"] == "expert"}
    assert all(m["accepted"] for m in lines.values()) and state.round == 2
    on_a = sorted(e for (r, e), m in lines.items() if r == 1 and m["node"] == "a")
    ((i, nid, body),) = [x for x in _trains(grid) if x[2]["round"] == 2]
    assert nid == 1001 and i >= marks[1]  # sent after round 1's commit
    for t in body["tasks"]:
        if t["expert"] in on_a:
            stored = checkpoint.load(run.root / f"experts/{t['expert']}/v1.msgpack", "expert")
            assert protocol.weights_sha256(t["weights"]) == stored["sha256"] == lines[(1, t["expert"])]["sha256"]


@pytest.mark.parametrize("why", ["a reply missed the deadline", "pipeline = false"])
def test_rounds_wait_for_the_checks_where_they_must(run, tmp_path, monkeypatch, why):
    equal_rates(monkeypatch)
    set_fed(run, rounds=2, **({"pipeline": False} if why == "pipeline = false" else {"deadline_slack": 0.3}))
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    if why == "a reply missed the deadline":
        grid.delay[1001] = 2.0
    marks = _commits(run, grid)
    Coordinator(grid, run).main()
    rounds = [m for m in run.read_metrics() if m["type"] == "round"]
    assert [m["next_round_ahead"] for m in rounds] == [False, False]
    assert min(i for i, _, b in _trains(grid) if b["round"] == 2) >= marks[1]
