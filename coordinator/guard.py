"""Guarded updates: a reply that passes the protocol checks must still not make its expert worse.

The coordinator scores each new version on the expert's val windows and compares it, window by window,
with the guard's bar (`GuardBar`: a version and its loss on each window). The difference of the two means
is measured with its standard error from the per-window differences, so the test follows the noise of the
val estimate: few or uneven windows widen it, many narrow it. A version is refused when it is worse than
the bar by more than `federation.guard_tolerance` (a floor for what the windows cannot show: the drift of
honest SPSA between rounds) plus `federation.guard_sigmas` standard errors (as a confidence: Student's
t for that many windows, 3.1 errors at 64 windows, 9.2 at 4, since the error is estimated from the
same few windows), that standard error capped
by the bar's own (a liar cannot widen the margin by spreading its damage unevenly: at most it costs the
expert tolerance + sigmas x the val estimate's standard error, once, as the bar does not move for it).
At the defaults (0.01 and 3) a version no worse than the bar in truth is refused with probability under
Phi(-3) = 0.13%, and on the 64 windows of a 124K expert (standard error ~0.006-0.011 between rounds) one
that raises the val loss by 0.05 is refused (docs/RELIABILITY.md, "The guard, measured").

Few windows cannot estimate their own spread: one window has none, and 2-8 windows give an estimate so
unsure that Student's t widens it 5-235 fold. Under POOL_BELOW windows the margin is the wider of the
expert's own (its spread, at its own t quantile) and the other experts' (`Spread`, `pool`: the median of
their last accepted per-window spreads, at the quantile of their summed degrees of freedom), so the error is
never 0 and an expert noisier than the rest keeps its own margin. prepare gives every expert at least 8
val windows.

The bar moves only to a version that beats it by more than `guard_sigmas` standard errors: a lucky
measurement never raises the bar that honest versions after it must meet. Bounding by the bar, not the
current version, is what stops a node that drifts the expert by just under one margin per round: the
second such step is past it. (The expert's `best`, what export takes, is still its lowest val loss.)

A result refused by the protocol checks (a malformed result, a log that does not replay, a failed audit) is a
strike against the node's identity at once: an honest worker never sends one. A guard refusal is not proof
of a lie: SPSA on a small shard overshoots or overfits now and then, and a node that trains 60 experts a
round will see a few of them refused. So the guard's verdicts on a node's results are judged together, once
the round's verdicts are in (`round_strikes`): one near miss a round (a version worse than its bar by at
most FAR margins, beside others accepted) is forgiven as honest noise; more refusals, or a far one, are
one strike for the round, and one strike per refusal when most of its versions were refused (nothing
honest about that); a round that earns no strike and raised a bar takes one strike off. At
`federation.max_strikes` strikes the node is excluded for the rest of the run. A liar cannot hide behind its
honest work: what it is allowed is one near miss a round, however many honest versions it sends, so a
node that poisons even one expert a round (a lie refused far from the bar) is struck every round, never
forgiven, and out after max_strikes rounds; what it can get away with unstruck, a near miss a round, is
refused all the same and costs one expert one round, what an honest overshoot costs. An honest node is
struck only in a round with two refusals or a far one, and out only when such rounds outnumber its clean
ones by max_strikes, which the plateau rule (each refusal halves the expert's lr) and finished experts
(coordinator.finish) make rare. A node is struck by its identity: the worker's registered key
(`key:<fingerprint>`, from RUN/workers.json, with `soma-coord start --auth`), which survives restarts of
the worker and of the coordinator. Without authentication it is the Flower node id (`node:<id>`), which
a restarted worker does not keep: its strikes start again.

The strike table lives in state.msgpack (`strikes`), so it commits with the round it was counted in.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator import workers
from soma_edge.errors import ConfigError
from soma_edge.rundir.layout import RunDir
from soma_edge.rundir.metrics import Rejection
from soma_edge.rundir.state import GuardBar

POOL_BELOW = 16  # under this many val windows, an expert's spread is pooled with the other experts'


@dataclass(frozen=True)
class Spread:
    """Per-window standard deviations of a judgement: of the paired differences (version - bar) and of the
    bar's losses, with the degrees of freedom they were estimated with."""

    diff_sd: float
    bar_sd: float
    dof: int


