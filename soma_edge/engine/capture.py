"""A resident expert's steps at fixed device addresses, so that the CUDA EP can capture them as CUDA graphs.

A resident step (soma_edge.engine.resident) is two ORT calls of many small kernels: the population graph and the
update graph. With the CUDA EP's enable_cuda_graph, ORT records a call's kernels once and then replays them
with one launch, which removes the host's per-kernel launch cost. A replay reads and writes the addresses
it recorded, so every input and output must stay in the same device buffer from call to call:

- the batch, eps, the noise and the update's scalars are copied into their buffers before each call
  (OrtValue.update_inplace), and the losses are read from theirs;
- an update's outputs are the next step's inputs, so the weights and optimizer state live in two sets,
  A and B: a round's first step reads A and writes B, the next reads B and writes A, and so on, each
  direction its own captured graph (RunOptions "gpu_graph_id" 1 and 2). A tensor the update does not
  write (a frozen decoder) is one buffer in both sets.

Only one-minibatch steps (spsa.accumulate = 1) qualify: several minibatches would need a noise buffer each
and a joined copy for the update. On the CPU EP the same fixed-address calls run without capture, which is
how the tests check them against the resident's ordinary calls, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from soma_edge.engine.runtime import load_ort, make_session
from soma_edge.expert import update_graph

if TYPE_CHECKING:
    from soma_edge.config import Config
    from soma_edge.engine.population import PopulationEvaluator
    from soma_edge.expert.population_graph import NoiseInput


def qualifies(cfg: Config) -> bool:
    """Whether a resident expert's steps can run at fixed addresses (the module docstring)."""
    return cfg.spsa.accumulate == 1


@dataclass(frozen=True)
class ResidentParts:
    """What of a resident expert (soma_edge.engine.resident) its fixed buffers are made from:
    its config, population evaluator, device (OrtValue's name for it), the update graph's inputs, the
    device values of its state (`w.<name>`, `m.<name>`, ...), and whether the delta rule trains its decoder."""

    cfg: Config
    population: PopulationEvaluator
    where: tuple[str, int]
    inputs: list[NoiseInput]
    values: dict[str, Any]
    delta: bool


