"""A float32 change sent as int8 codes with a float32 scale per block of BLOCK values, which both sides
then adopt.

The delta-rule decoder is dense: its round of updates cannot be replayed from scalars, so a log reply
carries it. Sent as the change from the version the round started at, in int8 codes per block of BLOCK
values, it costs 1 + 4/BLOCK bytes a weight instead of 4 (and its Adam moments stay on the worker, see
spsa.log.UpdateLog). The coded change is lossy, so the worker adopts what the coordinator rebuilds, base +
decode(codes), as its own weights (the version's hash is of those) and trains on from there. What the codes
leave out is not fed back into the next round: each round's error is then bounded by its own codes
(`error_bound`, half a code step), which the coordinator's audit of the decoder can allow for, and Adam's
steps, of about equal size across a block's weights, leave few of them below a code step.

decode is numpy float32 arithmetic with one rounding per value (codes times scale), the same on every
machine, so the coordinator's rebuild equals the worker's adopted weights bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

BLOCK = 256  # values per scale: 1.6% overhead; a block shares its largest |value| as the code's range
LEVELS = 127  # codes in [-127, 127], symmetric, so that a zero change is coded exactly


class Coded(NamedTuple):
    codes: np.ndarray  # int8 [n]
    scales: np.ndarray  # float32 [ceil(n / BLOCK)]: a block's value per unit code


def blocks(n: int) -> int:
    return -(-n // BLOCK)


def encode(change: np.ndarray) -> Coded:
    """The codes of float32 `change` (1-D): per block, scale = max |value| / LEVELS and codes = round(value /
    scale), clipped to ±LEVELS; an all-zero block has scale 0 and codes 0."""
    x = np.asarray(change, dtype=np.float32)
    if x.ndim != 1 or not np.isfinite(x).all():
        raise ValueError("a coded change is a finite float32 vector")
    n = x.size
    padded = np.zeros(blocks(n) * BLOCK, np.float32)
    padded[:n] = x
    rows = padded.reshape(-1, BLOCK)
    scales = (np.max(np.abs(rows), axis=1) / np.float32(LEVELS)).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1))
    codes = np.clip(np.rint(rows / safe[:, None]), -LEVELS, LEVELS).astype(np.int8)
    return Coded(codes.reshape(-1)[:n], scales)


def decode(coded: Coded, n: int) -> np.ndarray:
    """The float32 change `coded` stands for, of length n; ValueError when the arrays do not fit n."""
    codes, scales = coded
    if codes.dtype != np.int8 or codes.shape != (n,):
        raise ValueError(f"codes must be int8[{n}], got {codes.dtype}{list(codes.shape)}")
    if scales.dtype != np.float32 or scales.shape != (blocks(n),):
        raise ValueError(f"scales must be float32[{blocks(n)}], got {scales.dtype}{list(scales.shape)}")
    if not np.isfinite(scales).all() or (scales < 0).any():
        raise ValueError("scales must be finite and not negative")
    if (codes == -128).any():
        raise ValueError(f"codes must lie in [-{LEVELS}, {LEVELS}]")
    per = np.repeat(scales, BLOCK)[:n]
    return codes.astype(np.float32) * per


def error_bound(coded: Coded, n: int) -> np.ndarray:
    """Per value, the most |change - decode(coded)| can be for the change `coded` was made from: half a
    code step, plus float32 rounding of the division and the product."""
    return np.repeat(coded.scales, BLOCK)[:n].astype(np.float64) * (0.5 + 1e-6)


def adopt(base: np.ndarray, end: np.ndarray) -> tuple[Coded, np.ndarray]:
    """A round's change of one float32 vector from `base` to `end`: (its codes, the vector both sides adopt,
    base + decode(codes))."""
    coded = encode((end - base).astype(np.float32))
    return coded, base + decode(coded, base.size)
