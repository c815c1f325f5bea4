"""External mode: `soma-coord start --superlink HOST:PORT`, for a SuperLink on another box.

Flower runs the ServerApp on the SuperLink's host, so the run directory lives there and this box may
not see it at all. `start` therefore reads and writes nothing in RUN: it submits the run with its
config (the --config file's TOML and the command-line overrides, passed through Flower's run config and
applied by the ServerApp, under the run lock, on the SuperLink's host), and follows it through the
SuperLink alone: the run's status (`flwr ls`) and the coordinator's log lines (`flwr log`), which
Flower delivers in batches, often tens of seconds late.

Its Flower connection lives in $SOMA_CACHE/coord-flwr, not in RUN.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from coordinator import launcher
from soma_edge import corpus
from soma_edge.errors import ConfigError, SomaError
from soma_edge.procs import flower_bin, flower_env

START_KEY = "start"  # the app's run-config key that carries the start request
POLL_SECONDS = 5.0
LOG_LINE = re.compile(r"soma\.coord (INFO|WARNING|ERROR) (.*)$")


def flwr_home() -> Path:
    return corpus.cache_dir() / "coord-flwr"


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


def apply_request(run, value: str) -> None:
    """On the SuperLink's host, under the run lock: resolve the config as a local start would, prepare
    RUN if it is not, and save run.toml."""
    import tempfile

    from coordinator.start import _explicit_keys, ensure_prepared, resolve_config

    config_text, overrides = decode_request(value)
    with tempfile.TemporaryDirectory(prefix="soma-start-") as tmp:
        path = None
        if config_text is not None:
            path = Path(tmp) / "config.toml"
            path.write_text(config_text, encoding="utf-8")
        run.root.mkdir(parents=True, exist_ok=True)
        cfg = resolve_config(run, path, overrides)
        given = set(overrides) | (_explicit_keys(path) if path else set())
        ensure_prepared(run, cfg, given, own_lock=True)  # the ServerApp holds the lock it prepares under
    run.save_config(cfg)


def start(opts) -> int:
    """Submit to the external SuperLink and follow the run there until it finishes."""
    if not Path(opts.run).is_absolute():
        raise ConfigError(
            f"--run {opts.run}: with --superlink, give the absolute path of the run directory on the "
            "SuperLink's host (Flower runs the coordinator there)"
        )
    if opts.auth:
        raise ConfigError(
            "--auth registers worker keys with the embedded SuperLink; with --superlink, register "
            "them there (`flwr supernode register KEY.pub`)"
        )
    text = None
    if opts.config is not None:
        try:
            text = Path(opts.config).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"--config {opts.config}: cannot read ({e.strerror})") from None
    home = flwr_home()
    run_id = launcher.submit(
        home, Path(opts.run), opts.superlink, opts.tls, extra={START_KEY: encode_request(text, opts.overrides or {})}
    )
    print(
        f"submitted Flower run {run_id} to {opts.superlink}; following it through the SuperLink "
        "(Flower delivers the coordinator's log in batches)",
        flush=True,
    )
    return follow(home, run_id)


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
