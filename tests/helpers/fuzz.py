"""What the fuzz and bad-input tests share (tests/unit/test_fuzz_*.py): hypothesis' fixed budget, the dtypes
the codec allows, the one-line check every case makes of its error, hand-built envelopes, and a file tree's
snapshot (what a refused load must leave unchanged)."""

from __future__ import annotations

import os
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

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
