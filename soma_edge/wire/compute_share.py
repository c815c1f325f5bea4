"""Compute share, counted by when the training happened: the stretches of training behind each result, and
the share of a round's span they fill.

A worker that trains on while its reply is in flight runs part of round r + 1's steps before round r + 1
is planned, and a share counted by the round that a result answers then passes 100%. So each result says
when it was trained (`trained`: [start, end] pairs, in seconds since the epoch on the worker's clock), the
coordinator keeps them per node in the round line of the round that received them, and a round's span
runs from its plan to the next round's (the last round's, to its commit). Its share is the training that
fell inside the span, on the nodes it planned, over those nodes times its length: nothing counts twice,
and no share passes 100%. The workers' clocks are taken as the coordinator's; on boxes whose clocks
disagree the stretches move by the difference.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence

Span = tuple[float, float]

MAX_SPANS = 64  # stretches per result on the wire; more are joined across their shortest gaps


def merged(spans: Iterable[Sequence[float]], most: int = MAX_SPANS) -> list[Span]:
    """The union of `spans` as sorted, disjoint stretches; past `most`, joined across the shortest gaps
    (the gap then counts as training: a bound on the error, kept small by `most`)."""
    out: list[list[float]] = []
    for a, b in sorted((float(s[0]), float(s[1])) for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    while len(out) > most:
        i = min(range(len(out) - 1), key=lambda j: out[j + 1][0] - out[j][1])
        out[i : i + 2] = [[out[i][0], out[i + 1][1]]]
    return [(a, b) for a, b in out]


def record(spans: Iterable[Sequence[float]]) -> list[list[float]]:
    """`spans` merged, as they go on the wire and into a round line: [start, end] lists, to the millisecond."""
    return [[a, b] for a, b in merged((round(float(s[0]), 3), round(float(s[1]), 3)) for s in spans)]


def busy(spans: Iterable[Sequence[float]], lo: float, hi: float) -> float:
    """Seconds of the union of `spans` that fall inside [lo, hi]."""
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in merged(spans, most=1 << 30))


def share(
    trained: Mapping[Hashable, Iterable[Sequence[float]]], nodes: Iterable[Hashable], lo: float, hi: float
) -> float:
    """The share of [lo, hi] that `nodes` spent training, by the stretches in `trained` (node -> spans)."""
    nodes = set(nodes)
    if hi <= lo or not nodes:
        return 0.0
    return sum(busy(trained.get(n, []), lo, hi) for n in nodes) / (len(nodes) * (hi - lo))


def shares(rounds: Sequence[object]) -> dict[int, float]:
    """Each round's compute share as this module's docstring counts it, from the round lines of a run
    (soma_edge.rundir.metrics.RoundLine, in order); rounds whose lines predate `planned_at` are left out."""
    timed = [r for r in rounds if getattr(r, "planned_at", None) is not None]
    by_node: dict[str, list[Sequence[float]]] = {}
    for r in timed:
        for node, spans in (getattr(r, "trained", None) or {}).items():
            by_node.setdefault(node, []).extend(spans)
    out = {}
    for i, r in enumerate(timed):
        lo = r.planned_at
        hi = timed[i + 1].planned_at if i + 1 < len(timed) else r.time
        if hi is None or hi <= lo or not r.nodes:
            continue
        out[r.round] = share(by_node, r.nodes, lo, hi)
    return out
