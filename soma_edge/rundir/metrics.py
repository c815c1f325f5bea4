"""The lines of RUN/metrics.jsonl and RUN/status.json: one schema for the coordinator that writes them and
for everything that reads them (`soma-coord status` and `report`, TensorBoard, the benches).

    ExpertLine   one per expert per round: accepted (the version it made, its losses, what moved) or not
                 (why: `reason`; then the current version's losses and no work)
    RoundLine    one per round, after its expert lines: the round's totals, time and bytes
    Status       status.json, rewritten as a run goes: its phase, round, experts and nodes

They are records (soma_edge.records): they read and write the same bytes as the dicts that the coordinator
wrote before them, and a key that a later version added (a round's `next_round_ahead`, an expert line's
`step`, `lr` and `eps`, …) is optional, so the lines of older runs read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable

from soma_edge import records
from soma_edge.errors import CheckpointError
from soma_edge.records import Record
from soma_edge.rundir.layout import RunDir
from soma_edge.rundir.state import ExpertRecord, expert_records

log = logging.getLogger("soma.metrics")

EXPERT = "expert"
ROUND = "round"


@dataclass(kw_only=True)
class ExpertLine(Record):
    type: str = EXPERT
    round: int
    expert: int
    accepted: bool
    reason: str | None = None  # why not accepted
    version: int  # the version it made (accepted), else the current one
    sha256: str
    node: str | None = None  # label of the node it was assigned to
    node_id: int | None = None
    train_loss: float | None = None
    val_loss: float | None = None
    steps: int = 0
    forward_evals: int = 0
    seconds: float = 0.0
    steps_per_s: float | None = None
    weights_bytes_down: int = 0
    shard_bytes_down: int = 0
    weights_bytes_up: int = 0
    opt_bytes_up: int = 0
    log_bytes_up: int | None = None  # None: a weights reply, no update log
    torch_importable: bool | None = None
    lr_scale: float = 1.0  # the plateau rule's scale it trained at
    next_lr_scale: float = 1.0  # and the next round's
    best_version: int | None = None
    step: int | None = None  # the expert's step count after this round
    lr: float | None = None  # lr and eps at the round's last step
    eps: float | None = None
    late: bool = False  # accepted after its round's deadline, committed with the next round
    evaluator: str | None = None  # how the worker evaluated the steps (loop | population); None: not said
    # The probes it trained with (soma_edge.spsa.recipe.Probes: directions, split_rows, noise, density): its
    # recipe is the run's with these (its update log, if it sent one, carries the whole). None: not said.
    recipe: dict[str, Any] | None = None
    bar_version: int | None = None  # the guard's bar after it (coordinator.guard); None: a run from before bars
    guard_margin: float | None = None  # how much worse than the bar it was allowed to be
    epochs: float | None = None  # its steps' bytes over its train text's (coordinator.records.epochs)

    ACCEPTED: ClassVar = (
        "type",
        "round",
        "expert",
        "accepted",
        "version",
        "sha256",
        "node",
        "node_id",
        "train_loss",
        "val_loss",
        "steps",
        "forward_evals",
        "seconds",
        "steps_per_s",
        "weights_bytes_down",
        "shard_bytes_down",
        "weights_bytes_up",
        "opt_bytes_up",
        "log_bytes_up",
        "torch_importable",
        "lr_scale",
        "next_lr_scale",
        "best_version",
        "step",
        "lr",
        "eps",
    )
    REFUSED: ClassVar = (
        "type",
        "round",
        "expert",
        "accepted",
        "reason",
        "version",
        "sha256",
        "node",
        "val_loss",
        "train_loss",
        "steps",
        "forward_evals",
        "seconds",
    )

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "ExpertLine":
        return records.read(cls, d, where)

    def to_dict(self) -> dict[str, Any]:
        return records.write(self, self.ACCEPTED if self.accepted else self.REFUSED)


@dataclass(kw_only=True)
class Rejection(Record):
    """A refused result in a round line: whose, why, and the node's strike count after it. `guard`: refused
    by the val-loss bound (then its val loss, and the lr scale the expert retrains at)."""

    expert: Any  # an expert id, or what a malformed reply named
    node: str
    node_id: int | None = None
    reason: str
    strike: int = 0
    guard: bool = False
    val_loss: float | None = None
    lr_scale: float | None = None
    next_lr_scale: float | None = None
    guard_margin: float | None = None  # how much worse than the guard's bar it was allowed to be

    KEYS: ClassVar = ("expert", "node", "node_id", "reason", "strike")

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "Rejection":
        return records.read(cls, d, where)

    def to_dict(self) -> dict[str, Any]:
        return records.write(self, self.KEYS)


@dataclass(kw_only=True)
class SeedDone(Record):
    """The seed's last version, in the round line of the round whose commit started the experts from it."""

    expert: int
    step: int
    version: int
    sha256: str

    KEYS: ClassVar = ("expert", "step", "version", "sha256")

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "SeedDone":
        return records.read(cls, d, where)

    def to_dict(self) -> dict[str, Any]:
        return records.write(self, self.KEYS)