class Captured:
    """The fixed buffers, bindings and sessions of a population evaluator's captured steps, made once and
    kept on it (a captured graph holds its buffers' addresses, so the buffers live as long as the
    sessions). `load` puts an expert's state in; `evaluate` is a step's population call, `update` its update
    call; `values` is the side that holds the current weights and optimizer state."""

    def __init__(self, resident: ResidentParts, batch: tuple[int, ...]) -> None:
        r, pop = resident, resident.population
        self.ort, self.where, self.batch = load_ort(), r.where, tuple(batch)
        self.cuda = r.where[0] == "cuda"
        self.population = make_session(pop.graph(), pop.device, pop.threads, pop.spin, cuda_graph=True)
        k = r.cfg.spsa.directions * r.cfg.spsa.accumulate
        update = update_graph.build_update(r.cfg.model, r.cfg.spsa, k, pop.perturbed, pop.noise, r.delta)
        # One thread, no spinning, as the resident's own update session (soma_edge.engine.resident says why).
        self.update_session = make_session(update, pop.device, 1, False, cuda_graph=True)
        # What each refill takes: the batch, eps, the noise both calls read, the update's per-step inputs.
        self.kinds = {n: (np.dtype(np.int64), self.batch) for n in ("x", "y")}
        self.kinds["eps"] = (np.dtype(np.float32), ())
        self.kinds.update({i.name: (np.dtype(i.dtype), tuple(i.shape)) for i in pop.inputs})
        steps = [i for i in r.inputs if i.name in update_graph.STEP_INPUTS]
        self.kinds.update({i.name: (np.dtype(np.float32), tuple(i.shape)) for i in steps})
        self.buffers: dict[str, Any] = {n: self._empty(shape, t) for n, (t, shape) in self.kinds.items()}
        shapes = dict(zip(pop.layout.names, pop.layout.shapes))
        self.outputs = {"losses": self._empty((2 * pop.k + 1,), np.float32)}
        self.outputs.update({n: self._empty(shapes[n[len("grad.") :]], np.float32) for n in pop.outputs[1:]})
        written = [o[len("new.") :] for o in update_graph.update_outputs(r.inputs)]
        a = {n: self._empty(v.shape(), np.float32) for n, v in r.values.items()}
        b = {n: self._empty(v.shape(), np.float32) if n in written else v for n, v in a.items()}
        self.sets = (a, b)
        self.side = 0
        self.runs = [self._run_options(side) for side in (0, 1)]
        self.population_io = [self._bind_population(r, side) for side in (0, 1)]
        self.update_io = [self._bind_update(r, side, written) for side in (0, 1)]

    def load(self, host: dict[str, np.ndarray]) -> dict[str, Any]:
        """Copy an expert's weights and optimizer state (`w.<name>`, `m.<name>`, ...) into side A, where
        the first captured graph reads them; returns that side."""
        self.side = 0
        for name, value in self.sets[0].items():
            value.update_inplace(np.ascontiguousarray(host[name], dtype=np.float32))
        return self.values

    @property
    def values(self) -> dict[str, Any]:
        return self.sets[self.side]

    def _empty(self, shape, dtype) -> Any:
        return self.ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, *self.where)

    def _run_options(self, side: int) -> Any:
        ro = self.ort.RunOptions()
        if self.cuda:  # one captured graph per direction of the A/B swap; 0 is ORT's own default id
            ro.add_run_config_entry("gpu_graph_id", str(side + 1))
        return ro

    def _bind_population(self, r: ResidentParts, side: int) -> Any:
        io = self.population.io_binding()
        for name in r.population.layout.names:
            io.bind_ortvalue_input(name, self.sets[side][f"w.{name}"])
        for name in ["x", "y", "eps", *(i.name for i in r.population.inputs)]:
            io.bind_ortvalue_input(name, self.buffers[name])
        for name, value in self.outputs.items():
            io.bind_ortvalue_output(name, value)
        return io

    def _bind_update(self, r: ResidentParts, side: int, written: list[str]) -> Any:
        io = self.update_session.io_binding()
        source, target = self.sets[side], self.sets[1 - side]
        grads = {update_graph.grad_name(n[len("grad.") :], 0): v for n, v in self.outputs.items() if n != "losses"}
        for i in r.inputs:
            value = source.get(i.name, self.buffers.get(i.name, grads.get(i.name)))
            if value is None:
                raise ValueError(f"the update graph's input {i.name} has no fixed buffer")
            io.bind_ortvalue_input(i.name, value)
        for name in written:
            io.bind_ortvalue_output(f"new.{name}", target[name])
        return io

    def _refill(self, name: str, value: np.ndarray) -> None:
        """Copy `value` into its fixed buffer. update_inplace checks only the element count and copies the
        buffer's bytes, so the dtype and shape are checked here."""
        dtype, shape = self.kinds[name]
        if value.dtype != dtype or tuple(value.shape) != shape:
            raise ValueError(f"{name}: {value.dtype}{list(value.shape)}, the fixed buffer is {dtype}{list(shape)}")
        self.buffers[name].update_inplace(np.ascontiguousarray(value))

    def evaluate(self, noise: dict[str, np.ndarray], eps: float, x: np.ndarray, y: np.ndarray) -> tuple:
        """The step's population call: its losses (host) and the decoder gradients (their fixed buffers)."""
        feeds = {**noise, "x": x, "y": y, "eps": np.array(eps, dtype=np.float32)}
        for name, value in feeds.items():
            self._refill(name, value)
        self.population.run_with_iobinding(self.population_io[self.side], self.runs[self.side])
        return self.outputs["losses"].numpy(), [v for n, v in self.outputs.items() if n != "losses"]

    def update(self, scalars: dict[str, np.ndarray]) -> dict[str, Any]:
        """The step's update call on the noise and decoder gradients its population call left in place;
        returns the side that now holds the weights."""
        for name, value in scalars.items():
            if name in self.buffers:
                self._refill(name, np.asarray(value, dtype=np.float32))
        self.update_session.run_with_iobinding(self.update_io[self.side], self.runs[self.side])
        self.side = 1 - self.side
        return self.values
