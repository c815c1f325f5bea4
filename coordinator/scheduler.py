"""Which expert trains on which node, and for how many steps: minimize the round's makespan, stay sticky.

Experts are equal units of work. With node rates r_n (forward evaluations/s), giving each next expert to
the node that would finish it first, argmin (k_n + 1) / r_n, minimizes the makespan max_n k_n / r_n for
identical jobs on machines of different speeds. Those are the quotas k_n. Then an expert stays on the node
it trained on last round whenever that node is live and has quota left, so its weights stay where they
are (the node caches them; nothing is sent); only the remainder moves.

Each node then gets a step budget that fills `round_seconds` of compute: steps = round_seconds * r_n /
(2 K k_n), two forward passes per SPSA direction, times HEADROOM. The worker also stops each expert at
its share of `round_seconds`, so a node whose rate was overestimated still meets the deadline and one
that was underestimated does not sit idle: every node computes for about `round_seconds`, whatever the
load of its box did to its speed since the last round. A node that missed the last deadline is simply
not among the live nodes, so its experts are redistributed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

HEADROOM = 1.5  # step budget over the predicted steps; the worker's time budget is what normally stops it
# Rates are claims by workers: bound them, so that no claim takes every expert with steps too large to encode.
MAX_RATE = 1e7  # forward evaluations/s; orders of magnitude above any device on our model shapes
MAX_STEPS = 2**31 - 1  # per expert per round


@dataclass
class Plan:
    assignment: dict[int, int]  # expert -> node
    steps: dict[int, int]  # expert -> SPSA steps this round
    makespan: float  # predicted compute seconds of the slowest node
    moved: list[int]  # experts whose node changed (weights must travel)


def quotas(n_experts: int, rates: dict[int, float]) -> dict[int, int]:
    """Experts per node minimizing the makespan (ties to the lower node id, for determinism)."""
    if not rates:
        raise ValueError("no live nodes to schedule on")
    counts = {n: 0 for n in rates}
    for _ in range(n_experts):
        best = min(sorted(rates), key=lambda n: (counts[n] + 1) / max(rates[n], 1e-9))
        counts[best] += 1
    return counts


def assign(experts: list[int], rates: dict[int, float], previous: dict[int, int]) -> dict[int, int]:
    """Sticky assignment within the makespan-optimal quotas."""
    left = quotas(len(experts), rates)
    out: dict[int, int] = {}
    for e in sorted(experts):
        n = previous.get(e)
        if n in left and left[n] > 0:
            out[e] = n
            left[n] -= 1
    for e in sorted(experts):
        if e in out:
            continue
        n = max(sorted(left), key=lambda n: (left[n], rates[n]))
        out[e] = n
        left[n] -= 1
    return out


def clamp_rate(rate: float) -> float:
    """A claimed or observed rate within (0, MAX_RATE] (callers have checked it is finite and positive)."""
    return min(float(rate), MAX_RATE)


def steps_for(rate: float, count: int, round_seconds: float, evals_per_step: int) -> int:
    """SPSA steps per expert so that `count` experts fill `round_seconds` on a node of `rate` evals/s
    (`evals_per_step`: forward passes of one update, `soma_edge.spsa.evals_per_step`)."""
    steps = round_seconds * clamp_rate(rate) / (evals_per_step * max(count, 1))
    return max(1, min(MAX_STEPS, math.floor(steps)))


def plan(experts: list[int], rates: dict[int, float], previous: dict[int, int], round_seconds: float,
         evals_per_step: int) -> Plan:  # fmt: skip
    assignment = assign(experts, rates, previous)
    counts: dict[int, int] = {}
    for n in assignment.values():
        counts[n] = counts.get(n, 0) + 1
    predicted = {e: steps_for(rates[n], counts[n], round_seconds, evals_per_step) for e, n in assignment.items()}
    span = max((sum(predicted[e] for e, m in assignment.items() if m == n) * evals_per_step / rates[n]
                for n in counts), default=0.0)  # fmt: skip
    steps = {e: min(MAX_STEPS, math.ceil(HEADROOM * s)) for e, s in predicted.items()}
    moved = sorted(e for e, n in assignment.items() if previous.get(e) != n)
    return Plan(assignment=assignment, steps=steps, makespan=span, moved=moved)


def update_rate(old: float, observed: float, weight: float = 0.5) -> float:
    """Blend a node's rate with what it just achieved under real load (other workers on its box, etc.)."""
    if observed <= 0 or not math.isfinite(observed):
        return old
    observed = clamp_rate(observed)
    return observed if old <= 0 else clamp_rate((1 - weight) * old + weight * observed)
