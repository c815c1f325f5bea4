"""Strikes against nodes, as coordinator.guard's rule counts them: a result the protocol checks refuse is a
strike at once (`reject`); the guard's refusals wait in the round's tallies (`refuse`) and are judged per
node once the round's verdicts are in (`judge_nodes`); at `federation.max_strikes` a node is excluded.

Called by coordinator.intake.
"""

from __future__ import annotations

from typing import Any

from coordinator import guard
from coordinator.fleet import Node, NodeStatus
from coordinator.guard import Tally
from coordinator.round import Round
from soma_edge.config import FederationConfig
from soma_edge.processes import logs
from soma_edge.processes.logs import role_logger
from soma_edge.rundir.metrics import Rejection

log = role_logger("soma.coord")


def reject(rnd: Round, node: Node, experts: list, reason: str, fed: FederationConfig, table: dict[str, Any]) -> None:
    """Refuse these results (the current versions stay) and count a strike for each against the node."""
    for e in experts:
        n = guard.strike(table, node.who, node.label, reason, rnd.r)
        log.warning(
            "round %d: rejected expert %s from node %s (%s), strike %d of %s: %s",
            rnd.r,
            e,
            node.id,
            node.name,
            n,
            fed.max_strikes or "unlimited",
            reason,
        )
        rnd.rejected.append(Rejection(expert=e, node=node.label, node_id=node.id, reason=reason, strike=n))
        if isinstance(e, int) and e in rnd.plan.assignment:
            rnd.failed.setdefault(e, f"rejected: {reason}")
    exclude_if_out(rnd, node, fed, table)


def refuse(rnd: Round, node: Node, e: int, reason: str, far: bool, **extra: Any) -> None:
    """The guard refused expert e's version from `node` (`far`: by more than guard.FAR margins): the current
    version stays, and the node's strike waits for the round's other verdicts (`judge_nodes`)."""
    log.info("round %d: refused expert %d from node %s (%s): %s", rnd.r, e, node.id, node.name, reason)
    rej = Rejection(expert=e, node=node.label, node_id=node.id, reason=reason, guard=True, **extra)
    rnd.rejected.append(rej)
    tally = rnd.tallies.setdefault(node.id, Tally())
    tally.refused.append(rej)
    tally.far += far
    if e in rnd.plan.assignment:
        rnd.failed.setdefault(e, f"rejected: {reason}")


def judge_nodes(rnd: Round, nodes: dict[int, Node], fed: FederationConfig, table: dict[str, Any]) -> None:
    """Strike or forgive each node for its guard verdicts since it was last judged, all of them together
    (`guard.judge_round`): the rule reads how many of a node's versions were refused and accepted, so it
    must not see them one by one as they settle."""
    for nid, t in sorted(rnd.tallies.items()):
        node = nodes[nid]
        if node.status == NodeStatus.EXCLUDED:
            continue
        counts = guard.judge_round(table, node.who, node.label, t, rnd.r)
        if not counts:
            if t.refused:
                log.info("round %d: node %s (%s): one near miss of the guard, no strike", rnd.r, nid, node.name)
            continue
        for i, rej in enumerate(t.refused):
            rej.strike = counts[min(i, len(counts) - 1)]
        log.warning(
            "round %d: node %s (%s): %d of its %d versions refused by the guard (experts %s), %s: strike %d of %s",
            rnd.r,
            nid,
            node.name,
            len(t.refused),
            len(t.refused) + t.accepted,
            logs.expert_set([rej.expert for rej in t.refused]),
            "one strike for the round" if len(counts) == 1 else "most of them: a strike each",
            counts[-1],
            fed.max_strikes or "unlimited",
        )
        exclude_if_out(rnd, node, fed, table)
    rnd.tallies.clear()


def exclude_if_out(rnd: Round, node: Node, fed: FederationConfig, table: dict[str, Any]) -> None:
    """Exclude the node for the rest of the run once it has max_strikes strikes."""
    if node.status != NodeStatus.EXCLUDED and guard.excluded(table, node.who, fed.max_strikes):
        log.warning(
            "round %d: node %s (%s) has %d strikes (federation.max_strikes): excluded for the rest of the run",
            rnd.r,
            node.id,
            node.name,
            fed.max_strikes,
        )
        node.status = NodeStatus.EXCLUDED
        rnd.excluded.append(node.label)
