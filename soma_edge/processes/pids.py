"""Whether a process is alive: for `soma-coord start` watching its ServerApp, and for the Flower stand-ins
(`flower_commands`) watching their parent. A zombie counts as dead: it will never answer again."""

from __future__ import annotations

import os
from pathlib import Path


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (not Linux): os.kill's answer stands
