"""The coordinator's budget for checking update logs (coordinator.check_budget): each node's logs timed as they
are checked, and a plan that gives a GPU-sized log's round to the weights where its checks would overrun."""

from __future__ import annotations

import time

import numpy as np
import pytest

from coordinator import check_budget
from coordinator.check_budget import CheckCost
from coordinator.dispatch import log_bytes, reply_mode
from coordinator.fleet import Node
from soma_edge.config import Config, check_threads
from soma_edge.expert import params
from soma_edge.expert import steps as expert_steps
from soma_edge.spsa.log import UpdateLog
from soma_edge.spsa.optim import State
from soma_edge.spsa.recipe import Probes
from soma_edge.wire.protocol import ReplyMode

# The demo expert at 64 dense directions on an H200: 9,249 forward evaluations/s of 128 a step
# (docs/BENCHMARKS.md, "The first GPU run", population_resident at 124K, K = 64, density 1.0).
GPU_STEPS_PER_S = 9249.0 / 128


def test_check_cost_blends_what_each_log_took_and_the_budget_shares_the_threads():
    cost = CheckCost()
    assert check_budget.log_seconds(cost, 1000, 1.0) == 0.0  # not timed yet: planned as free
    cost.seen(100, 0.5, None)
    assert cost.replay == 200.0 and cost.audit is None
    cost.seen(100, 0.25, 1.0)
    assert cost.replay == 300.0 and cost.audit == 100.0
    assert check_budget.log_seconds(cost, 300, 1.0) == pytest.approx(1.0 + 3.0)
    assert check_budget.log_seconds(cost, 300, 0.5) == pytest.approx(1.0 + 1.5)
    cfg = Config()
    cfg.federation.round_seconds, cfg.federation.check_threads = 60.0, 2
    assert check_budget.budget(cfg, 3) == pytest.approx(0.1 * 60 * 2 / 3)


def test_audited_logs_are_a_secret_share():
    key = 12345
    picks = [check_budget.audited(key, e, v, 0.25) for e in range(40) for v in range(1, 26)]
    assert 0.2 < np.mean(picks) < 0.3
    assert picks == [check_budget.audited(key, e, v, 0.25) for e in range(40) for v in range(1, 26)]
    assert picks != [check_budget.audited(key + 1, e, v, 0.25) for e in range(40) for v in range(1, 26)]
    assert all(check_budget.audited(key, e, 1, 1.0) for e in range(10))


def _timed_replay(cfg: Config, steps: int) -> CheckCost:
    """A log of `steps` steps of `cfg`'s recipe replayed as the coordinator replays one, and timed so."""
    w = params.init(cfg.model, cfg.seed)
    k = cfg.spsa.directions * cfg.spsa.accumulate
    grads = np.random.default_rng(0).standard_normal((steps + 1, k)).astype(np.float32)
    body = params.layout(cfg.model).body
    log = UpdateLog(start=0, grads=grads[1:], lr_scale=1.0, decoder=w[body:].copy())
    expert_steps.replay(cfg, State(w.copy()), UpdateLog(0, grads[:1], 1.0, decoder=w[body:].copy()), 0)  # warm
    t0 = time.perf_counter()
    expert_steps.replay(cfg, State(w.copy()), log, 0)
    cost = CheckCost()
    cost.seen(steps, time.perf_counter() - t0, None)
    return cost


def test_a_gpu_sized_log_is_planned_within_its_budget():
    """The demo expert at a GPU-sized recipe (64 dense directions on the whole batch): a log's replay is timed
    here on one thread, as the coordinator times each log it checks. A worker stepping at the H200's rate for
    a 60 s round, one of 4 nodes, sends a log shorter than its weights, whose replay takes this box's check
    threads more than the node's share of 10% of the round: reply = "auto" asks for its weights instead,
    which its 2 Mbit/s link carries sooner, and whose check is one val loss. On a link slower than the
    checks, the log stays (and the coordinator says so, coordinator.dispatch)."""
    run = Config()
    run.federation.round_seconds, run.federation.weights_every = 60.0, 1000
    run.federation.check_threads = 2  # this box's default: the budget does not grow with a bigger box's cores
    gpu = Probes(64, False, "rademacher", 1.0).apply(run)
    steps, version_bytes = round(GPU_STEPS_PER_S * 60), 12 * params.count(run.model)
    node = Node(1, caps={"numpy": np.__version__}, link=250_000.0)  # 2 Mbit/s: the weights in 6 s
    node.checks = _timed_replay(gpu, 16)
    budget = check_budget.budget(run, 4)
    took = check_budget.log_seconds(node.checks, steps, 0.0)
    assert took > 2 * budget, (took, budget, check_threads(run))  # 30 s against 3 s on the 2-core box
    assert log_bytes(gpu, steps) < version_bytes and version_bytes / node.link < took
    assert reply_mode(run, gpu, node, 2, steps, version_bytes, nodes=4) == ReplyMode.WEIGHTS
    # A link slower than the checks: the log, whatever its checks cost.
    node.link = version_bytes / (2 * took)
    assert reply_mode(run, gpu, node, 2, steps, version_bytes, nodes=4) == ReplyMode.LOG
    # The run's own recipe at a CPU core's pace (~30 steps/s) fits its share of the budget.
    assert check_budget.log_seconds(_timed_replay(run, 16), 30 * 60, 0.0) < check_budget.budget(run, 2)
