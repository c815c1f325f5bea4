"""Central-difference SPSA, forward passes only.

For k = 1..K: z_k comes from a counter-based RNG keyed by (seed, expert, step, k), g_k = (L(w+εz_k) -
L(w-εz_k)) / 2ε, ĝ = (1/K) Σ g_k z_k, and w <- w - η_t u(ĝ). The noise is regenerated from its key and
never stored (as in MeZO), so an update replays from (key, g_1..g_K): `replay` gives bit-identical weights.

While ORT evaluates one direction (ORT releases the GIL), another thread draws the next one's noise.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np

from soma_edge.config import SPSAConfig

LossFn = Callable[[np.ndarray], float]

_NOISE_DOMAIN = 0x5A0A  # separates SPSA noise streams from every other use of the seed
# _SIGNS[b] = the 8 float32 bit patterns (+1.0 / -1.0) for the bits of byte b, most significant first.
_SIGNS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1) == 1,
    np.uint32(0x3F800000),
    np.uint32(0xBF800000),
).astype(np.uint32)


def noise(seed: int, expert: int, step: int, k: int, n: int, kind: str = "rademacher") -> np.ndarray:
    """Direction z for (seed, expert, step, k): float32[n], Rademacher ±1 or standard Gaussian."""
    bitgen = np.random.Philox(key=_philox_key(seed, expert, step, k))
    if kind == "rademacher":
        # One random bit per weight, expanded a byte at a time through a table of ±1.0 bit patterns:
        # ~12x faster than unpackbits + arithmetic, which matters at 8M params x 2K evaluations.
        raw = np.frombuffer(bitgen.random_raw((n + 63) // 64).tobytes(), dtype=np.uint8)
        return np.take(_SIGNS, raw, axis=0).reshape(-1)[:n].view(np.float32)
    if kind == "gaussian":
        return np.random.Generator(bitgen).standard_normal(n, dtype=np.float32)
    raise ValueError(f"unknown noise kind {kind!r}")


def _philox_key(seed: int, expert: int, step: int, k: int) -> np.ndarray:
    # A Philox key is 2 x 64 bits; pack the counter tuple into it directly (no hashing), so distinct
    # tuples give distinct streams as long as each field fits its bits.
    if not (0 <= seed < 2**32 and 0 <= expert < 2**16 and 0 <= step < 2**40 and 0 <= k < 2**24):
        raise ValueError(f"noise key out of range: seed={seed} expert={expert} step={step} k={k}")
    hi = (seed << 32) | (_NOISE_DOMAIN << 16) | expert
    lo = (step << 24) | k
    return np.array([lo, hi], dtype=np.uint64)


def schedule(cfg: SPSAConfig, step: int) -> tuple[float, float]:
    """(lr, eps) at `step`: linear warmup, then cosine to lr*lr_min_frac over total_steps (if set)."""
    lr = cfg.lr
    if cfg.warmup_steps and step < cfg.warmup_steps:
        lr = cfg.lr * (step + 1) / cfg.warmup_steps
    elif cfg.total_steps > cfg.warmup_steps:
        t = min(1.0, (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps))
        lr = cfg.lr * (cfg.lr_min_frac + (1 - cfg.lr_min_frac) * 0.5 * (1 + math.cos(math.pi * t)))
    eps = max(cfg.eps_min, lr) if cfg.tie_eps_to_lr else cfg.eps
    return lr, eps


@dataclass
class State:
    """What an expert carries between steps: its weights, step counter and (optional) momentum."""

    weights: np.ndarray
    step: int = 0
    momentum: np.ndarray | None = None


@dataclass
class StepResult:
    step: int  # the step index this update used for its key and schedule
    grads: np.ndarray  # float64[K] projected gradients g_k: with the key, all that is needed to replay
    loss: float  # mean of L+ and L- over the K directions: a (slightly biased) minibatch loss
    lr: float
    eps: float


def _accumulate(acc: np.ndarray, g: float, z: np.ndarray) -> None:
    acc += np.float32(g) * z


def _apply(state: State, cfg: SPSAConfig, acc: np.ndarray, lr: float) -> None:
    update = acc / np.float32(cfg.directions)
    if cfg.normalize:
        rms = np.sqrt(np.mean(np.square(update, dtype=np.float64)))
        if rms > 0:
            update *= np.float32(1.0 / rms)
    if cfg.momentum > 0:
        if state.momentum is None:
            state.momentum = np.zeros_like(state.weights)
        state.momentum *= np.float32(cfg.momentum)
        state.momentum += update
        update = state.momentum
    state.weights -= np.float32(lr) * update
    state.step += 1


@dataclass
class Stepper:
    """Runs SPSA steps for one expert. `loss_fn(w)` evaluates the current minibatch at weights w.

    Directions are worked on by `parallel + 1` threads, while at most `parallel` loss evaluations run at
    once (ORT releases the GIL): the spare thread draws the next direction's noise and builds its probe
    while the others evaluate, so the cores never wait on numpy. On a 2-core CPU, parallel=2 (two
    single-thread ORT runs side by side) beats one two-thread run by ~20-40% (docs/BENCHMARKS.md). The
    main thread sums g_k z_k in the order k, so the result is bit-identical for any `parallel`.
    """

    cfg: SPSAConfig
    seed: int
    expert: int = 0
    parallel: int = 1

    def __post_init__(self) -> None:
        self._pool = ThreadPoolExecutor(self.parallel + 1, thread_name_prefix="spsa")
        self._gate = threading.BoundedSemaphore(self.parallel)
        self._buffers = threading.local()

    def _z(self, step: int, k: int, n: int) -> np.ndarray:
        return noise(self.seed, self.expert, step, k, n, self.cfg.noise)

    def _probe(self, n: int) -> np.ndarray:
        buf = getattr(self._buffers, "probe", None)
        if buf is None or buf.size != n:
            buf = self._buffers.probe = np.empty(n, dtype=np.float32)
        return buf

    def _direction(self, w: np.ndarray, loss_fn: LossFn, t: int, k: int, eps: float) -> tuple[float, float, np.ndarray]:
        z = self._z(t, k, w.size)
        probe = self._probe(w.size)
        np.multiply(z, np.float32(eps), out=probe)
        probe += w
        with self._gate:
            lp = loss_fn(probe)
        np.multiply(z, np.float32(-eps), out=probe)
        probe += w
        with self._gate:
            lm = loss_fn(probe)
        return lp, lm, z

    def step(self, state: State, loss_fn: LossFn) -> StepResult:
        cfg, n, t = self.cfg, state.weights.size, state.step
        lr, eps = schedule(cfg, t)
        acc = np.zeros(n, dtype=np.float32)
        grads = np.empty(cfg.directions, dtype=np.float64)
        losses = 0.0
        window = self.parallel + 1  # directions in flight; bounds memory to ~2 vectors per thread
        submit = lambda k: self._pool.submit(self._direction, state.weights, loss_fn, t, k, eps)  # noqa: E731
        futures = {k: submit(k) for k in range(min(window, cfg.directions))}
        for k in range(cfg.directions):
            lp, lm, z = futures.pop(k).result()
            if k + window < cfg.directions:
                futures[k + window] = submit(k + window)
            g = (lp - lm) / (2.0 * eps)
            grads[k] = g
            losses += lp + lm
            _accumulate(acc, g, z)
        _apply(state, cfg, acc, lr)
        return StepResult(step=t, grads=grads, loss=losses / (2 * cfg.directions), lr=lr, eps=eps)

    def replay(self, state: State, grads: np.ndarray) -> None:
        """Apply a recorded step from its K scalars alone: no loss evaluation, bit-identical result."""
        cfg, n, t = self.cfg, state.weights.size, state.step
        if len(grads) != cfg.directions:
            raise ValueError(f"replay needs {cfg.directions} scalars, got {len(grads)}")
        lr, _ = schedule(cfg, t)
        acc = np.zeros(n, dtype=np.float32)
        for k, g in enumerate(grads):
            _accumulate(acc, float(g), self._z(t, k, n))
        _apply(state, cfg, acc, lr)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
