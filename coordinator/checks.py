"""A claimed result's costly checks: the version it stands for (a log reply's audit and replay), its val
loss on each of its expert's val windows, and the guard's bar to judge it by. They change nothing, so a
round's claims can be checked side by side (`ahead`, on `federation.check_threads` threads: ORT and numpy
release the GIL) while the verdicts, which depend on each other through the guard's pooled spread, are still
given one by one (coordinator.intake).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from coordinator import check_budget
from coordinator import replay as replay_mod
from coordinator.evaluation import Evaluation
from coordinator.ledger import Ledger
from coordinator.round import Checked, Claim
from soma_edge.config import Config, Evaluator, check_threads
from soma_edge.corpus.documents import SEPARATOR
from soma_edge.engine.evaluator import evaluator_for
from soma_edge.errors import ValidationError
from soma_edge.rundir import seed as seed_mod
from soma_edge.rundir.layout import RunDir
from soma_edge.rundir.state import PrepareSummary
from soma_edge.spsa.optim import OptState, State
from soma_edge.wire import protocol


class Checks:
    def __init__(self, run: RunDir, cfg: Config, ledger: Ledger, prep: PrepareSummary, evaluation: Evaluation) -> None:
        self.run, self.cfg, self.ledger, self.prep, self.evaluation = run, cfg, ledger, prep, evaluation
        self.auditor: Any = None  # the audit's loss session, made on first use (onnxruntime)
        self.audit_key = replay_mod.audit_key()  # which steps it audits: no worker can tell in advance

    def check(self, c: Claim) -> Checked | ValidationError:
        """Claim c's checks: its version, its val loss on each window and its expert's guard bar; or why it
        is refused."""
        try:
            w, opt = (c.w, c.opt) if c.ulog is None else self.from_log(c)
        except ValidationError as err:
            return err
        windows = self.evaluation.window_losses(c.res["expert"], protocol.decode_weights(w))
        return w, opt, windows, self.ledger.bar(c.res["expert"], len(windows))

    def ahead(self, claims: list[Claim]) -> None:
        """Check `claims` side by side, each outcome kept in its `checked` (one thread, or one claim: left to
        be checked as it settles)."""
        threads = check_threads(self.cfg)
        if threads < 2 or len(claims) < 2:
            return
        self.evaluation.ready()  # its session, and the auditor, made once before the threads share them
        if self.cfg.federation.audit_steps:
            self._audit_evaluator(self.ledger.phase_config())
        with ThreadPoolExecutor(min(threads, len(claims)), thread_name_prefix="check") as pool:
            for c, checked in zip(claims, pool.map(self.check, claims)):
                c.checked = checked

    def from_log(self, c: Claim) -> tuple[np.ndarray, OptState]:
        """The version a log reply stands for: the replay of its log from the current version, which must
        hash to what the worker claims (log alone) or equal the weights it sent too; audited steps first,
        where its log is one of federation.audit_share (coordinator.check_budget). Times both into `c.timed`."""
        res, ulog, w, opt, fed = c.res, c.ulog, c.w, c.opt, self.cfg.federation
        e, version = res["expert"], int(res["version"])
        # The log's own recipe, which its arrival checked against its node's (protocol.check_log).
        cfg = self.ledger.phase_config() if ulog.recipe is None else ulog.recipe.apply(self.ledger.phase_config())
        x = self.ledger.expert(e)
        stored = self.run.load_expert(x.path)
        weights = protocol.decode_weights(stored["weights"])
        base = State(weights, step=int(x.step), opt=self.ledger.checked_opt(stored, x.path))
        audit_s, t0 = None, time.perf_counter()
        if fed.audit_steps and check_budget.audited(self.audit_key, e, version, fed.audit_share):
            picks = replay_mod.sample_steps(ulog.steps, fed.audit_steps, self.audit_key, e, version)
            shards = seed_mod.shards(self.cfg, self.prep, e, "train")
            data = np.frombuffer(SEPARATOR.join(self.run.shard(h) for h in shards), dtype=np.uint8)
            replay_mod.audit(cfg, base, ulog, e, data, self._audit_evaluator(cfg), picks)
            audit_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        got = replay_mod.rebuild(cfg, base, ulog, e)
        c.timed = (ulog.steps, time.perf_counter() - t1, audit_s)
        if w is None:
            if protocol.weights_sha256(got.weights) != res["sha256"]:
                raise ValidationError(f"expert {e}: its update log replays to other weights than the sha256 it claims")
            return got.weights, got.opt
        if got.weights.astype(w.dtype).tobytes() != w.tobytes():
            raise ValidationError(f"expert {e}: the weights it sent are not what its update log replays to")
        return w, opt

    def _audit_evaluator(self, cfg: Config) -> Any:
        if self.auditor is None:  # one thread, no spinning, as for the val loss; the audit recomputes probe by probe
            self.auditor = evaluator_for(cfg, "cpu", threads=1, spin=False, parallel=1, evaluator=Evaluator.LOOP)
        return self.auditor
