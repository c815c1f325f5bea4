"""Rebuilding a version from a worker's update log, and auditing the steps it claims.

In log mode a worker returns, per expert, the scalars of its round's SPSA steps instead of the weights
(`soma_edge.spsa.log.UpdateLog`); the noise comes back from its keys, so `spsa.log.replay` gives the version the
worker ended at, bit for bit, and its hash must be the one the worker claimed.

The log also makes each step checkable. With `federation.audit_steps = s`, the coordinator picks s steps
at random, from a secret key of its own (`audit_key`), and recomputes their two losses per direction with
forward passes of its own, at the weights the replay reached at that step, on the batch the step's key
draws: a claimed scalar further from the recomputed one than two honest devices can disagree
(`g_tolerance`) refuses the reply. A delta-rule decoder's weights are not in the log step by step, so an
audit rebuilds the decoder along the way with a clean forward per step (with spsa.decoder_from = "probes",
the step's probes: the delta rule is exact either way), and its final decoder must match the worker's
within float noise. A log's recipe must be its node's (the run's with the node's probes), and it is replayed
and audited under that recipe.
"""

from __future__ import annotations

import secrets

import numpy as np

from soma_edge.config import Config
from soma_edge.engine.numerics import DELTA, FLOAT32_STEP
from soma_edge.errors import ValidationError
from soma_edge.expert import steps as expert_steps
from soma_edge.spsa import quant, recipe
from soma_edge.spsa.log import UpdateLog
from soma_edge.spsa.optim import State, mean_decoder_grad, schedule

# Max |decoder - claimed| after a rebuilt round, in weight units. It need not scale with ε: the decoder
# learns from exact gradients of clean forwards, where ε never enters, and Adam's steps are bounded by its lr.
DECODER_TOLERANCE = 1e-3


def g_tolerance(lp: float, lm: float, eps: float, claimed: float) -> float:
    """The largest |g - claimed| an honest worker can cause, for our losses lp, lm of one direction at ε.

    A worker whose two losses are each within δ|L| of ours (`numerics.DELTA`, which as a difference of
    float32 results already holds their rounding) moves g = (L+ - L-)/2ε by at most δ(|L+| + |L-|)/2ε: the
    bound grows as ε falls, which a fixed tolerance on g cannot follow. The float slack on top: the claim
    travels as float32 (half a FLOAT32_STEP of |claimed|, allowed a whole one), and both sides' float64
    arithmetic rounds at 2^-53 of the losses, which a factor 1 + FLOAT32_STEP on the bound covers many times.
    """
    return DELTA * (1 + FLOAT32_STEP) * (abs(lp) + abs(lm)) / (2.0 * eps) + FLOAT32_STEP * abs(claimed)


def rebuild(cfg: Config, base: State, log: UpdateLog, expert: int) -> State:
    """The version the log leads to from `base` (ValidationError if the log does not fit it)."""
    try:
        return expert_steps.replay(cfg, base, log, expert)
    except ValueError as e:
        raise ValidationError(f"expert {expert}: {e}") from None


def audit(cfg: Config, base: State, log: UpdateLog, expert: int, data: np.ndarray, evaluator, steps: list[int]) -> None:
    """Recompute the scalars of `steps` (indices into the log) from forward passes; ValidationError on
    the first that the worker did not compute. `evaluator` is a `LossEvaluator` of the run's model (with
    the decoder-gradient graph when the decoder learns by the delta rule)."""
    try:
        recipe.check(log.recipe, cfg)
    except ValueError as e:
        raise ValidationError(f"expert {expert}: {e}") from None
    stepper = expert_steps.stepper(cfg, expert)
    state = State(base.weights.copy(), step=base.step, opt=base.opt.copy())
    state.opt.lr_scale = log.lr_scale
    body, delta = stepper.split(state.weights.size)
    from_probes = stepper.probe_decoder(delta)  # the decoder's steps need every step's probes
    wanted, last = set(steps), max(steps, default=-1)
    try:
        for i, g in enumerate(log.grads):
            if not delta and i > last:
                return  # every audited step is checked, and nothing dense needs rebuilding
            objs = expert_steps.objectives(data, cfg, evaluator, expert, state.step)  # the worker's own batches
            sums = None
            if i in wanted or from_probes:
                _, eps = schedule(cfg.spsa, state.step, state.opt.lr_scale)
                sums = stepper.evaluate(state.weights, objs, state.step, body, eps, delta)
            if i in wanted:
                _check_step(sums.pairs, eps, g, state.step, i, expert)
            dec = None
            if delta:
                cleans = sums.cleans if sums is not None else [o.clean(state.weights) for o in objs]
                dec = mean_decoder_grad([d for _, d in cleans])
            stepper.replay(state, g, dec)
    finally:
        stepper.close()
    if delta and log.steps:
        _check_decoder(state.weights[stepper.body :], base.weights[stepper.body :], log, expert)


def _check_decoder(rebuilt: np.ndarray, base: np.ndarray, log: UpdateLog, expert: int) -> None:
    """The decoder the audit's exact steps lead to against the one the log claims: within DECODER_TOLERANCE,
    plus, for a coded change, what its codes may leave out (quant.error_bound: half a code step)."""
    n, coded = rebuilt.size, log.coded()
    try:
        claimed = log.decoder if coded is None else base + quant.decode(coded, n)
        slack = DECODER_TOLERANCE + (np.zeros(n) if coded is None else quant.error_bound(coded, n))
        off = np.abs(rebuilt.astype(np.float64) - claimed)
    except (TypeError, ValueError) as e:
        raise ValidationError(f"expert {expert}: the log's decoder does not fit ({e})") from None
    worst = int(np.argmax(off - slack))
    if not off[worst] <= slack[worst]:
        raise ValidationError(
            f"expert {expert}: the decoder that its steps lead to differs from the one it sent by "
            f"{off[worst]:.3g} at weight {worst} (tolerance {slack[worst]:.3g})"
        )


def sample_steps(n: int, count: int, key: int, expert: int, version: int) -> list[int]:
    """Which of a log's n steps to audit: `count` distinct ones, drawn from `key` and the result's expert and
    version. The coordinator's key is a secret of its own (`audit_key`): from a key the worker knows (the
    run's seed, as once) it could tell which steps will be audited, compute those honestly and invent the
    rest, which the replay then rebuilds without a word."""
    rng = np.random.default_rng([key, expert, version, 0xA0D1])
    return sorted(int(i) for i in rng.choice(n, size=min(count, n), replace=False)) if n else []


def audit_key() -> int:
    """A coordinator's secret for `sample_steps`: 128 random bits, drawn when it starts and sent to no one."""
    return secrets.randbits(128)


def _check_step(pairs: np.ndarray, eps: float, claimed: np.ndarray, step: int, i: int, expert: int) -> None:
    """The claimed scalars of log step i (model step `step`) against the losses `pairs` recomputed here."""
    for j, want in enumerate(claimed):
        lp, lm = float(pairs[j, 0]), float(pairs[j, 1])
        got, want = (lp - lm) / (2.0 * eps), float(want)
        tol = g_tolerance(lp, lm, eps, want)
        if not abs(got - want) <= tol:
            raise ValidationError(
                f"expert {expert}: step {step} (log step {i}), direction {j}: the losses give "
                f"{got:.6g}, the log claims {want:.6g} (tolerance {tol:.3g} at eps {eps:.3g})"
            )
