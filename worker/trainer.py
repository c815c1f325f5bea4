"""The worker's local training loop: S forward-only SPSA steps of one expert on a byte stream.

Imports nothing from torch: this is the path that runs on inference-only hardware.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from soma_edge.config import Config, Evaluator, evals_per_step
from soma_edge.engine.evaluator import LossEvaluator, evaluator_kind
from soma_edge.expert.steps import batches, objectives
from soma_edge.expert.steps import stepper as make_stepper
from soma_edge.spsa.optim import State


@dataclass
class TrainReport:
    steps: int
    seconds: float
    loss: float  # mean minibatch loss over the steps run (the clean loss with the delta rule)
    forward_evals: int
    evaluator: Evaluator = Evaluator.LOOP  # how the steps' losses were evaluated
    grads: list[np.ndarray] = field(default_factory=list)  # per step, the scalars that replay its body update
    decoder_grads: list[np.ndarray] = field(default_factory=list)  # per step, with keep_decoder_grads
    spans: list[tuple[float, float]] = field(default_factory=list)  # when it trained: seconds since the epoch

    def add(self, more: "TrainReport") -> None:
        """Count a later stretch of the same round's training (`train` called again on the same state)."""
        total = self.steps + more.steps
        self.loss = (self.loss * self.steps + more.loss * more.steps) / max(total, 1)
        self.steps, self.seconds = total, self.seconds + more.seconds
        self.forward_evals += more.forward_evals
        self.evaluator = more.evaluator
        self.grads += more.grads
        self.decoder_grads += more.decoder_grads
        self.spans += more.spans

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
    keep_decoder_grads: bool = False,
    stop: Callable[[], bool] | None = None,
) -> TrainReport:
    """Run SPSA on `state` in place until `steps` are done or `seconds` have passed (whichever is set
    first), or `stop()`, asked before each step, says so."""
    if steps is None and seconds is None:
        raise ValueError("give steps, seconds, or both")
    if cfg.spsa.decoder == "delta" and evaluator.train_session is None:
        raise ValueError("spsa.decoder = 'delta' needs an evaluator built with decoder_grad=True")
    # With the population evaluator, the expert stays on its device where the update graph allows it.
    runner = None
    if evaluator.population is not None:
        from soma_edge.engine import resident  # imports onnx, as the population evaluator does: only on its path

        runner = resident.for_training(cfg, evaluator.population, expert, state)
    stepper = None if runner is not None else make_stepper(cfg, expert, evaluator.parallel)
    report = TrainReport(steps=0, seconds=0.0, loss=0.0, forward_evals=0, evaluator=evaluator_kind(evaluator))
    t0, began = time.perf_counter(), time.time()
    loss_sum = 0.0
    try:
        while (
            (steps is None or report.steps < steps)
            and (seconds is None or time.perf_counter() - t0 < seconds)
            and (stop is None or not stop())
        ):
            if runner is not None:
                result = runner.step(batches(data, cfg, expert, state.step), keep_decoder_grads)
            else:
                result = stepper.step(state, objectives(data, cfg, evaluator, expert, state.step))
            report.steps += 1
            report.forward_evals += evals_per_step(cfg.spsa)
            report.grads.append(result.grads)
            if keep_decoder_grads and result.decoder_grad is not None:
                report.decoder_grads.append(result.decoder_grad)
            loss_sum += result.loss
    finally:
        if runner is not None:
            runner.download()  # the weights and optimizer state back into `state`
        else:
            stepper.close()
    report.seconds = time.perf_counter() - t0
    if report.steps:
        report.spans.append((began, time.time()))  # compute share is counted by when training happened
    report.loss = loss_sum / max(report.steps, 1)
    return report
