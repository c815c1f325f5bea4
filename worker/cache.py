"""The worker's disk cache: data shards by sha256 and expert weights by version hash.

Flower starts a fresh ClientApp process for every message, so nothing survives in memory between
rounds. With this cache an unchanged assignment costs no transfer: the coordinator names the shard
hashes and the base version hash, and the worker finds both here. Entries are content-addressed and
verified on read; a corrupt entry is dropped and reported missing rather than trained on.

Bounded two ways: at most `keep_versions` weight versions per expert of each run besides its pinned ones
(the oldest written pruned; version numbers of different runs are unrelated, and one cache folder serves
every run a worker joins), and at most `max_bytes` in all (least recently used dropped first). An expert's
pinned versions are those the coordinator may name next (`pin`): the base its last task named, the
accepted version under a base still to be judged (a round planned ahead of the last one's checks), and
the result sent. A version the guard may still refuse can then never push out the one the expert would
train from again: every result is cached before it is judged, and a refused one, retrained, shares its
version number with the next. All writes are atomic, so two workers sharing one cache folder cannot see
half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from soma_edge import checkpoint
from soma_edge.errors import CheckpointError
from soma_edge.wire.protocol import weights_sha256

KIND = "worker_weights"
DEFAULT_MAX_BYTES = 2 << 30
HEARTBEAT_ADVICE = "heartbeat"  # get_json/put_json name: the coordinator's advised heartbeat interval (s)


@dataclass
class Cache:
    root: Path
    max_bytes: int = DEFAULT_MAX_BYTES
    keep_versions: int = 3
    # The side index's entries read so far, by file name: a version's (run, expert, version) never changes, so
    # each is read once per Cache, not once per version stored (a node of 105 experts spent 6 s a round on it).
    _meta: dict[str, tuple[str | None, int, int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        for sub in ("shards", "weights", "probe", "parts", "pins"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    # --- shards -------------------------------------------------------------------------------------

    def _shard_path(self, sha: str) -> Path:
        if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            raise ValueError(f"not a sha256 hex digest: {sha!r}")
        return self.root / "shards" / f"{sha}.bin"

    def put_shard(self, sha: str, data: bytes) -> None:
        if hashlib.sha256(data).hexdigest() != sha:
            raise CheckpointError(f"shard {sha[:12]}: its bytes do not hash to its name")
        checkpoint.atomic_write(self._shard_path(sha), data)

    def put_piece(self, sha: str, offset: int, total: int, data: bytes) -> bool:
        """Store bytes [offset, offset + len(data)) of shard `sha` of `total` bytes (pieces may come in any
        order, each in its own process); True once the whole shard is here, assembled and verified."""
        if offset == 0 and len(data) == total:
            self.put_shard(sha, data)
            return True
        if self._shard_path(sha).exists():
            return True
        folder = self.root / "parts" / f"{sha}-{total}"
        checkpoint.atomic_write(folder / f"{offset:016d}.bin", data)
        return self._assemble(sha, total, folder)

    def _assemble(self, sha: str, total: int, folder: Path) -> bool:
        """Join the pieces in `folder` into the shard once they cover it, hashing as they stream to disk."""
        parts = []
        for p in folder.glob("*.bin"):
            try:
                parts.append((int(p.stem), p.stat().st_size, p))
            except (ValueError, FileNotFoundError):
                continue
        end = 0
        for off, size, _ in sorted(parts):
            if off > end:
                return False  # a gap: more pieces to come
            end = max(end, off + size)
        if end < total:
            return False
        digest = hashlib.sha256()
        fd, tmp = tempfile.mkstemp(dir=self.root / "shards", prefix=f".{sha}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                pos = 0
                for off, size, p in sorted(parts):
                    if off + size <= pos:
                        continue
                    chunk = p.read_bytes()[pos - off :]
                    digest.update(chunk)
                    out.write(chunk)
                    pos += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            if digest.hexdigest() != sha:
                raise CheckpointError(
                    f"shard {sha[:12]}: its {total} bytes, joined from pieces, do not hash to its name"
                )
            os.replace(tmp, self._shard_path(sha))
        except (OSError, CheckpointError):
            Path(tmp).unlink(missing_ok=True)
            shutil.rmtree(folder, ignore_errors=True)  # bad pieces: the coordinator sends them again
            raise
        shutil.rmtree(folder, ignore_errors=True)
        return True

    def get_shard(self, sha: str) -> bytes | None:
        path = self._shard_path(sha)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if hashlib.sha256(data).hexdigest() != sha:
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # LRU clock
        return data

    def shards(self) -> list[str]:
        return sorted(p.stem for p in (self.root / "shards").glob("*.bin"))

    # --- weights ------------------------------------------------------------------------------------

    def _weights_path(self, sha: str) -> Path:
        self._shard_path(sha)  # same digest check
        return self.root / "weights" / f"{sha}.msgpack"

    def put_weights(
        self,
        sha: str,
        *,
        expert: int,
        version: int,
        step: int,
        weights: np.ndarray,
        opt: dict[str, Any] | None,
        run_id: str | None = None,
    ) -> None:
        """Store a version with its optimizer state (`spsa.optim.OptState.to_record`, or None for a fresh one)."""
        if weights_sha256(weights) != sha:
            raise CheckpointError(f"weights {sha[:12]}: the array does not hash to its name")
        body = {"expert": expert, "version": version, "step": step, "sha256": sha, "weights": weights, "opt": opt}
        path = self._weights_path(sha)
        # The side index (run, expert, version) is written first, so the newest version always counts in pruning.
        # No fsyncs: a version a power cut loses fails its checksum or is gone, and the coordinator sends it
        # again when the node reports it missing; a worker of 64 experts stored 128 files a round.
        meta = {"run_id": run_id, "expert": expert, "version": version}
        checkpoint.atomic_write(path.with_suffix(".json"), json.dumps(meta).encode(), durable=False)
        checkpoint.save(path, body, KIND, durable=False)
        self._meta[path.name] = (run_id, expert, version)  # the same weights stored again under another run
        self._prune_versions(run_id, expert)

    def get_weights(self, sha: str) -> dict[str, Any] | None:
        path = self._weights_path(sha)
        if not path.exists():
            return None
        try:
            body = checkpoint.load(path, KIND)
        except CheckpointError:
            path.unlink(missing_ok=True)
            return None
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("weights"), np.ndarray)
            or weights_sha256(body["weights"]) != sha
        ):
            path.unlink(missing_ok=True)
            return None
        os.utime(path)
        return body

    def weights(self) -> list[str]:
        return sorted(p.stem for p in (self.root / "weights").glob("*.msgpack"))

    def _index(self) -> dict[str, tuple[str | None, int, int]]:
        """File name -> (run_id, expert, version) of every cached version, read from a small side index per
        file (run_id None for entries written without one). The folder is listed every time, so that versions
        other processes stored or removed count, but each side file is read once."""
        listed = set()
        for entry in os.scandir(self.root / "weights"):
            if not entry.name.endswith(".msgpack"):
                continue
            listed.add(entry.name)
            if entry.name not in self._meta:
                try:
                    m = json.loads(Path(entry.path).with_suffix(".json").read_text())
                    self._meta[entry.name] = (m.get("run_id"), int(m["expert"]), int(m["version"]))
                except (OSError, ValueError, KeyError, TypeError, AttributeError):
                    continue
        for gone in set(self._meta) - listed:
            del self._meta[gone]
        return self._meta

    def _pins_path(self, run_id: str | None, expert: int) -> Path:
        run = hashlib.sha256(str(run_id).encode()).hexdigest()[:16]  # a run id is not a file name
        return self.root / "pins" / f"{run}-{int(expert)}.json"

    def pin(self, run_id: str | None, expert: int, shas: list[str]) -> None:
        """Keep these versions of `expert` whatever else is cached after them (None entries are skipped); the
        expert's earlier pins go."""
        want = sorted({s for s in shas if isinstance(s, str)})
        path = self._pins_path(run_id, expert)
        if self.pinned(run_id, expert) != set(want):
            checkpoint.atomic_write(path, json.dumps(want).encode(), durable=False)

    def pinned(self, run_id: str | None, expert: int) -> set[str]:
        try:
            got = json.loads(self._pins_path(run_id, expert).read_text())
        except (OSError, ValueError):
            return set()
        return {s for s in got if isinstance(s, str)} if isinstance(got, list) else set()

    def _prune_versions(self, run_id: str | None, expert: int) -> None:
        pinned = self.pinned(run_id, expert)
        mine = []
        for name, (r, e, v) in self._index().items():
            if r != run_id or e != expert or name.removesuffix(".msgpack") in pinned:
                continue
            p = self.root / "weights" / name
            try:  # newest written first, not highest numbered: after a refusal, the version trained
                # again from the accepted one has a lower number than one trained on from the refused
                mine.append((p.stat().st_mtime_ns, v, p))
            except FileNotFoundError:
                continue
        mine.sort()
        for _, _, p in mine[: max(0, len(mine) - self.keep_versions)]:
            p.unlink(missing_ok=True)
            p.with_suffix(".json").unlink(missing_ok=True)

    # --- bounds -------------------------------------------------------------------------------------

    def evict(self, protect: set[str] = frozenset()) -> list[str]:
        """Drop least recently used entries until the cache fits `max_bytes`; never those in `protect`."""
        files = [
            p for sub in ("shards", "weights") for p in (self.root / sub).iterdir() if p.suffix in (".bin", ".msgpack")
        ]
        stats = []
        for p in files:
            try:  # one stat: another worker sharing this folder may unlink the file at any moment
                st = p.stat()
            except FileNotFoundError:
                continue
            stats.append((st.st_mtime, st.st_size, p))
        total = sum(s for _, s, _ in stats)
        dropped = []
        for _, size, p in sorted(stats, key=lambda t: t[0]):
            if total <= self.max_bytes:
                break
            if p.stem in protect:
                continue
            p.unlink(missing_ok=True)
            p.with_suffix(".json").unlink(missing_ok=True)
            total -= size
            dropped.append(p.stem)
        return dropped

    def inventory(self) -> dict[str, list[str]]:
        return {"weights": self.weights(), "shards": self.shards()}

    # --- small JSON blobs (the probe result) ------------------------------------------------------------

    def get_json(self, name: str) -> Any | None:
        try:
            return json.loads((self.root / "probe" / f"{name}.json").read_text())
        except (OSError, ValueError):
            return None

    def put_json(self, name: str, value: Any) -> None:
        checkpoint.atomic_write(self.root / "probe" / f"{name}.json", json.dumps(value).encode())
