"""The workers a run trusts: their public keys in RUN/workers.json, and their registration with Flower.

With `soma-coord start --auth` the embedded SuperLink accepts only SuperNodes whose public key was
registered with it. It keeps that list in memory, so `start` registers every key of the registry each
time it starts; `soma-coord add-worker` on a live run registers the new key at once, through the run's
Flower connection (`flwr supernode register`). Within one SuperLink's life a key keeps its node id across
worker restarts.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from coordinator.launcher import superlink_running
from soma_edge.checkpoint import atomic_write
from soma_edge.errors import ConfigError, SomaError
from soma_edge.processes.launch import flower_bin, flower_env
from soma_edge.rundir.layout import RunDir
from soma_edge.wire.certs import fingerprint, read_public_key

MAX_REGISTRY_BYTES = 4 << 20


@dataclass
class Worker:
    name: str
    public_key: str  # one line, OpenSSH format
    fingerprint: str
    added: float
    node_id: int | None = None  # from the last registration with a live SuperLink

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Worker":
        """A row of workers.json (KeyError for a missing key; `node_id` came later, and may be absent)."""
        return cls(
            name=d["name"],
            public_key=d["public_key"],
            fingerprint=d["fingerprint"],
            added=d["added"],
            node_id=d.get("node_id"),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load(run: RunDir) -> list[Worker]:
    path = run.registry_path
    if not path.exists():
        return []
    try:
        if path.stat().st_size > MAX_REGISTRY_BYTES:
            raise ValueError("too large")
        rows = json.loads(path.read_bytes())
        return [Worker.from_dict(r) for r in rows]
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(
            f"{path}: not a worker registry ({e}); fix or remove it, then add the workers again"
        ) from None


def save(run: RunDir, workers: list[Worker]) -> None:
    atomic_write(run.registry_path, (json.dumps([w.to_dict() for w in workers], indent=2) + "\n").encode(), mode=0o644)


def add(run: RunDir, public_key: Path, name: str | None = None) -> Worker:
    """Register a worker's public key with the run (by its file); ConfigError for a bad or repeated key."""
    key = read_public_key(public_key)
    fp = fingerprint(key)
    name = name or public_key.stem
    workers = load(run)
    for w in workers:
        if w.fingerprint == fp:
            raise ConfigError(f"{public_key}: this key is already registered, as worker {w.name!r}")
        if w.name == name:
            raise ConfigError(f"--name {name!r}: another key is registered under that name; pick another")
    worker = Worker(name=name, public_key=key, fingerprint=fp, added=time.time())
    save(run, workers + [worker])
    return worker


def register(flwr_home: Path, worker: Worker, connection: str, wait: float = 30.0) -> int | None:
    """Register one key with the SuperLink of `connection` (in flwr_home's config); its node id (None when
    another command registered it a moment before). Retries while the SuperLink's Control API is still
    coming up, for up to `wait` seconds."""
    deadline = time.monotonic() + wait
    while True:
        out = _flwr_register(flwr_home, worker, connection)
        if out.get("success") and isinstance(out.get("node-id"), int):
            return out["node-id"]
        why = str(out.get("error-message") or out).strip().splitlines()
        if "already in use" in str(why):  # `start` and `add-worker` both registered it just now: it is
            return None
        if "unavailable" not in str(why) or time.monotonic() >= deadline:
            raise SomaError(f"could not register worker {worker.name!r} with the SuperLink: {why[-1] if why else out}")
        time.sleep(1.0)


def _flwr_register(flwr_home: Path, worker: Worker, connection: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="soma-key-") as tmp:
        pub = Path(tmp) / f"{worker.fingerprint}.pub"
        pub.write_text(worker.public_key + "\n")
        cmd = [
            flower_bin("flwr"),
            "supernode",
            "register",
            str(pub),
            connection,
            "--name",
            worker.name,
            "--format",
            "json",
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, env=flower_env(flwr_home), timeout=60)
    text = r.stdout[r.stdout.find("{") :] if "{" in r.stdout else ""
    try:
        out = json.loads(text)
    except ValueError:
        out = None
    return out if isinstance(out, dict) else {"error-message": (r.stdout + r.stderr).strip() or f"exit {r.returncode}"}


def live(run: RunDir) -> bool:
    """Whether RUN's SuperLink is up, so that a key added now must be registered with it: from the moment
    `start` launched it, not only once the ServerApp holds the run (a key added in between was missed)."""
    return (run.flwr_home / "config.toml").is_file() and (run.is_locked() or superlink_running(run.flwr_home))


def register_all(run: RunDir, connection: str, only: str | None = None) -> list[Worker]:
    """Register every key of the run's registry (or only the one with fingerprint `only`) with the live
    SuperLink, recording their node ids in the registry; the workers registered."""
    workers = load(run)
    done = [w for w in workers if only is None or w.fingerprint == only]
    for w in done:
        w.node_id = register(run.flwr_home, w, connection)
    save(run, workers)
    return done
