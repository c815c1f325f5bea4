"""The audit across devices: an honest worker whose losses differ from the coordinator's by δ is never
struck, at any ε the schedule can reach, while the lies the poisoned tests tell are still refused.

g = (L+ - L-)/2ε, so a relative loss difference δ between devices moves g by up to δ(|L+| + |L-|)/2ε,
which grows as the plateau rule and the guard halve ε. The lies: tests/federation/test_replay.py's worker
triples one scalar of a step; here also every scalar of a step, and every sign flipped (the cheapest way
to steer an expert uphill). The poisoned workers of test_guard.py and tests/e2e/test_e2e_poisoned.py send
honest scalars with false weights: in log mode the replay's hash refuses those, not the audit.
"""

from __future__ import annotations

import numpy as np
import pytest

from coordinator import replay
from soma_edge.config import from_dict
from soma_edge.engine.evaluator import evaluator_for
from soma_edge.engine.numerics import DELTA
from soma_edge.errors import ValidationError
from soma_edge.expert import params, steps
from soma_edge.spsa import log as update_log
from soma_edge.spsa import optim
from worker.trainer import train

CFG = from_dict(
    {
        "model": {"embed": 8, "hidden": 16},
        "data": {"batch": 16, "seq_len": 16},
        "device": "cpu",
        "spsa": {"decoder": "frozen"},  # the decoder does not enter the scalars' check
    }
)
DATA = np.frombuffer(b"".join(bytes([i % 97 + 32]) * (i % 7 + 1) for i in range(4000)), dtype=np.uint8)
LIES = {
    "one scalar x3": lambda g: np.where(np.arange(g.size) == 0, 3 * g, g),
    "every scalar x3": lambda g: 3 * g,
    "signs flipped": lambda g: -g,
}


def _eps_sweep() -> list[tuple[float, float]]:
    """(lr_scale, ε) from the config's ε down to the schedule's smallest, halving as the plateau rule and
    the guard's slow-down do, both floored at lr_floor / lr."""
    s = CFG.spsa
    floor = s.lr_floor / s.lr
    smallest = min(optim.schedule(s, t, floor)[1] for t in (0, s.warmup_steps, 10**9))
    out, scale = [], 1.0
    while True:
        out.append((scale, optim.schedule(s, 10**6, scale)[1]))
        if scale <= floor:
            break
        scale = max(floor, scale * s.plateau_factor)
    assert out[0][1] == pytest.approx(1e-3) and out[-1][1] == pytest.approx(smallest)
    return out


@pytest.fixture(scope="module")
def trained():
    """A version some way into a run (its loss and gradients as they are when ε has fallen), and the
    coordinator's evaluator."""
    evaluator = evaluator_for(CFG, threads=1, parallel=1)
    state = optim.State(params.init(CFG.model, CFG.seed))
    train(state, DATA, CFG, evaluator, steps=300)
    return state, evaluator


def _losses(state: optim.State, evaluator) -> np.ndarray:
    """The coordinator's (L+, L-) of every direction of the state's next step."""
    stepper = steps.stepper(CFG, 0)
    try:
        _, eps = optim.schedule(CFG.spsa, state.step, state.opt.lr_scale)
        body, _ = stepper.split(state.weights.size)
        objs = steps.objectives(DATA, CFG, evaluator, 0, state.step)
        k = CFG.spsa.directions
        # each direction on what it evaluates: with spsa.split_rows (the default) its own rows
        out = [
            stepper.direction(state.weights, stepper.probe_fn(objs, j), state.step, j, body, eps)[:2] for j in range(k)
        ]
    finally:
        stepper.close()
    return np.array(out, dtype=np.float64)


def _audit(state: optim.State, evaluator, claims: np.ndarray) -> None:
    log = update_log.UpdateLog(start=state.step, grads=claims.astype(np.float32)[None, :], lr_scale=state.opt.lr_scale)
    replay.audit(CFG, state, log, 0, DATA, evaluator, [0])


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_worker_off_by_delta_is_never_struck_and_the_lies_are_refused_at_every_eps(trained, sign):
    """A lie that moves a scalar further than g_tolerance is refused, one within it is not (no rule that
    keeps δ-honest devices could tell it). Whole-step lies are refused at every ε. The one-scalar lie can
    hide only where that scalar is below about twice the tolerance, ~0.1 L at ε = 1e-5 with δ = 1e-6: then
    g is near the float32 resolution of the loss anyway (ulp(L)/2ε ≈ 0.02 there)."""
    base, evaluator = trained
    worst_old = 0.0  # how far past the replaced rule, 1e-2 (1 + |g|), an honest device went
    refused = {name: [] for name in LIES}
    for scale, eps in _eps_sweep():
        state = optim.State(base.weights, step=base.step, opt=base.opt.copy())
        state.opt.lr_scale = scale
        lp, lm = _losses(state, evaluator).T
        exact = (lp - lm) / (2 * eps)
        # The worst case of a device within δ: L+ off one way, L- the other.
        honest = (lp * (1 + sign * DELTA) - lm * (1 - sign * DELTA)) / (2 * eps)
        _audit(state, evaluator, honest)
        worst_old = max(worst_old, float(np.max(np.abs(honest - exact) / (1e-2 * (1 + np.abs(honest))))))
        for name, lie in LIES.items():
            told = lie(honest).astype(np.float32)  # as a log carries it
            tol = np.array([replay.g_tolerance(a, b, eps, float(c)) for a, b, c in zip(lp, lm, told)])
            try:
                _audit(state, evaluator, told)
                refused[name].append(False)
            except ValidationError as e:
                assert "the losses give" in str(e)
                refused[name].append(True)
            assert refused[name][-1] == bool(np.any(np.abs(told - exact) > tol)), (name, eps)
            if name == "one scalar x3" and abs(exact[0]) > 2.5 * tol[0]:  # then x3 moves it past any δ offset
                assert refused[name][-1], (name, eps)
    assert worst_old > 1, "the sweep never reached an ε where device differences matter"
    assert all(refused["every scalar x3"]) and all(refused["signs flipped"]), refused
    assert refused["one scalar x3"][0], refused  # at the config's ε, as tests/federation/test_replay.py tells it


def test_the_tolerance_follows_delta_and_eps():
    tol = replay.g_tolerance(2.0, 3.0, 1e-5, 0.0)
    assert tol == pytest.approx(DELTA * 5.0 / 2e-5, rel=1e-6)
    assert replay.g_tolerance(2.0, 3.0, 1e-3, 0.0) == pytest.approx(tol / 100)
    # The claim's own float32 rounding is allowed for, and no more than that.
    big = 1e4
    assert 0 < replay.g_tolerance(2.0, 3.0, 1e-3, big) - replay.g_tolerance(2.0, 3.0, 1e-3, 0.0) <= big * 2.0**-23
