"""A corpus as labelled documents: the train/val/test split by content hash, byte streams, and the
minibatches and held-out windows cut from them.

Long texts are cut at line boundaries into documents of at most CHUNK bytes (`chunk`), so that the split and
the router's clusters work on many documents rather than a few plays. Where documents come from:
soma_edge.corpus.sources.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from soma_edge.errors import CorpusError

CHUNK = 16 * 1024
SPLITS = ("train", "val", "test")
_SPLIT_PERMILLE = (900, 950)  # train < 900 <= val < 950 <= test
SEPARATOR = b"\n\n"


@dataclass(frozen=True)
class Document:
    name: str
    domain: str
    text: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text).hexdigest()

    @property
    def split(self) -> str:
        return split_of(self.text)


def split_of(text: bytes) -> str:
    """train / val / test by content hash: stable across machines, orderings and corpus growth."""
    bucket = int.from_bytes(hashlib.sha256(text).digest()[:8], "big") % 1000
    return "train" if bucket < _SPLIT_PERMILLE[0] else "val" if bucket < _SPLIT_PERMILLE[1] else "test"


def chunk(text: bytes, size: int = CHUNK) -> list[bytes]:
    """Cut at line boundaries into pieces of at most `size` bytes (a longer line is cut hard)."""
    out, start = [], 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            nl = text.rfind(b"\n", start, end)
            if nl > start:
                end = nl + 1
        out.append(text[start:end])
        start = end
    return [c for c in out if c.strip()]


def by_split(docs: list[Document]) -> dict[str, list[Document]]:
    out: dict[str, list[Document]] = {s: [] for s in SPLITS}
    for d in docs:
        out[d.split].append(d)
    return out


def to_stream(docs: list[Document]) -> np.ndarray:
    """Concatenate documents into one uint8 byte stream."""
    return np.frombuffer(SEPARATOR.join(d.text for d in docs), dtype=np.uint8)


def unigram_entropy(data: np.ndarray, eval_data: np.ndarray | None = None) -> float:
    """Cross-entropy (nats/byte) of `eval_data` (default: `data`) under `data`'s byte unigram, add-one smoothed."""
    counts = np.bincount(data, minlength=256).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    target = data if eval_data is None else eval_data
    freq = np.bincount(target, minlength=256).astype(np.float64)
    return float(-(freq * logp).sum() / freq.sum())


def batch_rng(seed: int, expert: int, step: int, part: int = 0) -> np.random.Generator:
    """Minibatch positions for (seed, expert, step) and, with accumulation, the step's `part`-th batch:
    a step's batches are as replayable as its noise."""
    key = [seed, expert, step, 0xDA7A] + ([part] if part else [])
    return np.random.Generator(np.random.Philox(np.random.SeedSequence(key)))


def sample_batch(data: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) int64 [batch, seq_len] windows from a byte stream, y shifted by one byte."""
    if data.size < seq_len + 1:
        raise CorpusError(f"data has {data.size} bytes, fewer than seq_len + 1 = {seq_len + 1}")
    starts = rng.integers(0, data.size - seq_len, size=batch)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    win = data[idx].astype(np.int64)
    return win[:, :-1], win[:, 1:]


def eval_windows(data: np.ndarray, seq_len: int, max_windows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping (x, y) windows covering `data` in order, for held-out evaluation."""
    n = (data.size - 1) // seq_len
    if max_windows is not None and n > max_windows:
        # Evenly spaced windows: a deterministic sample spanning the whole split.
        starts = np.linspace(0, data.size - seq_len - 1, max_windows).astype(np.int64)
    else:
        starts = np.arange(n, dtype=np.int64) * seq_len
    if starts.size == 0:
        raise CorpusError(f"data has {data.size} bytes, fewer than seq_len + 1 = {seq_len + 1}")
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    win = data[idx].astype(np.int64)
    return win[:, :-1], win[:, 1:]
