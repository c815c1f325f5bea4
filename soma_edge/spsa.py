"""Central-difference SPSA on the body, the exact delta rule on the decoder, forward passes only.

One step at weights w, for each of A minibatches (`accumulate`) and each of its K directions:
z comes from a counter-based RNG keyed by (seed, expert, step, a*K + k), optionally sparsified by a mask
from the same key, or (`noise = "rank1"`) built as a·bᵀ per weight matrix from m + n of the key's signs;
g = (L(w+εz) - L(w-εz)) / 2ε; the estimate is ĝ = (1/AK) Σ g z over the body only.
With `decoder = "delta"`, one clean forward per minibatch at w gives the step's clean loss and the exact
gradient of the loss with respect to the decoder (hidden states held fixed), which takes its own Adam
step. The body's estimate goes through the configured update: unit-RMS, Adam, or plain SGD, with optional
momentum and coupled weight decay.

The noise (and its mask) is regenerated from its key and never stored (as in MeZO), so a step replays from
(key, g_1..g_AK) plus, for the delta-rule decoder, its dense gradient: `replay` gives bit-identical
weights, because it runs the same float32 element-wise arithmetic in the same order (no BLAS anywhere in
the update). While ORT evaluates one direction (ORT releases the GIL), another thread draws the next one's
noise.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, NamedTuple, Sequence

import numpy as np

from soma_edge import quant
from soma_edge.config import SPSAConfig
from soma_edge.errors import CheckpointError

if TYPE_CHECKING:  # population builds ONNX graphs (onnx, onnxruntime), which replay and the coordinator need not load
    from soma_edge.population import Population

LossFn = Callable[[np.ndarray], float]
CleanFn = Callable[[np.ndarray], tuple[float, np.ndarray]]

_NOISE_DOMAIN = 0x5A0A  # separates SPSA noise streams from every other use of the seed
_MASK_DOMAIN = 0x5A0B  # the sparse-probe mask: its own stream, so density never changes the signs
# _SIGNS[b] = the 8 float32 bit patterns (+1.0 / -1.0) for the bits of byte b, most significant first.
_SIGNS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1) == 1,
    np.uint32(0x3F800000),
    np.uint32(0xBF800000),
).astype(np.uint32)


def noise(seed: int, expert: int, step: int, k: int, n: int, kind: str = "rademacher") -> np.ndarray:
    """Direction z for (seed, expert, step, k): float32[n], Rademacher ±1 or standard Gaussian."""
    if kind == "rademacher":
        return expand_bits(noise_bits(seed, expert, step, k, n), n)
    if kind == "gaussian":
        bitgen = np.random.Philox(key=_philox_key(seed, expert, step, k))
        return np.random.Generator(bitgen).standard_normal(n, dtype=np.float32)
    raise ValueError(f"unknown noise kind {kind!r}")


def noise_bits(seed: int, expert: int, step: int, k: int, n: int) -> np.ndarray:
    """The Rademacher direction (seed, expert, step, k) over n weights as the keyed Philox stream's raw bytes:
    uint8[bits_bytes(n)], one bit a weight, most significant first (`expand_bits` gives `noise`'s z). What
    crosses to a device, which expands it there (soma_edge.population_graph): 1/32 of z's bytes."""
    bitgen = np.random.Philox(key=_philox_key(seed, expert, step, k))
    return np.frombuffer(bitgen.random_raw(bits_bytes(n) // 8).tobytes(), dtype=np.uint8)


def bits_bytes(n: int) -> int:
    """Bytes of a Rademacher direction over n weights: whole 64-bit Philox words (the stream's unit)."""
    return (n + 63) // 64 * 8


def expand_bits(raw: np.ndarray, n: int) -> np.ndarray:
    """float32[n] ±1 from `noise_bits`' bytes: each byte through a table of ±1.0 bit patterns, ~12x faster
    than unpackbits + arithmetic, which matters at 8M params x 2K evaluations."""
    return np.take(_SIGNS, raw, axis=0).reshape(-1)[:n].view(np.float32)


def sign_table() -> np.ndarray:
    """float32[256, 8]: row b is the ±1 signs of byte b's bits, most significant first (expand_bits' table)."""
    return _SIGNS.view(np.float32)


def keep_table() -> np.ndarray:
    """float32[256, 8]: row b is byte b's bits as 1.0 / 0.0, most significant first (np.packbits' order): how
    a device expands a sparse probe's packed mask."""
    return np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(np.float32)


def expand_keep(packed: np.ndarray, n: int) -> np.ndarray:
    """bool[n] from a mask packed by np.packbits."""
    return np.unpackbits(packed, count=n).astype(bool)


@dataclass(frozen=True)
class Rank1:
    """A weight matrix's rank-1 probe z = a·bᵀ: its two float32 ±1 factors, a [m] and b [n]."""

    a: np.ndarray
    b: np.ndarray


def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """(m, n) when a tensor of this layout shape is a matrix for rank-1 probes (its shape without size-1
    dims is 2-D with both sides > 1: LSTM W [1, 4H, in] is (4H, in)); None for a vector (biases, gains)."""
    dims = tuple(int(d) for d in shape if d != 1)
    return (dims[0], dims[1]) if len(dims) == 2 else None


def rank1_signs(shapes: Sequence[Sequence[int]]) -> int:
    """Signs one rank-1 direction draws: m + n per matrix, every entry of each vector."""
    out = 0
    for shape in shapes:
        mn = matrix_shape(shape)
        out += sum(mn) if mn else int(np.prod(shape, dtype=np.int64))
    return out


def rank1_factors(
    seed: int, expert: int, step: int, k: int, shapes: Sequence[Sequence[int]]
) -> list[Rank1 | np.ndarray]:
    """The rank-1 direction (seed, expert, step, k) over tensors of `shapes` (layout order): Rank1(a, b) for a
    matrix, float32 ±1 signs of its size for a vector. They are the first `rank1_signs(shapes)` signs of the
    key's Rademacher stream (`noise`'s domain and bits), taken in layout order, a before b."""
    signs = noise(seed, expert, step, k, rank1_signs(shapes))
    out: list[Rank1 | np.ndarray] = []
    at = 0
    for shape in shapes:
        mn = matrix_shape(shape)
        if mn:
            m, n = mn
            out.append(Rank1(signs[at : at + m], signs[at + m : at + m + n]))
            at += m + n
        else:
            size = int(np.prod(shape, dtype=np.int64))
            out.append(signs[at : at + size])
            at += size
    return out


def rank1_probe(
    seed: int, expert: int, step: int, k: int, shapes: Sequence[Sequence[int]], out: np.ndarray | None = None
) -> np.ndarray:
    """The rank-1 direction materialized: float32[sum of sizes], each matrix's outer(a, b) in its tensor's
    C order, each vector's signs. Every entry is ±1 exactly (a product of two ±1 floats)."""
    total = sum(int(np.prod(s, dtype=np.int64)) for s in shapes)
    z = np.empty(total, dtype=np.float32) if out is None else out
    at = 0
    for f in rank1_factors(seed, expert, step, k, shapes):
        if isinstance(f, Rank1):
            size = f.a.size * f.b.size
            np.multiply(f.a[:, None], f.b[None, :], out=z[at : at + size].reshape(f.a.size, f.b.size))
        else:
            size = f.size
            z[at : at + size] = f
        at += size
    return z


def body_shapes(shapes: Sequence[Sequence[int]], n: int) -> tuple[tuple[int, ...], ...]:
    """The leading tensors of a layout's `shapes` that make up its first n weights (ValueError if n is not
    at a tensor boundary): what a rank-1 probe of a body of n weights covers."""
    out, at = [], 0
    for shape in shapes:
        if at == n:
            break
        out.append(tuple(int(d) for d in shape))
        at += int(np.prod(shape, dtype=np.int64))
    if at != n:
        raise ValueError(f"{n} weights do not end at a tensor boundary of the layout (the tensors give {at})")
    return tuple(out)


def probe_mask(seed: int, expert: int, step: int, k: int, n: int, density: float) -> np.ndarray:
    """Which of n weights the sparse probe (seed, expert, step, k) touches: bool[n], each True with
    probability `density` (to 1/65536), from its own keyed stream."""
    bitgen = np.random.Philox(key=_philox_key(seed, expert, step, k, _MASK_DOMAIN))
    draws = np.frombuffer(bitgen.random_raw((n + 3) // 4).tobytes(), dtype=np.uint16)[:n]
    return draws < np.uint16(min(65535, round(density * 65536)))  # density 1/2 is exact: draws < 32768


def _philox_key(seed: int, expert: int, step: int, k: int, domain: int = _NOISE_DOMAIN) -> np.ndarray:
    # A Philox key is 2 x 64 bits; pack the counter tuple into it directly (no hashing), so distinct
    # tuples give distinct streams as long as each field fits its bits.
    if not (0 <= seed < 2**32 and 0 <= expert < 2**16 and 0 <= step < 2**40 and 0 <= k < 2**24):
        raise ValueError(f"noise key out of range: seed={seed} expert={expert} step={step} k={k}")
    hi = (seed << 32) | (domain << 16) | expert
    lo = (step << 24) | k
    return np.array([lo, hi], dtype=np.uint64)


# --- schedule ------------------------------------------------------------------------------------------


def _cosine(cfg: SPSAConfig, step: int) -> float:
    if cfg.total_steps <= cfg.warmup_steps or step < cfg.warmup_steps:
        return 1.0
    t = min(1.0, (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps))
    return cfg.lr_min_frac + (1 - cfg.lr_min_frac) * 0.5 * (1 + math.cos(math.pi * t))


def schedule(cfg: SPSAConfig, step: int, scale: float = 1.0) -> tuple[float, float]:
    """(body lr, eps) at `step`: linear warmup, then constant or cosine to lr*lr_min_frac over total_steps
    (if set), times `scale`, the plateau rule's factor, which scales eps too (halved together)."""
    warm = (step + 1) / cfg.warmup_steps if cfg.warmup_steps and step < cfg.warmup_steps else 1.0
    lr = cfg.lr * warm * _cosine(cfg, step) * scale
    eps = max(cfg.eps_min, lr) if cfg.tie_eps_to_lr else cfg.eps * scale
    return lr, eps


def decoder_lr(cfg: SPSAConfig, step: int, scale: float = 1.0) -> float:
    """The delta-rule decoder's Adam lr: no warmup (its gradient is exact), the same cosine and plateau."""
    return cfg.decoder_lr * _cosine(cfg, step) * scale


# --- optimizer state -----------------------------------------------------------------------------------


@dataclass
class OptState:
    """Everything besides the weights that an expert's next step depends on; it travels and checkpoints
    with the weights. Arrays cover the whole flat vector (the body's part for the body update, the
    decoder's part for the delta rule) and are created on first use."""

    momentum: np.ndarray | None = None
    adam_m: np.ndarray | None = None
    adam_v: np.ndarray | None = None
    adam_t: int = 0  # Adam updates behind the moments (bias correction), which need not equal the step
    lr_scale: float = 1.0  # the plateau rule's factor on lr and eps, constant within a federation round
    best_val: float | None = None  # plateau counters: the best val loss so far and the step it was seen
    best_step: int = 0

    def copy(self) -> "OptState":
        def arr(a):
            return None if a is None else a.copy()

        return OptState(
            momentum=arr(self.momentum),
            adam_m=arr(self.adam_m),
            adam_v=arr(self.adam_v),
            adam_t=self.adam_t,
            lr_scale=self.lr_scale,
            best_val=self.best_val,
            best_step=self.best_step,
        )

    def nbytes(self) -> int:
        """Bytes of its vectors (what the state adds to a message or checkpoint beyond the weights)."""
        return sum(a.nbytes for a in (self.momentum, self.adam_m, self.adam_v) if a is not None)

    def to_record(self) -> dict[str, Any]:
        return {
            "momentum": self.momentum,
            "adam_m": self.adam_m,
            "adam_v": self.adam_v,
            "adam_t": int(self.adam_t),
            "lr_scale": float(self.lr_scale),
            "best_val": self.best_val,
            "best_step": int(self.best_step),
        }

    @classmethod
    def from_record(cls, rec: Any, size: int, where: str = "optimizer state") -> "OptState":
        """Check a record against the weights it belongs to (float32[size], finite); CheckpointError if not."""
        if rec is None:
            return cls()
        if not isinstance(rec, dict):
            raise CheckpointError(f"{where}: not a map")
        unknown = set(rec) - {"momentum", "adam_m", "adam_v", "adam_t", "lr_scale", "best_val", "best_step"}
        if unknown:
            raise CheckpointError(f"{where}: unknown fields {sorted(unknown)}")
        arrays = {}
        for name in ("momentum", "adam_m", "adam_v"):
            a = rec.get(name)
            if a is not None and (
                not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != (size,) or not np.isfinite(a).all()
            ):
                got = f"{a.dtype}{list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
                raise CheckpointError(f"{where}: {name} is {got}, not a finite float32[{size}] like the weights")
            arrays[name] = None if a is None else np.array(a, dtype=np.float32)
        if (arrays["adam_m"] is None) != (arrays["adam_v"] is None) or (
            arrays["adam_v"] is not None and (arrays["adam_v"] < 0).any()
        ):
            raise CheckpointError(f"{where}: Adam moments are incomplete or negative")
        scale, best, best_step = rec.get("lr_scale", 1.0), rec.get("best_val"), rec.get("best_step", 0)
        adam_t = rec.get("adam_t", 0)
        if not _count(adam_t) or (adam_t > 0) != (arrays["adam_m"] is not None):
            raise CheckpointError(f"{where}: adam_t {adam_t!r} does not fit the Adam moments")
        if not _finite_number(scale) or not 0 < scale <= 1:
            raise CheckpointError(f"{where}: lr_scale {scale!r} is not in (0, 1]")
        if best is not None and not _finite_number(best):
            raise CheckpointError(f"{where}: best_val {best!r} is not a finite number")
        if not _count(best_step):
            raise CheckpointError(f"{where}: best_step {best_step!r} is not a step count")
        return cls(
            **arrays,
            adam_t=adam_t,
            lr_scale=float(scale),
            best_val=None if best is None else float(best),
            best_step=best_step,
        )


def _finite_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**62


@dataclass
class State:
    """What an expert carries between steps: its weights, step counter and optimizer state."""

    weights: np.ndarray
    step: int = 0
    opt: OptState = field(default_factory=OptState)


def slower(cfg: SPSAConfig, scale: float) -> float:
    """The lr scale after one slow-down (a plateau, or a refused version): x plateau_factor, never below
    lr_floor."""
    return max(cfg.lr_floor / cfg.lr, scale * cfg.plateau_factor)


def plateau(cfg: SPSAConfig, opt: OptState, val: float, step: int) -> bool:
    """Record the expert's val loss at `step`; halve lr and eps (opt.lr_scale) when it has not improved by
    `plateau_min_delta` for `plateau_patience` steps, never below `lr_floor`. True when it decayed.

    The caller decides when to look (the coordinator at round boundaries), so the scale is constant
    between looks and a round's steps all use one lr."""
    if not cfg.plateau:
        return False
    if opt.best_val is None or val < opt.best_val - cfg.plateau_min_delta:
        opt.best_val, opt.best_step = float(val), step
        return False
    if step - opt.best_step < cfg.plateau_patience:
        return False
    new = slower(cfg, opt.lr_scale)
    opt.best_step = step  # patience counts afresh from the decay
    if new >= opt.lr_scale:
        return False
    opt.lr_scale = new
    return True


# --- one step ------------------------------------------------------------------------------------------


@dataclass
class Probes:
    """One minibatch's K directions, for an evaluator that takes them all at once: z float32[K, body] as
    the Stepper draws them (Gaussian), or, with rank-1 probes, each direction's `rank1_factors`, or, for
    Rademacher probes, their `noise_bits` uint8[K, bits_bytes(body)] and, sparse, their packed masks `keep`
    (z None for both)."""

    z: np.ndarray | None
    factors: list[list[Rank1 | np.ndarray]] | None = None
    bits: np.ndarray | None = None
    keep: np.ndarray | None = None  # sparse probes: uint8[K, ceil(body / 8)], each one's mask, np.packbits'd

    def direction(self, i: int, body: int) -> np.ndarray:
        """Direction i's z float32[body] from its bits (and mask): the Stepper's `_z`, bit for bit."""
        if self.bits is None:
            raise ValueError("these directions carry no keyed bits")
        z = expand_bits(self.bits[i], body)
        if self.keep is not None:
            z *= expand_keep(self.keep[i], body)  # exact: multiplies by 1.0 or 0.0, as _z
        return z

    def dense(self, body: int) -> np.ndarray:
        """z float32[K, body], expanded from the bits where the directions came as bits."""
        if self.z is not None:
            return self.z
        if self.bits is None:
            raise ValueError("rank-1 directions have no dense z here: they cross as their factors")
        return np.stack([self.direction(i, body) for i in range(len(self.bits))])


MembersFn = Callable[[np.ndarray, Probes, float], "Population"]


@dataclass
class Objective:
    """One minibatch: `loss(w)` for the probes and, for the delta rule, `clean(w)` -> (loss, decoder grad).
    With `members(w, probes, eps)` (the population evaluator: soma_edge.population), the Stepper evaluates
    the minibatch's clean forward and 2K probes in that one call instead."""

    loss: LossFn
    clean: CleanFn | None = None
    members: MembersFn | None = None


@dataclass
class StepResult:
    step: int  # the step index this update used for its key and schedule
    grads: np.ndarray  # float64[A*K] projected gradients g: with the key, all that replays the body
    loss: float  # the clean minibatch loss where there was a clean forward, else the mean of L+ and L-
    lr: float
    eps: float
    decoder_grad: np.ndarray | None = None  # float32, the delta rule's mean gradient (replays the decoder)


def _adam(g: np.ndarray, m: np.ndarray, v: np.ndarray, t: int, cfg: SPSAConfig) -> np.ndarray:
    """Bias-corrected Adam direction for gradient g at update t >= 1; updates the moments in place."""
    m *= np.float32(cfg.beta1)
    m += np.float32(1 - cfg.beta1) * g
    v *= np.float32(cfg.beta2)
    v += np.float32(1 - cfg.beta2) * (g * g)
    m_hat = m / np.float32(1 - cfg.beta1**t)
    v_hat = v / np.float32(1 - cfg.beta2**t)
    return m_hat / (np.sqrt(v_hat) + np.float32(cfg.adam_eps))


def _moments(opt: OptState, n: int) -> tuple[np.ndarray, np.ndarray]:
    if opt.adam_m is None or opt.adam_v is None:
        opt.adam_m, opt.adam_v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    return opt.adam_m, opt.adam_v


def _apply(
    state: State, cfg: SPSAConfig, body: int, acc: np.ndarray, dec: np.ndarray | None, decoder_elsewhere: bool = False
) -> None:
    """w <- w - lr u(ĝ) on the body, and the decoder's Adam step on the delta-rule gradient (or, with
    `decoder_elsewhere`, none: a replay that sets the decoder from its log counts the Adam update only)."""
    t, opt, w = state.step, state.opt, state.weights
    lr, _ = schedule(cfg, t, opt.lr_scale)
    adam = cfg.update == "adam" or dec is not None or decoder_elsewhere
    n_adam = opt.adam_t + 1
    update = acc / np.float32(cfg.directions * cfg.accumulate)
    if cfg.weight_decay > 0:
        update += np.float32(cfg.weight_decay) * w[:body]
    if cfg.update == "adam":
        m, v = _moments(opt, w.size)
        update = _adam(update, m[:body], v[:body], n_adam, cfg)
    elif cfg.update == "rms":
        rms = np.sqrt(np.mean(np.square(update, dtype=np.float64)))
        if rms > 0:
            update *= np.float32(1.0 / rms)
    if cfg.momentum > 0 and cfg.update != "adam":
        if opt.momentum is None:
            opt.momentum = np.zeros_like(w)
        buf = opt.momentum[:body]
        buf *= np.float32(cfg.momentum)
        buf += update
        update = buf
    w[:body] -= np.float32(lr) * update
    if dec is not None:
        # No weight decay here: the decoder's exact gradient is tiny for rare bytes, so a coupled wd*w would
        # dominate it and Adam would shrink those weights at its full lr (measured: +0.1 nats/byte).
        m, v = _moments(opt, w.size)
        w[body:] -= np.float32(decoder_lr(cfg, t, opt.lr_scale)) * _adam(dec, m[body:], v[body:], n_adam, cfg)
    if adam:
        opt.adam_t = n_adam
    state.step += 1


class _Sums(NamedTuple):
    """What a step's evaluation gives its update: Σ g_j z_j, the g_j, Σ (L+ + L-), and per minibatch the
    clean forward's (loss, decoder gradient) for the delta rule (empty without it)."""

    acc: np.ndarray
    grads: np.ndarray
    probe_losses: float
    cleans: list[tuple[float, np.ndarray | None]]


@dataclass
class Stepper:
    """Runs SPSA steps for one expert.

    `body` is how many leading weights SPSA perturbs (the layout's body); the rest is the decoder, which
    the delta rule updates, SPSA perturbs as well (`decoder = "spsa"`), or nobody touches ("frozen").
    0 means the whole vector is body (no decoder). `dense` marks body weights that sparse probes always
    touch (norm gains). `shapes` is the layout's tensor shapes in order (`params.Layout.shapes`), which
    rank-1 probes (`noise = "rank1"`) need to tell matrices from vectors.

    Work runs on `parallel + 1` threads with at most `parallel` loss evaluations at once (ORT releases
    the GIL): the spare thread draws the next direction's noise and builds its probe while the others
    evaluate, so the cores never wait on numpy. On a 2-core CPU, parallel=2 (two single-thread ORT runs
    side by side) beats one two-thread run by ~20-40% (docs/BENCHMARKS.md). The main thread sums g z
    in index order, so the result is bit-identical for any `parallel`.
    """

    cfg: SPSAConfig
    seed: int
    expert: int = 0
    parallel: int = 1
    body: int = 0
    dense: np.ndarray | None = None
    shapes: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.cfg.noise == "rank1" and (not self.shapes or self.cfg.density != 1):
            raise ValueError("rank-1 probes need the layout's tensor shapes and spsa.density = 1.0")
        self._pool = ThreadPoolExecutor(self.parallel + 1, thread_name_prefix="spsa")
        self._gate = threading.BoundedSemaphore(self.parallel)
        self._buffers = threading.local()

    def split(self, n: int) -> tuple[int, bool]:
        """(perturbed length, whether the delta rule trains the rest) for n weights."""
        body = self.body or n
        if self.cfg.decoder == "spsa":
            return n, False
        return body, self.cfg.decoder == "delta" and body < n

    def _z(self, step: int, j: int, n: int) -> np.ndarray:
        if self.cfg.noise == "rank1":
            # Materialized, so the update (acc += g z in index order) and its replay are the full-rank code.
            return rank1_probe(self.seed, self.expert, step, j, body_shapes(self.shapes, n))
        z = noise(self.seed, self.expert, step, j, n, self.cfg.noise)
        if self.cfg.density < 1:
            z *= self._keep(step, j, n)  # exact: multiplies by 1.0 or 0.0
        return z

    def _keep(self, step: int, j: int, n: int) -> np.ndarray:
        """The sparse probe's mask: its keyed draws, and the weights it always touches."""
        keep = probe_mask(self.seed, self.expert, step, j, n, self.cfg.density)
        if self.dense is not None:
            keep |= self.dense[:n]
        return keep

    def _probe(self, n: int) -> np.ndarray:
        buf = getattr(self._buffers, "probe", None)
        if buf is None or buf.size != n:
            buf = self._buffers.probe = np.empty(n, dtype=np.float32)
        return buf

    def direction(
        self, w: np.ndarray, loss_fn: LossFn, t: int, j: int, body: int, eps: float
    ) -> tuple[float, float, np.ndarray]:
        """Direction j of step t: (L(w + eps z), L(w - eps z), z), z perturbing the first `body` weights."""
        z = self._z(t, j, body)
        probe = self._probe(w.size)
        probe[body:] = w[body:]
        head = probe[:body]
        np.multiply(z, np.float32(eps), out=head)
        head += w[:body]
        with self._gate:
            lp = loss_fn(probe)
        np.multiply(z, np.float32(-eps), out=head)
        head += w[:body]
        with self._gate:
            lm = loss_fn(probe)
        return lp, lm, z

    def _clean(self, w: np.ndarray, clean_fn: CleanFn) -> tuple[float, np.ndarray]:
        with self._gate:
            return clean_fn(w)

    def step(self, state: State, objectives: Objective | Sequence[Objective] | LossFn) -> StepResult:
        """One update from `accumulate` minibatches (one Objective each; a bare loss function is one
        minibatch without a clean forward). Objectives with `members` are evaluated a minibatch per call
        (the population evaluator), others a probe per call; either way g_j z_j is summed in index order j
        and applied by the same code, so the log's scalars mean the same and replay is unchanged."""
        objs = _as_objectives(objectives)
        cfg, w, t = self.cfg, state.weights, state.step
        if len(objs) != cfg.accumulate:
            raise ValueError(f"spsa.accumulate = {cfg.accumulate} needs that many minibatches, got {len(objs)}")
        body, delta = self.split(w.size)
        population = all(o.members is not None for o in objs)
        if delta and not population and any(o.clean is None for o in objs):
            raise ValueError("the delta-rule decoder needs a clean forward (Objective.clean) per minibatch")
        lr, eps = schedule(cfg, t, state.opt.lr_scale)
        run = self._population if population else self._loop
        acc, grads, probe_losses, cleans = run(w, objs, t, body, eps, delta)
        dec, loss = None, probe_losses / (2 * len(grads))
        if delta:
            if any(g is None for _, g in cleans):
                raise ValueError("the delta-rule decoder needs the population evaluator's decoder gradient")
            dec = mean_decoder_grad([g for _, g in cleans])
            loss = sum(x for x, _ in cleans) / len(cleans)
        _apply(state, cfg, body, acc, dec)
        return StepResult(step=t, grads=grads, loss=loss, lr=lr, eps=eps, decoder_grad=dec)

    def _loop(self, w: np.ndarray, objs: list[Objective], t: int, body: int, eps: float, delta: bool) -> _Sums:
        """The step's sums from one loss evaluation per probe, `parallel` at a time."""
        K, total = self.cfg.directions, self.cfg.directions * self.cfg.accumulate
        cleans = [self._pool.submit(self._clean, w, o.clean) for o in objs] if delta else []
        window = self.parallel + 1  # directions in flight; bounds memory to ~2 vectors per thread

        def submit(j):
            return self._pool.submit(self.direction, w, objs[j // K].loss, t, j, body, eps)

        futures: dict[int, Future] = {j: submit(j) for j in range(min(window, total))}
        acc = np.zeros(body, dtype=np.float32)
        grads = np.empty(total, dtype=np.float64)
        probe_losses = 0.0
        for j in range(total):
            lp, lm, z = futures.pop(j).result()
            if j + window < total:
                futures[j + window] = submit(j + window)
            grads[j] = (lp - lm) / (2.0 * eps)
            probe_losses += lp + lm
            _accumulate(acc, grads[j], z)
        return _Sums(acc, grads, probe_losses, [f.result() for f in cleans])

    def _population(self, w: np.ndarray, objs: list[Objective], t: int, body: int, eps: float, delta: bool) -> _Sums:
        """The step's sums from one `members` call per minibatch: its clean forward and K directions' 2K
        probes, fed the noise `_z` draws (or, for rank-1 probes, its factors), bit for bit."""
        K = self.cfg.directions
        acc = np.zeros(body, dtype=np.float32)
        grads = np.empty(K * len(objs), dtype=np.float64)
        probe_losses, cleans = 0.0, []
        for a, obj in enumerate(objs):
            probes = self.probes(t, range(a * K, (a + 1) * K), body)
            with self._gate:
                out = obj.members(w, probes, eps)
            for i in range(K):
                j = a * K + i
                lp, lm = float(out.lp[i]), float(out.lm[i])
                grads[j] = (lp - lm) / (2.0 * eps)
                probe_losses += lp + lm
                _accumulate(acc, grads[j], self._drawn(probes, i, t, j, body))
            cleans.append((out.loss, out.decoder_grad if delta else None))
        return _Sums(acc, grads, probe_losses, cleans)

    def _drawn(self, probes: Probes, i: int, t: int, j: int, body: int) -> np.ndarray:
        """Direction j's z (probes' i-th) for the update: taken from the probes where they carry it."""
        if probes.z is not None:
            return probes.z[i]
        if probes.bits is not None:
            return probes.direction(i, body)
        return self._z(t, j, body)

    def probes(self, t: int, js: range, body: int) -> Probes:
        """Directions `js` of step t over the first `body` weights, as a population call takes them: for
        Rademacher probes their keyed bits (and, sparse, their masks packed: a device expands both), for
        rank-1 probes their factors, for Gaussian ones their dense z stacked."""
        if self.cfg.noise == "rank1":
            shapes = body_shapes(self.shapes, body)
            return Probes(None, [rank1_factors(self.seed, self.expert, t, j, shapes) for j in js])
        if self.cfg.noise == "rademacher":
            bits = np.stack([noise_bits(self.seed, self.expert, t, j, body) for j in js])
            if self.cfg.density >= 1:
                return Probes(None, bits=bits)
            return Probes(None, bits=bits, keep=np.stack([np.packbits(self._keep(t, j, body)) for j in js]))
        return Probes(np.stack([self._z(t, j, body) for j in js]))

    def replay(
        self, state: State, grads: np.ndarray, decoder_grad: np.ndarray | None = None, body_only: bool = False
    ) -> None:
        """Apply a recorded step from its scalars (and the delta rule's decoder gradient, unless
        `body_only`: the caller sets the decoder itself): no loss evaluation, bit-identical result."""
        cfg, n, t = self.cfg, state.weights.size, state.step
        total = cfg.directions * cfg.accumulate
        if len(grads) != total:
            raise ValueError(f"replay needs {total} scalars, got {len(grads)}")
        body, delta = self.split(n)
        if delta and not body_only and (decoder_grad is None or decoder_grad.shape != (n - body,)):
            raise ValueError(f"replay of a delta-rule step needs the decoder gradient float32[{n - body}]")
        acc = np.zeros(body, dtype=np.float32)
        for j, g in enumerate(grads):
            _accumulate(acc, float(g), self._z(t, j, body))
        _apply(state, cfg, body, acc, None if body_only or not delta else decoder_grad, delta and body_only)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


# --- update logs ---------------------------------------------------------------------------------------


@dataclass
class UpdateLog:
    """A round of one expert's steps as the scalars that rebuild it: with the noise keys (the run's seed,
    the expert, the step), `replay` turns the version it started from into the version it ended at, bit
    for bit. A delta-rule decoder's update is dense, so it comes along: as its change since the round's
    start in int8 codes (`decoder_codes`, `decoder_scales`: soma_edge.quant, which the worker adopted), or
    as its final float32 weights (`decoder`: federation.log_decoder = "float32"). Its Adam moments
    (`decoder_m`, `decoder_v`) come along only where the coordinator audits logs (federation.audit_steps > 0:
    the audit rebuilds the decoder's steps from them) and in logs before protocol 4; otherwise they stay on
    the worker, which keeps the exact ones, and a replay keeps the base version's."""

    start: int  # the step of the first update
    grads: np.ndarray  # float32[steps, A*K]: each step's projected gradients (float32 is what the update uses)
    lr_scale: float  # the plateau factor on lr and eps in force for the round
    decoder: np.ndarray | None = None  # float32[n - body]: the delta-rule decoder at the end of the round
    decoder_m: np.ndarray | None = None  # ... and its Adam moments, where the coordinator audits
    decoder_v: np.ndarray | None = None
    decoder_codes: np.ndarray | None = None  # int8[n - body]: the decoder's change, coded (soma_edge.quant)
    decoder_scales: np.ndarray | None = None  # float32[blocks]: ... and its scales

    KEYS: ClassVar = ("start", "grads", "lr_scale", "decoder", "decoder_m", "decoder_v")  # every record's
    CODED_KEYS: ClassVar = ("decoder_codes", "decoder_scales")  # ... and a coded decoder's (protocol 4)

    @property
    def steps(self) -> int:
        return int(self.grads.shape[0])

    def coded(self) -> quant.Coded | None:
        return None if self.decoder_codes is None else quant.Coded(self.decoder_codes, self.decoder_scales)

    def nbytes(self) -> dict[str, int]:
        """Bytes of the body's part (the scalars) and of the decoder's (dense weights and moments, or codes)."""
        parts = (self.decoder, self.decoder_m, self.decoder_v, self.decoder_codes, self.decoder_scales)
        return {"body": int(self.grads.nbytes), "decoder": int(sum(a.nbytes for a in parts if a is not None))}

    def to_record(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.KEYS}
        if self.decoder_codes is not None:
            out.update({k: getattr(self, k) for k in self.CODED_KEYS})
        return out

    @classmethod
    def from_record(cls, rec: Any, where: str = "update log") -> "UpdateLog":
        """Type-check a record (`replay` checks that it fits the state and config); CheckpointError if not."""
        if not isinstance(rec, dict) or set(rec) not in (set(cls.KEYS), set(cls.KEYS) | set(cls.CODED_KEYS)):
            raise CheckpointError(f"{where}: not an update log record")
        g, scale = rec["grads"], rec["lr_scale"]
        if not _count(rec["start"]):
            raise CheckpointError(f"{where}: start {rec['start']!r} is not a step")
        if not isinstance(g, np.ndarray) or g.dtype != np.float32 or g.ndim != 2:
            raise CheckpointError(f"{where}: scalars are not a float32 [steps, directions] array")
        if not isinstance(scale, float) or not (0 < scale <= 1):
            raise CheckpointError(f"{where}: lr scale {scale!r} is not in (0, 1]")
        if not all(_vector(rec[k], np.float32) for k in ("decoder", "decoder_m", "decoder_v")):
            raise CheckpointError(f"{where}: the decoder's weights and moments must be float32 vectors")
        if (rec["decoder_m"] is None) != (rec["decoder_v"] is None):
            raise CheckpointError(f"{where}: the decoder's Adam moments come both, or neither")
        codes, scales = rec.get("decoder_codes"), rec.get("decoder_scales")
        if not (_vector(codes, np.int8) and _vector(scales, np.float32)) or (codes is None) != (scales is None):
            raise CheckpointError(f"{where}: the decoder's codes must be an int8 vector with float32 scales")
        if codes is not None and rec["decoder"] is not None:
            raise CheckpointError(f"{where}: a decoder comes as its codes or as its weights, not both")
        return cls(int(rec["start"]), g, scale, rec["decoder"], rec["decoder_m"], rec["decoder_v"], codes, scales)


def _vector(a: Any, dtype: type) -> bool:
    """None, or a 1-D array of `dtype`."""
    return a is None or (isinstance(a, np.ndarray) and a.dtype == dtype and a.ndim == 1)


def code_decoder(state: State, body: int, base: np.ndarray) -> quant.Coded:
    """Code the delta-rule decoder's change since `base` (its weights when the round started) and adopt
    the coded change: the state's decoder becomes base + decode(codes), what the coordinator rebuilds."""
    coded, adopted = quant.adopt(base, state.weights[body:])
    state.weights[body:] = adopted
    return coded


def record_log(
    start: int,
    lr_scale: float,
    grads: Sequence[np.ndarray],
    state: State | None = None,
    body: int = 0,
    coded: quant.Coded | None = None,
    moments: bool = False,
) -> UpdateLog:
    """The log of the steps whose StepResult.grads are `grads`; with `state` (after them) and `body` < its
    size, the delta-rule decoder too: its `coded` change (code_decoder), or else its float32 weights, and
    with `moments` its Adam moments."""
    g = np.array(grads, dtype=np.float32).reshape(len(grads), -1) if len(grads) else np.zeros((0, 0), np.float32)
    out = UpdateLog(start=int(start), grads=g, lr_scale=float(lr_scale))
    if state is not None and 0 < body < state.weights.size:
        if coded is not None:
            out.decoder_codes, out.decoder_scales = coded
        else:
            out.decoder = state.weights[body:].copy()
        if moments:
            m, v = _moments(state.opt, state.weights.size)
            out.decoder_m, out.decoder_v = m[body:].copy(), v[body:].copy()
    return out


def replay(
    cfg: SPSAConfig,
    state: State,
    log: UpdateLog,
    *,
    seed: int,
    expert: int,
    body: int = 0,
    dense: np.ndarray | None = None,
    shapes: tuple[tuple[int, ...], ...] = (),
) -> State:
    """The state after `log`'s steps from `state` (which is left as it was): the same float32 arithmetic
    in the same order as training, so the weights and optimizer state match the worker's bit for bit.
    ValueError when the log does not fit the state or the config."""
    n = state.weights.size
    dec_n = n - body if 0 < body < n else 0
    delta = cfg.decoder == "delta" and dec_n > 0
    if log.start != state.step:
        raise ValueError(f"the log starts at step {log.start}, the version is at step {state.step}")
    if log.grads.ndim != 2 or (log.steps and log.grads.shape[1] != cfg.directions * cfg.accumulate):
        raise ValueError(
            f"the log holds scalars of shape {list(log.grads.shape)}, each step needs {cfg.directions * cfg.accumulate}"
        )
    if not np.isfinite(log.grads).all():
        raise ValueError("the log holds non-finite scalars")
    out = State(state.weights.copy(), step=state.step, opt=state.opt.copy())
    out.opt.lr_scale = float(log.lr_scale)
    decoder = _logged_decoder(log, state.weights[body:], dec_n) if delta and log.steps else None
    stepper = Stepper(cfg, seed=seed, expert=expert, parallel=1, body=body, dense=dense, shapes=shapes)
    try:
        for g in log.grads:
            stepper.replay(out, g, body_only=delta)
    finally:
        stepper.close()
    if decoder is not None:
        out.weights[body:] = decoder
        m, v = _moments(out.opt, n)  # the decoder's Adam counted its steps: its moments exist, if only as zeros
        if log.decoder_m is not None:  # else the base's stay: the worker holds the exact ones
            m[body:], v[body:] = log.decoder_m, log.decoder_v
    return out


def _logged_decoder(log: UpdateLog, base: np.ndarray, n: int) -> np.ndarray:
    """The decoder a delta-rule log ends at, from its codes (and the base's decoder) or its weights;
    ValueError where the log's decoder part does not fit."""
    moments = (log.decoder_m, log.decoder_v)
    if log.decoder_m is not None and not all(a.shape == (n,) and np.isfinite(a).all() for a in moments):
        raise ValueError(f"a delta-rule log's decoder moments must be finite float32[{n}]")
    if log.decoder_v is not None and (log.decoder_v < 0).any():
        raise ValueError("the decoder's Adam second moment is negative")
    if log.decoder_codes is not None:
        return base + quant.decode(log.coded(), n)
    if not (isinstance(log.decoder, np.ndarray) and log.decoder.shape == (n,) and np.isfinite(log.decoder).all()):
        raise ValueError(f"a delta-rule log needs its decoder: int8 codes, or finite float32[{n}] weights")
    return log.decoder


def _accumulate(acc: np.ndarray, g: float, z: np.ndarray) -> None:
    acc += np.float32(g) * z


def mean_decoder_grad(grads: list[np.ndarray]) -> np.ndarray:
    """The delta rule's gradient of a step: the mean over its minibatches, in batch order."""
    out = np.array(grads[0], dtype=np.float32)
    for g in grads[1:]:
        out += g
    if len(grads) > 1:
        out /= np.float32(len(grads))
    return out


def _as_objectives(objectives: Objective | Sequence[Objective] | LossFn) -> list[Objective]:
    if isinstance(objectives, Objective):
        return [objectives]
    if callable(objectives):
        return [Objective(loss=objectives)]
    return list(objectives)