def _rejections(d: Any, where: str) -> list[Rejection]:
    if not isinstance(d, list):
        raise CheckpointError(f"{where}: not a list (a {type(d).__name__})")
    return [Rejection.from_dict(x, f"{where}[{i}]") for i, x in enumerate(d)]


@dataclass(kw_only=True)
class RoundLine(Record):
    type: str = ROUND
    round: int
    rounds: int | None = None
    phase: str = "experts"  # "seed" while the seed run trains
    accepted: int = 0  # how many experts advanced
    rejected: list[Rejection] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)  # nodes that reached their strike limit this round
    missed: list[int] = field(default_factory=list)  # experts planned but not advanced
    val_loss_mean: float | None = None
    mixture_val_loss: float | None = None  # the routed mixture's, nats/byte
    wall_seconds: float | None = None  # first request out to last reply in
    round_seconds_total: float | None = None  # plan to commit (or to the next round's plan, if it went ahead)
    compute_seconds: dict[str, float] = field(default_factory=dict)  # node label -> compute seconds
    compute_share: float | None = None  # as far as the commit knew (coordinator.records.share_at_commit)
    predicted_makespan: float | None = None
    moved: list[int] = field(default_factory=list)  # experts that changed node
    bytes_down: int = 0
    bytes_up: int = 0
    nodes: list[str] = field(default_factory=list)
    time: float | None = None
    next_round_ahead: bool = False  # the next round was planned before this one's checks (pipelining)
    seed_done: SeedDone | None = None
    settle_seconds: float | None = None  # last reply in (or the deadline) to the commit: checks, guard, mixture
    planned_at: float | None = None  # the round's plan, seconds since the epoch (soma_edge.wire.compute_share)
    trained: dict[str, list[list[float]]] = field(default_factory=dict)  # node label -> when its results trained
    finished: dict[str, str] = field(default_factory=dict)  # experts finished this round -> why (coordinator.finish)

    KEYS: ClassVar = (
        "type",
        "round",
        "rounds",
        "phase",
        "accepted",
        "rejected",
        "excluded",
        "missed",
        "val_loss_mean",
        "mixture_val_loss",
        "wall_seconds",
        "round_seconds_total",
        "compute_seconds",
        "compute_share",
        "predicted_makespan",
        "moved",
        "bytes_down",
        "bytes_up",
        "nodes",
        "time",
        "next_round_ahead",
    )

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "RoundLine":
        return records.read(cls, d, where, rejected=_rejections, seed_done=SeedDone.from_dict)

    def to_dict(self) -> dict[str, Any]:
        seed_done = None if self.seed_done is None else self.seed_done.to_dict()
        return records.write(self, self.KEYS, rejected=[x.to_dict() for x in self.rejected], seed_done=seed_done)


Line = ExpertLine | RoundLine


def line(d: Any, where: str) -> Line | None:
    """The record of one metrics line; None for a type this version does not know (a later version's)."""
    kind = d.get("type") if isinstance(d, dict) else None
    if kind == EXPERT:
        return ExpertLine.from_dict(d, where)
    if kind == ROUND:
        return RoundLine.from_dict(d, where)
    if not isinstance(d, dict):
        raise CheckpointError(f"{where}: not a map (a {type(d).__name__})")
    return None


