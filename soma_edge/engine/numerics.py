"""How closely two honest evaluations of one loss must agree: one bound, shared by every check that
compares losses from different evaluators or devices (the coordinator's audit of a worker's scalars, the
GPU check of CPU against CUDA losses, batched against one-at-a-time evaluation).
"""

from __future__ import annotations

# δ: the largest relative loss difference between evaluators or devices that soma-edge accepts, for the same
# weights and batch in float32. Two ORT CPU runs that only reduce in another order differ by ~4e-8 on our
# models (one float32 rounding is 6e-8), and a GPU with TF32 off (its rounding, ~5e-4 per product, is why
# TF32 is off) should differ by a few times that; 1e-6 leaves a factor of ~20 above what we measured. It is
# not larger because the audit's tolerance on a scalar g = (L+ - L-)/2ε is δ(|L+| + |L-|)/2ε: at the
# schedule's smallest ε, 1e-5, that is ~0.1 L, about a typical |g| already, so a larger δ would let a worker
# invent most scalars unseen there. A device that differs by more is outside what soma-edge supports.
DELTA = 1e-6

# The relative spacing of float32 numbers near 1: twice the rounding error of one float32 result. Losses come
# out of ORT as float32, and a log carries each scalar as float32 (`spsa.log.UpdateLog.grads`).
FLOAT32_STEP = 2.0**-23
