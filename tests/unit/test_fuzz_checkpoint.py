"""Bad input to the checkpoint loader (`soma_edge.checkpoint.load`) and the run state
(`soma_edge.rundir.layout.RunDir.read_state`).

Every case names its input (the parametrize id), expects the loader's own error type with a specific
fragment of its one-line message, and checks that what it was given (dicts, files) is unchanged.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from soma_edge import checkpoint, codec
from soma_edge.errors import CheckpointError
from soma_edge.wire import protocol
from tests.helpers.fuzz import (
    ARR3,
    EXAMPLES,
    arr_ext,
    cases,
    env,
    flip,
    one_line,
    tree,
)

BODY = {"weights": np.arange(16, dtype=np.float32), "expert": 0, "version": 1, "note": "x"}


def _ck_payload(obj, kind="expert") -> bytes:
    return codec.encode(obj, kind)


def _signed(payload: bytes) -> bytes:
    """A checkpoint file with a valid checksum around `payload`, whatever it holds."""
    return checkpoint.MAGIC + hashlib.sha256(payload).digest() + payload


GOOD_CK = _signed(_ck_payload(BODY))
HEAD = len(checkpoint.MAGIC) + 32

# (id, file bytes or a special, max_bytes, fragment)
CKPT_CASES = [
    ("empty", b"", None, "not a soma-edge checkpoint (bad magic)"),
    ("truncated-in-magic", GOOD_CK[:4], None, "bad magic"),
    ("truncated-after-magic", GOOD_CK[:8], None, "bad magic"),
    ("truncated-in-digest", GOOD_CK[:20], None, "bad magic"),
    ("truncated-after-digest", GOOD_CK[:HEAD], None, "checksum mismatch, the file is corrupt"),
    ("truncated-mid-payload", GOOD_CK[: HEAD + 20], None, "checksum mismatch"),
    ("truncated-last-byte", GOOD_CK[:-1], None, "checksum mismatch"),
    ("bad-magic", flip(GOOD_CK, 0), None, "bad magic"),
    ("other-magic-version", b"SOMACKP2" + GOOD_CK[8:], None, "bad magic"),
    ("flipped-payload-byte", flip(GOOD_CK, len(GOOD_CK) - 5), None, "checksum mismatch"),
    ("flipped-first-payload-byte", flip(GOOD_CK, HEAD), None, "checksum mismatch"),
    ("flipped-digest-byte", flip(GOOD_CK, 8 + 7), None, "checksum mismatch"),
    ("appended-byte", GOOD_CK + b"\x00", None, "checksum mismatch"),
    ("garbage-after-magic", checkpoint.MAGIC + bytes(range(256)), None, "checksum mismatch"),
    ("random-garbage", hashlib.sha512(b"garbage").digest() * 8, None, "bad magic"),
    ("signed-wrong-kind", _signed(_ck_payload(BODY, "run_state")), None, "expected a expert message, got 'run_state'"),
    ("signed-wrong-schema", _signed(msgpack.packb({"schema": 2, "kind": "expert", "body": 1})), None, "has schema 2"),
    ("signed-garbage-payload", _signed(b"\xc1\xc1"), None, "malformed expert message"),
    ("signed-bad-array", _signed(env(arr_ext(["<f4", [100]], b"\0" * 4), kind="expert")), None, "does not match its 4"),
    (
        "signed-object-dtype",
        _signed(env(arr_ext(["|O", [1]], b"\0" * 8), kind="expert")),
        None,
        "refusing array of dtype",
    ),
    ("oversize-vs-max-bytes", GOOD_CK, 64, "exceeds the limit of 64"),
    ("directory", "dir", None, "not a regular file"),
    ("fifo", "fifo", None, "not a regular file"),
    ("missing", "missing", None, "cannot read (No such file or directory)"),
    ("parent-is-a-file", "under-file", None, "cannot read (Not a directory)"),
    ("dangling-symlink", "dangling", None, "cannot read (No such file or directory)"),
    ("symlink-loop", "loop", None, "cannot read (Too many levels of symbolic links)"),
    ("nul-in-name", "nul", None, "not a valid file path"),
    ("unreadable", "unreadable", None, "cannot read (Permission denied)"),
]


def _load_guarded(path, kind, max_bytes=None, timeout=10.0):
    """checkpoint.load, failing (not hanging) when it blocks: opening a FIFO waits for a writer."""
    out = {}

    def target():
        try:
            out["value"] = checkpoint.load(path, kind, *(() if max_bytes is None else (max_bytes,)))
        except BaseException as e:  # reported to the test below
            out["error"] = e

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(timeout)
    if th.is_alive():
        if Path(path).is_fifo():
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # a writer releases the blocked open
            th.join(timeout)
        pytest.fail(f"checkpoint.load({path}) blocked for {timeout} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize("data,max_bytes,fragment", cases(CKPT_CASES))
def test_checkpoint_load_refuses(tmp_path, data, max_bytes, fragment):
    path = tmp_path / "e.msgpack"
    if isinstance(data, bytes):
        path.write_bytes(data)
    elif data == "dir":
        path.mkdir()
        (path / "inner").write_bytes(GOOD_CK)
    elif data == "fifo":
        os.mkfifo(path)
    elif data == "under-file":
        (tmp_path / "file").write_bytes(GOOD_CK)
        path = tmp_path / "file" / "e.msgpack"
    elif data == "dangling":
        path.symlink_to(tmp_path / "nowhere")
    elif data == "loop":
        path.symlink_to(tmp_path / "e2")
        (tmp_path / "e2").symlink_to(path)
    elif data == "nul":
        (tmp_path / "e").write_bytes(GOOD_CK)
        path = tmp_path / "e\0.msgpack"
    elif data == "unreadable":
        if os.geteuid() == 0:
            pytest.skip("root reads any file whatever its permissions")
        path.write_bytes(GOOD_CK)
        path.chmod(0)
    before = tree(tmp_path)
    with pytest.raises(CheckpointError) as got:
        _load_guarded(path, "expert", max_bytes)
    assert fragment in one_line(got.value), got.value
    assert tree(tmp_path) == before  # a failed load changes nothing on disk


def test_checkpoint_good_file_loads(tmp_path):
    """The baseline the cases break, and the exact size limit (max_bytes is the payload's)."""
    path = tmp_path / "e.msgpack"
    path.write_bytes(GOOD_CK)
    assert np.array_equal(checkpoint.load(path, "expert")["weights"], BODY["weights"])
    assert checkpoint.load(path, "expert", len(GOOD_CK) - HEAD)["version"] == 1
    with pytest.raises(CheckpointError, match="exceeds the limit"):
        checkpoint.load(path, "expert", len(GOOD_CK) - HEAD - 1)


@settings(derandomize=True, max_examples=EXAMPLES // 3, deadline=None, database=None)
@given(payload=st.binary(max_size=200), signed=st.booleans())
def test_checkpoint_random_files_only_checkpoint_errors(tmp_path_factory, payload, signed):
    path = tmp_path_factory.mktemp("ck") / "x.msgpack"
    path.write_bytes(_signed(payload) if signed else payload)
    try:
        checkpoint.load(path, "expert")
    except CheckpointError as e:
        one_line(e)


# --- RunDir.read_state ---------------------------------------------------------------------------------


def _run_dir(root: Path):
    """A run directory with two commits (round 1 in state.prev.msgpack, round 2 in state.msgpack), each
    naming its own version of one expert, as the coordinator leaves them."""
    from soma_edge.rundir.layout import RunDir

    rd = RunDir(root)
    for r in (1, 2):
        w = np.full(8, float(r), np.float32)
        sha = protocol.weights_sha256(w)
        rel = rd.save_expert({"expert": 0, "version": r, "weights": w, "sha256": sha})
        rd.save_state({"round": r, "experts": {"0": {"version": r, "path": rel, "sha256": sha}}})
    return rd


def _resign(path: Path, fn) -> None:
    """Rewrite a checkpoint's body through fn, with a valid checksum (a consistent but wrong file)."""
    body = checkpoint.load(path, "run_state")
    checkpoint.save(path, fn(body), "run_state")


def _corrupt(path: Path) -> None:
    path.write_bytes(flip(path.read_bytes(), -3))


def _state_expert(**kv):
    return lambda rd: _resign(rd.state_path, lambda b: {**b, "experts": {"0": {**b["experts"]["0"], **kv}}})


STATE_CASES = [
    # (id, break(rd), verify, fallback fragment or None when nothing loads, error fragment)
    ("state-flipped-byte", lambda rd: _corrupt(rd.state_path), False, "checksum mismatch"),
    ("state-truncated", lambda rd: rd.state_path.write_bytes(rd.state_path.read_bytes()[:30]), False, "bad magic"),
    ("state-empty", lambda rd: rd.state_path.write_bytes(b""), False, "bad magic"),
    ("state-missing", lambda rd: rd.state_path.unlink(), False, "state.msgpack is missing"),
    (
        "state-wrong-kind",
        lambda rd: checkpoint.save(rd.state_path, {"round": 9}, "expert"),
        False,
        "expected a run_state message, got 'expert'",
    ),
    ("state-is-a-directory", lambda rd: (rd.state_path.unlink(), rd.state_path.mkdir()), False, "not a regular file"),
    (
        "expert-file-corrupt",
        lambda rd: _corrupt(rd.root / "experts/0/v2.msgpack"),
        True,
        "v2.msgpack: checksum mismatch",
    ),
    ("expert-file-missing", lambda rd: (rd.root / "experts/0/v2.msgpack").unlink(), True, "v2.msgpack: cannot read"),
    ("expert-sha-not-the-weights", _state_expert(sha256="0" * 64), True, "weights do not match state.msgpack"),
    ("expert-path-nul", _state_expert(path="experts/0/v\0.msgpack"), True, "not a valid file path"),
    ("expert-path-a-directory", _state_expert(path="experts/0"), True, "experts/0: not a regular file"),
    ("expert-path-the-state", _state_expert(path="state.prev.msgpack"), True, "expected a expert message"),
    ("no-experts-map", lambda rd: _resign(rd.state_path, lambda b: {**b, "experts": [1]}), True, "no experts map"),
    ("state-not-a-map", lambda rd: _resign(rd.state_path, lambda b: [b]), True, "not a run state (a list, not a map)"),
    (
        "expert-entry-not-a-map",
        lambda rd: _resign(rd.state_path, lambda b: {**b, "experts": {"0": "v2.msgpack"}}),
        True,
        "is not a version record",
    ),
    ("expert-sha-ndarray", _state_expert(sha256=ARR3), True, "is not a version record"),
]


@pytest.mark.parametrize("breaker,verify,fragment", cases(STATE_CASES))
def test_load_state_falls_back_to_the_commit_before(tmp_path, breaker, verify, fragment):
    rd = _run_dir(tmp_path / "run")
    assert rd.read_state(verify=True).round == 2 and rd.fallback is None  # the baseline: no fallback
    breaker(rd)
    before = tree(rd.root)
    state = rd.read_state(verify=verify)
    assert state.round == 1 and state.expert(0).version == 1
    assert (
        fragment in rd.fallback and "falling back to the commit before it (state.prev.msgpack, round 1)" in rd.fallback
    )
    assert "\n" not in rd.fallback
    assert tree(rd.root) == before


BOTH_CASES = [
    (
        "both-flipped",
        lambda rd: (_corrupt(rd.state_path), _corrupt(rd.prev_state_path)),
        False,
        ["state.msgpack: checksum mismatch", "state.prev.msgpack: checksum mismatch"],
    ),
    (
        "state-corrupt-prev-missing",
        lambda rd: (_corrupt(rd.state_path), rd.prev_state_path.unlink()),
        False,
        ["state.msgpack: checksum mismatch"],
    ),
    (
        "both-empty",
        lambda rd: (rd.state_path.write_bytes(b""), rd.prev_state_path.write_bytes(b"")),
        False,
        ["bad magic"],
    ),
    (
        "both-experts-corrupt",
        lambda rd: [_corrupt(rd.root / f"experts/0/v{v}.msgpack") for v in (1, 2)],
        True,
        ["v2.msgpack: checksum mismatch", "v1.msgpack: checksum mismatch"],
    ),
    (
        "state-corrupt-prev-expert-gone",
        lambda rd: (_corrupt(rd.state_path), (rd.root / "experts/0/v1.msgpack").unlink()),
        True,
        ["state.msgpack: checksum mismatch", "v1.msgpack: cannot read"],
    ),
    (
        "prev-not-a-map",
        lambda rd: (_corrupt(rd.state_path), checkpoint.save(rd.prev_state_path, [1], "run_state")),
        False,
        ["state.msgpack: checksum mismatch"],
    ),
]


@pytest.mark.parametrize("breaker,verify,fragments", cases(BOTH_CASES))
def test_load_state_refuses_when_no_commit_loads(tmp_path, breaker, verify, fragments):
    rd = _run_dir(tmp_path / "run")
    breaker(rd)
    before = tree(rd.root)
    with pytest.raises(CheckpointError) as got:
        rd.read_state(verify=verify)
    msg = one_line(got.value)
    assert "no committed state loads" in msg and "the run cannot resume" in msg
    for f in fragments:
        assert f in msg, msg
    assert tree(rd.root) == before


def test_load_state_of_a_run_that_never_committed(tmp_path):
    from soma_edge.rundir.layout import RunDir

    assert RunDir(tmp_path).read_state(verify=True) is None
