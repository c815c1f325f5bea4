"""Requests of the last round that missed its deadline (`Loop._missed`): the train requests and shard
pieces still out. A train reply that comes before the next round is planned is checked like any other
and commits with the next round (`Late.poll`). A node still receiving or answering one is busy, not gone:
where the next round finds no free node, it waits for that node (`Fleet.wait_for_nodes` with `busy`)
instead of failing the run after `wait_seconds`, and takes its late reply. A held request stops counting
as work when its node leaves (the SuperLink drops it from its live nodes, or answers NODE_UNAVAILABLE) or
after BUSY_FACTOR times its round's allowance (a live but hung worker), so the wait always ends.

Once the next round is planned, what is still out is given up (`drop`): its experts may move, and a reply
on a base version another node has since trained from would be refused as stale.

Called by coordinator.loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.fleet import Fleet, NodeStatus, Outgoing, Sent
from coordinator.intake import Intake
from coordinator.round import Round
from soma_edge.processes.logs import role_logger

log = role_logger("soma.coord")

# A late request counts as work for up to this many times the time its round allowed it (compute, slack and
# the transfer priced at the node's link or at scheduler.UNMEASURED_LINK): a link 3x slower than the rate
# its deadline assumed still delivers; past that the worker is taken as hung although its SuperNode lives.
BUSY_FACTOR = 3.0


@dataclass
class Held:
    o: Outgoing
    until: float  # the clock after which it no longer counts as work, its node live or not


class Late:
    def __init__(self, fleet: Fleet, intake: Intake) -> None:
        self.fleet, self.intake = fleet, intake
        self.held: dict[str, Held] = {}  # message id -> a request of the last round still out

    def hold(self, outs: list[Outgoing], allowance: float) -> None:
        """Keep a round's requests still out at its deadline (`allowance`: seconds the round gave them)."""
        self.held = {o.mid: Held(o, o.sent_at + BUSY_FACTOR * allowance) for o in outs}

    def drop(self) -> None:
        self.held = {}

    def poll(self, rnd: Round) -> dict[int, float]:
        """Pull the held requests' replies once; a train reply is checked as one of round rnd's (marked
        late), and its node gets work again. Returns the live nodes still working on one, and since when."""
        self.pull(rnd)
        self.intake.settle_all(rnd)
        for line in rnd.accepted.values():
            if line.late:  # marked at an earlier poll
                continue
            line.late = True
            log.info(
                "round %d: accepted expert %d v%d from %s after the last round's deadline",
                rnd.r,
                line.expert,
                line.version,
                line.node,
            )
            node = self.fleet.nodes[line.node_id]
            if node.status != NodeStatus.EXCLUDED:  # struck out by the same poll's verdicts: it stays out
                node.status = NodeStatus.ACTIVE  # it answered after all
        return self.busy()

    def pull(self, rnd: Round) -> None:
        if not self.held:
            return
        out = self.fleet.out
        out.update({mid: h.o for mid, h in self.held.items()})

        def handle(mid, reply, o: Outgoing) -> None:
            if mid in self.held and o.kind is Sent.TRAIN:  # a piece's reply only says the node is free of it
                self.intake.on_train(mid, reply, o, rnd)

        self.fleet.pull(handle)
        for mid in list(self.held):
            if out.pop(mid, None) is None:  # answered: `Fleet.pull` took it out
                del self.held[mid]

    def busy(self) -> dict[int, float]:
        """The live nodes with a held request still out, and when the oldest went; forgets those of nodes
        that left and those past their patience."""
        live, now = self.fleet.live_ids(), self.fleet.clock()
        expired = {h.o.node for h in self.held.values() if h.o.node in live and now > h.until}
        for nid in sorted(expired):
            node, oldest = self.fleet.nodes[nid], min(h.o.sent_at for h in self.held.values() if h.o.node == nid)
            log.warning(
                "node %s (%s) is live but has not answered its last round's request in %.0f s: "
                "no longer waiting for it",
                nid,
                node.label,
                now - oldest,
            )
        self.held = {mid: h for mid, h in self.held.items() if h.o.node in live and h.o.node not in expired}
        since: dict[int, float] = {}
        for h in self.held.values():
            since[h.o.node] = min(since.get(h.o.node, h.o.sent_at), h.o.sent_at)
        return since
