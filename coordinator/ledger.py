"""The expert table: each expert's current and best version, its step count and lr scale, the node
strikes, and the run state as each round commits it (RUN/state.msgpack); which stored versions stay.

Also `Bases`: the version each expert trains from next, which is the committed one or, for a round planned
ahead of the last one's checks, the version that round's result claims.

Called by coordinator.loop (resume, commit), coordinator.intake (accepting a version), coordinator.dispatch
and coordinator.planning (what each expert trains from).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from coordinator import guard, records
from coordinator.evaluation import Evaluation
from coordinator.fleet import Node
from coordinator.round import Round
from soma_edge.config import Config, expert_config, expert_steps
from soma_edge.errors import CheckpointError, SomaError
from soma_edge.expert import params
from soma_edge.processes.logs import role_logger
from soma_edge.rundir import seed as seed_mod
from soma_edge.rundir.layout import RunDir
from soma_edge.rundir.metrics import Line, SeedDone
from soma_edge.rundir.state import BestVersion, ExpertRecord, GuardBar, RunState
from soma_edge.spsa.log import UpdateLog
from soma_edge.spsa.optim import OptState, slower
from soma_edge.wire import protocol

log = role_logger("soma.coord")


class Ledger:
    def __init__(self, run: RunDir, cfg: Config, evaluation: Evaluation) -> None:
        self.run, self.cfg, self.evaluation = run, cfg, evaluation
        self.size = params.layout(cfg.model).size
        state = run.read_state(verify=True)
        if run.fallback:
            log.warning("%s", run.fallback)
        self.state: RunState = self._init_state() if state is None else state
        self.committed = self.kept()  # what state.msgpack holds: the fallback once the next round commits
        self.started = {e: self.expert(e).version for e in self.expert_ids()}  # to tell who advanced in this run
        self.last_failure: dict[int, str] = {}  # each expert's last round failure, for the run's last word

    def resume(self, locked_at: float) -> None:
        """Before the first round of this coordinator: best versions checked, what a crash left undone
        (temp files, a prune, metrics lines past the commit) cleaned up, and an older stop request cleared."""
        run = self.run
        self.check_best()
        if run.clean_debris():
            log.info("removed the temp files of writes a crash interrupted")
        self.prune(self.kept_in(run.prev_state_path))  # a prune that a crash after the commit cut short
        run.truncate_metrics(self.state.round)
        run.clear_stop(before=locked_at)  # a stop addresses the coordinator that held the lock then
        for e in self.expert_ids():  # a new coordinator tries every expert again: workers or code may differ
            self.expert(e).cannot_train = None

    # --- a new run, and the best versions --------------------------------------------------------------

    def _init_state(self) -> RunState:
        """Version 0 of every expert: the same seeded initialization (a common start, as in c-BTM). With a
        seed run, only the seed starts from it; the experts start from the seed (`fan_out`)."""
        w = params.init(self.cfg.model, self.cfg.seed)
        seeded = seed_mod.enabled(self.cfg)
        ids = [seed_mod.seed_expert(self.cfg)] if seeded else range(self.cfg.federation.experts)
        state = records.run_state(self.cfg, {str(e): self._version0(e, w) for e in ids}, seeded)
        self.run.save_state(state.to_dict())
        return state

    def _version0(self, e: int, w: np.ndarray) -> ExpertRecord:
        """Write version 0 of expert `e` with weights `w`, fresh optimizer state and step 0; its state entry.
        Its val loss is the first best that the guard measures replies against, and its losses window by
        window the guard's first bar (made here, before round 1, not in round 1's checks)."""
        sha = protocol.weights_sha256(w)
        windows = self.evaluation.window_losses(e, protocol.decode_weights(w))
        val = float(np.mean(windows))
        rel = self.run.save_expert(records.expert_body(e, 0, sha, self.cfg, 0, w, None, val))
        best = BestVersion(version=0, sha256=sha, path=rel, val_loss=val)
        return records.expert_record(0, sha, rel, 0, None, val, None, best, OptState(), guard.bar_of(0, windows))

    def check_best(self) -> None:
        """Every expert's best version loads and matches its hash; else (corrupt, or a run from before
        guards) the current version becomes the best, with one warning."""
        for e, x in self.state.experts.items():
            rec = x.best
            try:
                body = self.run.load_expert(rec.path) if rec else None
                if body is not None and protocol.weights_sha256(body["weights"]) != rec.sha256:
                    raise CheckpointError(f"{self.run.root / rec.path}: weights do not match its sha256")
            except (CheckpointError, KeyError, TypeError) as err:
                log.warning(
                    "expert %s: its best version does not load (%s); the current version v%s is the best now",
                    e,
                    err,
                    x.version,
                )
                body = None
            if body is None:
                val = x.val_loss
                if val is None:
                    w = protocol.decode_weights(self.run.load_expert(x.path)["weights"])
                    val = self.evaluation.val_loss(int(e), w)
                x.best = BestVersion(version=int(x.version), sha256=x.sha256, path=x.path, val_loss=float(val))
        self.committed = self.kept()

    # --- the seed phase and step budgets ---------------------------------------------------------------

    def seeding(self) -> bool:
        return self.state.phase == "seed"

    def fan_out(self) -> bool:
        """When the seed has its steps: every expert's version 0 is the seed's weights, bit for bit (not yet
        committed: the caller's save_state is the commit point). True if it fanned out."""
        sid = seed_mod.seed_expert(self.cfg)
        seed = self.state.experts.get(str(sid))
        if not self.seeding() or seed is None or seed.step < self.cfg.federation.seed_steps:
            return False
        w = self.run.load_expert(seed.path)["weights"]
        if protocol.weights_sha256(w) != seed.sha256:
            raise SomaError(f"{self.run.root / seed.path}: the seed's weights do not match state.msgpack")
        experts = {str(e): self._version0(e, w) for e in range(self.cfg.federation.experts)}
        self.state.seed = dataclasses.replace(seed, expert=sid)
        self.state.experts, self.state.phase = experts, "experts"
        self.state.assignment = {}  # the experts' versions 0 are on no node yet
        log.info(
            "seed expert %s done at step %d (val %.4f): version 0 of all %d experts is its weights %s",
            sid,
            seed.step,
            seed.val_loss or float("nan"),
            len(experts),
            seed.sha256[:12],
        )
        return True

    def phase_config(self) -> Config:
        """What the current phase trains with: the run's config for the seed (or no seed), else the experts'."""
        return self.cfg if self.seeding() else expert_config(self.cfg)

    def capped(self) -> bool:
        return self.seeding() or bool(self.cfg.federation.max_steps)

    def steps_left(self, bases: Bases) -> dict[int, int]:
        """Steps each expert may still take from its base (experts with none left omitted): the seed's
        seed_steps, else federation.max_steps less the seed's share."""
        cap = self.cfg.federation.seed_steps if self.seeding() else expert_steps(self.cfg)
        left = {e: cap - int(bases.base(e).step) for e in self.expert_ids()}
        return {e: n for e, n in left.items() if n > 0}

    # --- the table ------------------------------------------------------------------------------------

    def expert_ids(self) -> list[int]:
        return self.state.expert_ids()

    def trainable_ids(self) -> list[int]:
        """The experts the rounds hand out: all but those that cannot train (`bench`) or are finished."""
        return [e for e in self.expert_ids() if self.expert(e).cannot_train is None and self.expert(e).finished is None]

    def finished(self) -> dict[int, str]:
        """The finished experts (coordinator.finish), with why."""
        return {e: self.expert(e).finished for e in self.expert_ids() if self.expert(e).finished is not None}

    def bench(self, e: int, reason: str) -> bool:
        """Leave expert e out of the rounds that follow, saying why in state.msgpack (`soma-coord status`
        shows it); True the first time, so the caller reports it once."""
        rec = self.expert(e)
        if rec.cannot_train is not None:
            return False
        rec.cannot_train = reason
        return True

    def never_advanced(self) -> dict[int, str]:
        """The experts without a new version since this coordinator started, with why where it is known."""
        out = {}
        for e in self.expert_ids():
            rec = self.expert(e)
            if rec.version == self.started.get(e, 0):  # one born in this run (a seed's fan-out) started at v0
                out[e] = rec.cannot_train or self.last_failure.get(e) or "never handed out (no worker had time)"
        return out

    def expert(self, e: int) -> ExpertRecord:
        """Expert e's entry in state.msgpack."""
        return self.state.expert(e)

    def current_sha(self) -> dict[int, str]:
        return {int(e): x.sha256 for e, x in self.state.experts.items()}

    def version_bytes(self) -> int:
        """What a version weighs on the wire: float32 weights and Adam's two moments."""
        return 3 * 4 * self.size

    def checked_opt(self, body: dict[str, Any], rel: str) -> OptState:
        """The optimizer state of a stored version, checked against its weights (CheckpointError if not)."""
        return OptState.from_record(body.get("opt"), self.size, f"{self.run.root / rel}: optimizer state")

    def slow_down(self, e: int) -> dict[str, float]:
        """After a refused version: the expert retrains from the same version at a lower lr and eps (the
        plateau factor), so an honest node does not repeat the same refused steps bit for bit."""
        x = self.expert(e)
        old = float(x.lr_scale)
        x.lr_scale = slower(self.cfg.spsa, old)
        return {"lr_scale": old, "next_lr_scale": x.lr_scale}

    def bar(self, e: int, windows: int) -> GuardBar:
        """Expert e's guard bar (coordinator.guard); for a run from before bars, or one whose number of val
        windows (`windows`) changed, its best version scored afresh."""
        x = self.expert(e)
        if x.bar is not None and len(x.bar.windows) == windows:
            return x.bar
        best = x.best_or_current()
        if best is None:
            raise CheckpointError(f"expert {e} has neither a best version nor a scored current one to guard by")
        w = protocol.decode_weights(self.run.load_expert(best.path)["weights"])
        return guard.bar_of(best.version, self.evaluation.window_losses(e, w))

    def store(
        self,
        res: dict,
        w: np.ndarray,
        opt: OptState,
        val: float,
        ulog: UpdateLog | None,
        best: BestVersion,
        node: Node,
        bar: GuardBar,
    ) -> BestVersion:
        """Store an accepted version (and the log it replays from) and make it expert e's current one; its
        best too when its val loss is lower; `bar`: the guard's bar after it. Returns the expert's best."""
        e = res["expert"]
        body = records.expert_body(e, res["version"], res["sha256"], self.cfg, res["step"], w, opt, val)
        rel = self.run.save_expert(body)
        if ulog is not None and w.dtype == np.float32:  # then the stored weights are the log's replay
            rec = {"from_sha256": res["base_sha256"], "sha256": res["sha256"], "log": ulog.to_record()}
            self.run.save_log(e, res["version"], rec)
        if val < best.val_loss:
            best = BestVersion(version=res["version"], sha256=res["sha256"], path=rel, val_loss=val)
        old = self.expert(e)
        new = records.expert_record(
            res["version"], res["sha256"], rel, res["step"], float(res["train_loss"]), val, node.label, best, opt, bar
        )
        # coordinator.finish's counts go on; a run from before them starts its mark at the version it trained from
        new.mark, new.stale, new.refusals = old.val_loss if old.mark is None else old.mark, old.stale, old.refusals
        self.state.experts[str(e)] = new
        return best

    # --- commit and pruning ---------------------------------------------------------------------------

    def commit(self, r: int, assignment: dict[str, str], lines: list[Line], board: Any) -> None:
        """Round r's commit: the seed's fan-out when it is done, its metrics lines (the last one the round's),
        then state.msgpack (the commit point; the state before it becomes the fallback), then the pruning of
        old versions."""
        self.state.round = r
        self.state.assignment = assignment
        if self.fan_out():
            seed = self.state.seed
            lines[-1].seed_done = SeedDone(expert=seed.expert, step=seed.step, version=seed.version, sha256=seed.sha256)
        self.run.append_metrics([m.to_dict() for m in lines])  # the resume's truncate_metrics removed round r's
        if board is not None:
            board.commit(lines)
        self.run.save_state(self.state.to_dict())
        fallback, self.committed = self.committed, self.kept()
        self.prune(fallback)

    def kept(self, state: RunState | None = None) -> dict[int, set[int]]:
        """The versions a state refers to (the current one by default), per expert: current and best (the
        current one when it has none: a run from before guards)."""
        experts = (state or self.state).experts
        return {int(e): {int(x.version), int(x.best.version if x.best else x.version)} for e, x in experts.items()}

    def kept_in(self, path: Path) -> dict[int, set[int]]:
        """`kept` of a state file, or nothing when it does not load."""
        try:
            return self.kept(self.run.read_state_file(path))
        except (CheckpointError, KeyError, TypeError, ValueError, AttributeError):
            return {}

    def prune(self, fallback: dict[int, set[int]]) -> None:
        """Old versions beyond keep_versions go; never a best version, or one the fallback state refers to."""
        for e in self.expert_ids():
            keep = tuple(sorted(fallback.get(e, set()) | self.committed[e]))
            self.run.prune(e, self.cfg.federation.keep_versions, self.expert(e).version, protect=keep)


class Bases:
    """The version each expert trains from next: its committed one or, while round `ahead` is planned
    ahead of the last round's checks, the version that round's result claims (not stored yet: no path),
    on the node that made it, which holds it."""

    def __init__(self, ledger: Ledger, nodes: dict[int, Node], ahead: Round | None = None) -> None:
        self.ledger, self.nodes, self.ahead = ledger, nodes, ahead

    def base(self, e: int) -> ExpertRecord:
        x = self.ledger.expert(e)
        c = self.ahead.claims.get(e) if self.ahead else None
        if c is None:
            return x
        res = c.res
        return dataclasses.replace(x, version=res["version"], sha256=res["sha256"], step=res["step"], path=None)

    def holds(self, nid: int, e: int) -> bool:
        """Whether node `nid` holds the version expert e trains from next (a claimed one: the node that made it)."""
        c = self.ahead.claims.get(e) if self.ahead else None
        return c.node == nid if c is not None else self.ledger.expert(e).sha256 in self.nodes[nid].weights

    def last_assignment(self) -> dict[int, int | str]:
        """Where each expert trained last: the committed assignment (node labels), and round `ahead`'s (ids)."""
        last: dict[int, int | str] = {int(e): n for e, n in self.ledger.state.assignment.items()}
        last.update(self.ahead.plan.assignment if self.ahead else {})
        return last
