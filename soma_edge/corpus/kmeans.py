"""Balanced spherical k-means: the router's clustering, over unit-length features.

The assignment step is balanced: a cluster holds at most `cap` weight (bytes, for documents), so every
expert gets an equal share of the corpus; rows are placed in order of regret, surest first. Seeding is
greedy k-means++; the best of `n_init` restarts wins. float64 sums: the result does not depend on BLAS
threading.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

SLACK = 1.0  # balanced k-means: a cluster holds at most max(SLACK x mean, mean + largest document) bytes
N_INIT = 8  # k-means restarts; the lowest objective wins (it tracks purity closely, and a restart is cheap)

Progress = Callable[[str, int, int], None]  # (phase, done, total)


def balanced_assign(d2: np.ndarray, weight: np.ndarray, cap: float) -> np.ndarray:
    """Each row to its nearest cluster that still has room for its weight; surest rows choose first.

    Rows are taken in order of regret (second-nearest minus nearest distance), so a document that clearly
    belongs somewhere gets there, and the ambiguous ones fill the space left over.
    """
    n, c = d2.shape
    if c == 1:
        return np.zeros(n, dtype=np.int64)
    part = np.sort(d2, axis=1)
    order = np.argsort(-(part[:, 1] - part[:, 0]), kind="stable")
    prefs = np.argsort(d2, axis=1, kind="stable")
    load = np.zeros(c)
    labels = np.empty(n, dtype=np.int64)
    for i in order.tolist():
        w = weight[i]
        for k in prefs[i].tolist():
            if load[k] + w <= cap:
                break
        else:  # cannot happen with cap >= mean + max weight; kept as a safe fallback
            k = int(np.argmin(load))
        labels[i] = k
        load[k] += w
    return labels


def centroids(x: np.ndarray, labels: np.ndarray, c: int) -> np.ndarray:
    """Unit-length mean direction of each cluster (float64 sums: independent of BLAS threading)."""
    out = np.zeros((c, x.shape[1]), dtype=np.float64)
    for k in range(c):
        members = x[labels == k]
        if members.shape[0]:
            out[k] = members.sum(axis=0, dtype=np.float64)
    norm = np.linalg.norm(out, axis=1, keepdims=True)
    return (out / np.where(norm > 0, norm, 1.0)).astype(np.float32)


def sq_dist(x: np.ndarray, cent: np.ndarray) -> np.ndarray:
    return np.maximum(2.0 - 2.0 * (x @ cent.T), 0.0)


def kmeanspp(x: np.ndarray, c: int, rng: np.random.Generator) -> np.ndarray:
    """Greedy k-means++ seeding: of 2 + ln(c) candidates drawn by d^2, keep the one that lowers the cost most."""
    n, trials = x.shape[0], 2 + int(np.log(c))
    idx = [int(rng.integers(n))]
    best = sq_dist(x, x[idx])[:, 0].astype(np.float64)
    for _ in range(1, c):
        total = best.sum()
        p = best / total if total > 0 else None
        cand = rng.choice(n, size=trials, p=p)
        costs = np.minimum(best[None, :], sq_dist(x, x[cand]).T)  # [trials, n]
        pick = int(np.argmin(costs.sum(axis=1)))
        idx.append(int(cand[pick]))
        best = costs[pick]
    return x[idx].copy()


def balanced_kmeans(
    x: np.ndarray,
    weight: np.ndarray,
    c: int,
    seed: int,
    n_init: int = N_INIT,
    iters: int = 30,
    cap: float | None = None,
    progress: Progress | None = None,
) -> tuple[np.ndarray, np.ndarray, float]:
    """Spherical k-means with the balanced assignment above: (centroids, labels, objective), best of n_init.

    A cluster holds at most `cap` weight (default: max(SLACK x mean, mean + the largest weight))."""
    weight = np.asarray(weight, dtype=np.float64)
    mean = weight.sum() / c
    if cap is None:
        cap = max(SLACK * mean, mean + weight.max())
    best = None
    for trial in range(n_init):
        rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([seed, trial, 0xC1])))
        cent = kmeanspp(x, c, rng)
        labels = np.full(x.shape[0], -1)
        for _ in range(iters):
            d2 = sq_dist(x, cent)
            new = balanced_assign(d2, weight, cap)
            if np.array_equal(new, labels):
                break
            labels = new
            cent = centroids(x, labels, c)
            for k in np.flatnonzero(np.bincount(labels, minlength=c) == 0).tolist():
                # An empty cluster restarts at the document farthest from its own centroid.
                far = int(np.argmax(d2[np.arange(x.shape[0]), labels]))
                cent[k] = x[far]
        objective = float((weight * sq_dist(x, cent)[np.arange(x.shape[0]), labels]).sum())
        if best is None or objective < best[2]:
            best = (cent, labels, objective)
        if progress:
            progress("k-means", trial + 1, n_init)
    return best
