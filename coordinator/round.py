"""What one round holds while it runs: its plan and deadline, the requests it waits for, the results in
but not yet checked (claims), and what it accepted, refused or missed.

Made by `Loop.start_round` (coordinator.loop); filled by coordinator.dispatch (requests) and
coordinator.intake (results); read by the commit (`Loop.commit`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator import scheduler
from coordinator.guard import Tally
from soma_edge.rundir.metrics import ExpertLine, Rejection
from soma_edge.rundir.state import GuardBar
from soma_edge.spsa.log import UpdateLog
from soma_edge.spsa.optim import OptState

# a claim's version (weights, optimizer state), its val loss on each window, and its expert's guard bar
Checked = tuple[np.ndarray, OptState, np.ndarray, GuardBar]


@dataclass
class Claim:
    """One expert's result that passed the reply's cheap checks (header, shapes, base version, log
    structure), waiting for the costly ones (`Intake.settle`)."""

    node: int
    res: dict[str, Any]
    w: np.ndarray | None  # as received (None for a log alone)
    opt: OptState | None
    sent: dict[str, int]  # weight and shard bytes sent down for it
    reply: dict[str, Any]
    ulog: UpdateLog | None
    checked: Any = None  # its costly checks' outcome once run ahead of its verdict (Checked or ValidationError)
    timed: tuple[int, float, float | None] | None = None  # a log's steps, replay and audit seconds, once checked


@dataclass
class Waiting:
    """A node's train request, held until the shard pieces sent before it are answered."""

    mids: set[str]
    experts: list[int]
    steps: dict[int, int]
    last: list[dict[str, Any]]  # the last piece, which rides in the train request
    shard_bytes: dict[int, int]
    rest: list[dict[str, Any]] = field(default_factory=list)  # pieces held until the first one timed the link


@dataclass
class Round:
    r: int
    plan: scheduler.Plan
    deadline: float
    t_sent: float
    t_done: float = 0.0
    accepted: dict[int, ExpertLine] = field(default_factory=dict)  # expert -> the line of its accepted version
    failed: dict[int, str] = field(default_factory=dict)
    rejected: list[Rejection] = field(default_factory=list)
    compute: dict[int, float] = field(default_factory=dict)  # node id -> compute seconds this round
    excluded: list[str] = field(default_factory=list)  # nodes that reached their strike limit this round
    late: list[ExpertLine] = field(default_factory=list)  # last round's late replies, settled this round
    train_mids: set[str] = field(default_factory=set)  # every train request of the round, resends included
    waiting: dict[int, Waiting] = field(default_factory=dict)  # node -> its train request, held for pieces
    pending_resend: set[int] = field(default_factory=set)
    resent: set[int] = field(default_factory=set)  # experts resent once this round: a second miss is not resent
    tallies: dict[int, Tally] = field(default_factory=dict)  # node id -> its guard verdicts, judged together
    finished: dict[int, str] = field(default_factory=dict)  # experts finished by this round's verdicts, and why
    claims: dict[int, Claim] = field(default_factory=dict)  # expert -> a result in, its checks to come
    deferred: dict[int, list[int]] = field(default_factory=dict)  # node -> experts sent once the last round commits
    following: dict[int, list[int]] = field(default_factory=dict)  # node -> its experts next round ({}: the same)
    t_round: float = 0.0  # when the round began: its plan
    planned_at: float = 0.0  # the same, in seconds since the epoch (compute share's spans)
    trained: dict[int, list] = field(default_factory=dict)  # node id -> when its results of this round trained
    bytes_down: int = 0
    bytes_up: int = 0