def spread_of(windows: np.ndarray, bar: GuardBar) -> Spread | None:
    """The spread of one judgement (None with fewer than 2 windows: it has none)."""
    base = np.asarray(bar.windows, np.float64)
    d = np.asarray(windows, np.float64) - base
    if d.size < 2 or not np.all(np.isfinite(d)):
        return None
    return Spread(float(d.std(ddof=1)), float(base.std(ddof=1)), int(d.size - 1))


def pool(spreads: list[Spread]) -> Spread | None:
    """Spreads pooled over experts: the median of each (a few liars' uneven damage cannot widen everyone's
    margin), with the sum of the degrees of freedom. None without any."""
    if not spreads:
        return None
    return Spread(
        float(np.median([s.diff_sd for s in spreads])),
        float(np.median([s.bar_sd for s in spreads])),
        sum(s.dof for s in spreads),
    )


@dataclass
class Verdict:
    refused: str | None  # why the version is refused (None: accepted)
    raises_bar: bool  # it beat the bar beyond the noise: it is the new bar
    margin: float  # how much worse than the bar it could have been: tolerance + sigmas x standard error
    worse: float = 0.0  # how much worse than the bar it is (mean over the windows; < 0: better)


def judge(windows: np.ndarray, bar: GuardBar, tolerance: float, sigmas: float, pooled: Spread | None = None) -> Verdict:
    """The guard's verdict on a version whose loss on each val window is `windows` (the bar's windows, in
    the same order). The standard error of the paired difference is capped by the bar's own (the standard
    error of its val loss): a liar that spreads its damage unevenly over the windows cannot widen the
    margin beyond what the val estimate's noise is. Under POOL_BELOW windows, `pooled` (the other experts'
    spread) gives a second margin and the wider one counts; one window cannot be judged without it."""
    base = np.asarray(bar.windows, np.float64)
    d = np.asarray(windows, np.float64) - base
    n, mean = d.size, float(d.mean())
    if n < 2 and pooled is None:
        raise ValueError("one val window and no other expert's spread: the guard cannot estimate an error")
    own = spread_of(windows, bar) or Spread(0.0, 0.0, 0)
    # The error comes from a few windows: Student's t, not the normal, at sigmas' confidence.
    se = min(own.diff_sd, own.bar_sd) / math.sqrt(n)
    noise, how = t_quantile(sigmas, own.dof) * se, "its standard error"
    if n < POOL_BELOW and pooled is not None and pooled.dof > own.dof:
        pooled_se = min(pooled.diff_sd, pooled.bar_sd) / math.sqrt(n)
        pooled_noise = t_quantile(sigmas, pooled.dof) * pooled_se
        if pooled_noise > noise:  # the wider of the two: an expert noisier than the others keeps its own
            # margin, one with no spread of its own gets theirs
            se, noise = pooled_se, pooled_noise
            how = f"the other experts' standard error ({pooled.dof} degrees of freedom) for {n} windows,"
    margin = tolerance + noise
    refused = None
    if not mean <= margin:  # NaN too
        refused = (
            f"val loss {float(np.mean(windows)):.4f} is worse than the guard's bar {bar.val_loss:.4f} "
            f"(v{bar.version}) by {mean:.4f}, more than federation.guard_tolerance {tolerance:g} + "
            f"guard_sigmas {sigmas:g} x {how} {se:.4f}"
        )
    return Verdict(refused=refused, raises_bar=mean < -(margin - tolerance), margin=margin, worse=mean)


