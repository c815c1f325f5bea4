"""The population evaluator: one ORT call gives a step's clean forward and its 2K perturbed losses on one
minibatch (the graph: soma_edge.expert.population_graph), where evaluator.LossEvaluator takes 2K + 1 calls.

Also the bridge between the host's noise and the graph's noise inputs: Rademacher directions cross as their
keyed bits, sparse ones with their packed masks (`graph_noise`); `noise_feeds` cuts K flat directions (the
Stepper's z over the flat vector) into the graph's per-tensor inputs, `factor_feeds` lays out K rank-1
directions' factors (spsa.noise.rank1_factors), and `direction` materializes member j's dense z from them (the
looped reference, and what an update sums). `for_config` builds the evaluator a run's config trains with
(evaluator.evaluator_for), and `PopulationEvaluator.members` is what the Stepper calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from soma_edge.config import Config, ModelConfig, SPSAConfig
from soma_edge.config import Noise as SPSANoise
from soma_edge.engine.runtime import make_session
from soma_edge.expert.params import Layout, layout
from soma_edge.expert.population_graph import (
    Noise,
    NoiseInput,
    build_population,
    core_shape,
    noise_inputs,
    perturbed_size,
)
from soma_edge.spsa.noise import Rank1
from soma_edge.spsa.stepper import Population, Probes


@dataclass
class PopulationEvaluator:
    """One ORT session on the population graph of one expert shape, K, perturbed tensors and noise form."""

    model: ModelConfig
    k: int
    perturbed: Sequence[str]
    noise: Noise | str
    seq_len: int
    decoder_grad: bool = False
    device: str = "auto"
    threads: int = 0
    spin: bool = True
    decoder_from: str = "clean"  # spsa.decoder_from: the clean member's decoder gradient, or the probes' mean
    split: bool = False  # spsa.split_rows: each direction's members read their own 1/K of the rows
    layout: Layout = field(init=False)

    def __post_init__(self) -> None:
        self.noise = Noise(self.noise)
        self.perturbed = tuple(self.perturbed)
        self.layout = layout(self.model)
        self.session = make_session(self.graph(), self.device, self.threads, self.spin)
        self.providers: list[str] = self.session.get_providers()
        self.inputs: list[NoiseInput] = noise_inputs(self.model, self.k, self.perturbed, self.noise)
        self.outputs = ["losses"] + ([f"grad.{n}" for n in self.layout.decoder] if self.decoder_grad else [])
        self.update: Any = None  # the update graph's session (soma_edge.engine.resident), made on first use
        self.captured: Any = None  # the captured steps' buffers and sessions (soma_edge.engine.capture), likewise
        self.capture_refused = False  # the device refused capture once: later rounds run uncaptured

    def graph(self) -> Any:
        """Its population graph (an onnx.ModelProto; capture builds its own sessions on the same graph)."""
        return build_population(
            self.model,
            self.k,
            self.perturbed,
            self.noise,
            self.decoder_grad,
            self.seq_len,
            decoder_from=self.decoder_from,
            split=self.split,
        )

    def _check(self, noise: dict[str, np.ndarray]) -> None:
        if set(noise) != {i.name for i in self.inputs}:
            raise ValueError(f"noise inputs {sorted(noise)}, expected {[i.name for i in self.inputs]}")
        for i in self.inputs:
            a = noise[i.name]
            if a.dtype != i.dtype or a.shape != i.shape:
                raise ValueError(f"{i.name}: {a.dtype}{list(a.shape)}, expected {np.dtype(i.dtype)}{list(i.shape)}")

    def evaluate(
        self, flat: np.ndarray, noise: dict[str, np.ndarray], eps: float, x: np.ndarray, y: np.ndarray
    ) -> Population:
        """Losses of the clean weights `flat` and of its 2K members on (x, y), int64 [B, seq_len]."""
        self._check(noise)
        feeds: dict[str, np.ndarray] = {"x": x, "y": y, "eps": np.array(eps, dtype=np.float32)}
        feeds.update(self.layout.views(flat))
        feeds.update(noise)
        losses, *grads = self.session.run(self.outputs, feeds)
        dec = np.concatenate([g.reshape(-1) for g in grads]) if grads else None
        return Population(float(losses[0]), dec, losses[1::2].astype(np.float64), losses[2::2].astype(np.float64))

    def members(self, flat: np.ndarray, probes: Probes, eps: float, x: np.ndarray, y: np.ndarray) -> Population:
        """`evaluate` on the Stepper's directions for one minibatch (its flat z, or its rank-1 factors)."""
        return self.evaluate(flat, self.noise_of(probes), eps, x, y)

    def noise_of(self, probes: Probes) -> dict[str, np.ndarray]:
        """The graph's noise inputs for the Stepper's directions: their keyed bits (and masks), their factors,
        or cut from their flat z."""
        if probes.factors is not None:
            return factor_feeds(self.layout, self.perturbed, probes.factors)
        if self.noise.keyed:
            if probes.bits is None or (probes.keep is None) != (self.noise is Noise.BITS):
                raise ValueError(f"{self.noise.value} noise takes Rademacher probes' keyed bits (masks: when sparse)")
            return {"bits": probes.bits} | ({} if probes.keep is None else {"keep": probes.keep})
        return noise_feeds(
            self.layout, self.perturbed, self.noise, probes.dense(perturbed_size(self.model, self.perturbed))
        )


