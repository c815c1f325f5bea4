"""Who trains which expert this round, for how many steps, and the round's deadline: a sticky,
proportionally fair plan (coordinator.scheduler) over the active nodes' rates, that prices what each node
must fetch and send back over its link: as measured, or at scheduler.UNMEASURED_LINK until it is.

Called by coordinator.loop (`Loop.start_round`).
"""

from __future__ import annotations

from typing import Callable

from coordinator import scheduler
from coordinator.dispatch import log_bytes, reply_mode
from coordinator.fleet import Fleet, Node
from coordinator.ledger import Bases, Ledger
from soma_edge.config import Config, evals_per_step
from soma_edge.rundir import seed as seed_mod
from soma_edge.rundir.state import PrepareSummary
from soma_edge.wire.protocol import ReplyMode


class Planner:
    def __init__(self, cfg: Config, ledger: Ledger, fleet: Fleet, prep: PrepareSummary) -> None:
        self.cfg, self.ledger, self.fleet, self.prep = cfg, ledger, fleet, prep  # prep: the shards
        self.sizes = prep.shard_sizes()  # shard hash -> bytes

    def plan(self, active: dict[int, Node], bases: Bases) -> tuple[scheduler.Plan, dict[int, list[int]]]:
        """The round's plan from the bases each expert trains from, and each node's experts."""
        rates, phase = {nid: n.rate for nid, n in active.items()}, self.ledger.phase_config()
        fed = self.cfg.federation
        ids = in_turn(
            self.ledger.trainable_ids(),
            lambda e: bases.base(e).step,
            len(active),
            fed.round_seconds,
            fed.min_expert_seconds,
        )
        plan = scheduler.plan(
            ids,
            rates,
            self.previous(active, bases),
            fed.round_seconds,
            {nid: evals_per_step(n.config(phase).spsa) for nid, n in active.items()},
            lambda e, nid: self.transfer_seconds(e, nid, bases),
        )
        if self.ledger.capped():  # a fixed budget: never past it; experts that have it all sit the round out
            left = self.ledger.steps_left(bases)
            plan.steps = {e: min(s, left[e]) for e, s in plan.steps.items() if e in left}
        by_node: dict[int, list[int]] = {}
        for e, nid in sorted(plan.assignment.items()):
            if e in plan.steps:
                by_node.setdefault(nid, []).append(e)
        return plan, by_node

    def following(self, active: dict[int, Node], bases: Bases, plan: scheduler.Plan) -> dict[int, list[int]]:
        """Each node's experts in the round after `plan`, as its plan will most likely give them: the experts
        in turn once this round's steps are taken, each on the node that trains it now or holds its version
        (a worker's speculating trainer trains those while its reply is in flight). {} where the next round
        trains the same experts as this one."""
        fed = self.cfg.federation
        ids = in_turn(
            self.ledger.trainable_ids(),
            lambda e: bases.base(e).step + plan.steps.get(e, 0),
            len(active),
            fed.round_seconds,
            fed.min_expert_seconds,
        )
        if set(ids) == set(plan.steps):
            return {}
        held = self.previous(active, bases)
        out: dict[int, list[int]] = {}
        for e in ids:
            nid = plan.assignment.get(e, held.get(e))
            if nid is not None:
                out.setdefault(nid, []).append(e)
        return out

    def deadline(self, r: int, plan: scheduler.Plan, by_node: dict[int, list[int]]) -> float:
        """When round r's replies are due. A node on a slow link gets the time to fetch what it lacks
        (weights, shards) and to send its reply, one after the other, both priced at `link`."""
        fed = self.cfg.federation
        transfer = max(
            (
                plan.transfer.get(n, 0.0) + self.reply_seconds(n, es, r, plan.steps, len(by_node))
                for n, es in by_node.items()
            ),
            default=0.0,
        )
        return self.fleet.clock() + fed.round_seconds * fed.deadline_factor + fed.deadline_slack + transfer

    def previous(self, active: dict[int, Node], bases: Bases) -> dict[int, int]:
        """Where each expert's base version already is: last round's node, else any node caching it."""
        prev: dict[int, int] = {}
        last = bases.last_assignment()
        by_label = {n.label: nid for nid, n in active.items()}
        for e in self.ledger.expert_ids():
            nid = last.get(e)
            if isinstance(nid, str):
                nid = by_label.get(nid)
            if nid in active and bases.holds(nid, e):
                prev[e] = nid
                continue
            holders = sorted(nid for nid in active if bases.holds(nid, e))
            if holders:
                prev[e] = holders[0]
        return prev

    def transfer_seconds(self, e: int, nid: int, bases: Bases) -> float:
        """How long node `nid` would take to fetch what expert e needs and its cache lacks: the version
        with its optimizer state, and the shards."""
        node = self.fleet.nodes[nid]
        nbytes = 0 if bases.holds(nid, e) else self.ledger.version_bytes()
        shards = seed_mod.shards(self.cfg, self.prep, e, "train")
        nbytes += sum(self.sizes.get(h, 0) for h in shards if h not in node.shards)
        return nbytes / link(node)

    def reply_seconds(self, nid: int, experts: list[int], r: int, steps: dict[int, int], nodes: int = 1) -> float:
        """How long node `nid`'s reply for `experts` takes up its link."""
        node = self.fleet.nodes[nid]
        phase, vbytes = node.config(self.ledger.phase_config()), self.ledger.version_bytes()
        most = max(steps[e] for e in experts)
        mode = reply_mode(self.cfg, phase, node, r, most, vbytes, len(experts), nodes)  # as the request asks
        weights = vbytes if mode in (ReplyMode.WEIGHTS, ReplyMode.BOTH) else 0
        logs = (ReplyMode.LOG, ReplyMode.BOTH)
        return sum(weights + (log_bytes(phase, steps[e]) if mode in logs else 0) for e in experts) / link(node)


def in_turn(ids: list[int], step: Callable[[int], int], nodes: int, round_seconds: float, least: float) -> list[int]:
    """The experts a round trains: every one, unless `nodes` nodes cannot give each `least` seconds of their
    `round_seconds`; then as many as they can, those with the fewest steps so far (`step(e)`, asked only
    then; ties to the lower id), so that every expert trains in turn with a useful budget rather than all in
    slivers."""
    if least <= 0:
        return ids
    slots = nodes * max(1, int(round_seconds // least))
    if len(ids) <= slots:
        return ids
    return sorted(sorted(ids, key=lambda e: (step(e), e))[:slots])


def link(node: Node) -> float:
    return scheduler.priced_link(node.link)
