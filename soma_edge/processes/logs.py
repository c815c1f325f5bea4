"""Loggers for code that Flower runs in its own processes.

`flwr-serverapp` and `flwr-clientapp` configure only Flower's logger, so our roles attach their own
stderr handler (which lands in the SuperLink's or SuperNode's log) and do not propagate into Flower's.
"""

from __future__ import annotations

import logging
import sys
from typing import Any


def role_logger(name: str) -> logging.Logger:
    log = logging.getLogger(name)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setLevel(logging.INFO)
        handler.setFormatter(logging.Formatter(f"%(asctime)s {name} %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


def expert_set(es: Any, most: int = 8) -> str:
    """Expert ids for a log line, short at any N: the list up to `most`, else the count and its runs of
    consecutive ids ("40 experts: 0-31, 40-47"; after 4 runs, "...")."""
    ids = sorted(int(e) for e in es)
    if len(ids) <= most:
        return str(ids)
    runs: list[list[int]] = []
    for e in ids:
        if runs and e == runs[-1][1] + 1:
            runs[-1][1] = e
        else:
            runs.append([e, e])
    text = ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs[:4])
    return f"{len(ids)} experts: {text}{', ...' if len(runs) > 4 else ''}"