@functools.lru_cache(maxsize=64)
def t_quantile(sigmas: float, dof: int) -> float:
    """The quantile of Student's t with `dof` degrees of freedom at the normal's probability of `sigmas`
    (3 -> 0.99865): 3.1 for 64 windows, 3.6 for 16, 9.2 for 4. 0 without a dof (then the error is 0)."""
    if dof < 1 or sigmas <= 0:
        return 0.0
    target = 0.5 * math.erf(sigmas / math.sqrt(2))  # the t density's area from 0 to the quantile
    scale = math.exp(math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2)) / math.sqrt(dof * math.pi)

    def area(t: float) -> float:
        x = np.linspace(0.0, t, 4001)
        return float(np.trapezoid(scale * (1 + x * x / dof) ** (-(dof + 1) / 2), x))

    lo, hi = sigmas, 2 * sigmas  # t's tails are heavier than the normal's: its quantile is the larger
    while area(hi) < target:
        lo, hi = hi, 2 * hi
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if area(mid) < target else (lo, mid)
    return hi


def bar_of(version: int, windows: np.ndarray) -> GuardBar:
    return GuardBar(version=version, val_loss=float(np.mean(windows)), windows=[float(x) for x in windows])


def identity(run: RunDir, node_id: int) -> str:
    """Who a node is for strikes: its registered key if its node id was registered with this run."""
    try:
        registered = workers.load(run)
    except ConfigError:
        registered = []
    for w in registered:
        if w.node_id == node_id:
            return key_identity(w.fingerprint)
    return f"node:{node_id}"


def key_identity(fingerprint: str) -> str:
    """The strike-table identity of a registered worker key."""
    return f"key:{fingerprint}"


def count(strikes: dict[str, Any], who: str) -> int:
    return int((strikes.get(who) or {}).get("count", 0))


def strike(strikes: dict[str, Any], who: str, label: str, reason: str, round_: int) -> int:
    """Count one strike against `who` in the run's strike table; its count now."""
    rec = strikes.setdefault(who, {"count": 0, "name": label, "last": "", "round": 0})
    rec.update(count=int(rec["count"]) + 1, name=label, last=reason[:300], round=round_)
    return rec["count"]


FAR = 2.0  # a refusal worse than the bar by more than this many margins is no near miss


@dataclass
class Tally:
    """A node's guard verdicts since it was last judged (`judge_round`): the refused versions' rejections,
    how many of them were far (`FAR`), and its accepted versions, of which `raised` raised their bars."""

    refused: list[Rejection] = field(default_factory=list)
    far: int = 0
    accepted: int = 0
    raised: int = 0


def round_strikes(t: Tally) -> int:
    """The strikes a node's guard verdicts of one round earn, judged together: none without a refusal, nor
    for one near miss (worse than its bar by at most FAR margins: what honest SPSA does now and then, at
    any number of experts); else one for the round, or one per refusal when those were most of its versions."""
    n = len(t.refused)
    if n == 0 or (n == 1 and t.far == 0 and t.accepted > 0):
        return 0
    return n if n > t.accepted else 1


def judge_round(strikes: dict[str, Any], who: str, label: str, t: Tally, round_: int) -> list[int]:
    """Strike or forgive `who` (named `label`) for its guard verdicts of one round, taken together; a round
    that earns no strike and raised a bar takes one off. The strike counts after each strike it took."""
    n = round_strikes(t)
    if n == 0 and t.raised:
        forgive(strikes, who)
    return [strike(strikes, who, label, rej.reason, round_) for rej in t.refused[:n]]


def forgive(strikes: dict[str, Any], who: str) -> None:
    """A round of `who`'s that earned no strike, in which one of its versions raised its expert's bar, takes
    one strike off: honest overshoots are forgiven by good work (beyond the noise: luck earns nothing), a
    node that never improves anything, or that makes something worse every round, is not."""
    rec = strikes.get(who)
    if rec and int(rec["count"]) > 0:
        rec["count"] = int(rec["count"]) - 1


def excluded(strikes: dict[str, Any], who: str, limit: int) -> bool:
    return limit > 0 and count(strikes, who) >= limit
