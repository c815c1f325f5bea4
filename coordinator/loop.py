"""The coordinator's round loop, one round top to bottom (`Loop.rounds`):

    plan     which node trains which expert, for how many steps (`start_round`, coordinator.planning)
    send     each node one train request with all its experts (coordinator.dispatch)
    collect  replies until every node has answered, left, or the deadline passes (`collect`); each
             result's cheap checks make it a claim (coordinator.intake)
    settle   each claim's costly checks (replay, audit, the guard's val loss): accept or refuse it
    commit   the round's metrics lines, then state.msgpack, the commit point (`commit`, coordinator.ledger)

Where every reply is in (and `federation.pipeline`), the next round is planned and sent before the
settling, from the versions the replies claim (`start_round` with `ahead`), so the workers train while
the coordinator checks and commits. A reply that comes after its round's deadline but before the next
plan is checked like any other (`collect_late`), and commits with the next round; where the next round
finds no free node, it waits for a node still sending its late reply rather than fail (coordinator.late).

`Coordinator` is the process around the loop: it takes the run lock, logs to RUN/logs, applies an
external start request, opens the run and writes a failure to status.json. Called by
coordinator.server_app (Flower's ServerApp) and by the tests on a fake grid.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from coordinator import finish, records, scheduler
from coordinator.board import Board
from coordinator.dispatch import Dispatcher
from coordinator.evaluation import Evaluation
from coordinator.fleet import POLL_SECONDS, Fleet, NodeStatus, Outgoing, Sent, end_run
from coordinator.intake import Intake
from coordinator.late import Late
from coordinator.ledger import Bases, Ledger
from coordinator.planning import Planner
from coordinator.round import Round
from soma_edge.config import Config, expert_steps
from soma_edge.corpus.documents import SEPARATOR
from soma_edge.errors import SomaError
from soma_edge.processes import logs
from soma_edge.processes.logs import role_logger
from soma_edge.rundir import seed as seed_mod
from soma_edge.rundir.layout import RunDir
from soma_edge.rundir.state import PrepareSummary, RunState
from soma_edge.wire import protocol

log = role_logger("soma.coord")

STOPPED = "stopped (soma-coord stop)"
FINISHED = "every expert is finished"


class NoTrainableExpert(RuntimeError):
    """Every expert of the run is left out: the run cannot go on (an internal failure, exit 1, not the
    user's input: the corpus was prepared, and workers said why)."""

    def __init__(self, left_out: dict[int, str]) -> None:
        super().__init__(f"no expert can train: {records.reasons(left_out)}")


class Coordinator:
    """One coordinator on one run directory: `main` runs its rounds and returns the run state."""

    def __init__(
        self,
        grid: Any,
        run: RunDir,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        setup: Callable[[], None] | None = None,
    ) -> None:
        self.grid, self.run, self.setup = grid, run, setup  # setup: runs first under the run lock
        self.clock, self.sleep = clock, sleep
        self.loop: Loop | None = None  # the last `main`'s loop, once it opened the run (tests inspect it)

    def main(self, lock_wait: float = 60.0) -> RunState:
        # Flower keeps the ServerApp's own output to itself (`flwr log`); ours also goes to RUN/logs.
        self.run.logs.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(self.run.logs / "coordinator.log")
        handler.setFormatter(logging.Formatter("%(asctime)s soma.coord %(levelname)s %(message)s"))
        # The file has every line; `soma-coord start` shows its INFO and higher ones (the events, the
        # commits), not the DEBUG ones (each accepted expert: the experts table shows those).
        log.addHandler(handler)
        log.setLevel(logging.DEBUG)
        self.loop, cfg = None, None
        try:
            with self.run.lock(wait=lock_wait):
                locked_at = time.time()
                if self.setup is not None:
                    self.setup()
                cfg = self.run.load_config()
                self.loop = Loop(self.grid, self.run, cfg, locked_at, clock=self.clock, sleep=self.sleep)
                why = self.loop.main()
                if why is not None:
                    self._finish(self.loop, why)
                return self.loop.ledger.state
        except Exception as e:
            log.error("coordinator failed: %s: %s", type(e).__name__, e)
            if cfg is not None:  # status.json shows the run's config: a coordinator that never read it writes none
                self._failed(cfg, e)
            raise
        finally:
            log.removeHandler(handler)
            handler.close()

    def _finish(self, loop: Loop, why: str) -> None:
        """Tell the workers the run is over, and say why in status.json and the log."""
        state, fed = loop.ledger.state, loop.cfg.federation
        end_run(loop.fleet, protocol.run_end(state.run_id, state.round, fed.rounds, why), why)
        if why == STOPPED:
            self.run.clear_stop()
            loop.status("done", stopped=True)
            log.info(
                "run stopped after round %d of %d: `soma-coord start --run %s` resumes it",
                state.round,
                fed.rounds,
                self.run.root,
            )
        elif why == FINISHED:
            loop.status("done")
            log.info(
                "run over after round %d of %d: every expert is finished (%s); `soma-coord start --run %s "
                "--reopen` trains them again",
                state.round,
                fed.rounds,
                records.reasons({e: finish.rule_of(w) for e, w in loop.ledger.finished().items()}),
                self.run.root,
            )
        else:
            left = loop.ledger.never_advanced()
            loop.status("done", never_advanced={str(e): why for e, why in left.items()})
            log.info("run complete: %d rounds", state.round)
            if left:
                log.warning(
                    "%d of %d experts never advanced in this run: %s",
                    len(left),
                    len(state.experts),
                    records.reasons(left),
                )

    def _failed(self, cfg: Config, e: Exception) -> None:
        why = {"message": f"{type(e).__name__}: {e}", "user_error": isinstance(e, SomaError)}
        if self.loop is not None:
            self.loop.status("failed", **why)
        else:  # the run state did not load
            self.run.write_status(records.status("failed", cfg, None, {}, **why).to_dict())


def bench_short_shards(cfg: Config, prep: PrepareSummary, ledger: Ledger) -> None:
    """Leave out, in one line, the experts whose train shards cannot hold one window (seq_len + 1 bytes):
    every worker would fail them every round."""
    sizes, need = prep.shard_sizes(), cfg.data.seq_len + 1
    short = {}
    for e in ledger.trainable_ids():
        hashes = seed_mod.shards(cfg, prep, e, "train")
        got = sum(sizes.get(h, 0) for h in hashes) + len(SEPARATOR) * max(len(hashes) - 1, 0)
        if got < need and ledger.bench(e, f"its train shards hold {got} bytes, fewer than seq_len + 1 = {need}"):
            short[e] = got
    if short:
        listed = ", ".join(f"expert {e}: {n}" for e, n in sorted(short.items())[:8])
        log.warning(
            "%d expert(s) cannot train, left out of the run: their train shards hold fewer than seq_len + 1 = %d "
            "bytes (%s%s)",
            len(short),
            need,
            listed,
            ", ..." if len(short) > 8 else "",
        )


class Loop:
    """The rounds of one run, from its committed state to its last round."""

    def __init__(
        self,
        grid: Any,
        run: RunDir,
        cfg: Config,
        locked_at: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.run, self.cfg, self.clock, self.sleep = run, cfg, clock, sleep
        self.locked_at = locked_at  # when this coordinator took the run lock
        self.prep = run.read_prepare()  # which shards each expert trains and validates on
        self.evaluation = Evaluation(run, cfg, self.prep)
        self.ledger = Ledger(run, cfg, self.evaluation)
        self.fleet = Fleet(grid, run, cfg, self.ledger.state, self.ledger.version_bytes(), self.status, clock, sleep)
        self.dispatcher = Dispatcher(run, cfg, self.ledger, self.fleet, self.prep)
        self.planner = Planner(cfg, self.ledger, self.fleet, self.prep)
        self.intake = Intake(
            run, cfg, self.ledger, self.fleet, self.prep, self.evaluation, self.dispatcher, self.status
        )
        self.late = Late(self.fleet, self.intake)  # requests of the last round still out at its deadline
        self.board: Board | None = None  # RUN/tb/'s event writer, while rounds run with federation.tensorboard

    def main(self) -> str | None:
        """Resume the run and run its rounds left; returns why they ended (None: the run had none left)."""
        run, fed, state = self.run, self.cfg.federation, self.ledger.state
        self.ledger.resume(self.locked_at)
        if state.round >= fed.rounds:
            log.info("run %s already completed its %d rounds", run.root, fed.rounds)
            self.status("done")
            return None
        self.board = Board(run.tb, state.round) if fed.tensorboard else None
        try:
            log.info(
                "run %s: resuming after round %d of %d" if state.round else "run %s: starting, round %d of %d",
                run.root,
                state.round,
                fed.rounds,
            )
            if self.ledger.fan_out():  # a seed that finished in a round whose commit never happened
                run.save_state(state.to_dict())
            bench_short_shards(self.cfg, self.prep, self.ledger)
            self.fleet.wait_for_nodes(fed.min_nodes, grace=fed.join_grace, stoppable=True)
            return self.rounds()
        finally:
            if self.board is not None:
                self.board.close()

    def rounds(self) -> str:
        """Run the rounds left; returns why they ended."""
        rnd = None
        for r in range(self.ledger.state.round + 1, self.cfg.federation.rounds + 1):
            if rnd is None:
                why = self.why_stop(r)
                if why is not None:
                    return why
                rnd = self.start_round(r)  # plan and send
                if rnd is None:
                    log.info(
                        "stop requested (soma-coord stop) while no worker was left: stopping after round %d of %d",
                        r - 1,
                        self.cfg.federation.rounds,
                    )
                    return STOPPED
            self.collect(rnd)  # replies until all are in or the deadline passes; each result's cheap checks
            if self.pipelines(rnd):  # the next round goes out now, ahead of this one's costly checks, once
                self.intake.settle_suspects(rnd)  # the claims most likely to be refused are checked
            nxt = self.start_round(r + 1, ahead=rnd) if self.pipelines(rnd) else None
            self.intake.settle_all(rnd)  # the costly checks: a log's replay and audit, the guard's val loss
            self.commit(rnd, nxt.t_round if nxt else None)  # metrics lines, then state.msgpack
            if nxt is not None:
                self.dispatcher.send_deferred(nxt)  # what waited for this commit
                self.round_status(nxt)
            rnd = nxt
        return "complete"

    def why_stop(self, r: int) -> str | None:
        """Why no round r should start: a stop request, no steps left in a fixed budget, or every expert
        finished (None: none); NoTrainableExpert where every expert is left out and none finished."""
        if not self.ledger.trainable_ids():
            if self.ledger.finished():  # the others cannot train: `status` says why
                return FINISHED
            self.run.save_state(self.ledger.state.to_dict())  # with why each is left out: `status` shows it
            raise NoTrainableExpert(self.ledger.never_advanced())
        if self.run.stop_requested():
            log.info(
                "stop requested (soma-coord stop): stopping after round %d of %d", r - 1, self.cfg.federation.rounds
            )
            return STOPPED
        if self.ledger.capped() and not self.ledger.steps_left(Bases(self.ledger, self.fleet.nodes)):
            why = f"every expert has its {expert_steps(self.cfg)} steps (federation.max_steps)"
            log.info("%s: stopping before round %d", why, r)
            return why
        return None

    def start_round(self, r: int, ahead: Round | None = None) -> Round | None:
        """Plan round r and send it. With `ahead` (round r - 1, every reply in but not all of them checked
        yet: pipelining), an expert with an unchecked result trains on from the version it claims, on the
        node that made it, which holds it; a node given an expert whose claimed version it does not hold
        gets its request only once round r - 1 has committed (`Dispatcher.send_deferred`). None: no worker was left
        and a stop was requested while waiting for one."""
        t_round, planned_at = self.clock(), time.time()
        late = self.collect_late(r)
        self.fleet.query_new_nodes()
        self.fleet.pull(lambda mid, reply, o: None)
        active = self.fleet.active()
        if not active:  # a node still sending its late reply is busy, not gone: the wait takes that reply
            active = self.fleet.wait_for_nodes(1, stoppable=True, busy=lambda: self.late.poll(late))
            if not active:
                return None
        self.late.drop()  # its experts may move now: a reply from their old base would be refused as stale
        bases = Bases(self.ledger, self.fleet.nodes, ahead)
        plan, by_node = self.planner.plan(active, bases)
        log.info(
            "round %d/%d: %s (predicted compute %.1f s; moved: %s%s)",
            r,
            self.cfg.federation.rounds,
            ", ".join(f"{self.fleet.nodes[n].label}<-{logs.expert_set(es)}" for n, es in by_node.items()),
            plan.makespan,
            logs.expert_set(plan.moved) if plan.moved else "none",
            "; before round %d's checks" % (r - 1) if ahead else "",
        )
        rnd = Round(
            r=r,
            plan=plan,
            deadline=self.planner.deadline(r, plan, by_node),
            t_sent=self.clock(),
            t_round=t_round,
            planned_at=planned_at,
            trained=late.trained,
            late=list(late.accepted.values()),
            rejected=late.rejected,
            excluded=late.excluded,
            finished=late.finished,
            bytes_up=late.bytes_up,
            bytes_down=late.bytes_down,
            following=self.planner.following(active, bases, plan),
        )
        self.dispatcher.send_round(rnd, by_node, bases, ahead)
        self.round_status(rnd)
        return rnd

    def collect_late(self, r: int) -> Round:
        """Replies to last round's requests that came after its deadline but before round r is planned:
        checked like any other, and accepted where their base version is still current. What they give
        (metrics lines marked late, rejections) commits with round r."""
        rnd = Round(r=r, plan=scheduler.Plan({}, {}, 0.0, []), deadline=self.clock(), t_sent=self.clock())
        self.late.poll(rnd)
        return rnd

    def collect(self, rnd: Round) -> None:
        """Pull replies until every request is answered or the deadline passes, checking the results that
        are in while waiting for the rest; a node that misses the deadline is set aside."""

        def handle(mid: str, reply: Any, o: Outgoing) -> None:
            (self.dispatcher.on_pieces if o.kind is Sent.PIECES else self.intake.on_train)(mid, reply, o, rnd)

        def waiting() -> bool:
            return bool(rnd.waiting) or any(mid in self.fleet.out for mid in rnd.train_mids)

        while self.clock() < rnd.deadline and waiting():
            self.fleet.pull(handle)
            self.fleet.query_new_nodes()  # a worker that joins now is probed, and ready for the next plan
            self.dispatcher.give_idle(rnd)
            if waiting():
                if rnd.claims:  # use the wait: check a result that is in
                    self.intake.settle(rnd, next(iter(rnd.claims)))
                else:
                    self.sleep(POLL_SECONDS)
        if waiting():
            self.fleet.pull(handle)  # what came in while a long check ran past the deadline
        rnd.t_done = self.clock()
        self._missed(rnd)

    def _missed(self, rnd: Round) -> None:
        """The requests still out at the deadline: their nodes go on probation, their experts move next
        round, and their replies may still come in time for the next plan (`collect_late`)."""
        out = self.fleet.out
        late = [out.pop(mid) for mid in sorted(out) if out[mid].kind in (Sent.TRAIN, Sent.PIECES)]
        self.late.hold(late, rnd.deadline - rnd.t_sent)
        for nid in sorted({o.node for o in late}):
            node = self.fleet.nodes[nid]
            tasks = {e for o in late if o.node == nid and o.expected for e in o.expected.tasks}
            tasks |= set(rnd.waiting[nid].experts) if nid in rnd.waiting else set()
            log.warning(
                "round %d: node %s (%s) missed the deadline; its experts %s move next round",
                rnd.r,
                nid,
                node.name,
                logs.expert_set(tasks),
            )
            node.status = NodeStatus.PROBATION
            for e in tasks:
                rnd.failed.setdefault(e, f"node {node.label} missed the round deadline")

    def pipelines(self, rnd: Round) -> bool:
        """Whether the next round may start before this one's results are checked: only when every reply
        is in (none may still come late), outside the seed phase (its commit may fan out), with no stop
        requested, and when a round is left to run with steps to take and a node to take them."""
        fed = self.cfg.federation
        if not fed.pipeline or rnd.r >= fed.rounds or self.late.held or self.ledger.seeding():
            return False
        if self.run.stop_requested():
            return False
        if not self.fleet.active() or not self.ledger.trainable_ids():
            return False
        return not self.ledger.capped() or bool(self.ledger.steps_left(Bases(self.ledger, self.fleet.nodes, rnd)))

    def commit(self, rnd: Round, t_next: float | None) -> None:
        """Write round rnd.r's metrics and state (the commit point). Its span runs from its plan to the next
        round's plan when that went ahead of this commit (`t_next`), else to now: spans tile the run."""
        r, fed, state = rnd.r, self.cfg.federation, self.ledger.state
        mix = None if self.ledger.seeding() else self.evaluation.mixture_val_loss(state)
        settle = self.clock() - rnd.t_done  # the checks, the guard's val losses and the mixture's, since the last reply
        round_total = (self.clock() if t_next is None else t_next) - rnd.t_round
        labels = {nid: n.label for nid, n in self.fleet.nodes.items()}
        lines = records.commit_lines(rnd, self.cfg, state, labels, mix, round_total, t_next is not None, settle)
        line = lines[-1]  # the round's
        self.ledger.last_failure.update(rnd.failed)
        self.ledger.commit(r, {str(e): labels[n] for e, n in rnd.plan.assignment.items()}, lines, self.board)
        log.info(
            "round %d/%d committed: %d/%d experts advanced, mean val %.4f, routed val %s nats/byte, %.1f s, "
            "compute share %.0f%%",
            r,
            fed.rounds,
            len(rnd.accepted),
            len(self.ledger.expert_ids()),
            line.val_loss_mean or float("nan"),
            "n/a" if mix is None else f"{mix:.4f}",
            round_total,
            100 * line.compute_share,
        )
        self.status("committed", round=r)

    def round_status(self, rnd: Round) -> None:
        self.status(
            "round",
            round=rnd.r,
            started=time.time() - (self.clock() - rnd.t_sent),
            deadline_in=rnd.deadline - self.clock(),
            assignment={str(e): self.fleet.nodes[n].label for e, n in rnd.plan.assignment.items()},
        )

    def status(self, phase: str, **extra: Any) -> None:
        self.run.write_status(records.status(phase, self.cfg, self.ledger.state, self.fleet.nodes, **extra).to_dict())
