"""Text for every expert at any N: the quotas `prepare` guarantees, and held-out windows cut within documents.

The corpus is split by document (corpus.documents.split_of): about 5% of documents are val and 5% test. With
a few documents per cluster (the default corpus holds ~3 per cluster at N = 256), most clusters then get no
held-out document at all. The SOMA paper splits each shard by sequence instead; so does prepare, where it must:

- every cluster is guaranteed `Quota.train_bytes` of training text and HELD_OUT_WINDOWS val and as many test
  windows of seq_len + 1 bytes (the coordinator judges every version on its own expert's val windows);
- a train document may set aside its last windows (`reserve`, at most 1/RESERVE_SHARE of it) for held-out
  use. Set-aside bytes are left out of the router's fit, so val and test bytes never shape the router; the
  windows a cluster does not need go back to its train shard;
- a window is cut whole, at a window boundary, so none reaches two splits.
- a cluster's val documents weigh at most 1/HEAVY_VAL_SHARE of its train text. Heavier (a small cluster that
  one large val document routed to), they join its train text and its val windows are cut from the end of
  the largest of them (`heavy_val`): its expert is judged on text of its own documents, as the paper's split
  by sequence does, not on a document that outweighs what it trains on. Test documents always stay test.

`shortfall` says what each cluster lacks, `rebalance` moves documents to clusters that lack text (the nearest
first, never from a cluster that would then lack), and `cut` takes each cluster's missing windows from the
ends of its train documents. numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from soma_edge.errors import CorpusError

HELD_OUT_WINDOWS = 8  # val windows, and test windows, every expert gets
TRAIN_WINDOWS = 32  # train text every expert gets, in windows of seq_len + 1 bytes (4,128 bytes at 128)
RESERVE_SHARE = 4  # a train document sets aside at most this fraction (1/4) of its bytes for held-out windows
HEAVY_VAL_SHARE = 4  # a cluster's val documents weigh at most 1/4 of its train text, or they join it (heavy_val)
SEPARATOR_BYTES = 2  # len(corpus.documents.SEPARATOR), the bytes between two documents of a shard


@dataclass(frozen=True)
class Quota:
    """What prepare guarantees each cluster, for windows of `seq_len` predictions."""

    seq_len: int

    @property
    def window(self) -> int:
        return self.seq_len + 1

    @property
    def train_bytes(self) -> int:
        return TRAIN_WINDOWS * self.window

    @property
    def per_expert(self) -> int:
        """Corpus bytes one expert needs: its train text and its val and test windows."""
        return self.train_bytes + 2 * HELD_OUT_WINDOWS * self.window

    def stream_windows(self, n_bytes: np.ndarray | int) -> np.ndarray:
        """Held-out windows in a stream of n_bytes, as corpus.documents.eval_windows cuts them."""
        n = np.asarray(n_bytes, dtype=np.int64)
        return np.where(n > self.seq_len, (n - 1) // self.seq_len, 0)

    def reserve(self, lengths: np.ndarray) -> np.ndarray:
        """Windows each (train) document of `lengths` bytes sets aside for held-out use."""
        per_doc = (np.asarray(lengths, dtype=np.int64) // RESERVE_SHARE) // self.window
        return np.minimum(per_doc, 2 * HELD_OUT_WINDOWS)


@dataclass(frozen=True)
class Docs:
    """The documents as prepare sees them: their bytes, split, and windows set aside (0 for held-out ones)."""

    lengths: np.ndarray  # int64 [n]
    split: np.ndarray  # int64 [n]: 0 train, 1 val, 2 test
    reserved: np.ndarray  # int64 [n]: windows set aside at the end of each train document

    @classmethod
    def of(cls, lengths: list[int], splits: list[str], quota: Quota | None) -> "Docs":
        """`quota` None: nothing set aside (the plain document split)."""
        ln = np.asarray(lengths, dtype=np.int64)
        sp = np.asarray([("train", "val", "test").index(s) for s in splits], dtype=np.int64)
        reserved = np.zeros_like(ln) if quota is None else np.where(sp == 0, quota.reserve(ln), 0)
        return cls(ln, sp, reserved)


@dataclass(frozen=True)
class Shortfall:
    """Per cluster: train bytes below the quota, and held-out windows that neither its held-out documents nor
    its set-aside windows can supply (both 0 where the cluster has what it needs)."""

    train: np.ndarray  # int64 [C]
    held_out: np.ndarray  # int64 [C]

    @property
    def short(self) -> np.ndarray:
        return (self.train > 0) | (self.held_out > 0)


def _stream_bytes(docs: Docs, labels: np.ndarray, split: int, c: int) -> np.ndarray:
    """Bytes of each cluster's joined `split` shard (documents plus the separators between them)."""
    mask = docs.split == split
    total = np.bincount(labels[mask], weights=docs.lengths[mask], minlength=c).astype(np.int64)
    count = np.bincount(labels[mask], minlength=c)
    return total + SEPARATOR_BYTES * np.maximum(count - 1, 0)


def needed_windows(docs: Docs, labels: np.ndarray, c: int, quota: Quota) -> tuple[np.ndarray, np.ndarray]:
    """(val, test) int64 [C]: windows each cluster's held-out documents fall short of HELD_OUT_WINDOWS by."""
    val = quota.stream_windows(_stream_bytes(docs, labels, 1, c))
    test = quota.stream_windows(_stream_bytes(docs, labels, 2, c))
    return np.maximum(HELD_OUT_WINDOWS - val, 0), np.maximum(HELD_OUT_WINDOWS - test, 0)