def as_lines(items: Iterable[Line | dict[str, Any]], where: str = "metrics line") -> list[Line]:
    """Lines as records: records as they are, dicts read (as metrics.jsonl's JSON gives them)."""
    out = []
    for i, m in enumerate(items):
        rec = m if isinstance(m, (ExpertLine, RoundLine)) else line(m, f"{where} {i + 1}")
        if rec is not None:
            out.append(rec)
    return out


def read_lines(run: RunDir) -> list[Line]:
    """RUN/metrics.jsonl as records. A log is never a reason to fail: lines that are not JSON, of an unknown
    type, or that lack a key their type needs are left out, with a warning for the last."""
    out = []
    for i, m in enumerate(run.read_metrics()):
        try:
            out += as_lines([m], f"{run.metrics_path}: line {i + 1}")
        except CheckpointError as e:
            log.warning("%s: left out", e)
    return out


def expert_lines(lines: Iterable[Line]) -> list[ExpertLine]:
    return [m for m in lines if isinstance(m, ExpertLine)]


def round_lines(lines: Iterable[Line]) -> list[RoundLine]:
    return [m for m in lines if isinstance(m, RoundLine)]


@dataclass(kw_only=True)
class NodeEntry(Record):
    """A node as status.json shows it (its `status` is a `coordinator.fleet.NodeStatus` value)."""

    name: str | None = None
    status: str | None = None
    rate: float | None = None  # forward evaluations per second, measured, each step counted at its own recipe
    torch_importable: bool | None = None
    recipe: str | None = None  # the probes it trains with (soma_edge.spsa.recipe.Probes.describe); None: not yet said

    KEYS: ClassVar = ("name", "status", "rate", "torch_importable")

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "NodeEntry":
        return records.read(cls, d, where)

    def to_dict(self) -> dict[str, Any]:
        return records.write(self, self.KEYS)


def _nodes(d: Any, where: str) -> dict[Any, NodeEntry]:
    if not isinstance(d, dict):
        raise CheckpointError(f"{where}: not a map (a {type(d).__name__})")
    return {n: NodeEntry.from_dict(x, f"{where}[{n!r}]") for n, x in d.items()}


@dataclass(kw_only=True)
class Status(Record):
    """status.json. The fields after `nodes` are the phase's own: `message` (waiting, failed), `user_error`
    (failed), `stopped` and `never_advanced` (done), `started`, `deadline_in` and `assignment` (a round in
    progress)."""

    phase: str  # starting | waiting | round | committed | done | failed
    pid: int | None = None
    time: float | None = None
    round: int = 0
    rounds: int | None = None
    round_seconds: float | None = None
    experts: dict[Any, ExpertRecord] = field(default_factory=dict)  # state.msgpack's, by expert id
    nodes: dict[Any, NodeEntry] = field(default_factory=dict)  # by Flower node id
    message: str | None = None
    user_error: bool | None = None
    stopped: bool | None = None
    started: float | None = None  # when the round in progress began (time.time())
    deadline_in: float | None = None  # seconds from `time` to its deadline
    assignment: dict[str, str] | None = None  # expert -> node label, for the round in progress
    never_advanced: dict[str, str] | None = None  # done: expert -> why it has no new version from this run

    KEYS: ClassVar = ("phase", "pid", "time", "round", "rounds", "round_seconds", "experts", "nodes")

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "Status":
        return records.read(cls, d, where, experts=expert_records, nodes=_nodes)

    def to_dict(self) -> dict[str, Any]:
        experts = {e: x.to_dict() for e, x in self.experts.items()}
        return records.write(self, self.KEYS, experts=experts, nodes={n: x.to_dict() for n, x in self.nodes.items()})


def read_status(run: RunDir) -> Status | None:
    """RUN/status.json as a record; None while there is none (or it does not parse, or lacks a key it needs:
    the live view waits for the next one rather than failing)."""
    d = run.read_status()
    try:
        return None if d is None else Status.from_dict(d, str(run.status_path))
    except CheckpointError as e:
        log.warning("%s: ignored", e)
        return None
