"""The expert's loss evaluators SPSA calls: the loop (`LossEvaluator`, one ORT call per weight set, the
clean forward with the decoder gradient beside it) and, where `choose_evaluator` picks it, the population
evaluator (soma_edge.engine.population: a step's clean forward and 2K probes in one call), made for a run's
config by `evaluator_for`; how many run at once and on how many threads (`plan_concurrency`).

The graph builders, and with them onnx, load only where an evaluator is made: the coordinator's ServerApp
and a worker's every per-message ClientApp import this module without paying for onnx until they build a
graph. The deploy path (export.infer) makes its sessions from bytes with soma_edge.engine.runtime alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from soma_edge.config import Config, Evaluator, ModelConfig
from soma_edge.devices import CPU
from soma_edge.engine import runtime
from soma_edge.expert.params import layout
from soma_edge.spsa.stepper import population_takes

if TYPE_CHECKING:  # population and the graph builders import onnx: loaded where a graph is built, not before
    from soma_edge.engine.population import PopulationEvaluator


def plan_concurrency(device: str, threads: int = 0, parallel: int = 0) -> tuple[int, int]:
    """Resolve (intra-op threads, concurrent evaluations); 0 means choose.

    On CPU, two single-thread runs side by side beat one two-thread run (ORT's LSTM op scales poorly
    across threads at batch 16), so auto splits the cores between two concurrent evaluations. On an
    accelerator one evaluation at a time keeps the device busy.
    """
    on_cpu = runtime.plan(device).first == CPU
    cores = runtime.cpu_count()
    if not on_cpu:
        return threads, parallel or 1
    if parallel == 0:
        parallel = 1 if cores < 2 or (threads and threads * 2 > cores) else 2
    if threads == 0:
        threads = max(1, cores // parallel)
    return threads, parallel


@dataclass
class LossEvaluator:
    """One ORT session per expert shape; evaluates L(w) for any flat weight vector w of that shape.

    `session.run` is thread-safe, so `parallel` evaluations may run at once on the one session. With
    `decoder_grad`, a second session on the "train" graph gives the clean forward: the loss and the exact
    decoder-path gradient at w. `population`, when `evaluator_for` chose the population evaluator, gives a
    step's clean forward and 2K probes in one call (soma_edge.expert.steps.objectives hands it to the Stepper).
    """

    model: ModelConfig
    device: str = "auto"
    threads: int = 0
    spin: bool = True
    parallel: int = 0
    decoder_grad: bool = False

    def __post_init__(self) -> None:
        from soma_edge.expert.graph import build  # onnx: heavy (module docstring)

        self.threads, self.parallel = plan_concurrency(self.device, self.threads, self.parallel)
        self.layout = layout(self.model)
        self.session = runtime.make_session(build(self.model, "loss"), self.device, self.threads, self.spin)
        self.providers: list[str] = self.session.get_providers()
        self.train_session = None
        self.population: PopulationEvaluator | None = None  # set by evaluator_for when it chose the population
        if self.decoder_grad:
            self.train_session = runtime.make_session(build(self.model, "train"), self.device, self.threads, self.spin)

    def _feeds(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
        feeds: dict[str, np.ndarray] = {"x": x, "y": y}
        feeds.update(self.layout.views(flat))
        return feeds

    def loss(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
        (out,) = self.session.run(["loss"], self._feeds(flat, x, y))
        return float(out)

    def clean(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
        """(loss, gradient of the loss with respect to the decoder) at `flat`; the gradient is float32 in
        the layout's order, the length of flat[layout.body:]."""
        if self.train_session is None:
            raise RuntimeError("this evaluator was built without decoder_grad")
        names = ["loss"] + [f"grad.{n}" for n in self.layout.decoder]
        loss, *grads = self.train_session.run(names, self._feeds(flat, x, y))
        return float(loss), np.concatenate([g.reshape(-1) for g in grads])


def evaluator_for(
    cfg: Config,
    device: str | None = None,
    threads: int | None = None,
    spin: bool = True,
    parallel: int | None = None,
    evaluator: Evaluator | None = None,
) -> LossEvaluator:
    """The evaluator a config trains with: its model, the clean-forward session when the decoder learns by
    the delta rule, and the population evaluator when `choose_evaluator` picks it for `evaluator` (default:
    the config's spsa.evaluator) on the session's provider. Arguments left None come from the config."""
    out = LossEvaluator(
        cfg.model,
        cfg.device if device is None else device,
        cfg.threads if threads is None else threads,
        spin,
        cfg.parallel if parallel is None else parallel,
        decoder_grad=cfg.spsa.decoder == "delta",
    )
    choice = cfg.spsa.evaluator if evaluator is None else evaluator
    if not population_takes(cfg.spsa):
        choice = Evaluator.LOOP
    if choose_evaluator(choice, out.providers) is Evaluator.POPULATION:
        from soma_edge.engine.population import for_config  # imports onnx (heavy): only where it is chosen

        # One call at a time, so it gets the threads the loop's concurrent evaluations would share.
        pop_threads, _ = plan_concurrency(out.device, cfg.threads if threads is None else threads, 1)
        out.population = for_config(cfg, out.device, pop_threads, spin)
    return out


def choose_evaluator(choice: Evaluator | str, providers: list[str]) -> Evaluator:
    """LOOP or POPULATION for the spsa.evaluator setting on a session whose providers are `providers`.

    AUTO on the CPU EP is the loop, one fixed choice so CPU runs stay deterministic: on a 2-core CPU the
    population graph measured 0.57-0.91x of the loop's throughput (docs/BENCHMARKS.md). On an accelerator
    AUTO is the population until the worker has measured both (`measures_auto`; worker/probe.py times each
    once per expert shape, caches the faster and passes it here explicitly).
    """
    choice = Evaluator(choice)
    if choice is not Evaluator.AUTO:
        return choice
    return Evaluator.LOOP if providers[0] == CPU else Evaluator.POPULATION


def measures_auto(choice: Evaluator | str, providers: list[str]) -> bool:
    """Whether `auto` is decided by measuring both evaluators: on an accelerator, where which one wins
    depends on the device and the expert's shape. On the CPU EP it is the fixed loop."""
    return Evaluator(choice) is Evaluator.AUTO and providers[0] != CPU


def evaluator_kind(evaluator: LossEvaluator) -> Evaluator:
    """Which evaluator `evaluator` trains with (what a worker records with each version it makes)."""
    return Evaluator.LOOP if evaluator.population is None else Evaluator.POPULATION


def mean_loss(evaluator: LossEvaluator, flat: np.ndarray, x: np.ndarray, y: np.ndarray, batch: int = 64) -> float:
    """Mean nats/byte over all windows (x, y), evaluated in batches of `batch` windows."""
    total, count = 0.0, 0
    for i in range(0, len(x), batch):
        xb, yb = x[i : i + batch], y[i : i + batch]
        total += evaluator.loss(flat, xb, yb) * xb.size
        count += xb.size
    return total / max(count, 1)