def shortfall(docs: Docs, labels: np.ndarray, c: int, quota: Quota) -> Shortfall:
    train_mask = docs.split == 0
    kept = docs.lengths - docs.reserved * quota.window  # the train bytes left if every reserve were used
    train = np.bincount(labels[train_mask], weights=kept[train_mask], minlength=c).astype(np.int64)
    flex = np.bincount(labels[train_mask], weights=docs.reserved[train_mask], minlength=c).astype(np.int64)
    val, test = needed_windows(docs, labels, c, quota)
    return Shortfall(np.maximum(quota.train_bytes - train, 0), np.maximum(val + test - flex, 0))


def _deficit(s: Shortfall, quota: Quota) -> np.ndarray:
    """One number per cluster to drive down: missing train text and missing held-out text, in windows."""
    return -(-s.train // quota.window) + s.held_out


def rebalance(docs: Docs, labels: np.ndarray, d2: np.ndarray, quota: Quota) -> np.ndarray:
    """Labels where no cluster falls short: a short cluster takes, one at a time, the nearest document (by d2,
    [n, C]) that lowers its deficit from a cluster that does not fall short without it. Deterministic."""
    labels = labels.copy()
    c = d2.shape[1]
    moves = int(_deficit(shortfall(docs, labels, c, quota), quota).sum())  # each move lowers the total by >= 1
    for _ in range(moves + 1):
        deficit = _deficit(shortfall(docs, labels, c, quota), quota)
        if not deficit.any():
            return labels
        k = int(np.argmax(deficit))  # the cluster that lacks most (ties: the lowest id)
        best = _best_move(docs, labels, d2, k, deficit[k], quota)
        if best is None:
            raise CorpusError(
                f"cannot give cluster {k} {quota.train_bytes} train bytes and {HELD_OUT_WINDOWS} val and test "
                f"windows of {quota.window} bytes without leaving another short: use fewer experts"
            )
        labels[best] = k
    raise CorpusError("rebalancing the clusters did not settle (a bug)")


def _best_move(docs: Docs, labels: np.ndarray, d2: np.ndarray, k: int, need: int, quota: Quota) -> int | None:
    """The nearest document outside cluster k whose move lowers k's deficit and leaves its own cluster whole."""
    c = d2.shape[1]
    order = np.argsort(np.where(labels == k, np.inf, d2[:, k]), kind="stable")
    for j in order.tolist():
        if labels[j] == k or not np.isfinite(d2[j, k]):
            break
        trial = labels.copy()
        trial[j] = k
        after = _deficit(shortfall(docs, trial, c, quota), quota)
        if after[k] < need and after[labels[j]] == 0:
            return j
    return None


@dataclass(frozen=True)
class Cut:
    """A document's last `windows` windows, given to held-out splits (the first `val` of them to val), the
    rest of it to train: a train document's reserve (`cut`), or a val document that joins train (`heavy_val`,
    possibly with 0 windows)."""

    doc: int
    windows: int
    val: int


def cut(docs: Docs, labels: np.ndarray, c: int, quota: Quota) -> list[Cut]:
    """The windows each cluster takes from the ends of its train documents (in document order) to reach
    HELD_OUT_WINDOWS val and test windows; a document gives at most what it set aside."""
    need_val, need_test = needed_windows(docs, labels, c, quota)
    out = []
    for k in np.flatnonzero(need_val + need_test).tolist():
        val, test = int(need_val[k]), int(need_test[k])
        for j in np.flatnonzero((labels == k) & (docs.split == 0) & (docs.reserved > 0)).tolist():
            take = min(int(docs.reserved[j]), val + test)
            out.append(Cut(j, take, min(take, val)))
            val, test = max(val - take, 0), test - max(take - val, 0)
            if val + test == 0:
                break
        if val + test:
            raise CorpusError(f"cluster {k} lacks {val + test} held-out windows after rebalancing (a bug)")
    return sorted(out, key=lambda x: x.doc)


def heavy_val(docs: Docs, labels: np.ndarray, c: int, quota: Quota) -> list[Cut]:
    """Where a cluster's val documents weigh more than 1/HEAVY_VAL_SHARE of its train documents, they all join
    its train text, the largest giving its last HELD_OUT_WINDOWS windows to val (no more than a quarter of it;
    where it is too short, the cluster stays as it is). None of them was in the router's fit, which sees train
    documents only."""
    train = np.bincount(labels[docs.split == 0], weights=docs.lengths[docs.split == 0], minlength=c)
    val = np.bincount(labels[docs.split == 1], weights=docs.lengths[docs.split == 1], minlength=c)
    out = []
    for k in np.flatnonzero(val * HEAVY_VAL_SHARE > train).tolist():
        members = np.flatnonzero((labels == k) & (docs.split == 1)).tolist()
        big = max(members, key=lambda j: (int(docs.lengths[j]), -j))
        if docs.lengths[big] < RESERVE_SHARE * HELD_OUT_WINDOWS * quota.window:
            continue
        out += [Cut(j, HELD_OUT_WINDOWS, HELD_OUT_WINDOWS) if j == big else Cut(j, 0, 0) for j in members]
    return out
