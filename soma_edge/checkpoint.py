"""Atomic, checksummed files.

Every file the project writes goes through `atomic_write` (temp file in the same folder, fsync, rename,
fsync of the folder), so a crash leaves the old file or the new one, never half of one. Checkpoints add a
magic and a sha256 of the payload, so corruption is detected on load instead of becoming bad weights.

A writer of many files at once (a round's expert versions) writes them with `durable=False` and makes them
durable together with `sync` before the write that names them (state.msgpack): one fsync per file, one
after another, cost the coordinator 5-9 s of each commit at N = 256 while its workers wrote too.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

from soma_edge import codec
from soma_edge.errors import CheckpointError, CodecError

MAGIC = b"SOMACKP1"
SYNC_THREADS = 16  # fsyncs in flight at once in `sync`: the filesystem's journal commits them together


def sha256_file(path: str | Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write(path: str | Path, data: bytes, mode: int | None = None, durable: bool = True) -> None:
    """Write `data` to `path` atomically; `mode` sets its permissions (default: mkstemp's owner-only 0600).
    `durable=False` leaves out the fsyncs: a crash of the process still leaves the old file or the new one,
    but the machine's crash may lose the write until `sync` makes it durable."""
    path = Path(path)
    try:
        _atomic_write(path, data, mode, durable)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot write ({e.strerror or e})") from None


def sync(paths: Iterable[str | Path]) -> None:
    """Make files written with `durable=False` durable: each file, then each of their folders (their renames),
    fsynced on SYNC_THREADS threads."""
    files = [Path(p) for p in paths]
    if not files:
        return
    folders = sorted({p.parent for p in files})
    try:
        with ThreadPoolExecutor(min(SYNC_THREADS, len(files)), thread_name_prefix="fsync") as pool:
            list(pool.map(_fsync_file, files))
            list(pool.map(fsync_dir, folders))
    except OSError as e:
        raise CheckpointError(f"{e.filename}: cannot make it durable ({e.strerror or e})") from None


def _fsync_file(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return  # removed since (a pruned version): nothing of it to keep
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes, mode: int | None, durable: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make a folder's entries (a rename, a new file) durable."""
    try:
        dfd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # no directory fsync on this platform
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def save(path: str | Path, body: Any, kind: str, durable: bool = True) -> str:
    """Write `body` as a checksummed msgpack file; returns the payload's sha256 (`durable`: atomic_write's)."""
    payload = codec.encode(body, kind)
    digest = hashlib.sha256(payload).digest()
    atomic_write(path, MAGIC + digest + payload, durable=durable)
    return digest.hex()


def load(path: str | Path, kind: str, max_bytes: int = codec.MAX_BYTES) -> Any:
    path = Path(path)
    limit = max_bytes + len(MAGIC) + 32
    try:
        st = path.stat()
        # A FIFO blocks the open and a device never ends (either can sit at a path a state file names): only
        # regular files, and never more bytes than the limit, even if the file grows after the stat.
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: not a regular file")
        if st.st_size > limit:
            raise CheckpointError(f"{path}: {st.st_size} bytes exceeds the limit of {max_bytes}")
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    except ValueError:  # os.stat refuses a path with a NUL byte (a crafted name in a state file)
        raise CheckpointError(f"{str(path)!r}: not a valid file path") from None
    if len(data) > limit:
        raise CheckpointError(f"{path}: grew past the limit of {max_bytes} bytes while being read")
    if len(data) < len(MAGIC) + 32 or data[: len(MAGIC)] != MAGIC:
        raise CheckpointError(f"{path}: not a soma-edge checkpoint (bad magic)")
    digest, payload = data[len(MAGIC) : len(MAGIC) + 32], data[len(MAGIC) + 32 :]
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"{path}: checksum mismatch, the file is corrupt")
    try:
        return codec.decode(payload, kind, max_bytes)
    except CodecError as e:
        raise CheckpointError(f"{path}: {e}") from None
