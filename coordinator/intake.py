"""A reply, from message to verdict: the reply's cheap checks (header, each result's shapes, base version
and log structure) make each result a claim; settling a claim runs the costly ones (a log's audit and
replay, coordinator.replay; the guard's val loss, coordinator.guard) and accepts the version into the
ledger or refuses it with a strike against its node.

Called by coordinator.loop: `on_train` for each train reply it pulls, `settle` while it waits and
`settle_all` before the commit.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from coordinator import finish, guard, records, scheduler, strikes
from coordinator.checks import Checks
from coordinator.dispatch import Dispatcher
from coordinator.evaluation import Evaluation
from coordinator.fleet import Fleet, Node, NodeStatus, Outgoing
from coordinator.ledger import Ledger
from coordinator.round import Claim, Round
from soma_edge.config import Config
from soma_edge.errors import CodecError, ValidationError
from soma_edge.processes import logs
from soma_edge.processes.logs import role_logger
from soma_edge.rundir import seed as seed_mod
from soma_edge.rundir.layout import RunDir
from soma_edge.rundir.state import GuardBar, PrepareSummary
from soma_edge.spsa.optim import OptState, plateau, schedule
from soma_edge.wire import protocol

log = role_logger("soma.coord")

STATUS_SECONDS = 1.0  # status.json at most this often while results come in: a live view redraws each second,
# and at N = 256 one write per accepted result (200 KB of JSON each) cost seconds of every commit
ROSE = 0.05  # nats/byte: a rise of a round's train loss that marks its claim suspect (`settle_suspects`);
# the soma kind's diverging experts rose 0.14-0.17, and at N = 256 any rise at all took half the claims
NODE_UNAVAILABLE = 5  # flwr's ErrorCode: the node missed two heartbeats


class Intake:
    def __init__(
        self,
        run: RunDir,
        cfg: Config,
        ledger: Ledger,
        fleet: Fleet,
        prep: PrepareSummary,
        evaluation: Evaluation,
        dispatcher: Dispatcher,
        status: Callable[..., None],
    ) -> None:
        self.cfg, self.ledger, self.fleet, self.prep = cfg, ledger, fleet, prep  # prep: the shards
        self.dispatcher = dispatcher
        self.status = status  # writes status.json (`Loop.status`)
        self.refused: set[str] = set()  # version hashes claimed by results that their checks refused
        self.checks = Checks(run, cfg, ledger, prep, evaluation)
        self.status_at = -math.inf  # when `accept` last wrote status.json (`STATUS_SECONDS`)
        self.last_refused: set[int] = set()  # experts whose last verdict was the guard's refusal (`settle_suspects`)
        self.spreads: dict[int, guard.Spread] = {}  # each expert's last accepted judgement's spread, pooled
        # for the experts with too few val windows to estimate their own (`guard.judge`)

    def on_train(self, mid: str, reply: Any, o: Outgoing, rnd: Round) -> None:
        node, exp = self.fleet.nodes[o.node], o.expected
        rnd.bytes_down += o.bytes_down
        if reply.has_error():
            self._failed(rnd, node, o, reply.error)
            return
        rnd.bytes_up += protocol.payload_bytes(reply.content)
        if node.status == NodeStatus.EXCLUDED:  # struck out after this request went (it went ahead of the checks)
            for e in exp.tasks:
                rnd.failed.setdefault(e, f"node {node.label} is excluded")
            return
        try:
            body = protocol.unpack(reply.content, protocol.KIND_REPLY, exp.max_reply_bytes())
            protocol.check_reply_header(body, exp, reply.metadata.src_node_id)
        except (CodecError, ValidationError) as err:
            self.reject(rnd, node, list(exp.tasks), str(err))
            return
        node.caps["torch_importable"] = body.get("torch_importable")
        seen, evals, secs = self._claim(rnd, node, o, body)
        if secs > 0:
            node.rate = scheduler.update_rate(node.rate, evals / secs)
        took = body.get("seconds_total")
        self.fleet.time_link(o, reply, float(took) if protocol.is_number(took) else secs)
        rnd.compute[node.id] = rnd.compute.get(node.id, 0.0) + secs
        for err in body.get("errors") or []:
            log.warning("round %d: node %s (%s) reports: %s", rnd.r, o.node, node.name, err)
        for f in body.get("failed") or []:  # checked: experts of this request, each once
            e, why = f["expert"], f["reason"]
            rnd.failed[e] = f"node {node.label}: {why}"
            if e not in seen and self.ledger.bench(e, rnd.failed[e]):
                log.warning(
                    "expert %d cannot train (node %s): %s; left out of the rounds that follow", e, node.label, why
                )
        missing = body.get("missing") or {}
        node.weights -= set(missing.get("weights") or [])
        node.shards -= set(missing.get("shards") or [])
        redo = [e for e in exp.tasks if e not in seen and e not in rnd.failed]
        if redo and (missing.get("weights") or missing.get("shards")):
            for e in redo:  # at most one resend an expert a round: a second miss is the node's, not the cache's
                if e in rnd.resent:
                    rnd.failed[e] = f"node {node.label} lacked its base again after a resend"
            redo = [e for e in redo if e not in rnd.resent]
            if redo:
                self.dispatcher.resend(rnd, o.node, redo)
        for e in redo:
            if e not in rnd.accepted and e not in rnd.failed and e not in rnd.pending_resend:
                rnd.failed[e] = f"node {node.label} returned no result"

    def _failed(self, rnd: Round, node: Node, o: Outgoing, error: Any) -> None:
        """An error reply: the node is gone (no heartbeat) or failed; its experts go to other nodes."""
        gone = error.code == NODE_UNAVAILABLE
        if gone:
            log.warning(
                "round %d: node %s (%s) is gone (no heartbeat); its experts %s go to other nodes",
                rnd.r,
                o.node,
                node.name,
                logs.expert_set(o.expected.tasks),
            )
        else:
            log.warning(
                "round %d: node %s (%s) failed: code %s, %s", rnd.r, o.node, node.name, error.code, error.reason
            )
        node.status = NodeStatus.PROBATION
        for e in o.expected.tasks:
            rnd.failed.setdefault(e, f"node {node.label} is gone" if gone else f"node {node.label} error {error.code}")

    def _claim(self, rnd: Round, node: Node, o: Outgoing, body: dict[str, Any]) -> tuple[set[int], int, float]:
        """Check each result of a reply for what it claims; those that pass become the round's claims.
        Returns the experts seen, and the forward evaluations and seconds they took."""
        exp = o.expected
        seen, evals, secs = set(), 0, 0.0
        for res in body["results"]:
            e = res.get("expert") if isinstance(res, dict) else None
            e = e if isinstance(e, int) and not isinstance(e, bool) else None  # anything else is only logged
            if node.status == NodeStatus.EXCLUDED:  # struck out by an earlier result of this reply
                if e in exp.tasks:
                    rnd.failed.setdefault(e, f"node {node.label} is excluded")
                continue
            if e in exp.tasks:  # compute share counts every result sent, checked or not (wire.compute_share)
                rnd.trained.setdefault(node.id, []).extend(protocol.trained_of(res))
            if e in exp.tasks and exp.tasks[e]["base_sha256"] in self.refused:
                seen.add(e)  # trained on from a claimed version that its checks then refused (pipelining)
                rnd.failed.setdefault(e, f"trained from v{exp.tasks[e]['version']}, which was refused")
                continue
            try:
                if e in seen:
                    raise ValidationError(f"expert {e} appears twice in one reply")
                w, opt = protocol.check_result(res, exp, self.ledger.current_sha())
                ulog = protocol.check_log(res, exp)
            except ValidationError as err:
                self.reject(rnd, node, [e], str(err))
                continue
            seen.add(e)  # checked for what it claims; its replay, audit and val loss come in settle
            rnd.claims[e] = Claim(node.id, res, w, opt, o.per_expert.get(e, {}), body, ulog)
            node.shards |= set(seed_mod.shards(self.cfg, self.prep, e, "train"))  # whatever its result's checks say
            evals += res["forward_evals"]
            secs += float(res["seconds"])
        return seen, evals, secs

    def settle(self, rnd: Round, e: int) -> None:
        """Check expert e's claimed result fully (a log's audit and replay, the guard's val loss) and accept
        or refuse it. A refused claim's sha256 is remembered: the next round may already train from it."""
        c = rnd.claims.pop(e)
        node = self.fleet.nodes[c.node]
        self.last_refused.discard(e)  # `accept` puts it back if the guard refuses this one
        if node.status == NodeStatus.EXCLUDED:  # struck out by an earlier result of the same node
            rnd.failed.setdefault(e, f"node {node.label} is excluded")
        elif self.ledger.expert(e).finished is not None:  # in a round planned before it finished
            rnd.failed.setdefault(e, "finished")
        else:
            checked = c.checked or self.checks.check(c)
            if c.timed is not None:
                node.checks.seen(*c.timed)
            if isinstance(checked, ValidationError):
                self.reject(rnd, node, [e], str(checked))
            else:
                self.accept(rnd, node, c, *checked)
        if e not in rnd.accepted:
            self.refused.add(c.res["sha256"])

    def settle_suspects(self, rnd: Round) -> list[int]:
        """Before the next round is planned ahead of this one's checks: settle the claims most likely to be
        refused, so that round trains those experts from what the guard decides, not from a version it then
        refuses (which would cost the expert that round too). A claim is suspect when its expert's last
        verdict was a refusal, or when its train loss rose over the round by more than ROSE (an overshoot;
        a round of a few dozen steps moves the mean by a few hundredths either way). The experts settled."""
        suspects = [e for e, c in rnd.claims.items() if e in self.last_refused or self._rose(e, c)]
        self.checks.ahead([rnd.claims[e] for e in suspects if rnd.claims[e].checked is None])
        for e in suspects:
            self.settle(rnd, e)
        return suspects

    def _rose(self, e: int, c: Claim) -> bool:
        before, after = self.ledger.expert(e).train_loss, c.res.get("train_loss")
        return before is not None and protocol.is_number(after) and float(after) > before + ROSE

    def settle_all(self, rnd: Round) -> None:
        """Settle every claim left, in order, their costly checks run side by side first (`Checks.ahead`)."""
        self.checks.ahead([c for c in rnd.claims.values() if c.checked is None])
        while rnd.claims:
            self.settle(rnd, next(iter(rnd.claims)))
        strikes.judge_nodes(rnd, self.fleet.nodes, self.cfg.federation, self.ledger.state.strikes)

    def reject(self, rnd: Round, node: Node, experts: list, reason: str) -> None:
        """Refuse these results by the protocol checks: a strike each against the node (coordinator.strikes)."""
        strikes.reject(rnd, node, experts, reason, self.cfg.federation, self.ledger.state.strikes)

    def _finished(self, rnd: Round, e: int, why: str | None) -> None:
        if why is None:
            return
        rnd.finished[e] = why
        best = self.ledger.expert(e).best_or_current()
        log.info(
            "round %d: expert %d finished, %s; it keeps its best version v%s (val %.4f) and leaves the plans",
            rnd.r,
            e,
            why,
            best.version if best else "?",
            best.val_loss if best else float("nan"),
        )

    def accept(
        self, rnd: Round, node: Node, c: Claim, w: np.ndarray, opt: OptState, windows: np.ndarray, bar: GuardBar
    ) -> None:
        """The guard's verdict on a checked result, by its val loss on each window against its expert's bar;
        then the ledger stores it."""
        res, e, fed = c.res, c.res["expert"], self.cfg.federation
        val = float(np.mean(windows))
        pooled = guard.pool([sp for x, sp in sorted(self.spreads.items()) if x != e])
        verdict = guard.judge(windows, bar, fed.guard_tolerance, fed.guard_sigmas, pooled)
        if verdict.refused is not None:
            why, slower = verdict.refused, self.ledger.slow_down(e)
            far = verdict.worse > guard.FAR * verdict.margin
            strikes.refuse(rnd, node, e, why, far, val_loss=val, guard_margin=verdict.margin, **slower)
            self.last_refused.add(e)
            self._finished(rnd, e, finish.after_refusal(self.ledger.expert(e), fed))
            return
        spread = guard.spread_of(windows, bar)
        if spread is not None:
            self.spreads[e] = spread
        tally = rnd.tallies.setdefault(node.id, guard.Tally())
        tally.accepted += 1
        if verdict.raises_bar:
            bar = guard.bar_of(res["version"], windows)
            tally.raised += 1
        best = self.ledger.expert(e).best_or_current()
        # The plateau counters are the coordinator's own (never the worker's): restore them, then decide the
        # next round's lr scale from this version's val loss.
        prev, trained_at = self.ledger.expert(e), opt.lr_scale
        opt.lr_scale, opt.best_val, opt.best_step = prev.lr_scale, prev.best_val, prev.best_step
        if plateau(self.cfg.spsa, opt, val, res["step"]):
            log.info(
                "round %d: expert %d plateaued (val %.4f, best %.4f): lr and eps now x%g",
                rnd.r,
                e,
                val,
                opt.best_val,
                opt.lr_scale,
            )
        best = self.ledger.store(res, w, opt, val, c.ulog, best, node, bar)
        self._finished(rnd, e, finish.after_accept(self.ledger.expert(e), val, fed))
        lr, eps = schedule(self.ledger.phase_config().spsa, res["step"] - 1, trained_at)  # at the round's last step
        node.weights.add(res["sha256"])
        self.refused.discard(res["sha256"])  # the same version made again and accepted (refused for its node)
        line = records.expert_line(rnd.r, res, node, val, w, opt, c.ulog, c.sent, c.reply, trained_at, best, lr, eps)
        line.bar_version, line.guard_margin = bar.version, verdict.margin
        line.epochs = records.epochs(self.ledger.phase_config(), self.prep, e, res["step"])
        rnd.accepted[e] = line
        rnd.failed.pop(e, None)
        rnd.pending_resend.discard(e)
        log.debug(
            "round %d: accepted expert %d v%d from %s: train %.4f, val %.4f nats/byte, %d steps in %.1f s",
            rnd.r,
            e,
            res["version"],
            node.label,
            res["train_loss"],
            val,
            res["steps"],
            res["seconds"],
        )
        now = self.fleet.clock()
        if now - self.status_at >= STATUS_SECONDS:
            self.status_at = now
            self.status("round", round=rnd.r)
