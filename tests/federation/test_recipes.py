"""Nodes of one run on different recipes (soma_edge.spsa.recipe.Probes). A node on the run's recipe and one
given a GPU-sized recipe by `--recipe device:K` train one run with update-log replies. The coordinator checks
each log against its node's recipe, audits and replays it under that recipe, and the experts, moved from one
node to the other halfway, keep learning."""

from __future__ import annotations

from types import SimpleNamespace

from coordinator import replay, scheduler
from coordinator.fleet import Outgoing, Sent
from coordinator.loop import Coordinator
from coordinator.progress import summary
from soma_edge.spsa.recipe import Probes
from soma_edge.wire import protocol
from tests.helpers.fakegrid import FakeGrid, equal_rates, set_fed, step_budgets_bind

GPU_SIZED = {"directions": 4, "split_rows": False, "noise": "rademacher", "density": 1.0}


def _swap_once(monkeypatch, at: int) -> None:
    """The plan of round `at` puts every expert on the other node; the sticky plans after it keep them there."""
    real, calls = scheduler.assign, []

    def assign(experts, rates, previous, transfer=None):
        out = real(experts, rates, previous, transfer)
        calls.append(1)
        if len(calls) != at:
            return out
        nodes = sorted(rates)
        return {e: nodes[1 - nodes.index(n)] for e, n in out.items()}

    monkeypatch.setattr(scheduler, "assign", assign)


def test_mixed_recipes_are_audited_and_replayed_and_moved_experts_keep_learning(run, tmp_path, monkeypatch):
    equal_rates(monkeypatch)
    audited = []
    real_audit = replay.audit

    def audit(cfg, base, log, expert, data, evaluator, steps):
        audited.append((log.recipe.rows, dict(log.recipe.spsa)["directions"], len(steps), log.steps))
        return real_audit(cfg, base, log, expert, data, evaluator, steps)

    monkeypatch.setattr(replay, "audit", audit)
    _swap_once(monkeypatch, at=3)
    set_fed(run, rounds=4, reply="log", audit_steps=8, val_windows=16)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    grid.nodes[1001]["recipe"] = "device:4"  # as `soma-worker join --recipe device:4` sets it
    step_budgets_bind(grid)
    state = Coordinator(grid, run).main()
    # Each node's steps are planned in its own recipe's forward passes a step: at equal rates (evals/s), the
    # run's 2 a step (split rows, the head from the probes) against 4 directions on the whole batch's 8.
    first = [
        protocol.unpack(m.content, protocol.KIND_TRAIN) for m in grid.sent if m.metadata.message_type == protocol.TRAIN
    ]
    steps = {b["node"]: {t["steps"] for t in b["tasks"]} for b in first if b["round"] == 1}
    assert len(steps[1000]) == len(steps[1001]) == 1 and 3.5 <= steps[1000].pop() / steps[1001].pop() <= 4.5, steps

    lines = [m for m in run.read_metrics() if m["type"] == "expert"]
    rejected = [x for m in run.read_metrics() if m["type"] == "round" for x in m["rejected"]]
    assert not rejected and lines and all(m["accepted"] and m["weights_bytes_up"] == 0 for m in lines), rejected
    # Each version records the probes its node trained with: the run's (2 directions on a row each), or 4 on both.
    run_probes = Probes.of(run.load_config()).to_record()
    assert {m["node"]: m["recipe"] for m in lines} == {"a": run_probes, "b": GPU_SIZED}
    # Every log was audited (8 of its steps, or all it had) under its own recipe, and both recipes were.
    assert len(audited) == len(lines) and all(n == min(8, steps) for *_, n, steps in audited), audited
    assert {(rows, k) for rows, k, *_ in audited} == {(1, 2), (2, 4)}
    # Every expert moved at round 3, and its val loss after two rounds on its new node is below round 2's.
    by = {(m["expert"], m["round"]): m for m in lines}
    for e in state.experts:
        e = int(e)
        assert by[e, 1]["node"] == by[e, 2]["node"] != by[e, 3]["node"] == by[e, 4]["node"], e
        assert by[e, 4]["val_loss"] < by[e, 2]["val_loss"], (e, by[e, 2]["val_loss"], by[e, 4]["val_loss"])
    # status.json and `soma-coord status` name each node's recipe.
    nodes = {n["name"]: n["recipe"] for n in run.read_status()["nodes"].values()}
    assert nodes == {"a": Probes(**run_probes).describe(), "b": Probes(**GPU_SIZED).describe()}
    assert summary(run)["node_recipes"] == nodes


def test_a_node_that_answers_again_with_other_probes_starts_its_rate_over(run, tmp_path):
    """A rate is counted in its recipe's forward passes a step, and a log's check cost is its recipe's: a
    node that answers a capability query again with other probes (a worker restarted with another --recipe)
    takes its new rate and costs afresh, where one with the same probes keeps its measured rate."""
    set_fed(run, rounds=1, min_nodes=1)
    coord = Coordinator(FakeGrid(tmp_path / "nodes", ["a"]), run)
    coord.main()
    fleet, node = coord.loop.fleet, coord.loop.fleet.nodes[1000]
    node.rate, node.checks.replay = 500.0, 10.0

    def answer(probes: dict, rate: float) -> None:
        caps = {**node.caps, "probes": probes, "evals_per_s": rate, "cache": {"weights": [], "shards": []}}
        reply = SimpleNamespace(
            has_error=lambda: False,
            metadata=SimpleNamespace(src_node_id=1000),
            content=protocol.pack(caps, protocol.KIND_CAPS),
        )
        fleet.on_capabilities(reply, Outgoing(node=1000, kind=Sent.QUERY))

    answer(Probes.of(run.load_config()).to_record(), 77.0)
    assert node.rate == 500.0 and node.checks.replay == 10.0  # the same probes: the measured rate stays
    answer(GPU_SIZED, 77.0)
    assert node.probes == Probes(**GPU_SIZED) and node.rate == 77.0 and node.checks.replay is None
