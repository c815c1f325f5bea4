"""Keyed noise: SPSA's directions regenerated from their key (seed, expert, step, k), never stored.

A Rademacher direction is the keyed Philox stream's raw bits (`noise_bits`, one a weight), expanded to ±1
through a table (`expand_bits`, `sign_table`); a sparse probe's mask is drawn from its own stream of the same
key (`probe_mask`), so density never changes the signs; a Gaussian direction is that stream's normals. Rank-1
probes (`rank1_factors`) take a·bᵀ per weight matrix from the first m + n of the key's signs. Devices expand
the same bits through the same tables (soma_edge.expert.population_graph), so z is the host's bit for bit.

The step's estimate Σ_j c_j z_j is summed by `add_rademacher` and `add_rank1` without building any z whole:
every term c·(±1) (times a mask's 1 or 0) is exact in float32, so a table of ±c per direction, or c·a times b
for a rank-1 one, gives `acc += float32(c) * z` bit for bit, and summing a cache-sized block of weights over
every direction in index order keeps each weight's additions in the same order, with acc in cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

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
    crosses to a device, which expands it there (soma_edge.expert.population_graph): 1/32 of z's bytes."""
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


# Bytes of bits a block of `add_rademacher`: 2^19 weights, 2 MiB of float32 for acc and as much for a term;
# 2.8 ms a direction at L on the 2-core EPYC (8192 bytes: 3.1 ms), where expand, multiply, add took 8-20 ms.
BLOCK_BYTES = 1 << 16
_KEEP = keep_table()


def add_rademacher(
    acc: np.ndarray, coefs: Sequence[float], bits: np.ndarray, keep: np.ndarray | None = None, block: int = BLOCK_BYTES
) -> None:
    """acc += Σ_j float32(coefs[j]) · z_j in index order j, z_j Rademacher from its `noise_bits` (bits[j]) and,
    for a sparse probe, its np.packbits'd mask (keep[j]): bit for bit `acc += float32(c) * z` direction by
    direction, `block` bytes of bits (8 weights each) at a time."""
    n = acc.size
    tables = [sign_table() * np.float32(c) for c in coefs]  # row b: byte b's signs times c, each exact
    for s in range(0, (n + 7) // 8, block):
        e = min((n + 7) // 8, s + block)
        lo, hi = s * 8, min(n, e * 8)
        out = acc[lo:hi]
        for j, table in enumerate(tables):
            term = np.take(table, bits[j, s:e], axis=0)  # into a new array: take(out=) measured 1.5-2.4x slower
            if keep is not None:
                term *= np.take(_KEEP, keep[j, s:e], axis=0)  # (c·s)·k is c·(s·k), both exact, zeros' signs alike
            out += term.reshape(-1)[: hi - lo]


def add_rank1(
    acc: np.ndarray, coefs: Sequence[float], factors: Sequence[Sequence[Rank1 | np.ndarray]], block: int = BLOCK_BYTES
) -> None:
    """acc += Σ_j float32(coefs[j]) · z_j in index order j, z_j the rank-1 direction of `factors[j]`
    (`rank1_factors`, over acc's tensors in order): bit for bit `acc += float32(c) * rank1_probe(...)`, since
    (c·a)·b and c·(a·b) are the same exact ±c; a matrix as many rows at a time as make `block` * 8 weights
    (one at least), its terms never whole."""
    at = 0
    for i, first in enumerate(factors[0] if len(factors) else ()):
        if isinstance(first, Rank1):
            m, n = first.a.size, first.b.size
            rows = max(1, (block * 8) // max(1, n))
            mat, tmp = acc[at : at + m * n].reshape(m, n), np.empty((min(rows, m), n), dtype=np.float32)
            scaled = [f[i].a * np.float32(c) for c, f in zip(coefs, factors)]
            for r in range(0, m, rows):
                out = mat[r : r + rows]
                term = tmp[: out.shape[0]]
                for ca, f in zip(scaled, factors):
                    np.multiply(ca[r : r + rows, None], f[i].b[None, :], out=term)
                    out += term
            at += m * n
        else:
            view = acc[at : at + first.size]
            for c, f in zip(coefs, factors):
                view += np.float32(c) * f[i]
            at += first.size


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
