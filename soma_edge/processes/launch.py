"""Starting Flower's processes: executables, environment, free ports, and lifetime.

Both roles launch Flower binaries (the coordinator a SuperLink and local workers, the worker a
SuperNode); they share these so both get the same environment and the same no-orphans guarantee.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import sys
from pathlib import Path

from soma_edge.errors import SomaError
from soma_edge.processes import commands as flower_commands

_PR_SET_PDEATHSIG = 1


def flower_bin(name: str) -> str:
    """A Flower executable from this interpreter's environment (so a venv's Flower wins over PATH)."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if not found:
        raise SomaError(f"`{name}` not found: install soma-edge (it depends on flwr) into this environment")
    return found


def flower_env(flwr_home: Path, **extra: str) -> dict[str, str]:
    """Our environment for a Flower process: its own FLWR_HOME, no telemetry, no update checks, and on its
    PATH first our lighter `flwr-clientapp` and `flower-superexec` (written into FLWR_HOME/bin, see
    `flower_commands`), then this interpreter's Flower (flwr-serverapp, ...)."""
    env = dict(os.environ)
    path = [str(Path(sys.executable).parent), env.get("PATH", "")]
    light = flower_commands.install(flwr_home / "bin")
    env.update(
        FLWR_HOME=str(flwr_home),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        PATH=os.pathsep.join([str(light), *path] if light else path),
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when its parent dies, even by SIGKILL (Linux only)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: children outlive a kill -9 of the parent, but Ctrl-C still stops them


def session_child() -> None:
    """preexec_fn of a child started in its own session (start_new_session): `die_with_parent`, and the
    parent's niceness for the session's scheduling group.

    Where Linux groups tasks by session (kernel.sched_autogroup_enabled), it shares the CPU between the
    groups first, each at its group's niceness (0 for a new one), and only then between the tasks inside by
    theirs. A worker started with `nice` whose SuperNode got a session of its own then took a full share
    anyway: on 2 cores, four local workers left the coordinator's checks a third of a core."""
    die_with_parent()
    niceness = os.nice(0)
    if niceness > 0:
        try:
            with open("/proc/self/autogroup", "w") as f:  # lowering a group's priority needs no privilege
                f.write(str(niceness))
        except OSError:
            pass  # no autogroups here (not Linux, or disabled): the tasks' own niceness is what counts
