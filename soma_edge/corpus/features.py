"""The router's featurizer: hashed byte n-gram tf-idf, folded into a small signed sketch.

- every byte n-gram (n = 1..4) of a text is hashed into 2^18 buckets (a fixed multiplicative hash);
- a bucket's weight is (1 + ln count) * idf, the idf fitted on the training documents;
- the 2^18-dimensional vector is folded into `dim` dimensions by a second, signed hash (a count sketch:
  inner products are preserved in expectation, with error ~ 1/sqrt(dim)), then scaled to unit length.
Texts are featurized in blocks (`blocks`), so memory stays bounded on long inputs. The ONNX featurizer of a
deploy bundle (soma_edge.expert.graph.router_features) hashes exactly as this one does.

numpy only: export/ runs it without onnx, flwr or torch.
"""

from __future__ import annotations

import numpy as np

FEATURIZER = "byte-ngram-tfidf-sketch-v1"  # bump when any hashing or weighting detail below changes
BUCKET_BITS = 18
MAX_N = 4
DIM = 2048
BLOCK_BYTES = 2 * 1024 * 1024  # featurize in blocks of about this many bytes (bounds peak memory)
BLOCK_SEGS = 4096  # ... and at most this many texts (at dim 2048: a 64 MiB float64 block)
# Fixed odd 64-bit multipliers (Fibonacci hashing): the n-gram -> bucket hash, and bucket -> (dim, sign);
# public, since the ONNX featurizer (soma_edge.expert.graph.router_features) must hash exactly as this one does.
H_GRAM = np.uint64(0x9E3779B97F4A7C15)
H_DIM = np.uint64(0xC2B2AE3D27D4EB4F)
H_SIGN = np.uint64(0x165667B19E3779F9)


def bucket_counts(buf: np.ndarray, bounds: np.ndarray, bits: int = BUCKET_BITS) -> tuple[np.ndarray, np.ndarray]:
    """(keys, counts) of every (segment, bucket) pair present; key = segment << bits | bucket, sorted.

    Segment s is buf[bounds[s]:bounds[s+1]]; an n-gram counts only if it lies inside one segment. Keys are
    uint32 (a block holds at most 2^(32-bits) segments), which sorts about twice as fast as int64.
    """
    n_seg = bounds.size - 1
    if n_seg > 1 << (32 - bits):
        raise ValueError(f"{n_seg} segments in one block; at most {1 << (32 - bits)}")
    L = buf.size
    seg = np.repeat(np.arange(n_seg, dtype=np.uint32), np.diff(bounds))
    end = bounds[1:][seg]
    keys = []
    gram = np.zeros(L, dtype=np.uint64)
    for n in range(1, MAX_N + 1):
        m = L - n + 1
        if m <= 0:
            break
        # gram[p] = the n bytes at p, big-endian, built from the (n-1)-gram at p.
        gram = (gram[:m] << np.uint64(8)) | buf[n - 1 :].astype(np.uint64)
        ok = np.arange(m) + n <= end[:m]
        h = ((gram[ok] | np.uint64(n << 32)) * H_GRAM) >> np.uint64(64 - bits)
        keys.append((seg[:m][ok] << np.uint32(bits)) | h.astype(np.uint32))
    if not keys:
        return np.zeros(0, np.uint32), np.zeros(0, np.int64)
    k = np.sort(np.concatenate(keys), kind="stable")  # runs sorted by segment: 2.5x faster than the default
    first = np.flatnonzero(np.concatenate([[True], k[1:] != k[:-1]]))
    return k[first], np.diff(np.append(first, k.size))


def sketch(dim: int, bits: int = BUCKET_BITS) -> tuple[np.ndarray, np.ndarray]:
    """Each bucket's (dimension, sign) in the folded space."""
    b = np.arange(1, (1 << bits) + 1, dtype=np.uint64)
    dims = ((b * H_DIM) >> np.uint64(64 - int(dim).bit_length() + 1)).astype(np.int64)
    signs = np.where((b * H_SIGN) >> np.uint64(63), 1.0, -1.0)
    return dims, signs


def weigh(
    keys: np.ndarray, counts: np.ndarray, n_seg: int, idf: np.ndarray, dims: np.ndarray, signs: np.ndarray, dim: int
) -> np.ndarray:
    """Unit-length float32 [n_seg, dim] features from (segment, bucket) counts; an empty segment stays 0."""
    bits = int(idf.size).bit_length() - 1
    seg, bucket = (keys >> bits).astype(np.int64), (keys & ((1 << bits) - 1)).astype(np.int64)
    w = (1.0 + np.log(counts)) * idf[bucket] * signs[bucket]
    x = np.bincount(seg * dim + dims[bucket], weights=w, minlength=n_seg * dim).reshape(n_seg, dim)
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.where(norm > 0, norm, 1.0)).astype(np.float32)


def blocks(lengths: np.ndarray, block_bytes: int = BLOCK_BYTES, max_segs: int = BLOCK_SEGS) -> list[tuple[int, int]]:
    """Consecutive [i, j) runs of segments of about block_bytes each, at least one and at most max_segs
    segments per run (a run's dense [segments, dim] features stay small; uint32 keys need < 2^14)."""
    out, i, n = [], 0, lengths.size
    ends = np.cumsum(lengths)
    while i < n:
        base = ends[i - 1] if i else 0
        j = max(i + 1, int(np.searchsorted(ends, base + block_bytes, side="right")))
        j = min(j, n, i + max_segs)
        out.append((i, j))
        i = j
    return out


def as_array(text: bytes | np.ndarray) -> np.ndarray:
    return text if isinstance(text, np.ndarray) else np.frombuffer(text, dtype=np.uint8)
