"""The run directory: everything one federated training run owns, and the lock that makes it one writer's.

    RUN/run.toml             resolved config (written once, read by every later start)
    RUN/router.msgpack       the predetermined router        \\  written by `prepare`
    RUN/prepare.json         shards per expert and split      |
    RUN/shards/<sha256>.bin  content-addressed data shards   /
    RUN/experts/<e>/v<n>.msgpack   accepted expert versions (last `keep_versions` kept)
    RUN/experts/<e>/l<n>.msgpack   the update log that made version n (log replies), for downstream logs
    RUN/state.msgpack        round, versions, assignment: the commit point of a round
    RUN/metrics.jsonl        one line per expert per round, one per round
    RUN/tb/                  TensorBoard event files: the same numbers (coordinator.board)
    RUN/status.json          live progress for `soma-coord start` to draw
    RUN/stop.json            a request (`soma-coord stop`) to stop once the round in progress commits
    RUN/logs/                logs of every process `start` launched
    RUN/flwr/                FLWR_HOME of the embedded SuperLink and the `flwr` CLI
    RUN/run.lock             held by the one ServerApp writing this directory

Round r commits by writing state.msgpack last: expert files written before it are overwritten by the
same round's retry after a crash, and metrics.jsonl, which only grows during a run (each commit appends
its lines), is truncated on resume to the committed rounds, a torn last line dropped, so a resumed run
neither repeats nor skips a round.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import tomli_w

from soma_edge import checkpoint
from soma_edge import config as config_mod
from soma_edge.config import Config
from soma_edge.errors import CheckpointError, CorpusError
from soma_edge.rundir.state import (
    EXPERT_KIND,
    LOG_KIND,
    STATE_KIND,
    PrepareSummary,
    RunState,
)
from soma_edge.wire.protocol import weights_sha256


class RunLockedError(CheckpointError):
    """Another live process holds the run directory."""


class RunDir:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.fallback: str | None = None  # why the last read_state fell back to state.prev.msgpack
        self.unsynced: set[Path] = set()  # versions and logs written since the last commit, not yet durable

    # --- paths ----------------------------------------------------------------------------------------
    run_toml = property(lambda self: self.root / "run.toml")
    router = property(lambda self: self.root / "router.msgpack")
    prepare_json = property(lambda self: self.root / "prepare.json")
    state_path = property(lambda self: self.root / "state.msgpack")
    prev_state_path = property(lambda self: self.root / "state.prev.msgpack")  # the commit before, kept as fallback
    metrics_path = property(lambda self: self.root / "metrics.jsonl")
    tb = property(lambda self: self.root / "tb")
    status_path = property(lambda self: self.root / "status.json")
    stop_path = property(lambda self: self.root / "stop.json")  # `soma-coord stop`: stop after the round in progress
    logs = property(lambda self: self.root / "logs")
    flwr_home = property(lambda self: self.root / "flwr")
    lock_path = property(lambda self: self.root / "run.lock")
    registry_path = property(lambda self: self.root / "workers.json")  # the worker keys it trusts (`add-worker`)

    def is_run(self) -> bool:
        """Whether the folder holds any file a run writes (its keys, its lock, its prepared data, its commits):
        the lock alone is a first start that is still preparing, which `status --watch` follows."""
        marks = (self.run_toml, self.prepare_json, self.router, self.state_path, self.prev_state_path)
        return any(p.exists() for p in (*marks, self.metrics_path, self.registry_path, self.lock_path))

    def expert_rel(self, expert: int, version: int) -> str:
        return f"experts/{expert}/v{version}.msgpack"

    # --- config and prepared data ---------------------------------------------------------------------

    def has_config(self) -> bool:
        return self.run_toml.exists()

    def load_config(self) -> Config:
        return config_mod.load(self.run_toml, saved_run=True)

    def save_config(self, cfg: Config) -> None:
        checkpoint.atomic_write(self.run_toml, tomli_w.dumps(cfg.to_dict()).encode())

    def is_prepared(self) -> bool:
        return self.prepare_json.exists() and self.router.exists()

    def load_prepare(self) -> dict[str, Any]:
        """prepare.json as parsed (coordinator.runconfig compares a few of its keys; all else: `read_prepare`)."""
        try:
            return json.loads(self.prepare_json.read_text())
        except OSError as e:
            raise CorpusError(
                f"{self.prepare_json}: cannot read ({e.strerror}); run `soma-coord prepare` into {self.root}"
            ) from None
        except ValueError as e:
            raise CorpusError(f"{self.prepare_json}: not valid JSON ({e})") from None

    def read_prepare(self) -> PrepareSummary:
        """prepare.json as a record (CheckpointError naming a required key it lacks)."""
        return PrepareSummary.from_dict(self.load_prepare(), str(self.prepare_json))

    def router_bytes(self) -> bytes:
        try:
            return self.router.read_bytes()
        except OSError as e:
            raise CheckpointError(f"{self.router}: cannot read the router ({e.strerror})") from None

    def shard(self, sha: str) -> bytes:
        path = self.root / "shards" / f"{sha}.bin"
        try:
            data = path.read_bytes()
        except OSError as e:
            raise CorpusError(f"{path}: cannot read shard ({e.strerror})") from None
        if hashlib.sha256(data).hexdigest() != sha:
            raise CorpusError(f"{path}: shard content does not match its sha256 name; re-run prepare")
        return data

    # --- experts --------------------------------------------------------------------------------------

    def save_expert(self, body: dict[str, Any]) -> str:
        """Write a version; it becomes durable with the next `save_state`, the commit that names it."""
        rel = self.expert_rel(body["expert"], body["version"])
        self._save_unsynced(self.root / rel, body, EXPERT_KIND)
        return rel

    def _save_unsynced(self, path: Path, body: dict[str, Any], kind: str) -> None:
        checkpoint.save(path, body, kind, durable=False)
        self.unsynced.add(path)

    def load_expert(self, rel: str) -> dict[str, Any]:
        return checkpoint.load(self.root / rel, EXPERT_KIND)

    def log_path(self, expert: int, version: int) -> Path:
        return self.root / "experts" / str(expert) / f"l{version}.msgpack"

    def save_log(self, expert: int, version: int, body: dict[str, Any]) -> None:
        """The update log that made `version` from the version before it (`from_sha256`); durable with the
        next `save_state`."""
        self._save_unsynced(self.log_path(expert, version), body, LOG_KIND)

    def load_log(self, expert: int, version: int) -> dict[str, Any] | None:
        """That log, or None when there is none (weights replies) or it does not load (it is an optimization)."""
        try:
            body = checkpoint.load(self.log_path(expert, version), LOG_KIND)
        except CheckpointError:
            return None
        return body if isinstance(body, dict) else None

    def clean_debris(self) -> list[Path]:
        """Remove the temp files of atomic writes that a crash interrupted (only the lock holder may)."""
        gone = [p for p in [*self.root.glob(".*.tmp"), *self.root.glob("experts/*/.*.tmp")] if p.is_file()]
        for p in gone:
            p.unlink(missing_ok=True)
        return gone

    def prune(self, expert: int, keep: int, current: int, protect: tuple[int, ...] = ()) -> list[Path]:
        """Delete all but the newest `keep` versions at or below `current` (and anything above it: a
        version above the committed one is debris of a crashed round), never those in `protect`."""
        folder = self.root / "experts" / str(expert)
        found = []
        for p in folder.glob("v*.msgpack"):
            try:
                found.append((int(p.stem[1:]), p))
            except ValueError:
                continue
        gone = [p for v, p in found if (v > current or v <= current - keep) and v not in protect]
        for p in gone:
            p.unlink(missing_ok=True)
            p.with_name("l" + p.name[1:]).unlink(missing_ok=True)  # its update log goes with it
        return gone

    # --- state and metrics ----------------------------------------------------------------------------

    def read_state(self, verify: bool = False) -> RunState | None:
        """The last committed state that reads (and, with `verify`, whose expert files all load and match
        their hashes): state.msgpack, else the commit before it (state.prev.msgpack), with one warning in
        `self.fallback`. None for a run that never committed; CheckpointError when nothing committed reads."""
        self.fallback = None
        errors = []
        for path in (self.state_path, self.prev_state_path):
            if not path.exists():
                continue
            try:
                state = checkpoint.load(path, STATE_KIND)
                if not isinstance(state, dict):
                    raise CheckpointError(f"{path}: not a run state (a {type(state).__name__}, not a map)")
                if verify:
                    verify_experts(self, state, path)
                rec = RunState.from_dict(state, str(path))
            except CheckpointError as e:
                errors.append(str(e))
                continue
            if path != self.state_path:
                why = errors[0] if errors else f"{self.state_path} is missing"
                self.fallback = f"{why}; falling back to the commit before it ({path.name}, round {rec.round})"
            return rec
        if errors:
            raise CheckpointError(
                f"{self.root}: no committed state loads ({'; '.join(errors)}); the run cannot resume: "
                "start a new one with another --run"
            )
        return None

    def read_state_file(self, path: Path) -> RunState:
        """One state file as a record, with no fallback (export reads the last commit, and only it)."""
        return RunState.from_dict(checkpoint.load(path, STATE_KIND), str(path))

    def save_state(self, state: dict[str, Any]) -> None:
        """Commit `state` (a `RunState.to_dict()`); the state it replaces stays as state.prev.msgpack, the
        fallback of `read_state` (a crash between the two steps leaves that fallback, which it then uses).
        The versions and logs written since the last commit become durable first, all together."""
        checkpoint.sync(sorted(self.unsynced))
        self.unsynced.clear()
        if self.state_path.exists():
            os.replace(self.state_path, self.prev_state_path)
        checkpoint.save(self.state_path, state, STATE_KIND)

    def read_metrics(self) -> list[dict[str, Any]]:
        try:
            text = self.metrics_path.read_text()
        except FileNotFoundError:
            return []
        return json_lines(text.splitlines())

    def append_metrics(self, lines: list[dict[str, Any]]) -> None:
        """Add a commit's lines in one write, then fsync: the file only grows while a run goes on, so what
        tails it never sees it rewritten. A crash may tear the last line (`truncate_metrics` drops it)."""
        new = not self.metrics_path.exists()
        try:
            with open(self.metrics_path, "ab") as f:
                f.write(metrics_bytes(lines))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise CheckpointError(f"{self.metrics_path}: cannot append ({e.strerror or e})") from None
        if new:
            checkpoint.fsync_dir(self.root)

    def write_metrics(self, lines: list[dict[str, Any]]) -> None:
        checkpoint.atomic_write(self.metrics_path, metrics_bytes(lines))

    def truncate_metrics(self, last_round: int) -> None:
        """On resume: keep the lines of committed rounds (a crash may have cut a commit short after its
        metrics went in) and drop a torn last line; rewritten atomically, and only if something goes."""
        try:
            raw = self.metrics_path.read_bytes()
        except FileNotFoundError:
            return
        *whole, tail = raw.split(b"\n")  # what follows the last newline is torn (or nothing)
        kept = [m for m in json_lines(whole) if int(m.get("round", 0)) <= last_round]
        if tail or len(kept) != len(whole):
            self.write_metrics(kept)

    def write_status(self, status: dict[str, Any]) -> None:
        checkpoint.atomic_write(self.status_path, json.dumps(status, default=_json_default).encode())

    def request_stop(self) -> None:
        checkpoint.atomic_write(self.stop_path, json.dumps({"time": time.time(), "pid": os.getpid()}).encode())

    def stop_requested(self) -> bool:
        return self.stop_path.exists()

    def clear_stop(self, before: float | None = None) -> None:
        """Remove the stop request; with `before`, only one made before that time (or unreadable)."""
        if before is not None:
            try:
                if float(json.loads(self.stop_path.read_text())["time"]) >= before:
                    return
            except FileNotFoundError:
                return
            except (OSError, ValueError, KeyError, TypeError):
                pass
        self.stop_path.unlink(missing_ok=True)

    def read_status(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return None

    # --- the lock -------------------------------------------------------------------------------------

    def lock(self, wait: float = 0.0) -> AbstractContextManager[None]:
        """Exclusive hold on the run directory (flock: released by the kernel when the holder dies, even
        by kill -9). Waits up to `wait` seconds for a previous holder to exit."""
        return hold(self.root, self.lock_path, wait)

    def lock_holder(self) -> int | None:
        return holder(self.lock_path)

    def is_locked(self) -> bool:
        return held(self.lock_path)


def existing(path: str | Path) -> RunDir:
    """The run directory a command that reads one was given: CheckpointError, naming PATH, when it does not
    exist, is not a directory or holds no run (a mistyped path would otherwise read as an empty run)."""
    run = RunDir(path)
    if not run.root.exists():
        raise CheckpointError(f"{path}: no such run directory")
    if not run.root.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    if not run.is_run():
        raise CheckpointError(
            f"{path}: not a run directory (no run.toml, prepare.json, state.msgpack or workers.json in it)"
        )
    return run


def verify_experts(run: RunDir, state: Any, where: Path) -> None:
    """Every expert file that a state (read from `where`) refers to loads, and holds the weights it names."""
    experts = state.get("experts") if isinstance(state, dict) else None
    if not isinstance(experts, dict):
        raise CheckpointError(f"{where}: no experts map")
    for e, x in experts.items():
        if not isinstance(x, dict) or not isinstance(x.get("sha256"), str):
            raise CheckpointError(f"{where}: expert {e!r} is not a version record")
        body = run.load_expert(str(x.get("path", "")))
        w = body.get("weights") if isinstance(body, dict) else None
        if not isinstance(w, np.ndarray) or weights_sha256(w) != x["sha256"]:
            raise CheckpointError(f"{run.root / str(x.get('path'))}: weights do not match {where.name}")


# --- the lock (RunDir.lock) -------------------------------------------------------------------------------


@contextmanager
def hold(root: Path, lock_path: Path, wait: float) -> Iterator[None]:
    """Hold the flock on `lock_path` (with our pid in it), waiting up to `wait` seconds for it."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    pid = holder(lock_path)
                    raise RunLockedError(
                        f"{root} is in use by another coordinator (pid {pid}); stop it first"
                    ) from None
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        os.close(fd)  # closing releases the flock


def holder(lock_path: Path) -> int | None:
    """The pid written by the last holder of the lock."""
    try:
        return int(lock_path.read_text().strip() or 0) or None
    except (OSError, ValueError):
        return None


def held(lock_path: Path) -> bool:
    """Whether a live process holds the lock."""
    if not lock_path.exists():
        return False
    fd = os.open(lock_path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def json_lines(lines: list[str] | list[bytes]) -> list[Any]:
    """The lines that parse as JSON: a log is never a reason to fail."""
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def metrics_bytes(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line, default=_json_default) + "\n" for line in lines).encode()


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")
