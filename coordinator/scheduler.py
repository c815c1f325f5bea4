"""Which expert trains on which node, and for how many steps: share the nodes' speed fairly, stay sticky.

Every live node computes for `round_seconds` (each worker stops at its time budget), so a round's length
is fixed and the quotas k_n (experts per node, rates r_n in forward evaluations/s) only decide how fast each
expert trains: an expert on node n gets r_n / k_n. The quotas maximize sum_n k_n log(r_n / k_n), the sum of
the experts' log rates (proportional fairness): a node is never left idle while some expert would gain more
there, on a log scale, than the experts it leaves behind lose, and no expert starves on a node far slower
than the rest. Minimizing the makespan of equal jobs instead (the rule before) would put every expert on a
node 3x faster than the others and leave them idle for the whole round. The objective is separable and
concave in each k_n, so giving each next expert to the node of largest marginal gain is optimal (ties to
the lower node id, for determinism). Then an expert stays on the node it trained on last round whenever
that node is live and has quota left, so its weights stay where they are (the node caches them; nothing
is sent); only the remainder moves.

Moving costs: an expert that moves drags its weights, and maybe its shards, over the new node's link.
So the quotas keep last round's split while its experts' geometric-mean rate is within MOVE_MARGIN of the
best split's (a small change in measured rates no longer moves an expert and its cache), and an expert that
must move goes to the node with quota left that would fetch what it lacks fastest (`transfer(e, n)`:
seconds, from the bytes the node's cache lacks and its measured link rate). The plan's predicted transfer
time per node extends that node's round deadline.

Each node then gets a step budget that fills `round_seconds` of compute: steps = round_seconds * r_n /
(2 K k_n), two forward passes per SPSA direction, times HEADROOM. The worker also stops each expert at
its share of `round_seconds`, so a node whose rate was overestimated still meets the deadline and one
that was underestimated does not sit idle: every node computes for about `round_seconds`, whatever the
load of its box did to its speed since the last round. A node that missed the last deadline is simply
not among the live nodes, so its experts are redistributed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

HEADROOM = 1.5  # step budget over the predicted steps; the worker's time budget is what normally stops it
# Rates are claims by workers: bound them, so that no claim takes every expert with steps too large to encode.
MAX_RATE = 1e7  # forward evaluations/s; orders of magnitude above any device on our model shapes
MAX_STEPS = 2**31 - 1  # per expert per round
MOVE_MARGIN = 0.10  # keep last round's split while its experts' geometric-mean rate is within 10% of the best


@dataclass
class Plan:
    assignment: dict[int, int]  # expert -> node
    steps: dict[int, int]  # expert -> SPSA steps this round
    makespan: float  # predicted compute seconds of the slowest node
    moved: list[int]  # experts whose node changed (weights must travel)
    transfer: dict[int, float] = field(default_factory=dict)  # node -> predicted seconds to fetch what it lacks


def _utility(counts: dict[int, int], rates: dict[int, float]) -> float:
    """Sum over experts of the log of the rate each gets: sum_n k_n log(r_n / k_n)."""
    return sum(k * math.log(max(rates[n], 1e-9) / k) for n, k in counts.items() if k)


def _gain(k: int, rate: float) -> float:
    """What one more expert on a node of `k` experts adds to `_utility`, rounded so that equal gains
    computed along different float paths tie (and the lower node id wins)."""
    r = max(rate, 1e-9)
    return round((k + 1) * math.log(r / (k + 1)) - (k * math.log(r / k) if k else 0.0), 9)


def quotas(n_experts: int, rates: dict[int, float], keep: dict[int, int] | None = None) -> dict[int, int]:
    """Experts per node maximizing the experts' summed log rate (ties to the lower node id, for
    determinism); `keep` (last round's counts) stands while its geometric-mean rate per expert is within
    MOVE_MARGIN of the best split's."""
    if not rates:
        raise ValueError("no live nodes to schedule on")
    counts = {n: 0 for n in rates}
    for _ in range(n_experts):
        best = min(sorted(rates), key=lambda n: -_gain(counts[n], rates[n]))
        counts[best] += 1
    if keep and set(keep) <= set(rates) and sum(keep.values()) == n_experts:
        if _utility(keep, rates) >= _utility(counts, rates) - n_experts * math.log(1 + MOVE_MARGIN):
            return {n: keep.get(n, 0) for n in rates}
    return counts


def assign(
    experts: list[int],
    rates: dict[int, float],
    previous: dict[int, int],
    transfer: Callable[[int, int], float] | None = None,
) -> dict[int, int]:
    """Sticky assignment within the quotas; an expert that moves goes where it is fetched fastest."""
    held = {}
    for e in experts:
        if previous.get(e) in rates:
            held[previous[e]] = held.get(previous[e], 0) + 1
    left = quotas(len(experts), rates, held)
    out: dict[int, int] = {}
    for e in sorted(experts):
        n = previous.get(e)
        if n in left and left[n] > 0:
            out[e] = n
            left[n] -= 1
    for e in sorted(experts):
        if e in out:
            continue
        cost = (lambda n, e=e: transfer(e, n)) if transfer else (lambda n: 0.0)
        n = min(sorted(n for n in left if left[n] > 0), key=lambda n: (cost(n), -left[n], -rates[n]))
        out[e] = n
        left[n] -= 1
    return out


def clamp_rate(rate: float) -> float:
    """A claimed or observed rate within (0, MAX_RATE] (callers have checked it is finite and positive)."""
    return min(float(rate), MAX_RATE)


def steps_for(rate: float, count: int, round_seconds: float, evals_per_step: int) -> int:
    """SPSA steps per expert so that `count` experts fill `round_seconds` on a node of `rate` evals/s
    (`evals_per_step`: forward passes of one update, `soma_edge.config.evals_per_step`)."""
    steps = round_seconds * clamp_rate(rate) / (evals_per_step * max(count, 1))
    return max(1, min(MAX_STEPS, math.floor(steps)))


def plan(
    experts: list[int],
    rates: dict[int, float],
    previous: dict[int, int],
    round_seconds: float,
    evals_per_step: dict[int, int],
    transfer: Callable[[int, int], float] | None = None,
) -> Plan:
    """Who trains which of `experts` and for how many steps. `evals_per_step`: per node, the forward passes
    of one of its updates (its recipe's `soma_edge.config.evals_per_step`), the unit its rate counts in."""
    assignment = assign(experts, rates, previous, transfer)
    counts: dict[int, int] = {}
    for n in assignment.values():
        counts[n] = counts.get(n, 0) + 1
    predicted = {e: steps_for(rates[n], counts[n], round_seconds, evals_per_step[n]) for e, n in assignment.items()}
    span = max(
        (sum(predicted[e] for e, m in assignment.items() if m == n) * evals_per_step[n] / rates[n] for n in counts),
        default=0.0,
    )
    steps = {e: min(MAX_STEPS, math.ceil(HEADROOM * s)) for e, s in predicted.items()}
    moved = sorted(e for e, n in assignment.items() if previous.get(e) != n)
    fetch: dict[int, float] = {}
    for e, n in assignment.items():
        fetch[n] = fetch.get(n, 0.0) + (transfer(e, n) if transfer else 0.0)
    return Plan(assignment=assignment, steps=steps, makespan=span, moved=moved, transfer=fetch)


# What a link is taken to move before it is measured, in bytes/s: 1 Mbit/s, the slowest link soma-edge is
# built and benchmarked for (bench/slow_link.py). Round 1's deadline then leaves time for its transfers on
# such a link (pricing them at 0 failed a run at 1 Mbit/s: the worker was still receiving at the deadline);
# once a node's link is measured (`link_rate`), its own rate replaces this.
UNMEASURED_LINK = 125_000.0


def priced_link(measured: float | None) -> float:
    """A node's link in bytes/s, both ways: as measured, else UNMEASURED_LINK until its first large exchange."""
    return measured or UNMEASURED_LINK


FLOWER_SECONDS = 4.5  # a message's round trip beyond its transfer and compute (process start, polling)
MIN_PROBE_BYTES = 256 << 10  # smaller messages say nothing about a link: Flower's overhead dominates
MIN_LINK_SECONDS = 0.5  # the least time an exchange's transfer is credited with (faster: a lower bound)


def link_rate(old: float | None, nbytes: int, elapsed: float, compute: float) -> float | None:
    """A node's link rate (bytes/s) blended with what one train exchange showed (`link_seen`'s rate)."""
    return link_seen(old, False, nbytes, elapsed, compute)[0]


def link_seen(
    old: float | None, at_least: bool, nbytes: int, elapsed: float, compute: float
) -> tuple[float | None, bool]:
    """A node's link rate (bytes/s) blended with what one exchange showed: the bytes of the request and its
    reply over the time the reply took beyond the node's compute and Flower's own overhead (as if the link
    were as fast both ways), and whether that is only a floor: a transfer within Flower's overhead (a fast
    link, loopback) is credited MIN_LINK_SECONDS. Both as they were (`old`, `at_least`; None: unknown) until
    a message of at least MIN_PROBE_BYTES has been timed."""
    if nbytes < MIN_PROBE_BYTES or not math.isfinite(elapsed) or not math.isfinite(compute):
        return old, at_least
    transfer = elapsed - compute - FLOWER_SECONDS
    seen = nbytes / max(MIN_LINK_SECONDS, transfer)
    return (seen if old is None else 0.5 * old + 0.5 * seen), transfer < MIN_LINK_SECONDS


def update_rate(old: float, observed: float, weight: float = 0.5) -> float:
    """Blend a node's rate with what it just achieved under real load (other workers on its box, etc.)."""
    if observed <= 0 or not math.isfinite(observed):
        return old
    observed = clamp_rate(observed)
    return observed if old <= 0 else clamp_rate((1 - weight) * old + weight * observed)
