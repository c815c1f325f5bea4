import os

import msgpack
import numpy as np
import pytest

from soma_edge import checkpoint, codec
from soma_edge.errors import CheckpointError, CodecError


def test_roundtrip_arrays_and_scalars():
    body = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "h": np.float16(1.5), "n": 3, "s": "x", "t": (1, 2)}
    out = codec.decode(codec.encode(body, "k"), "k")
    assert out["w"].dtype == np.float32 and out["w"].shape == (3, 4)
    assert np.array_equal(out["w"], body["w"])
    assert out["t"] == [1, 2] and out["n"] == 3 and out["h"] == 1.5


def test_refuses_oversize_wrong_kind_schema_and_garbage():
    data = codec.encode({"a": 1}, "k")
    with pytest.raises(CodecError, match="exceeds"):
        codec.decode(data, "k", max_bytes=len(data) - 1)
    with pytest.raises(CodecError, match="expected a other"):
        codec.decode(data, "other")
    with pytest.raises(CodecError, match="schema"):
        codec.decode(msgpack.packb({"schema": 99, "kind": "k", "body": 1}), "k")
    with pytest.raises(CodecError):
        codec.decode(b"\xc1\xff\x00garbage", "k")
    with pytest.raises(CodecError, match="envelope"):
        codec.decode(msgpack.packb([1, 2, 3]), "k")


def test_refuses_lying_array_header_and_object_dtype():
    header = msgpack.packb(["<f4", [1000]])
    bad = msgpack.packb({"schema": 1, "kind": "k", "body": msgpack.ExtType(1, header + b"\x00" * 8)})
    with pytest.raises(CodecError, match="does not match"):
        codec.decode(bad, "k")
    header = msgpack.packb(["|O", [1]])
    bad = msgpack.packb({"schema": 1, "kind": "k", "body": msgpack.ExtType(1, header + b"\x00" * 8)})
    with pytest.raises(CodecError):
        codec.decode(bad, "k")
    with pytest.raises(CodecError):
        codec.encode({"a": np.array(["x"], dtype=object)}, "k")


def test_checkpoint_detects_corruption(tmp_path):
    p = tmp_path / "e.msgpack"
    digest = checkpoint.save(p, {"w": np.ones(10, dtype=np.float32)}, "expert")
    assert len(digest) == 64
    assert np.array_equal(checkpoint.load(p, "expert")["w"], np.ones(10, dtype=np.float32))
    data = bytearray(p.read_bytes())
    data[-3] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        checkpoint.load(p, "expert")
    p.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="magic"):
        checkpoint.load(p, "expert")
    with pytest.raises(CheckpointError, match="cannot read"):
        checkpoint.load(tmp_path / "missing", "expert")
    assert [f.name for f in tmp_path.iterdir()] == ["e.msgpack"]  # no temp files left behind


def test_unwritable_path_is_a_checkpoint_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="cannot write"):
        checkpoint.atomic_write(blocker / "sub" / "x.bin", b"data")
    with pytest.raises(CheckpointError, match="cannot write"):
        checkpoint.atomic_write(tmp_path, b"data")  # a folder where the file should go
    assert blocker.read_bytes() == b"x" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_versions_become_durable_with_the_commit_that_names_them(tmp_path, monkeypatch):
    from soma_edge.rundir.layout import RunDir

    run = RunDir(tmp_path)
    synced: list = []
    monkeypatch.setattr(checkpoint, "sync", lambda paths: synced.append(list(paths)))
    rel = run.save_expert({"expert": 3, "version": 1, "weights": b"w"})
    run.save_log(3, 1, {"log": b"l"})
    assert synced == [] and run.unsynced == {run.root / rel, run.log_path(3, 1)}
    run.save_state({"round": 1})
    assert synced == [sorted([run.root / rel, run.log_path(3, 1)])] and not run.unsynced
    run.save_state({"round": 2})
    assert synced[-1] == []  # nothing written since: nothing to wait for


def test_sync_makes_files_durable_and_skips_removed_ones(tmp_path, monkeypatch):
    a, b = tmp_path / "x" / "a", tmp_path / "y" / "b"
    checkpoint.atomic_write(a, b"1", durable=False)
    checkpoint.atomic_write(b, b"2", durable=False)
    assert a.read_bytes() == b"1" and not list(tmp_path.glob("*/.*.tmp"))
    fsynced: list = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsynced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    b.unlink()
    checkpoint.sync([a, b])
    assert sorted(fsynced) == sorted([str(a), str(a.parent), str(b.parent)])
