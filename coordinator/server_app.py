"""The SOMA coordinator as a Flower ServerApp (`coordinator.server_app:app`, named by the Flower app's
pyproject.toml): it reads the run directory and an external start request from the run config, then runs
the round loop (coordinator.loop).

Flower launches this process itself (next to the SuperLink), so progress goes to RUN/status.json and
RUN/metrics.jsonl, which `soma-coord start` tails.
"""

from __future__ import annotations

import functools

from flwr.serverapp import ServerApp  # this module is Flower's entry point: only Flower loads it

from coordinator.loop import Coordinator
from coordinator.remote import apply_request
from soma_edge.errors import SomaError
from soma_edge.rundir.layout import RunDir

app = ServerApp()


@app.main()
def main(grid, context) -> None:
    run_dir = str(context.run_config.get("run-dir", "")).strip()
    if not run_dir:
        raise SomaError("run config 'run-dir' is empty: pass --run-config \"run-dir='/path/to/RUN'\" to flwr run")
    run, request = RunDir(run_dir), str(context.run_config.get("start", "")).strip()
    setup = None
    if request:  # external mode: `soma-coord start --superlink` sent the config along
        setup = functools.partial(apply_request, run, request)
    Coordinator(grid, run, setup=setup).main()
