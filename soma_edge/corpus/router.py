"""The predetermined router: hashed byte n-gram tf-idf features, balanced k-means, top-k softmax scoring.

Fitted once before training (`fit`), never trained. One featurizer (soma_edge.corpus.features) serves
fitting and inference, so the router is small: the idf table (1 MiB) and C x dim centroids (16 x 2048 floats = 128 KiB).

Documents are clustered by spherical k-means whose assignment step is balanced: a cluster holds at most
the mean bytes plus one document, so every expert gets an equal share of the corpus. Each cluster maps to
one expert; an expert's squared distance to a text is the minimum over its clusters. The stored centroids
are fitted for what inference sees, short contexts: the mean direction of 256-byte windows of each
cluster's documents (see `fit`).

At inference the router scores the context that precedes the bytes being predicted (`route_windows` routes
window i on window i-1, and window 0 on the prior, the experts' share of the corpus), keeps the top-k
experts and weights them by softmax(-d^2 / T), renormalized over the top-k.

numpy and msgpack only: export/ runs it without onnx, flwr or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from soma_edge import codec
from soma_edge.corpus.features import (
    BUCKET_BITS,
    DIM,
    FEATURIZER,
    MAX_N,
    as_array,
    blocks,
    bucket_counts,
    sketch,
    weigh,
)
from soma_edge.corpus.kmeans import N_INIT, SLACK, Progress, balanced_assign, balanced_kmeans, sq_dist
from soma_edge.errors import CodecError, ConfigError

ROUTE_WINDOW = 256  # routing centroids are fitted on windows this long: the kind of context inference sees
ROUTE_WINDOWS_PER_DOC = 16
MAX_FIT_DOCS = 16384  # k-means runs on a seeded sample of at most this many documents; all are assigned
MAX_ROUTER_BYTES = 64 * 1024 * 1024

# (labels [n], d2 float32 [n, C]) -> labels: prepare's quotas, applied to the balanced assignment
Adjust = Callable[[np.ndarray, np.ndarray], np.ndarray]


# ---------------------------------------------------------------- the router


@dataclass
class Router:
    n_experts: int
    idf: np.ndarray  # float32 [2^bucket_bits]
    centroids: np.ndarray  # float32 [C, dim], unit length
    cluster_expert: np.ndarray  # int64 [C]: the expert each cluster feeds
    prior: np.ndarray  # float64 [n_experts]: each expert's share of the corpus bytes (sums to 1)
    temperature: float  # a default T for softmax(-d^2/T), calibrated at fit time (see `fit`)
    seed: int = 0
    bucket_bits: int = BUCKET_BITS

    def __post_init__(self) -> None:
        self._dims, self._signs = sketch(self.dim, self.bucket_bits)

    @property
    def n_clusters(self) -> int:
        return int(self.centroids.shape[0])

    @property
    def dim(self) -> int:
        return int(self.centroids.shape[1])

    # ------------------------------------------------------------ features and distances

    def _feature_blocks(self, texts: Sequence[bytes | np.ndarray]) -> Iterator[tuple[int, int, np.ndarray]]:
        arrays = [as_array(t) for t in texts]
        lengths = np.array([a.size for a in arrays], dtype=np.int64)
        for i, j in blocks(lengths):
            buf = np.concatenate(arrays[i:j]) if j > i + 1 else arrays[i]
            bounds = np.concatenate([[0], np.cumsum(lengths[i:j])])
            keys, counts = bucket_counts(buf, bounds, self.bucket_bits)
            yield i, j, weigh(keys, counts, j - i, self.idf, self._dims, self._signs, self.dim)

    def features(self, texts: Sequence[bytes | np.ndarray]) -> np.ndarray:
        """float32 [n, dim] unit-length features (zero rows for texts without a byte)."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, j, f in self._feature_blocks(texts):
            out[i:j] = f
        return out

    def cluster_distances(self, features: np.ndarray) -> np.ndarray:
        """float64 [n, C] squared distances of unit-length features to the centroids (NaN for zero rows)."""
        # float64: a context's distances must not depend on what else is in the batch (BLAS sums in a
        # batch-dependent order; in float32 that moved routing weights by ~1e-6).
        d2 = np.maximum(2.0 - 2.0 * (features.astype(np.float64) @ self.centroids.T.astype(np.float64)), 0.0)
        d2[~features.any(axis=1)] = np.nan
        return d2

    def _expert_min(self, d2: np.ndarray) -> np.ndarray:
        out = np.full((d2.shape[0], self.n_experts), np.inf)
        for c, e in enumerate(self.cluster_expert.tolist()):
            out[:, e] = np.fmin(out[:, e], d2[:, c])
        out[np.isnan(d2).any(axis=1)] = np.nan
        return out

    def distances(self, contexts: Sequence[bytes | np.ndarray | None]) -> np.ndarray:
        """float64 [n, n_experts]: squared distance of each context to each expert (min over its clusters).

        A None or empty context has no features: its row is NaN, which `route` answers with the prior.
        """
        texts = [b"" if c is None else c for c in contexts]
        out = np.empty((len(texts), self.n_experts))
        for i, j, f in self._feature_blocks(texts):  # block by block: no [n, dim] matrix for long inputs
            out[i:j] = self._expert_min(self.cluster_distances(f))
        return out

    # ------------------------------------------------------------ routing

    def route(self, distances: np.ndarray | None, top_k: int, temperature: float) -> tuple[np.ndarray, np.ndarray]:
        """(experts int64 [n, k], weights float64 [n, k]): the top-k nearest experts, softmax(-d^2/T) weights.

        `distances` None means one context with nothing to go on; it and any NaN row use the prior (the
        k experts with the most data, weighted by their share). Ties go to the lower expert id.
        """
        if not 1 <= top_k <= self.n_experts:
            raise ConfigError(f"top-k must be between 1 and the number of experts ({self.n_experts}), got {top_k}")
        if not (temperature > 0 and np.isfinite(temperature)):
            raise ConfigError(f"router temperature must be a positive number, got {temperature}")
        d = np.full((1, self.n_experts), np.nan) if distances is None else np.asarray(distances, dtype=np.float64)
        if d.ndim != 2 or d.shape[1] != self.n_experts:
            raise ConfigError(f"distances must have shape [n, {self.n_experts}], got {d.shape}")
        no_context = np.isnan(d).any(axis=1)
        # Scores to maximize: -d^2/T for a context, log(prior) without one; argsort is stable, so ties
        # go to the lower id.
        with np.errstate(divide="ignore"):
            scores = np.where(no_context[:, None], np.log(self.prior)[None, :], -d / temperature)
        experts = np.argsort(-scores, axis=1, kind="stable")[:, :top_k]
        top = np.take_along_axis(scores, experts, axis=1)
        top = np.exp(top - top[:, :1])  # the first column is the row max
        return experts.astype(np.int64), top / top.sum(axis=1, keepdims=True)

    def route_windows(
        self, data: bytes | np.ndarray, seq_len: int, top_k: int, temperature: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Route the windows data[i*seq_len:(i+1)*seq_len], i < ceil(len/seq_len), each on the window before it.

        Window 0 has no preceding bytes and uses the prior. A window's own bytes never reach the router.
        """
        if seq_len < 1:
            raise ConfigError(f"seq_len must be >= 1, got {seq_len}")
        data = as_array(data)
        if data.dtype != np.uint8:
            data = data.astype(np.uint8)
        n = -(-data.size // seq_len)
        d = np.full((n, self.n_experts), np.nan)
        if n > 1:
            ctx = data[: (n - 1) * seq_len]  # windows 0..n-2 are the contexts of windows 1..n-1
            d[1:] = self.distances([ctx[i : i + seq_len] for i in range(0, ctx.size, seq_len)])
        return self.route(d, top_k, temperature)

    # ------------------------------------------------------------ storage

    def to_bytes(self) -> bytes:
        body = {
            "featurizer": FEATURIZER,
            "bucket_bits": self.bucket_bits,
            "max_n": MAX_N,
            "n_experts": self.n_experts,
            "idf": np.asarray(self.idf, dtype=np.float32),
            "centroids": np.asarray(self.centroids, dtype=np.float32),
            "cluster_expert": np.asarray(self.cluster_expert, dtype=np.int64),
            "prior": np.asarray(self.prior, dtype=np.float64),
            "temperature": float(self.temperature),
            "seed": int(self.seed),
        }
        return codec.encode(body, "router")

    @classmethod
    def from_bytes(cls, data: bytes, max_bytes: int = MAX_ROUTER_BYTES) -> "Router":
        body = codec.decode(data, "router", max_bytes)
        if not isinstance(body, dict):
            raise CodecError("router message body is not a map")
        if body.get("featurizer") != FEATURIZER or body.get("max_n") != MAX_N:
            raise CodecError(
                f"router featurizer {body.get('featurizer')!r} (max_n {body.get('max_n')!r}) is not this "
                f"soma-edge's {FEATURIZER!r} (max_n {MAX_N}); prepare the corpus again"
            )
        try:
            bits, n = int(body["bucket_bits"]), int(body["n_experts"])
            idf, cent = body["idf"], body["centroids"]
            ce, prior, temp = body["cluster_expert"], body["prior"], float(body["temperature"])
            seed = int(body["seed"])
        except (KeyError, TypeError, ValueError) as e:
            raise CodecError(f"router message lacks or mistypes a field ({e})") from None
        arrays = (idf, cent, ce, prior)
        if not all(isinstance(a, np.ndarray) for a in arrays):
            raise CodecError("router idf, centroids, cluster_expert and prior must be arrays")
        dim = cent.shape[1] if cent.ndim == 2 else 0
        if not 8 <= bits <= 24:  # before anything sized by it
            raise CodecError(f"malformed router: bucket_bits {bits} outside 8..24")
        problems = [
            (idf.shape != (1 << bits,), f"idf has shape {idf.shape}, expected ({1 << bits},)"),
            (cent.ndim != 2 or cent.shape[0] < 1 or dim < 2 or dim & (dim - 1), f"centroids have shape {cent.shape}"),
            (n < 1 or prior.shape != (n,), f"prior has shape {prior.shape} for {n} experts"),
            (ce.shape != (cent.shape[0],), f"cluster_expert has shape {ce.shape} for {cent.shape[0]} clusters"),
            (ce.size and (ce.min() < 0 or ce.max() >= n), "cluster_expert names an expert out of range"),
            (set(ce.tolist()) != set(range(n)), "some expert has no cluster"),
            (not (np.all(np.isfinite(idf)) and np.all(np.isfinite(cent))), "non-finite idf or centroids"),
            (not (np.all(prior >= 0) and abs(prior.sum() - 1) < 1e-6), "prior is not a distribution"),
            (not (temp > 0 and np.isfinite(temp)), f"temperature {temp} is not positive"),
        ]
        for bad, what in problems:
            if bad:
                raise CodecError(f"malformed router: {what}")
        return cls(
            n,
            idf.astype(np.float32),
            cent.astype(np.float32),
            ce.astype(np.int64),
            prior.astype(np.float64),
            temp,
            seed,
            bits,
        )


def load(path: str | Path) -> Router:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CodecError(f"{path}: cannot read the router ({e.strerror})") from None
    try:
        return Router.from_bytes(data)
    except CodecError as e:
        raise CodecError(f"{path}: {e}") from None


def _map_clusters(cent: np.ndarray, n_experts: int, seed: int) -> np.ndarray:
    """Clusters to experts: cluster k to expert k when C = N; otherwise similar clusters share an expert
    (balanced k-means over the unit centroids, at most ceil(C/N) clusters per expert), so that each
    expert still specializes."""
    c = cent.shape[0]
    if c == n_experts:
        return np.arange(c, dtype=np.int64)
    cap = -(-c // n_experts)
    _, groups, _ = balanced_kmeans(cent, np.ones(c), n_experts, seed, cap=cap)
    for e in range(n_experts):  # an expert left without a cluster takes one from the expert with the most
        if not np.any(groups == e):
            donor = int(np.argmax(np.bincount(groups, minlength=n_experts)))
            groups[int(np.flatnonzero(groups == donor)[-1])] = e
    return groups.astype(np.int64)


def fit(
    texts: Sequence[bytes],
    n_experts: int,
    n_clusters: int | None = None,
    seed: int = 0,
    dim: int = DIM,
    fit_on: Sequence[int] | None = None,
    progress: Progress | None = None,
    adjust: Adjust | None = None,
) -> tuple[Router, np.ndarray]:
    """Fit the router; returns it and every document's cluster (the balanced assignment).

    The router learns only from the documents `fit_on` (default all; prepare passes the train split, so
    held-out text never shapes the router that will route it). Steps:
    1. idf and document features on (a seeded sample of at most MAX_FIT_DOCS of) those documents;
    2. balanced k-means on the document features;
    3. every document, held-out ones included, assigned to a cluster with the same byte cap, then moved
       by `adjust` if given (prepare gives every cluster its quota of text: corpus.holdout);
    4. routing centroids: the mean direction of ROUTE_WINDOW-byte windows of each cluster's documents.
       Inference scores short contexts, and a short context is far from every whole-document centroid
       (measured: 128-byte contexts matched their document's expert 49% of the time against document
       centroids, 87% against window centroids, on four domains).
    Deterministic for a given seed: the sample, the k-means++ draws and every tie are fixed.
    """
    n_docs = len(texts)
    c = n_clusters or n_experts
    pool = np.arange(n_docs) if fit_on is None else np.unique(np.asarray(fit_on, dtype=np.int64))
    _check_fit(n_experts, c, pool.size, dim)
    report = progress or (lambda phase, done, total: None)
    lengths = np.array([len(t) for t in texts], dtype=np.int64)
    rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([seed, 0xF17])))
    sample = pool if pool.size <= MAX_FIT_DOCS else np.sort(rng.choice(pool, MAX_FIT_DOCS, replace=False))

    # 1. idf and features of the sample; the router's clusters, map and prior are placeholders until 4.
    router, x = _sample_features(texts, lengths, sample, n_experts, c, dim, seed, report)

    # 2. balanced k-means on whole documents.
    report("k-means", 0, N_INIT)
    doc_cent, _, _ = balanced_kmeans(x, lengths[sample], c, seed, progress=report)

    # 3. every document to a cluster, under the same byte cap.
    labels = _assign_documents(router, texts, lengths, sample, x, doc_cent, report, adjust)

    # 4. routing centroids from windows of the sample documents.
    router.centroids = _window_centroids(router, texts, sample, labels, doc_cent, report)
    sizes = np.bincount(labels, weights=lengths, minlength=c)
    router.cluster_expert = _map_clusters(doc_cent, n_experts, seed)
    prior = np.bincount(router.cluster_expert, weights=sizes, minlength=n_experts)
    router.prior = prior / prior.sum()
    router.temperature = _calibrate(router, texts, sample, rng)
    return router, labels


def _check_fit(n_experts: int, c: int, pool: int, dim: int) -> None:
    if n_experts < 1:
        raise ConfigError(f"experts must be >= 1, got {n_experts}")
    if c < n_experts:
        raise ConfigError(f"clusters ({c}) must be >= experts ({n_experts}): every expert needs a cluster")
    if c > pool:
        raise ConfigError(f"{c} clusters need at least {c} documents to fit on, there are {pool}")
    if dim < 2 or dim & (dim - 1):
        raise ConfigError(f"router dim must be a power of two >= 2, got {dim}")


def _sample_features(
    texts: Sequence[bytes],
    lengths: np.ndarray,
    sample: np.ndarray,
    n_experts: int,
    c: int,
    dim: int,
    seed: int,
    report: Progress,
) -> tuple[Router, np.ndarray]:
    """A router with the sample's idf (its clusters still zero), and the sample's features [sample, dim]."""
    bits = BUCKET_BITS
    # (document, bucket) counts of the sample, kept for the idf and then the features.
    counted, done, total = [], 0, int(lengths[sample].sum())
    for i, j in blocks(lengths[sample]):
        bounds = np.concatenate([[0], np.cumsum(lengths[sample[i:j]])])
        buf = np.frombuffer(b"".join(texts[k] for k in sample[i:j].tolist()), dtype=np.uint8)
        counted.append((i, j, *bucket_counts(buf, bounds, bits)))
        done += int(bounds[-1])
        report("features", done, total)
    df = np.zeros(1 << bits, dtype=np.int64)
    for _, _, keys, _ in counted:
        df += np.bincount((keys & ((1 << bits) - 1)).astype(np.int64), minlength=1 << bits)
    idf = (np.log((1.0 + sample.size) / (1.0 + df)) + 1.0).astype(np.float32)
    router = Router(
        n_experts,
        idf,
        np.zeros((c, dim), np.float32),
        np.zeros(c, np.int64),
        np.full(n_experts, 1.0 / n_experts),
        1.0,
        seed,
        bits,
    )
    x = np.zeros((sample.size, dim), dtype=np.float32)
    for i, j, keys, counts in counted:
        x[i:j] = weigh(keys, counts, j - i, idf, router._dims, router._signs, dim)
    return router, x


def _assign_documents(
    router: Router,
    texts: Sequence[bytes],
    lengths: np.ndarray,
    sample: np.ndarray,
    x: np.ndarray,
    doc_cent: np.ndarray,
    report: Progress,
    adjust: Adjust | None,
) -> np.ndarray:
    """Every document's cluster (held-out ones too), balanced under a byte cap; no cluster left empty.
    Sets the router's centroids to `doc_cent` to featurize the documents outside the sample."""
    n_docs, c = len(texts), doc_cent.shape[0]
    d2 = np.empty((n_docs, c), dtype=np.float32)
    d2[sample] = sq_dist(x, doc_cent)
    rest = np.setdiff1d(np.arange(n_docs), sample)
    router.centroids = doc_cent
    for i in range(0, rest.size, 1024):
        part = rest[i : i + 1024]
        d2[part] = sq_dist(router.features([texts[k] for k in part.tolist()]), doc_cent)
        report("assign", i + part.size, rest.size)
    mean = lengths.sum() / c
    labels = balanced_assign(d2, lengths.astype(np.float64), max(SLACK * mean, mean + lengths.max()))
    for k in range(c):  # an empty cluster would leave an expert without data: give it its nearest document
        if not np.any(labels == k):
            movable = np.bincount(labels, minlength=c)[labels] > 1
            labels[int(np.argmin(np.where(movable, d2[:, k], np.inf)))] = k
    return labels if adjust is None else adjust(labels, d2)


def _window_centroids(
    router: Router,
    texts: Sequence[bytes],
    docs: np.ndarray,
    labels: np.ndarray,
    fallback: np.ndarray,
    report: Progress,
) -> np.ndarray:
    """Unit mean direction of the features of up to ROUTE_WINDOWS_PER_DOC evenly spaced ROUTE_WINDOW-byte
    windows of each document, per cluster (float64 sums in a fixed order: deterministic)."""
    c, w = fallback.shape[0], ROUTE_WINDOW
    wins, owner = [], []
    for k in docs.tolist():
        t = texts[k]
        n = max(1, len(t) // w)
        for s in np.unique(np.linspace(0, n - 1, min(n, ROUTE_WINDOWS_PER_DOC)).round().astype(np.int64)).tolist():
            wins.append(t[s * w : (s + 1) * w])
            owner.append(labels[k])
    owner = np.asarray(owner)
    sums = np.zeros((c, router.dim), dtype=np.float64)
    step = 2048  # windows per features() call: bounds the [step, dim] feature block
    for i in range(0, len(wins), step):
        f = router.features(wins[i : i + step])
        lab = owner[i : i + step]
        for k in np.unique(lab).tolist():
            sums[k] += f[lab == k].sum(axis=0, dtype=np.float64)
        report("routing", min(i + step, len(wins)), len(wins))
    norm = np.linalg.norm(sums, axis=1, keepdims=True)
    out = np.where(norm > 0, sums / np.where(norm > 0, norm, 1.0), fallback)
    return out.astype(np.float32)


def _calibrate(router: Router, texts: Sequence[bytes], sample: np.ndarray, rng: np.random.Generator) -> float:
    """A default temperature: on ROUTE_WINDOW-byte contexts from the corpus, the median gap between the
    nearest and second-nearest expert's d^2 becomes a weight ratio of e (top-1 leads, top-2 still mixes)."""
    if router.n_experts < 2:
        return 1.0
    picks = rng.choice(sample, size=min(512, sample.size), replace=False)
    ctx = []
    for k in np.sort(picks).tolist():
        t = texts[k]
        start = int(rng.integers(0, max(1, len(t) - ROUTE_WINDOW)))
        ctx.append(t[start : start + ROUTE_WINDOW])
    d = np.sort(router.distances(ctx), axis=1)
    gap = d[:, 1] - d[:, 0]
    gap = gap[np.isfinite(gap)]
    t = float(np.median(gap)) if gap.size else 1.0
    return t if t > 0 else 1.0
