"""Loggers for code that Flower runs in its own processes.

`flwr-serverapp` and `flwr-clientapp` configure only Flower's logger, so our roles attach their own
stderr handler (which lands in the SuperLink's or SuperNode's log) and do not propagate into Flower's.
"""

from __future__ import annotations

import logging
import sys


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