def graph_noise(cfg: SPSAConfig) -> Noise:
    """The form spsa.noise crosses to a population graph in: Rademacher as its keyed bits (sparse: with each
    probe's packed mask), Gaussian as float32, rank-1 as its factors."""
    if cfg.noise == SPSANoise.RADEMACHER:
        return Noise.BITS if cfg.density >= 1 else Noise.SPARSE_BITS
    return {SPSANoise.GAUSSIAN: Noise.GAUSSIAN, SPSANoise.RANK1: Noise.RANK1}[SPSANoise(cfg.noise)]


def for_config(cfg: Config, device: str, threads: int, spin: bool) -> PopulationEvaluator:
    """The population evaluator of a run's expert: K = spsa.directions, the tensors the Stepper perturbs
    (the body; everything with decoder = "spsa"), spsa.noise's form (`graph_noise`), the delta rule's
    decoder gradient when the decoder learns by it, each direction on its own rows under spsa.split_rows."""
    return PopulationEvaluator(
        cfg.model,
        cfg.spsa.directions,
        perturbed_tensors(cfg),
        graph_noise(cfg.spsa),
        cfg.data.seq_len,
        decoder_grad=cfg.spsa.decoder == "delta",
        device=device,
        threads=threads,
        spin=spin,
        decoder_from=cfg.spsa.decoder_from,
        split=cfg.spsa.split_rows,
    )


def perturbed_tensors(cfg: Config) -> list[str]:
    """The tensors SPSA perturbs under `cfg`: the body, and the decoder too where decoder = "spsa"."""
    lay = layout(cfg.model)
    return list(lay.names) if cfg.spsa.decoder == "spsa" else [n for n in lay.names if n not in lay.decoder]


def noise_feeds(lay: Layout, perturbed: Sequence[str], noise: Noise | str, z: np.ndarray) -> dict[str, np.ndarray]:
    """The graph's full-rank noise inputs from K flat directions z [K, n] (n covering the perturbed tensors'
    layout offsets: the Stepper's body): int8 signs for SIGNS (z in {-1, 0, +1}, exactly), float32 for
    GAUSSIAN. Rank-1 noise is drawn as its factors, not cut from a flat z."""
    noise = Noise(noise)
    if noise is Noise.RANK1 or noise.keyed:
        raise ValueError(f"{noise.value} noise crosses as drawn (factors, or keyed bits), not cut from a flat z")
    out = {}
    for name in perturbed:
        i = lay.names.index(name)
        size = int(np.prod(lay.shapes[i]))
        part = z[:, lay.offsets[i] : lay.offsets[i] + size].reshape(len(z), *lay.shapes[i])
        out[f"z.{name}"] = part.astype(np.int8) if noise is Noise.SIGNS else part.astype(np.float32)
    return out


def factor_feeds(
    lay: Layout, perturbed: Sequence[str], factors: Sequence[Sequence[Rank1 | np.ndarray]]
) -> dict[str, np.ndarray]:
    """The graph's rank-1 noise inputs from K directions' factors (each `spsa.noise.rank1_factors` over the
    perturbed tensors, `perturbed` in layout order): int8 a, b per matrix and z per vector (in its tensor's
    shape), exactly the ±1 signs."""
    out: dict[str, list[np.ndarray]] = {}
    for direction_factors in factors:
        if len(direction_factors) != len(perturbed):
            raise ValueError(f"{len(direction_factors)} factors for {len(perturbed)} perturbed tensors")
        for name, f in zip(perturbed, direction_factors):
            if isinstance(f, Rank1):
                out.setdefault(f"a.{name}", []).append(f.a)
                out.setdefault(f"b.{name}", []).append(f.b)
            else:
                out.setdefault(f"z.{name}", []).append(f.reshape(lay.shapes[lay.names.index(name)]))
    return {k: np.stack(v).astype(np.int8) for k, v in out.items()}


def direction(lay: Layout, noise: dict[str, np.ndarray], j: int, body: int | None = None) -> np.ndarray:
    """Direction j of a population's noise inputs as a dense float32 vector over the whole layout (zero on
    tensors not perturbed): z, or a b^T reshaped to the tensor's shape, or `bits` expanded over the first
    `body` weights (the perturbed ones; bits say only how many bytes)."""
    z = np.zeros(lay.size, dtype=np.float32)
    if "bits" in noise:
        if body is None:
            raise ValueError("bits noise needs the perturbed length `body`")
        z[:body] = Probes(None, bits=noise["bits"], keep=noise.get("keep")).direction(j, body)
        return z
    for name, shape, off in zip(lay.names, lay.shapes, lay.offsets):
        size = int(np.prod(shape))
        if f"z.{name}" in noise:
            z[off : off + size] = noise[f"z.{name}"][j].reshape(-1)
        elif f"a.{name}" in noise:
            a, b = noise[f"a.{name}"][j].astype(np.float32), noise[f"b.{name}"][j].astype(np.float32)
            if (len(a), len(b)) != core_shape(shape):
                raise ValueError(f"a.{name}, b.{name}: lengths {len(a)}, {len(b)}, not {core_shape(shape)}")
            z[off : off + size] = np.outer(a, b).reshape(-1)
    return z
