"""How a step's projected differences weigh their directions: `spsa.shaping`, read by the host step, the
replay and the audit alike (soma_edge.spsa.stepper), so each applies it to the same raw scalars.

The log keeps the raw g_j = (L+ - L-)/2ε. Shaping maps the step's A·K raw scalars to the weights w_j of
ĝ = (1/AK) Σ w_j z_j, in float64, deterministically (no summation whose order could change the bits):

- none:   w_j = g_j, the plain central-difference estimate (unbiased for the smoothed gradient).
- zscore: w_j = (g_j - mean g) / std g over the step's pairs (EGGROLL's fitness normalization): removes the
          step's common scale, so lr alone sets the step size; biased, like every shaping below.
- sign:   w_j = sign(g_j) (EGGROLL's sign variant): each pair votes with one unit.
- rank:   w_j = the centered rank of g_j among the step's scalars, in [-1/2, 1/2] (OpenAI ES's centered
          ranks, applied to the pair differences, which are all a log keeps): robust to outlying pairs.

zscore and rank need at least two scalars a step (spsa.directions * spsa.accumulate >= 2); config checks that.
"""

from __future__ import annotations

import numpy as np

KINDS = ("none", "zscore", "sign", "rank")


def shape(kind: str, grads: np.ndarray) -> np.ndarray:
    """The weights (float64[A*K]) that the step's raw scalars `grads` give its directions under `kind`."""
    g = np.asarray(grads, dtype=np.float64)
    if kind == "none":
        return g
    if kind == "sign":
        return np.sign(g)
    if g.size < 2:
        raise ValueError(f"spsa.shaping = {kind!r} needs at least 2 scalars a step, got {g.size}")
    if kind == "zscore":
        centered = g - g.mean()
        std = float(np.sqrt(np.mean(centered * centered)))
        return centered / std if std > 0 else np.zeros_like(g)
    if kind == "rank":
        # Equal scalars take ranks in index order (a stable sort), so the ranks follow from the scalars alone.
        ranks = np.empty(g.size, dtype=np.float64)
        ranks[np.argsort(g, kind="stable")] = np.arange(g.size, dtype=np.float64)
        return ranks / (g.size - 1) - 0.5
    raise ValueError(f"unknown spsa.shaping {kind!r} (known: {', '.join(KINDS)})")
