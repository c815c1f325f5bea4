"""What the fuzz and bad-input tests share (tests/unit/test_fuzz_*.py): hypothesis' fixed budget, the dtypes
the codec allows, the one-line check every case makes of its error, hand-built envelopes, and a file tree's
snapshot (what a refused load must leave unchanged), and a result `check_result` accepts."""

from __future__ import annotations

import os
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from soma_edge.spsa.optim import OptState
from soma_edge.wire import protocol

# Fixed example budget, derandomized: the same examples on every run and every machine, no database.
EXAMPLES = 300
FUZZ = settings(
    derandomize=True,
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

ALLOWED = {"float16", "float32", "float64", "int8", "uint8", "int32", "int64", "uint32", "uint64", "bool"}
ALLOWED_STRS = ["<f2", "<f4", "<f8", "|i1", "|u1", "<i4", "<i8", "<u4", "<u8", "|b1"]


def one_line(err: BaseException) -> str:
    text = str(err)
    assert text and "\n" not in text, f"not one line: {text!r}"
    return text


def cases(rows):
    """Cases written as (id, *values), as pytest params with readable ids."""
    return [pytest.param(*c[1:], id=c[0]) for c in rows]


DROP = object()  # a field left out of the envelope


def env(body=None, **over) -> bytes:
    """A hand-built envelope (msgpack.packb, not codec.encode, so that anything can go in it)."""
    d = {"schema": 1, "kind": "k", "body": body}
    d.update(over)
    return msgpack.packb({k: v for k, v in d.items() if v is not DROP}, use_bin_type=True)


def arr_ext(header, payload: bytes = b"", code: int = 1) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(header, use_bin_type=True) + payload)


ARR3 = np.arange(3)


def flip(data: bytes, i: int) -> bytes:
    b = bytearray(data)
    b[i] ^= 0x01
    return bytes(b)


def tree(root: Path) -> dict[str, bytes | str]:
    """Every entry under root: file bytes, or what kind of entry it is."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link->" + os.readlink(p)
        elif p.is_fifo():
            out[rel] = "fifo"
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = p.read_bytes()
    return out


SHA_A = "a" * 64  # the current version's hash in `good_result`


def good_result():
    """A result `protocol.check_result` accepts, its Expected and the current hashes."""
    w = np.ones(10, dtype=np.float16)
    exp = protocol.Expected(
        node=5,
        round=1,
        tasks={0: {"version": 0, "base_sha256": SHA_A, "step": 0, "steps": 3, "lr_scale": 0.5}},
        size=10,
        reply_dtype="float16",
    )
    opt = OptState(adam_m=np.zeros(10, np.float32), adam_v=np.ones(10, np.float32), adam_t=3, lr_scale=0.5).to_record()
    res = {
        "expert": 0,
        "base_sha256": SHA_A,
        "version": 1,
        "step": 3,
        "steps": 3,
        "weights": w,
        "opt": opt,
        "train_loss": 1.0,
        "sha256": protocol.weights_sha256(w),
        "forward_evals": 12,
        "seconds": 0.5,
    }
    return res, exp, {0: SHA_A}
