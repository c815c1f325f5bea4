"""An expert resident on its device: weights, optimizer state and the batch stay there as OrtValues, bound
to the population session (soma_edge.engine.population) and the update session (soma_edge.expert.update_graph) through
IOBinding. Per step, only the host's keyed noise (Rademacher bits and masks, or rank-1 factors) and the
minibatch go in, and the 2K + 1 losses come back; the delta rule's decoder gradient goes from one graph to
the other without leaving the device. The host computes each direction's scalar g_j = (L+ - L-) / 2 eps
in float64, as the Stepper does, so the update log and its replay are unchanged. On CUDA the two calls of
a step run as captured CUDA graphs where they qualify (soma_edge.engine.capture).

The update graph reproduces the numpy update bit for bit only where the device's kernels round as numpy
does (CPU EP: tested). `verified` runs one update on the device against spsa's numpy update, once per
device and graph; where the bits differ (or the config's update is one the graph cannot reproduce,
`update_graph.supported`), the worker keeps the host update and feeds the weights each step (the Stepper's
population path): slower, never different.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from soma_edge import devices
from soma_edge.config import Config
from soma_edge.devices import CUDA
from soma_edge.engine import capture as capture_mod
from soma_edge.engine.population import PopulationEvaluator
from soma_edge.engine.runtime import load_ort, make_session
from soma_edge.expert import update_graph
from soma_edge.expert.steps import stepper as make_stepper
from soma_edge.spsa import shaping
from soma_edge.spsa.optim import State, mean_decoder_grad, schedule
from soma_edge.spsa.stepper import StepResult, mean_probe_loss, minibatch_loss

log = logging.getLogger("soma.resident")
_VERIFIED: dict[tuple, bool] = {}  # (device, ORT provider, graph) -> whether its update gave the host's bits


def _ort_device(evaluator: PopulationEvaluator) -> tuple[str, int]:
    """Where the population session keeps its tensors, as OrtValue names it."""
    if evaluator.providers[0] == CUDA:
        return "cuda", devices.parse(evaluator.device).cuda_id or 0
    return "cpu", 0


class Resident:
    """SPSA steps of one expert with its state on the population evaluator's device (module docstring).

    Made from a host State (uploaded once); `step` runs one update; `download` writes the weights and
    optimizer state back into that State. Bit-identical to the Stepper's population path on a device that
    `verified` passes."""

    def __init__(
        self, cfg: Config, expert: int, population: PopulationEvaluator, state: State, capture: bool | None = None
    ) -> None:
        self.cfg, self.population, self.state = cfg, population, state
        self.stepper = make_stepper(cfg, expert)
        self.lay = population.layout
        self.body, self.delta = self.stepper.split(self.lay.size)
        k = cfg.spsa.directions * cfg.spsa.accumulate
        self.inputs = update_graph.update_inputs(
            cfg.model, cfg.spsa, k, population.perturbed, population.noise, self.delta
        )
        if population.update is None:  # one update session per population session, made on first use
            graph = update_graph.build_update(
                cfg.model, cfg.spsa, k, population.perturbed, population.noise, self.delta
            )
            # One thread, no spinning: the update is a few element-wise passes, and a second session's
            # spinning pool would steal the cores from the population session's next call.
            population.update = make_session(graph, population.device, 1, False)
        self.update = population.update
        self.ort = load_ort()
        self.where = _ort_device(population)
        self.values = self._resident(state)  # `w.<name>`, `m.<name>`, ...: what stays on the device
        # CUDA graph capture (soma_edge.engine.capture): by default wherever the device is CUDA; on the CPU EP
        # its fixed-address calls run uncaptured (how the tests check them).
        wanted = self.where[0] == "cuda" if capture is None else capture
        self.capture = wanted and capture_mod.qualifies(cfg) and not population.capture_refused
        self.captured: capture_mod.Captured | None = None  # made at the first step, which knows the batch

    def _host(self, state: State) -> dict[str, np.ndarray]:
        """The state's arrays that stay on the device, by the update graph's input names."""
        feeds = update_graph.update_feeds(self.cfg.model, self.cfg.spsa, state, np.zeros(1), {})
        names = [f"w.{n}" for n in self.lay.names]
        names += [i.name for i in self.inputs if i.name.split(".", 1)[0] in ("m", "v", "mom")]
        return {n: feeds[n] for n in names}

    def _resident(self, state: State) -> dict[str, Any]:
        return {n: self._upload(a) for n, a in self._host(state).items()}

    def _start_capture(self, batch: tuple[int, ...]) -> None:
        """The population evaluator's fixed buffers and captured sessions (made once, kept on it), loaded
        with this expert's state."""
        c = self.population.captured
        if c is None or c.batch != tuple(batch):
            seen = capture_mod.ResidentParts(
                self.cfg, self.population, self.where, self.inputs, self.values, self.delta
            )
            c = self.population.captured = capture_mod.Captured(seen, batch)
        self.values = c.load(self._host(self.state))
        self.captured = c

    def _upload(self, a: np.ndarray):
        return self.ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), *self.where)

    def _evaluate(self, host: dict[str, np.ndarray], eps: float, x: np.ndarray, y: np.ndarray) -> tuple:
        """One population call on the resident weights: the losses (host), the decoder gradients (device),
        and the noise as the update takes it (host, and device where uploaded)."""
        if self.captured is not None:
            losses, grads = self.captured.evaluate(host, eps, x, y)
            return losses, grads, (host, None)
        noise = {n: self._upload(v) for n, v in host.items()}
        io = self.population.session.io_binding()
        for name in self.lay.names:
            io.bind_ortvalue_input(name, self.values[f"w.{name}"])
        for name, value in noise.items():
            io.bind_ortvalue_input(name, value)
        io.bind_ortvalue_input("x", self._upload(x))
        io.bind_ortvalue_input("y", self._upload(y))
        io.bind_cpu_input("eps", np.array(eps, dtype=np.float32))
        io.bind_output("losses", "cpu")
        for name in self.population.outputs[1:]:
            io.bind_output(name, *self.where)
        self.population.session.run_with_iobinding(io)
        losses, *grads = io.get_outputs()
        return losses.numpy(), grads, (host, noise)

    def step(self, batches: Sequence[tuple[np.ndarray, np.ndarray]], decoder_grad: bool = False) -> StepResult:
        """One update from `accumulate` minibatches (x, y): the Stepper's population step, on the device
        (`decoder_grad`: also bring the delta rule's mean decoder gradient back, as StepResult has it)."""
        if len(batches) != self.cfg.spsa.accumulate:
            raise ValueError(
                f"spsa.accumulate = {self.cfg.spsa.accumulate} needs that many minibatches, got {len(batches)}"
            )
        if not self.capture:
            return self._step(batches, decoder_grad)
        t = self.state.step
        try:
            if self.captured is None:
                self._start_capture(batches[0][0].shape)
            return self._step(batches, decoder_grad)
        except Exception as e:  # ORT's own errors have no common class
            if self.state.step != t:  # the update ran: the state moved on, so this is no capture failure
                raise
            # Capture is a speed-up only: where the device refuses it, the same calls run uncaptured.
            log.warning("CUDA graph capture failed (%s): retrying the step uncaptured", " ".join(str(e).split())[:200])
            if self.captured is not None:  # the weights are in its buffers, on the side the step read
                self.values = dict(self.captured.values)
            self.captured, self.capture = None, False
            self.population.captured, self.population.capture_refused = None, True  # said once, not per round
            return self._step(batches, decoder_grad)  # an error that is not capture's comes back from here

    def _step(self, batches: Sequence[tuple[np.ndarray, np.ndarray]], decoder_grad: bool) -> StepResult:
        cfg, t = self.cfg.spsa, self.state.step
        lr, eps = schedule(cfg, t, self.state.opt.lr_scale)
        K = cfg.directions
        grads = np.empty(K * len(batches), dtype=np.float64)
        pairs, cleans, noises, decoder_grads = np.empty((K * len(batches), 2)), [], [], []
        for a, (x, y) in enumerate(batches):
            host = self.population.noise_of(self.stepper.probes(t, range(a * K, (a + 1) * K), self.body))
            losses, dec, noise = self._evaluate(host, eps, x, y)
            noises.append(noise)
            for i in range(K):  # the Stepper's float64 arithmetic and order
                lp, lm = float(losses[1 + 2 * i]), float(losses[2 + 2 * i])
                grads[a * K + i] = (lp - lm) / (2.0 * eps)
                pairs[a * K + i] = lp, lm
            cleans.append(minibatch_loss(cfg, pairs[a * K : (a + 1) * K], float(losses[0])))
            decoder_grads.append(dec)
        self.values = self._update(grads, noises, decoder_grads)
        loss = sum(cleans) / len(cleans) if self.delta else mean_probe_loss(pairs)
        dec_mean = None
        if decoder_grad and self.delta:
            dec_mean = mean_decoder_grad([np.concatenate([g.numpy().reshape(-1) for g in d]) for d in decoder_grads])
        return StepResult(step=t, grads=grads, loss=loss, lr=lr, eps=eps, decoder_grad=dec_mean)

    def _update(self, grads: np.ndarray, noises: list[tuple], decoder: list) -> dict[str, Any]:
        """The step's update of the resident state: captured, or `_apply`."""
        if self.captured is None:
            return self._apply(self.values, self.state, grads, noises, decoder)
        cfg, state = self.cfg.spsa, self.state
        host = update_graph.scalars(cfg, state.step, state.opt.adam_t, state.opt.lr_scale)
        values = self.captured.update({**host, "g": shaping.shape(cfg.shaping, grads).astype(np.float32)})
        update_graph.advance(cfg, state, self.delta)
        return values

    def _apply(
        self, values: dict[str, Any], state: State, grads: np.ndarray, noises: list[tuple[dict, dict]], decoder: list
    ) -> dict[str, Any]:
        """The update graph on the device from `values`; returns them with the new weights and moments, and
        advances `state`'s counters. `noises`: per minibatch, its noise inputs on the host and on the device
        (one minibatch's are bound as they are; several are joined on the host and uploaded once more)."""
        cfg = self.cfg.spsa
        io = self.update.io_binding()
        host = update_graph.scalars(cfg, state.step, state.opt.adam_t, state.opt.lr_scale)
        host["g"] = shaping.shape(cfg.shaping, grads).astype(np.float32)  # the Stepper's weights of the scalars
        noise = noises[0][1] if len(noises) == 1 else {}
        if len(noises) > 1:
            noise = {n: self._upload(np.concatenate([h[n] for h, _ in noises])) for n in noises[0][0]}
        bound = {**values, **noise}
        for a, dec in enumerate(decoder):  # the population calls' decoder gradients, still on the device
            bound.update({update_graph.grad_name(name, a): g for name, g in zip(self.lay.decoder, dec)})
        for i in self.inputs:
            if i.name in host:
                io.bind_cpu_input(i.name, host[i.name])
            else:
                io.bind_ortvalue_input(i.name, bound[i.name])
        names = [o.name for o in self.update.get_outputs()]
        for name in names:
            io.bind_output(name, *self.where)
        self.update.run_with_iobinding(io)
        out = dict(values)
        out.update({name[len("new.") :]: value for name, value in zip(names, io.get_outputs())})
        update_graph.advance(cfg, state, self.delta)
        return out

    def verified(self) -> bool:
        """Whether the update graph on this device gives spsa's numpy update bit for bit: one update of a
        copy of the uploaded state, with this step's keyed noise and made-up gradients, against
        Stepper.replay on the host. Run once per device, provider and graph."""
        # The graph: its description (kind, k, noise, update rule) and its inputs' shapes (the expert's size).
        graph = (self.update.get_modelmeta().graph_description, tuple((i.name, i.shape) for i in self.inputs))
        key = (repr(self.where), self.update.get_providers()[0], graph)
        if key not in _VERIFIED:
            _VERIFIED[key] = self._check_bits()
            if not _VERIFIED[key]:
                log.warning(
                    "the update graph on %s does not give the host's bits: the update stays on the host and "
                    "the weights are uploaded every step",
                    key[1],
                )
        return _VERIFIED[key]

    def _check_bits(self) -> bool:
        cfg, K, A = self.cfg.spsa, self.cfg.spsa.directions, self.cfg.spsa.accumulate
        host = State(self.state.weights.copy(), step=self.state.step, opt=self.state.opt.copy())
        device = State(host.weights.copy(), step=host.step, opt=host.opt.copy())
        rng = np.random.default_rng(0)
        grads = rng.standard_normal(K * A)
        per_batch = [rng.standard_normal(self.lay.size - self.body).astype(np.float32) for _ in range(A)]
        noises, decoder = [], []
        for a in range(A):
            noise = self.population.noise_of(self.stepper.probes(host.step, range(a * K, (a + 1) * K), self.body))
            noises.append((noise, {n: self._upload(v) for n, v in noise.items()}))
            full = np.concatenate([np.zeros(self.body, np.float32), per_batch[a]])
            decoder.append([self._upload(self.lay.views(full)[n]) for n in self.lay.decoder])
        values = self._apply(self._resident(device), device, grads, noises, decoder if self.delta else [])
        update_graph.store(self.cfg.model, cfg, device, {n: v.numpy() for n, v in values.items()}, self.delta)
        self.stepper.replay(host, grads, mean_decoder_grad(per_batch) if self.delta else None)
        same = [
            a is b or (a is not None and b is not None and np.array_equal(a.view(np.uint32), b.view(np.uint32)))
            for a, b in [
                (host.weights, device.weights),
                (host.opt.adam_m, device.opt.adam_m),
                (host.opt.adam_v, device.opt.adam_v),
                (host.opt.momentum, device.opt.momentum),
            ]
        ]
        return all(same) and (host.step, host.opt.adam_t) == (device.step, device.opt.adam_t)

    def download(self) -> State:
        """The host State, its weights and optimizer state copied back from the device."""
        arrays = {n: v.numpy() for n, v in self.values.items()}
        update_graph.store(self.cfg.model, self.cfg.spsa, self.state, arrays, self.delta)
        return self.state


def for_training(cfg: Config, population: PopulationEvaluator | None, expert: int, state: State) -> Resident | None:
    """The resident runner for training `state` with `population`, or None where the Stepper's host update
    must be used: no population evaluator, an update the graph cannot reproduce, or a device whose update
    bits differ from the host's (`verified` says so once)."""
    if population is None or update_graph.supported(cfg.spsa) is not None:
        return None
    runner = Resident(cfg, expert, population, state)
    return runner if runner.verified() else None
