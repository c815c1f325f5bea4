"""What each node is sent: its experts' train request (each task's base version as weights, as the log
from a version the node holds, or nothing where it holds it; the shards it lacks, in pieces before the
request where they are many), what it is asked to send back (`reply_mode`), and the requests that go
again: a resend after a cache miss, idle experts handed to a node without work.

Called by coordinator.loop (a round's requests), coordinator.intake (a resend) and coordinator.planning
(how long a reply takes up a link).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from coordinator import check_budget, scheduler
from coordinator.fleet import Fleet, Node, Outgoing, Sent, message
from coordinator.ledger import Bases, Ledger
from coordinator.round import Round, Waiting
from soma_edge.config import Config, LogDecoder, ReplyPolicy, check_threads, evals_per_step
from soma_edge.errors import CheckpointError, CorpusError
from soma_edge.expert import params
from soma_edge.processes import logs
from soma_edge.processes.logs import role_logger
from soma_edge.rundir import seed as seed_mod
from soma_edge.rundir.layout import RunDir
from soma_edge.rundir.state import PrepareSummary
from soma_edge.spsa import quant
from soma_edge.spsa.log import UpdateLog
from soma_edge.spsa.optim import OptState
from soma_edge.spsa.recipe import Recipe
from soma_edge.wire import pieces as pieces_mod
from soma_edge.wire import protocol
from soma_edge.wire.protocol import ReplyMode

log = role_logger("soma.coord")


def log_bytes(phase: Config, steps: int) -> int:
    """An update log's size: 4 bytes per direction per step, and a delta-rule decoder's change in int8
    codes and their scales (or its float32 weights: federation.log_decoder), with its Adam moments where
    the coordinator audits."""
    lay, fed = params.layout(phase.model), phase.federation
    n = lay.size - lay.body if phase.spsa.decoder == "delta" else 0
    dense = 4 * n if fed.log_decoder == LogDecoder.FLOAT32 else n + 4 * quant.blocks(n)
    dense += 8 * n if fed.audit_steps > 0 else 0
    return 4 * steps * phase.spsa.directions * phase.spsa.accumulate + dense


# reply = "auto": the weights where a node's measured link carries its experts' versions within this share of
# a round (the log would save little, and cost the coordinator its replay), else the log; and the weights as
# well every `weights_every` rounds (a checkpoint) only where they cross within CHECKPOINT_SHARE.
WEIGHTS_SHARE = 0.05
CHECKPOINT_SHARE = 0.25


def reply_mode(
    cfg: Config, phase: Config, node: Node, r: int, steps: int, version_bytes: int, experts: int = 1, nodes: int = 1
) -> ReplyMode:
    """What to ask a node's `experts` back in round r: weights, the update log, or both (a checkpoint).
    `phase` is the node's recipe; `nodes` how many share the round's checks (coordinator.check_budget)."""
    fed = cfg.federation
    if fed.reply == ReplyPolicy.WEIGHTS:
        return ReplyMode.WEIGHTS
    if phase.spsa.noise == "gaussian" and node.caps.get("numpy") != np.__version__:
        return ReplyMode.WEIGHTS  # numpy does not promise the same Gaussian stream from one version to the next
    if fed.reply == ReplyPolicy.LOG:
        return ReplyMode.LOG
    if log_bytes(phase, steps) >= version_bytes:  # a log longer than the weights and their Adam moments
        return ReplyMode.WEIGHTS
    # An unmeasured link counts as slow: logs until the node's first large exchange has been timed.
    seconds = experts * version_bytes / node.link if node.link else math.inf
    if seconds <= WEIGHTS_SHARE * fed.round_seconds:
        return ReplyMode.WEIGHTS
    priced = experts * version_bytes / scheduler.priced_link(node.link)
    budget = check_budget.budget(cfg, nodes)
    if check_budget.prefer_weights(node.checks, experts * steps, budget, check_budget.audit_share(cfg), priced):
        return ReplyMode.WEIGHTS  # checking its logs would take longer than its link takes to carry the weights
    if r % fed.weights_every == 0 and seconds <= CHECKPOINT_SHARE * fed.round_seconds:
        return ReplyMode.BOTH
    return ReplyMode.LOG


def missing_shards(
    run: RunDir, cfg: Config, prep: PrepareSummary, node: Node, experts: list[int]
) -> tuple[dict[str, bytes], dict[int, int]]:
    """The train shards of `experts` that `node` lacks, and how many of their bytes each expert is the
    first to need."""
    shards, per_expert = {}, {}
    for e in experts:
        hashes = seed_mod.shards(cfg, prep, e, "train")
        if not hashes:
            raise CorpusError(f"expert {e} has no train shards in {run.prepare_json}")
        per_expert[e] = 0
        for h in hashes:
            if h not in node.shards and h not in shards:
                shards[h] = run.shard(h)
                per_expert[e] += len(shards[h])
    return shards, per_expert


def downstream_log(run: RunDir, ledger: Ledger, e: int, node: Node) -> tuple[dict[str, Any], int] | None:
    """For a node that holds the version before expert e's current one: the log between them (and its
    bytes), when it is shorter than the weights and optimizer state it replaces (downstream logs)."""
    x = ledger.expert(e)
    rec = run.load_log(e, int(x.version)) if int(x.version) > 0 else None
    if rec is None or rec.get("from_sha256") not in node.weights or rec.get("sha256") != x.sha256:
        return None
    seed = ledger.state.seed
    if seed is not None and rec["from_sha256"] == seed.sha256:
        # Version 0 after a seed run hashes like the seed's final weights: the node may hold that hash as
        # the seed, at its step and with its optimizer state, from which version 0's log does not replay.
        return None
    try:
        nbytes = sum(UpdateLog.from_record(rec.get("log")).nbytes().values())
    except CheckpointError:
        return None
    if nbytes >= ledger.version_bytes():
        return None
    return {"from_sha256": rec["from_sha256"], "log": rec["log"]}, nbytes


def _link_said(link: float | None, at_least: bool) -> str:
    if not link:
        return "still untimed (a piece too small to tell)"
    if at_least:  # a piece that crossed within Flower's own overhead shows only a floor (loopback, a LAN)
        return f"timed at {8 * link / 1e6:.1f} Mbit/s or more (the piece crossed within Flower's own overhead)"
    return f"timed at {8 * link / 1e6:.1f} Mbit/s"


def say_over_budget(cfg: Config, node: Node, mode: ReplyMode, steps: int, nodes: int) -> None:
    """One line when checking a node's logs goes over their budget (coordinator.check_budget); again only
    after they were back under it."""
    if mode == ReplyMode.WEIGHTS:
        return
    budget = check_budget.budget(cfg, nodes)
    took = check_budget.log_seconds(node.checks, steps, check_budget.audit_share(cfg))
    if took > budget and not node.over_budget:
        log.warning(
            "node %s: checking its logs takes about %.1f s of one check thread a round, over their budget of "
            '%.1f s (%d%% of the round on %d threads, shared by %d nodes); reply = "auto" sends its weights '
            "where the link allows, a lower federation.audit_share audits fewer of its logs",
            node.label,
            took,
            budget,
            round(100 * check_budget.CHECK_SHARE),
            check_threads(cfg),
            nodes,
        )
    node.over_budget = took > budget


class Dispatcher:
    def __init__(self, run: RunDir, cfg: Config, ledger: Ledger, fleet: Fleet, prep: PrepareSummary) -> None:
        self.run, self.cfg, self.ledger, self.fleet, self.prep = run, cfg, ledger, fleet, prep  # prep: the shards

    def send_round(self, rnd: Round, by_node: dict[int, list[int]], bases: Bases, ahead: Round | None) -> None:
        """Send round rnd's requests (`by_node`: each node's experts). Planned ahead of round `ahead`'s checks,
        a node given an expert whose claimed version another node made waits for that round's commit."""
        for nid, es in sorted(by_node.items()):
            if ahead and any(e in ahead.claims and ahead.claims[e].node != nid for e in es):
                rnd.deferred[nid] = es
            else:
                self.send_train(rnd, nid, es, rnd.plan.steps, bases)

    def send_deferred(self, rnd: Round) -> None:
        """After the last round's commit: the requests `send_round` held back for it go out, and the
        round's deadline moves by the time the coordinator spent on that round's checks and commit (it
        pulled no replies meanwhile, and the held-back requests went out only now)."""
        rnd.deadline += self.fleet.clock() - rnd.t_sent
        bases = Bases(self.ledger, self.fleet.nodes)  # committed now
        for nid, es in sorted(rnd.deferred.items()):
            self.send_train(rnd, nid, es, rnd.plan.steps, bases)
        rnd.deferred.clear()

    def send_train(
        self, rnd: Round, nid: int, experts: list[int], steps: dict[int, int], bases: Bases, max_seconds=None
    ) -> None:
        """Give node `nid` its experts: the shard bytes it lacks in pieces of at most `Fleet.piece_bytes`, all but
        the last as messages of their own, then (once those are stored) the train request with the last.
        Where the node's link is not yet measured, the first piece goes alone: its exchange times the link
        (`on_pieces`), and the rest go in messages sized for the link as measured, not as feared."""
        shards, shard_bytes = missing_shards(self.run, self.cfg, self.prep, self.fleet.nodes[nid], experts)
        pieces = pieces_mod.split_pieces(shards, self.fleet.piece_bytes(nid))
        if len(pieces) <= 1:
            last = pieces[0] if pieces else []
            self.push_train(rnd, self.train_request(rnd, nid, experts, steps, bases, max_seconds, last, shard_bytes))
            return
        # An unmeasured link is priced low: time it with the first piece, and the rest wait to go in pieces
        # sized by what it measured, unless federation.piece_bytes already caps them at the feared size.
        timing = self.fleet.nodes[nid].link is None and self.fleet.piece_bytes(nid) < self.cfg.federation.piece_bytes
        rest = [p for m in pieces[1:] for p in m] if timing else []
        wait = Waiting(set(), experts, steps, [] if timing else pieces.pop(), shard_bytes, rest)
        rnd.waiting[nid] = wait
        self.push_pieces(nid, wait, pieces[:1] if timing else pieces)
        log.info(
            "round %d: node %s lacks %.1f MiB of shards: %s before its experts %s",
            rnd.r,
            self.fleet.nodes[nid].label,
            sum(map(len, shards.values())) / 2**20,
            "a first piece times its link" if timing else f"{len(pieces) + 1} pieces go",
            logs.expert_set(experts),
        )

    def push_pieces(self, nid: int, wait: Waiting, messages: list[list[dict[str, Any]]]) -> None:
        before = set(self.fleet.out)
        run_id = self.ledger.state.run_id
        self.fleet.push(
            [
                (
                    message(protocol.pieces_request(run_id, nid, p), protocol.KIND_PIECES, nid, protocol.QUERY_SHARDS),
                    Outgoing(node=nid, kind=Sent.PIECES),
                )
                for p in messages
            ]
        )
        wait.mids |= set(self.fleet.out) - before

    def push_train(self, rnd: Round, item: tuple[Any, Outgoing]) -> None:
        before = set(self.fleet.out)
        self.fleet.push([item])
        rnd.train_mids |= set(self.fleet.out) - before

    def on_pieces(self, mid: str, reply: Any, o: Outgoing, rnd: Round) -> None:
        """A piece was stored (or not: the train request then finds the shard missing and it comes again).
        The node's train request goes out with the last piece once every earlier one is answered."""
        rnd.bytes_down += o.bytes_down
        wait = rnd.waiting.get(o.node)
        if wait is None:
            return
        if reply.has_error():
            log.warning("round %d: node %s did not store shard pieces: %s", rnd.r, o.node, reply.error.reason)
        else:
            self.fleet.time_link(o, reply, 0.0)  # a piece is stored, not trained on
        wait.mids.discard(mid)
        if wait.rest:  # the first piece is in: the rest, in messages sized by the link it measured
            rest, wait.rest = wait.rest, []
            messages = pieces_mod.group_pieces(rest, self.fleet.piece_bytes(o.node))
            wait.last = messages.pop()  # rides in the train request
            self.push_pieces(o.node, wait, messages)
            node = self.fleet.nodes[o.node]
            log.info(
                "round %d: node %s's link %s: %s with and before its experts %s",
                rnd.r,
                node.label,
                _link_said(node.link, node.link_at_least),
                "1 more piece goes" if not messages else f"{len(messages) + 1} more pieces go",
                logs.expert_set(wait.experts),
            )
        if wait.mids:
            return
        del rnd.waiting[o.node]
        fed = self.cfg.federation
        # Never more than round_seconds: the deadline also holds the time its reply takes up the link.
        budget = min(fed.round_seconds, max(rnd.deadline - self.fleet.clock() - fed.deadline_slack, 1.0))
        bases = Bases(self.ledger, self.fleet.nodes)  # the committed versions (requests planned ahead defer)
        item = self.train_request(rnd, o.node, wait.experts, wait.steps, bases, budget, wait.last, wait.shard_bytes)
        self.push_train(rnd, item)

    def train_request(
        self,
        rnd: Round,
        nid: int,
        experts: list[int],
        steps: dict[int, int],
        bases: Bases,
        max_seconds: float | None,
        pieces: list[dict[str, Any]],
        shard_bytes: dict[int, int],
    ) -> tuple[Any, Outgoing]:
        """Node `nid`'s train request for round `rnd`, and what it expects back."""
        r, node, fed = rnd.r, self.fleet.nodes[nid], self.cfg.federation
        phase = node.config(self.ledger.phase_config())  # the node's recipe: the run's with its own probes
        most, nodes = max((steps[e] for e in experts), default=0), len(set(rnd.plan.assignment.values()))
        mode = reply_mode(self.cfg, phase, node, r, most, self.ledger.version_bytes(), len(experts), nodes)
        tasks, per_expert, exp_tasks = [], {}, {}
        for e in experts:
            task, exp_tasks[e], per_expert[e] = self._task(e, node, steps[e], bases, mode)
            per_expert[e]["shards"] = shard_bytes.get(e, 0)
            tasks.append(task)
        body = protocol.train_request(
            round=r,
            node=nid,
            run_id=self.ledger.state.run_id,
            config=phase.to_dict(),
            reply_dtype=fed.reply_dtype,
            max_seconds=max_seconds or fed.round_seconds,
            tasks=tasks,
            pieces=pieces,
            heartbeat=self.fleet.advised(nid),
            **self.following(rnd, nid, experts, steps, bases, mode),
        )
        width = phase.spsa.accumulate * phase.spsa.directions  # scalars a step of a log reply
        expected = protocol.Expected(nid, r, exp_tasks, self.ledger.size, fed.reply_dtype, width, Recipe.of(phase))
        say_over_budget(self.cfg, node, mode, most * len(experts), nodes)  # the log steps reply_mode priced
        msg = message(body, protocol.KIND_TRAIN, nid, protocol.TRAIN)
        return msg, Outgoing(node=nid, kind=Sent.TRAIN, expected=expected, per_expert=per_expert)

    def following(
        self, rnd: Round, nid: int, experts: list[int], steps: dict[int, int], bases: Bases, mode: ReplyMode
    ) -> dict[str, Any]:
        """A request's `next_experts` (the node's experts next round) and `next_tasks` (the task each one it does not
        train this round would get now from a version the node holds; not version 0, with its own optimizer state),
        where the experts in turn change; none in the last round, trained longer instead (worker.speculation)."""
        if rnd.r >= self.cfg.federation.rounds:
            return {"next_experts": [], "next_tasks": []}
        if not rnd.following:
            return {}
        nxt, node, fewest = rnd.following.get(nid, []), self.fleet.nodes[nid], min(map(steps.get, experts), default=0)
        ahead = [e for e in nxt if e not in experts and bases.holds(nid, e) and bases.base(e).version > 0]
        return {"next_experts": list(nxt), "next_tasks": [self._task(e, node, fewest, bases, mode)[0] for e in ahead]}

    def _task(
        self, e: int, node: Node, steps: int, bases: Bases, mode: ReplyMode
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, int]]:
        """Expert e's task for `node`, what its reply must match, and the weight bytes it sends down."""
        x = bases.base(e)
        send_w = not bases.holds(node.id, e)
        downstream = downstream_log(self.run, self.ledger, e, node) if send_w else None
        base_log, log_nbytes = downstream or (None, 0)
        send_w = send_w and base_log is None
        body = self.run.load_expert(x.path) if send_w else None
        w = body["weights"] if body else None
        stored = self.ledger.checked_opt(body, x.path) if body else None
        opt = stored.to_record() if stored is not None else None
        if not send_w and base_log is None and x.version == 0:
            # Version 0 may hash like a version the node holds with other optimizer state (a seed's final
            # weights, which every expert starts from): its own, fresh, goes along.
            opt = OptState().to_record()
        scale = float(x.lr_scale)
        task = protocol.task(
            expert=e,
            version=x.version,
            base_sha256=x.sha256,
            step=x.step,
            steps=steps,
            shards=seed_mod.shards(self.cfg, self.prep, e, "train"),
            lr_scale=scale,
            weights=w,
            opt=opt,
            reply=mode,
            base_log=base_log,
            keep_sha256=None if x.sha256 == self.ledger.expert(e).sha256 else self.ledger.expert(e).sha256,
        )
        expected = {k: task[k] for k in protocol.SentTask.__annotations__}  # what its result must match
        opt_bytes = stored.nbytes() if stored is not None else 0
        return task, expected, {"weights": log_nbytes if w is None else w.nbytes + opt_bytes}

    def resend(self, rnd: Round, nid: int, experts: list[int]) -> None:
        """The node lacked something it was assumed to cache: send again, with the payload, if time allows."""
        fed = self.cfg.federation
        left = rnd.deadline - self.fleet.clock() - fed.deadline_slack
        if left < fed.round_seconds * 0.25:
            for e in experts:
                rnd.failed.setdefault(e, "node lacked cached data and too little round time was left to resend")
            return
        scale = left / (fed.round_seconds * fed.deadline_factor)
        steps = {e: max(1, int(rnd.plan.steps[e] * min(1.0, scale))) for e in experts}
        log.info(
            "round %d: resending %s to node %s with their payload (cache miss)", rnd.r, logs.expert_set(experts), nid
        )
        bases = Bases(self.ledger, self.fleet.nodes)
        self.send_train(rnd, nid, experts, steps, bases, max_seconds=min(left, fed.round_seconds))
        rnd.pending_resend |= set(experts)
        rnd.resent |= set(experts)

    def give_idle(self, rnd: Round) -> None:
        """Experts left idle this round, because their node left or failed, go at once to a node without
        work this round (a worker that joined since the plan), when a whole round_seconds of training
        still fits before the deadline. The round then waits for that node's reply too."""
        fed = self.cfg.federation
        if rnd.deadline - self.fleet.clock() - fed.deadline_slack < fed.round_seconds:
            return
        idle = sorted(
            e
            for e, why in rnd.failed.items()
            if not why.startswith("rejected") and e not in rnd.accepted and e not in rnd.pending_resend
        )
        if not idle:  # the usual case: no need to ask the SuperLink for its nodes on every poll
            return
        busy = set(rnd.plan.assignment.values())
        free = [nid for nid in self.fleet.active() if nid not in busy]
        if not free:
            return
        nodes, bases = self.fleet.nodes, Bases(self.ledger, self.fleet.nodes)
        nid = max(free, key=lambda n: (nodes[n].rate, -n))
        cost = evals_per_step(nodes[nid].config(self.ledger.phase_config()).spsa)  # its recipe's passes a step
        per = scheduler.steps_for(nodes[nid].rate, len(idle), fed.round_seconds, cost)
        steps = {e: min(scheduler.MAX_STEPS, math.ceil(scheduler.HEADROOM * per)) for e in idle}
        if self.ledger.capped():
            left = self.ledger.steps_left(bases)
            steps = {e: min(s, left[e]) for e, s in steps.items() if left.get(e)}
        if not steps:
            return
        for e in steps:
            rnd.failed.pop(e)
            rnd.plan.assignment[e] = nid
            rnd.plan.moved = sorted(set(rnd.plan.moved) | {e})
        rnd.plan.steps.update(steps)
        what = (rnd.r, logs.expert_set(steps), nodes[nid].label)
        log.info("round %d: idle experts %s go to %s, which has no work this round", *what)
        self.send_train(rnd, nid, sorted(steps), steps, bases, max_seconds=fed.round_seconds)
