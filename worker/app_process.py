"""The ClientApp's process: Flower's own `flwr-clientapp`, started with half its import cost.

A SuperNode starts one `flwr-clientapp` process per message it receives, so one per round on every
worker. Flower's command imports the package `flwr.supernode.cli`, whose `__init__` also loads the
SuperNode's own command (SQLAlchemy, Alembic, its object store), which the ClientApp never uses: ~1 s of
CPU of the ~2.4 s that each process took to reach our ClientApp on a desktop core, and more on a small
board. `soma-worker join` puts `command(cache)` first on its SuperNode's PATH under Flower's name; it runs
Flower's own `flwr_clientapp()`, with that package registered but its `__init__` not run, so Flower's
arguments, token and app loading are its own.

    python -m worker.app_process [flwr-clientapp arguments...]
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
from pathlib import Path

NAME = "flwr-clientapp"  # what Flower's SuperExec runs from its PATH for each ClientApp message
PACKAGE = "flwr.supernode.cli"


def command(cache: Path) -> Path | None:
    """Write the `flwr-clientapp` that runs this module into CACHE/bin, and return that folder (for the
    front of the SuperNode's PATH); None where a shell script cannot stand in for a command (Windows)."""
    if os.name != "posix":
        return None
    folder = cache / "bin"
    folder.mkdir(parents=True, exist_ok=True)
    script = f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m worker.app_process "$@"\n'
    path = folder / NAME
    if not path.is_file() or path.read_text() != script:
        tmp = folder / f".{NAME}.{os.getpid()}"
        tmp.write_text(script)
        tmp.chmod(0o755)
        os.replace(tmp, path)  # atomic: a SuperExec of another join on this cache never runs half a script
    return folder


def register_package() -> None:
    """Register `flwr.supernode.cli` as a package without running its `__init__`, where this flwr lays it
    out as 1.42 does; otherwise leave it to the import system (the full cost, the same behaviour)."""
    if PACKAGE in sys.modules:
        return
    parent = importlib.util.find_spec("flwr.supernode")
    if parent is None or not parent.submodule_search_locations:
        return
    folder = Path(next(iter(parent.submodule_search_locations))) / "cli"
    if not (folder / "__init__.py").is_file() or not (folder / "flwr_clientapp.py").is_file():
        return
    spec = importlib.util.spec_from_file_location(
        PACKAGE, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    sys.modules[PACKAGE] = importlib.util.module_from_spec(spec)


def main() -> None:
    register_package()
    from flwr.supernode.cli.flwr_clientapp import flwr_clientapp  # only once the package is registered

    sys.argv[0] = NAME
    sys.exit(flwr_clientapp())


if __name__ == "__main__":
    main()
