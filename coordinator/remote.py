"""External mode's helpers: `soma-coord start --superlink HOST:PORT`, for a SuperLink on another box.

Flower runs the ServerApp on the SuperLink's host, so the run directory lives there and this box may
not see it at all. `start` therefore reads and writes nothing in RUN: it submits the run with its
config (the --config file's TOML and the command-line overrides, passed through Flower's run config as
one start request, `encode_request`, and applied by the ServerApp, under the run lock, on the
SuperLink's host: `apply_request`), and follows it through the SuperLink alone (`follow`): the run's
status (`flwr ls`) and the coordinator's log lines (`flwr log`), which Flower delivers in batches, often
tens of seconds late.

Its Flower connection lives in $SOMA_CACHE/coord-flwr, not in RUN.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from coordinator import launcher, runconfig
from soma_edge.corpus import sources
from soma_edge.errors import ConfigError, SomaError
from soma_edge.processes.launch import flower_bin, flower_env
from soma_edge.rundir.layout import RunDir

START_KEY = "start"  # the app's run-config key that carries the start request
POLL_SECONDS = 5.0
LOG_LINE = re.compile(r"soma\.coord (INFO|WARNING|ERROR) (.*)$")


def flwr_home() -> Path:
    return sources.cache_dir() / "coord-flwr"


def encode_request(config_text: str | None, overrides: dict[str, Any]) -> str:
    """The start request as one run-config value (base64 of JSON: no quotes for Flower's parser to trip on)."""
    body = {"config": config_text, "overrides": overrides}
    return base64.b64encode(json.dumps(body).encode()).decode()


def decode_request(value: str) -> tuple[str | None, dict[str, Any]]:
    try:
        body = json.loads(base64.b64decode(value.encode(), validate=True))
        config, overrides = body["config"], body["overrides"]
        if not (config is None or isinstance(config, str)) or not isinstance(overrides, dict):
            raise ValueError("wrong types")
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"run config {START_KEY!r} is not a start request from `soma-coord start` ({e})") from None
    return config, overrides


def apply_request(run: RunDir, value: str) -> None:
    """On the SuperLink's host, under the run lock: resolve the config as a local start would, prepare
    RUN if it is not, and save run.toml."""
    config_text, overrides = decode_request(value)
    with tempfile.TemporaryDirectory(prefix="soma-start-") as tmp:
        path = None
        if config_text is not None:
            path = Path(tmp) / "config.toml"
            path.write_text(config_text, encoding="utf-8")
        runconfig.configure(run, path, overrides, own_lock=True)  # the ServerApp holds the lock it prepares under


def read_config_text(config: Path | None) -> str | None:
    """The --config file's TOML, sent as it is: the ServerApp parses it on the SuperLink's host."""
    if config is None:
        return None
    try:
        return Path(config).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"--config {config}: cannot read ({e.strerror})") from None


def follow(home: Path, run_id: str) -> int:
    """Print the coordinator's log lines as the SuperLink delivers them; 0 when the run completes."""
    printed, errors = 0, []
    while True:
        status = launcher.run_status(home, run_id) or ""
        lines = [m.groups() for m in map(LOG_LINE.search, _logs(home, run_id)) if m]
        for level, text in lines[printed:]:
            print(f"{level.lower()}: {text}" if level != "INFO" else text, flush=True)
            if level == "ERROR":
                errors.append(text)
        printed = max(printed, len(lines))
        if status.startswith("finished"):
            if status.endswith("completed"):
                return 0
            why = errors[-1] if errors else f"the Flower run ended as {status}"
            raise SomaError(f"run {run_id} on the SuperLink failed: {why}")
        time.sleep(POLL_SECONDS)


def _logs(home: Path, run_id: str) -> list[str]:
    try:
        r = subprocess.run(
            [flower_bin("flwr"), "log", run_id, launcher.CONNECTION, "--show"],
            capture_output=True,
            text=True,
            env=flower_env(home),
            timeout=60,
        )
    except (subprocess.SubprocessError, OSError) as e:
        print(f"warning: cannot read the run's log from the SuperLink ({e})", file=sys.stderr, flush=True)
        return []
    return r.stdout.splitlines()
