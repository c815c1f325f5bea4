"""The coordinator's own measures of a version: its val loss on the expert's held-out stream (what the
guard and the plateau rule judge by), and the routed mixture's val loss of the whole model.

Called by coordinator.ledger (version 0, a best that does not load), coordinator.intake (each accepted
result) and coordinator.loop (each commit's mixture loss).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import numpy as np

from soma_edge.config import Config
from soma_edge.corpus import mixture, router
from soma_edge.corpus.documents import SEPARATOR, eval_windows
from soma_edge.engine.runtime import make_session
from soma_edge.errors import SomaError
from soma_edge.expert import params
from soma_edge.processes.logs import role_logger
from soma_edge.rundir import seed as seed_mod
from soma_edge.rundir.layout import RunDir
from soma_edge.rundir.state import PrepareSummary, RunState
from soma_edge.wire import protocol

log = role_logger("soma.coord")

VAL_BATCH = 64  # val windows per ORT call (64 x 128 x 256 float32 log-probs: 8 MiB)
MIXTURE_TOP_K = 2  # the per-round routed val loss mixes the top-2 experts (top-1 when N = 1)
MIXTURE_WINDOWS = 1024  # val windows it scores in all, shared out among the experts' val streams (64 each up
# to N = 16): at N = 64, every expert's 64 took 3.5-6.7 s of each commit, and the cost grows with N


class Versions(Mapping[int, Callable[[np.ndarray], np.ndarray]]):
    """Each expert's current version as a log-prob function, loaded when the mixture asks for it: the mixture
    runs one expert at a time, so the coordinator never holds every expert's weights at once."""

    def __init__(self, evaluation: "Evaluation", state: RunState) -> None:
        self.evaluation, self.state = evaluation, state

    def __getitem__(self, e: int) -> Callable[[np.ndarray], np.ndarray]:
        stored = self.evaluation.run.load_expert(self.state.expert(e).path)
        return self.evaluation.logprobs(protocol.decode_weights(stored["weights"]))

    def __iter__(self) -> Iterator[int]:
        return iter(self.state.expert_ids())

    def __len__(self) -> int:
        return len(self.state.expert_ids())


class Evaluation:
    def __init__(self, run: RunDir, cfg: Config, prep: PrepareSummary) -> None:
        self.run, self.cfg, self.prep = run, cfg, prep  # prep: each expert's shards
        self.windows: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # expert -> its val windows (x, y)
        self.session: Any = None  # the logprobs session (onnxruntime) with the weights as inputs, made on first use
        self.router: Any = None  # RUN/router, loaded on first use

    def val_stream(self, e: int) -> np.ndarray:
        data = [self.run.shard(h) for h in seed_mod.shards(self.cfg, self.prep, e, "val")]
        stream = np.frombuffer(SEPARATOR.join(data), dtype=np.uint8)
        # Prepare gives every expert 8 val windows; a run prepared before it did may have a cluster with
        # less than 2: judge that one on every cluster's val text (the guard needs 2 windows for a spread).
        if stream.size < 2 * self.cfg.data.seq_len + 1:
            fed = self.cfg.federation
            data = [self.run.shard(h) for x in range(fed.experts) for h in self.prep.shards(x, "val")]
            stream = np.frombuffer(SEPARATOR.join(data), dtype=np.uint8)
        return stream

    def window_losses(self, e: int, weights: np.ndarray) -> np.ndarray:
        """Nats/byte of `weights` on each of expert e's val windows (the guard compares them window by window).

        VAL_BATCH windows to a call: one window to a call took 9x as long at 8M parameters (each call feeds
        every weight and runs a batch-1 recurrence), and the coordinator evaluates every version it commits."""
        if e not in self.windows:
            self.windows[e] = eval_windows(self.val_stream(e), self.cfg.data.seq_len, self.cfg.federation.val_windows)
        x, y = self.windows[e]
        logprobs = self.logprobs(weights)
        out = []
        for i in range(0, len(x), VAL_BATCH):
            lp = logprobs(x[i : i + VAL_BATCH])
            picked = np.take_along_axis(lp, y[i : i + VAL_BATCH, :, None], axis=2)[..., 0]
            out.append(-picked.mean(axis=1, dtype=np.float64))
        return np.concatenate(out)

    def ready(self) -> None:
        """Make the shared session now (threads that check results side by side then share it)."""
        if self.session is None:
            # soma_edge.expert.graph imports onnx (heavy) at its top: loaded only where a version is scored.
            from soma_edge.expert.graph import build

            # One thread, no spinning: on a coordinator box that also hosts workers, this must not steal cores.
            self.session = make_session(build(self.cfg.model, "logprobs"), "cpu", 1, False)

    def logprobs(self, weights: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        """fn(x) -> log-probs of an expert with `weights`, on the one session every expert shares (weights are
        its inputs: at N = 256 a session per expert at every commit cost more than the round)."""
        self.ready()
        feeds = params.layout(self.cfg.model).views(weights)
        return lambda x: self.session.run(["logprobs"], {**feeds, "x": x})[0]

    def val_loss(self, e: int, weights: np.ndarray) -> float:
        """The mean of `window_losses`: the val loss the guard, the plateau rule and the metrics report."""
        return float(np.mean(self.window_losses(e, weights)))

    def mixture_val_loss(self, state: RunState) -> float | None:
        """Routed-mixture nats/byte of the whole model (`state`'s current versions) on held-out text (None if
        it cannot be computed)."""
        try:
            if self.router is None:
                self.router = router.load(self.run.router)
            seq = self.cfg.data.seq_len
            ids = state.expert_ids()
            per = max(1, min(self.cfg.federation.val_windows, MIXTURE_WINDOWS // len(ids))) * seq
            data = np.concatenate([self.val_stream(e)[:per] for e in ids])
            fns = Versions(self, state)
            top_k = min(MIXTURE_TOP_K, len(ids))
            return float(mixture.evaluate(self.router, fns, data, seq, top_k, self.router.temperature).nats_per_byte)
        except (SomaError, AttributeError, ValueError, OSError) as e:
            log.warning("routed-mixture val loss failed: %s", e)
            return None
