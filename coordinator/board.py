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
import time
from pathlib import Path
from typing import Any, Iterator

from soma_edge.errors import ConfigError

EXPERT_SCALARS = ("train_loss", "val_loss", "steps_per_s", "lr", "eps")
ROUND_SCALARS = {
    "mixture_val_loss": "mixture_val_loss",
    "val_loss_mean": "val_loss_mean",
    "compute_share": "compute_share",
    "bytes_down": "bytes_down",
    "bytes_up": "bytes_up",
    "seconds": "round_seconds_total",
    "accepted": "accepted",
}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def scalars(lines: list[dict[str, Any]]) -> Iterator[tuple[str, float, int]]:
    """(tag, value, round) of every scalar that metrics lines give."""
    for m in lines:
        r = int(m["round"])
        if m.get("type") == "expert" and m.get("accepted"):
            for key in EXPERT_SCALARS:
                if _number(m.get(key)):
                    yield f"expert_{m['expert']}/{key}", float(m[key]), r
        elif m.get("type") == "round":
            for tag, key in ROUND_SCALARS.items():
                if _number(m.get(key)):
                    yield f"round/{tag}", float(m[key]), r
            yield "round/rejected", float(len(m.get("rejected") or [])), r


class Board:
    """The run's event writer; `commit` adds a round's lines and flushes them to disk."""

    def __init__(self, folder: Path, committed_round: int) -> None:
        try:
            from tensorboardX import SummaryWriter
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

    def commit(self, lines: list[dict[str, Any]]) -> None:
        for tag, value, r in scalars(lines):
            self.writer.add_scalar(tag, value, r)
        for m in lines:
            if m.get("type") == "expert" and m.get("accepted"):
                self.writer.add_text(f"expert_{m['expert']}/node", str(m["node"]), int(m["round"]))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
