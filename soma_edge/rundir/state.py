"""The typed records of a run directory's state files: state.msgpack (the round, each expert's versions, the
guard's bars) and prepare.json (the router's summary and each cluster's shards). Each is a
soma_edge.records.Record: it reads and writes the same bytes, and reads what older runs wrote.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from soma_edge import records
from soma_edge.corpus.documents import SPLITS
from soma_edge.errors import CheckpointError, ConfigError
from soma_edge.records import Record

STATE_KIND = "run_state"
EXPERT_KIND = "expert"
LOG_KIND = "expert_log"


@dataclass(kw_only=True)
class BestVersion(Record):
    """An expert's best version so far (lowest val loss): what the guard bounds replies by, what export takes."""

    version: int
    sha256: str
    path: str
    val_loss: float

    KEYS: ClassVar = ("version", "sha256", "path", "val_loss")

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "BestVersion":
        return records.read(cls, d, where)

    def to_dict(self) -> dict[str, Any]:
        return records.write(self, self.KEYS)


@dataclass(kw_only=True)
class GuardBar(Record):
    """The version the guard measures an expert's new versions against, and its loss on each val window
    (the guard's test is paired, window by window). It moves only to a version that beat it beyond the
    noise of that comparison, so a lucky measurement never sets the bar."""

    version: int
    val_loss: float
    windows: list[float]

    KEYS: ClassVar = ("version", "val_loss", "windows")

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "GuardBar":
        bar = records.read(cls, d, where)
        w = bar.windows
        if not isinstance(w, list) or not w or not all(isinstance(x, float) and math.isfinite(x) for x in w):
            raise CheckpointError(f"{where}: windows must be a non-empty list of finite floats")
        return bar

    def to_dict(self) -> dict[str, Any]:
        return records.write(self, self.KEYS)


@dataclass(kw_only=True)
class ExpertRecord(Record):
    """An expert's entry in state.msgpack: its current version and where it is stored. `best` and the plateau
    rule's state (`lr_scale`, `best_val`, `best_step`) came later, and the guard's `bar` later still: older
    runs lack them, and `cannot_train` is written only for an expert the run left out, `finished` only for
    one that can no longer improve (coordinator.finish). `expert` is set only in
    the finished seed's record (state.msgpack's `seed`)."""

    version: int
    sha256: str
    path: str | None  # relative to the run directory
    step: int = 0
    train_loss: float | None = None
    val_loss: float | None = None
    node: str | None = None  # the label of the node that trained it
    best: BestVersion | None = None
    lr_scale: float = 1.0
    best_val: float | None = None
    best_step: int = 0
    expert: int | None = None
    bar: GuardBar | None = None
    cannot_train: str | None = None  # why the coordinator stopped handing it out (its shard, a worker's error)
    # coordinator.finish: the val loss of its last gain of finish_min_delta, the accepted versions and guard
    # refusals since, and why it finished (None: it trains on). Written only where set: older runs lack them.
    mark: float | None = None
    stale: int = 0
    refusals: int = 0
    finished: str | None = None

    KEYS: ClassVar = (
        "version",
        "sha256",
        "path",
        "step",
        "train_loss",
        "val_loss",
        "node",
        "best",
        "lr_scale",
        "best_val",
        "best_step",
    )

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "ExpertRecord":
        return records.read(cls, d, where, best=BestVersion.from_dict, bar=GuardBar.from_dict)

    def to_dict(self) -> dict[str, Any]:
        return records.write(
            self,
            self.KEYS,
            best=None if self.best is None else self.best.to_dict(),
            bar=None if self.bar is None else self.bar.to_dict(),
        )

    def best_or_current(self) -> BestVersion | None:
        """Its best version; the current one for a run from before guards (None without a path or val loss)."""
        if self.best is not None:
            return self.best
        if self.path is None or self.val_loss is None:
            return None
        return BestVersion(version=self.version, sha256=self.sha256, path=self.path, val_loss=self.val_loss)


def expert_records(d: Any, where: str) -> dict[Any, ExpertRecord]:
    if not isinstance(d, dict):
        raise CheckpointError(f"{where}: not a map (a {type(d).__name__})")
    return {e: ExpertRecord.from_dict(x, f"{where}[{e!r}]") for e, x in d.items()}


