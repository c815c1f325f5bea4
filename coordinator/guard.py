"""Guarded updates: a reply that passes the protocol checks must still not make its expert worse.

A new version is accepted only if its val loss is at most the expert's *best* val loss so far plus
`federation.guard_tolerance`. Bounding by the best, not the current version, is what stops a node that
drifts the expert by just under one tolerance per round: the second such step is past the bound.

Every rejected result (by this bound or by the protocol checks) is a strike against the node's
identity; at `federation.max_strikes` strikes the node is excluded for the rest of the run. A version that
improves on its expert's best takes one strike off its node, so an honest node whose step overshot now
and then is not excluded over a long run, while one that never improves anything is. The identity
is the worker's registered key (`key:<fingerprint>`, from RUN/workers.json, with `soma-coord start
--auth`), which survives restarts of the worker and of the coordinator. Without authentication it is the
Flower node id (`node:<id>`), which a restarted worker does not keep: its strikes start again.

The strike table lives in state.msgpack (`strikes`), so it commits with the round it was counted in.
"""

from __future__ import annotations

from typing import Any

from coordinator import workers
from soma_edge.errors import ConfigError
from soma_edge.rundir import BestVersion, RunDir


def verdict(val: float, best: BestVersion, tolerance: float) -> str | None:
    """Why a version of val loss `val` is refused (None: accept; `best`: the expert's best version so far,
    soma_edge.rundir.ExpertRecord.best_or_current)."""
    if val <= best.val_loss + tolerance:
        return None
    return (
        f"val loss {val:.4f} is worse than the expert's best {best.val_loss:.4f} (v{best.version}) by more "
        f"than federation.guard_tolerance = {tolerance:g}"
    )


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


def forgive(strikes: dict[str, Any], who: str) -> None:
    """A new best version from `who` takes one strike off: honest overshoots are forgiven by good work, a
    node that only ever makes its experts worse is not."""
    rec = strikes.get(who)
    if rec and int(rec["count"]) > 0:
        rec["count"] = int(rec["count"]) - 1


def excluded(strikes: dict[str, Any], who: str, limit: int) -> bool:
    return limit > 0 and count(strikes, who) >= limit
