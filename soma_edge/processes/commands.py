"""Flower's per-process commands, started without their packages' unrelated imports.

Flower starts a `flwr-clientapp` process for every message a SuperNode receives (one per round on every
worker), and a `flower-superexec` beside every SuperLink and SuperNode, each by name from its PATH. Both
commands import a CLI package whose `__init__` also loads its sibling commands: the SuperNode's own
(SQLAlchemy, Alembic, its object store), or the agent, connector and model apps'. None of it is used.
`install(folder)` writes stand-ins under those names that run Flower's own entry point with that package
registered but its `__init__` not run, so Flower's arguments, tokens and app loading are its own;
`soma_edge.processes.launch.flower_env` puts the folder first on the PATH of every Flower process soma-edge
starts. CPU per process start on a 2-core desktop box (/usr/bin/time, 3 runs each): flwr-clientapp 2.4 s -> 1.4 s,
flower-superexec 1.9 s -> 1.2 s. Where a flwr lays a package out otherwise, the full import runs. They
also end themselves once their parent is gone and Flower's own exit did not (`watch_parent`).

    python -m soma_edge.flower_commands NAME [Flower's arguments...]

(soma_edge/flower_commands.py is that entry point: its path is written into the stand-ins.)
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shlex
import sys
import threading
import time
from pathlib import Path

from soma_edge.processes.pids import pid_alive

# name: (the package whose __init__ is skipped, its module with the entry point, the entry point)
COMMANDS = {
    "flwr-clientapp": ("flwr.supernode.cli", "flwr_clientapp", "flwr_clientapp"),
    "flower-superexec": ("flwr.supercore.cli", "flower_superexec", "flower_superexec"),
}
ORPHAN_GRACE = 15.0  # seconds a process outlives its Flower parent before `watch_parent` ends it


def install(folder: Path) -> Path | None:
    """Write the stand-ins into `folder` (atomically; unchanged ones are left alone) and return it, for the
    front of a PATH; None where a shell script cannot stand in for a command (Windows)."""
    if os.name != "posix":
        return None
    folder.mkdir(parents=True, exist_ok=True)
    for name in COMMANDS:
        script = f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m soma_edge.flower_commands {name} "$@"\n'
        path = folder / name
        if path.is_file() and path.read_text() == script:
            continue
        tmp = folder / f".{name}.{os.getpid()}"
        tmp.write_text(script)
        tmp.chmod(0o755)
        os.replace(tmp, path)  # another process starting on this folder never runs half a script
    return folder


def register_package(package: str, module: str) -> None:
    """Register `package` without running its `__init__`, where this flwr has `module` in it as 1.42 does;
    otherwise leave it to the import system (the full cost, the same behaviour)."""
    if package in sys.modules:
        return
    parent, _, leaf = package.rpartition(".")
    spec = importlib.util.find_spec(parent)
    if spec is None or not spec.submodule_search_locations:
        return
    where = Path(next(iter(spec.submodule_search_locations))) / leaf
    if not (where / "__init__.py").is_file() or not (where / f"{module}.py").is_file():
        return
    spec = importlib.util.spec_from_file_location(
        package, where / "__init__.py", submodule_search_locations=[str(where)]
    )
    sys.modules[package] = importlib.util.module_from_spec(spec)


def parent_pid(argv: list[str]) -> int | None:
    """The `--parent-pid` Flower gave the process, if any."""
    for i, arg in enumerate(argv[:-1]):
        if arg == "--parent-pid" and argv[i + 1].isdigit():
            return int(argv[i + 1])
    return None


def watch_parent(pid: int, grace: float = ORPHAN_GRACE, poll: float = 1.0) -> None:
    """End this process `grace` seconds after its parent is gone, however it is stuck. Flower's own monitor
    raises SIGINT in a thread of its own, which runs the exit handler only once the main thread runs Python
    again; a ClientApp that lost its SuperNode while pulling its task waits forever on retrying threads
    (seen in a test that kills a worker: the orphan lived on, idle, holding ~150 MB)."""

    def watch() -> None:
        while pid_alive(pid):
            time.sleep(poll)
        time.sleep(grace)  # Flower's own exit first, with its 5 s force-exit timer
        os._exit(1)

    threading.Thread(target=watch, name="soma-orphan-watch", daemon=True).start()


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        raise SystemExit(f"usage: python -m soma_edge.flower_commands {{{','.join(COMMANDS)}}} [arguments...]")
    name = sys.argv.pop(1)
    pid = parent_pid(sys.argv)
    if pid is not None:
        watch_parent(pid)
    package, module, function = COMMANDS[name]
    register_package(package, module)
    entry = getattr(importlib.import_module(f"{package}.{module}"), function)
    sys.argv[0] = name
    sys.exit(entry())
