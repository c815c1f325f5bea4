"""TensorBoard event files of a run, in RUN/tb/: each commit's metrics lines as scalars, step = round.

tensorboardX writes them without TensorFlow or the tensorboard reader. `tensorboard --logdir runs/`
then shows every run side by side. The scalars are the metrics lines' own numbers, so RUN/tb/ and
RUN/metrics.jsonl always tell the same story:

    expert_<e>/train_loss, val_loss, steps_per_s, lr, eps   (accepted versions only)
    expert_<e>/node                                          (text: the node that trained it)
    round/mixture_val_loss, val_loss_mean, compute_share, bytes_down, bytes_up, seconds,
          accepted, rejected                                 (rejected: the count of refused results)

A resumed run purges the events of rounds past the committed one (a crash may have cut such a commit
short after its events were written), as metrics.jsonl is truncated.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from soma_edge.errors import ConfigError
from soma_edge.rundir import metrics
from soma_edge.rundir.metrics import ExpertLine, Line, RoundLine

EXPERT_SCALARS = ("train_loss", "val_loss", "steps_per_s", "lr", "eps")
ROUND_SCALARS = ("mixture_val_loss", "val_loss_mean", "compute_share", "bytes_down", "bytes_up", "seconds", "accepted")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _expert_values(m: ExpertLine) -> tuple[Any, ...]:
    """`EXPERT_SCALARS` of an expert line, in that order."""
    return (m.train_loss, m.val_loss, m.steps_per_s, m.lr, m.eps)


def _round_values(m: RoundLine) -> tuple[Any, ...]:
    """`ROUND_SCALARS` of a round line, in that order (seconds: plan to commit)."""
    return (
        m.mixture_val_loss,
        m.val_loss_mean,
        m.compute_share,
        m.bytes_down,
        m.bytes_up,
        m.round_seconds_total,
        m.accepted,
    )


def scalars(lines: list[Line]) -> Iterator[tuple[str, float, int]]:
    """(tag, value, round) of every scalar that metrics lines give."""
    for m in lines:
        r = int(m.round)
        if isinstance(m, ExpertLine) and m.accepted:
            for key, v in zip(EXPERT_SCALARS, _expert_values(m)):
                if _number(v):
                    yield f"expert_{m.expert}/{key}", float(v), r
        elif isinstance(m, RoundLine):
            for tag, v in zip(ROUND_SCALARS, _round_values(m)):
                if _number(v):
                    yield f"round/{tag}", float(v), r
            yield "round/rejected", float(len(m.rejected)), r


def _summary_writer() -> type:
    """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports torch where it can, only to
    accept its tensors (scalars here are floats), which cost the coordinator ~2.7 s and ~300 MB at every start
    on a box that has torch (a dev install). torch stays importable for the rest of the process."""
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError
    try:  # tensorboardX only where a run writes events (Board): status and the worker never need it
        from tensorboardX import SummaryWriter

        return SummaryWriter
    finally:
        if blocked:
            del sys.modules["torch"]


class Board:
    """The run's event writer; `commit` adds a round's lines and flushes them to disk."""

    def __init__(self, folder: Path, committed_round: int) -> None:
        try:
            SummaryWriter = _summary_writer()
        except ImportError:
            raise ConfigError(
                "federation.tensorboard = true needs tensorboardX, which is not installed: reinstall "
                "soma-edge, or set federation.tensorboard = false"
            ) from None

        folder.mkdir(parents=True, exist_ok=True)
        # purge_step: readers drop earlier events at or past it (an uncommitted round's, before a crash).
        # The suffix: tensorboardX names a file by the second it opens it, and a writer opened in the same
        # second would truncate the file of the one before.
        self.writer = SummaryWriter(
            str(folder), purge_step=committed_round + 1, filename_suffix=f".{os.getpid()}.{time.time_ns()}"
        )

    def commit(self, lines: list[Line | dict[str, Any]]) -> None:
        """Add a commit's lines (records, or their dicts as metrics.jsonl holds them)."""
        typed = metrics.as_lines(lines)
        for tag, value, r in scalars(typed):
            self.writer.add_scalar(tag, value, r)
        for m in metrics.expert_lines(typed):
            if m.accepted:
                self.writer.add_text(f"expert_{m.expert}/node", str(m.node), int(m.round))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
