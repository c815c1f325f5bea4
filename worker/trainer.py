"""The worker's local training loop: S forward-only SPSA steps of one expert on a byte stream.

Imports nothing from torch: this is the path that runs on inference-only hardware.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from soma_edge.config import Config
from soma_edge.corpus import batch_rng, sample_batch
from soma_edge.runtime import LossEvaluator
from soma_edge.spsa import State, Stepper


@dataclass
class TrainReport:
    steps: int
    seconds: float
    loss: float  # mean SPSA minibatch loss over the steps run
    forward_evals: int
    grads: list[np.ndarray] = field(default_factory=list)  # per step, the K scalars that replay it

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0

    @property
    def evals_per_s(self) -> float:
        return self.forward_evals / self.seconds if self.seconds > 0 else 0.0


def train(
    state: State,
    data: np.ndarray,
    cfg: Config,
    evaluator: LossEvaluator,
    *,
    expert: int = 0,
    steps: int | None = None,
    seconds: float | None = None,
) -> TrainReport:
    """Run SPSA on `state` in place until `steps` are done or `seconds` have passed (whichever is set first)."""
    if steps is None and seconds is None:
        raise ValueError("give steps, seconds, or both")
    stepper = Stepper(cfg.spsa, seed=cfg.seed, expert=expert, parallel=evaluator.parallel)
    report = TrainReport(steps=0, seconds=0.0, loss=0.0, forward_evals=0)
    t0 = time.perf_counter()
    loss_sum = 0.0
    try:
        while (steps is None or report.steps < steps) and (seconds is None or time.perf_counter() - t0 < seconds):
            x, y = sample_batch(data, cfg.data.batch, cfg.data.seq_len, batch_rng(cfg.seed, expert, state.step))
            result = stepper.step(state, lambda w: evaluator.loss(w, x, y))
            report.steps += 1
            report.forward_evals += 2 * cfg.spsa.directions
            report.grads.append(result.grads)
            loss_sum += result.loss
    finally:
        stepper.close()
    report.seconds = time.perf_counter() - t0
    report.loss = loss_sum / max(report.steps, 1)
    return report