@dataclass(kw_only=True)
class RunState(Record):
    """state.msgpack: the commit point of a round. `phase`, `strikes` (guard's table: identity -> count,
    name, last reason, round) and `seed` (the finished seed's record) came later: older runs lack them."""

    round: int
    rounds: int | None = None
    run_id: str | None = None
    experts: dict[Any, ExpertRecord]  # by expert id, as the file spells it (a string)
    assignment: dict[str, str] = field(default_factory=dict)  # expert -> label of the node that trained it
    phase: str = "experts"  # "seed" while the seed run trains
    strikes: dict[str, dict[str, Any]] = field(default_factory=dict)
    soma_version: str | None = None
    seed: ExpertRecord | None = None

    KEYS: ClassVar = ("round", "rounds", "run_id", "experts", "assignment", "phase", "strikes", "soma_version")

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "RunState":
        return records.read(cls, d, where, experts=expert_records, seed=ExpertRecord.from_dict)

    def to_dict(self) -> dict[str, Any]:
        experts = {e: x.to_dict() for e, x in self.experts.items()}
        return records.write(self, self.KEYS, experts=experts, seed=None if self.seed is None else self.seed.to_dict())

    def expert_ids(self) -> list[int]:
        return sorted(int(e) for e in self.experts)

    def expert(self, e: int) -> ExpertRecord:
        """Expert e's record (KeyError if the state has none)."""
        return self.experts[str(e)] if str(e) in self.experts else self.experts[e]


@dataclass(kw_only=True)
class ClusterShards(Record):
    """One cluster of prepare.json: the expert it trains, and its bytes and shard hash per split."""

    id: int
    expert: int
    docs: int = 0
    bytes: dict[str, int] = field(default_factory=dict)  # split -> bytes
    shards: dict[str, str]  # split -> sha256 of the shard (RUN/shards/<sha256>.bin)
    cut: dict[str, int] = field(default_factory=dict)  # split -> held-out windows cut from train documents

    KEYS: ClassVar = ("id", "expert", "docs", "bytes", "shards")

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "ClusterShards":
        return records.read(cls, d, where)

    def to_dict(self) -> dict[str, Any]:
        return records.write(self, self.KEYS)


@dataclass(kw_only=True)
class RouterSummary(Record):
    """prepare.json's account of the router it wrote (router.msgpack)."""

    sha256: str
    bytes: int | None = None
    clusters: int | None = None
    dim: int | None = None
    temperature: float | None = None
    prior: list[float] = field(default_factory=list)

    KEYS: ClassVar = ("sha256", "bytes", "clusters", "dim", "temperature", "prior")

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "RouterSummary":
        return records.read(cls, d, where)

    def to_dict(self) -> dict[str, Any]:
        return records.write(self, self.KEYS)


def _clusters(d: Any, where: str) -> list[ClusterShards]:
    if not isinstance(d, list):
        raise CheckpointError(f"{where}: not a list (a {type(d).__name__})")
    return [ClusterShards.from_dict(c, f"{where}[{i}]") for i, c in enumerate(d)]


@dataclass(kw_only=True)
class PrepareSummary(Record):
    """prepare.json: what `soma-coord prepare` made, and the shards of each expert per split."""

    schema: int | None = None
    corpus: str | None = None
    seed: int | None = None
    experts: int
    documents: int | None = None
    bytes: int | None = None
    separator: str | None = None
    router: RouterSummary | None = None
    clusters: list[ClusterShards]
    purity: float | None = None  # byte-weighted, against the corpus's domains (None: unlabelled)
    domains: dict[str, dict[str, int]] = field(default_factory=dict)  # domain -> cluster -> bytes
    seconds: float | None = None
    seq_len: int | None = None  # the window length the held-out quotas were cut for (None: before quotas)

    KEYS: ClassVar = (
        "schema",
        "corpus",
        "seed",
        "experts",
        "documents",
        "bytes",
        "separator",
        "router",
        "clusters",
        "purity",
        "domains",
        "seconds",
    )

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "PrepareSummary":
        return records.read(cls, d, where, router=RouterSummary.from_dict, clusters=_clusters)

    def to_dict(self) -> dict[str, Any]:
        router = None if self.router is None else self.router.to_dict()
        return records.write(self, self.KEYS, router=router, clusters=[c.to_dict() for c in self.clusters])

    def shards(self, expert: int, split: str) -> list[str]:
        """The shard hashes of `expert`'s clusters for `split`, in cluster order."""
        if split not in SPLITS:
            raise ConfigError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        return [c.shards[split] for c in self.clusters if c.expert == expert]

    def shard_sizes(self) -> dict[str, int]:
        """Every shard's bytes, by its hash."""
        return {c.shards[s]: int(c.bytes[s]) for c in self.clusters for s in c.shards}
