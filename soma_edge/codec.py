"""Bounded msgpack: the wire format and the on-disk format. Never pickle.

Every message is {"schema": SCHEMA, "kind": <what it is>, "body": ...}. numpy arrays travel as a msgpack
extension (dtype, shape, raw bytes) restricted to a few numeric dtypes. Decoding refuses oversized input,
unknown schemas, the wrong kind, and arrays whose byte count does not match their shape.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

from soma_edge.errors import CodecError

SCHEMA = 1
MAX_BYTES = 512 * 1024 * 1024  # a 64M-param float64 expert fits; anything larger is not a message of ours
_EXT_NDARRAY = 1
_DTYPES = {"float16", "float32", "float64", "int8", "uint8", "int32", "int64", "uint32", "uint64", "bool"}


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.name not in _DTYPES:
            raise CodecError(f"cannot encode arrays of dtype {obj.dtype}")
        arr = np.ascontiguousarray(obj)
        header = msgpack.packb([arr.dtype.str, list(arr.shape)])
        return msgpack.ExtType(_EXT_NDARRAY, header + arr.tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return list(obj)
    raise CodecError(f"cannot encode {type(obj).__name__}")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_NDARRAY:
        raise CodecError(f"unknown msgpack extension type {code}")
    unpacker = msgpack.Unpacker(max_buffer_size=len(data), max_array_len=64, max_str_len=16, max_bin_len=0)
    unpacker.feed(data)
    try:
        dtype_str, shape = unpacker.unpack()
    except Exception as e:
        raise CodecError(f"malformed array header ({e})") from None
    offset = unpacker.tell()
    if not isinstance(dtype_str, str):  # np.dtype(None) is float64, np.dtype(dict) a record: only dtype strings
        raise CodecError(f"unknown array dtype {_brief(dtype_str)}")
    try:
        dtype = np.dtype(dtype_str)
    except (TypeError, ValueError):
        raise CodecError(f"unknown array dtype {dtype_str!r}") from None
    if dtype.name not in _DTYPES or not isinstance(shape, list) or not all(_is_dim(s) for s in shape):
        raise CodecError(f"refusing array of dtype {dtype_str!r} and shape {shape!r}")
    # Exact integers: an int64 product of huge dimensions wraps around and could match the payload's size.
    count = math.prod(shape)
    if count * dtype.itemsize != len(data) - offset:
        raise CodecError(f"array of shape {shape} and dtype {dtype.name} does not match its {len(data) - offset} bytes")
    try:
        return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape).copy()
    except ValueError:  # an empty array whose other dimensions are beyond what numpy can index
        raise CodecError(f"refusing array of shape {shape}: too large to index") from None


def _is_dim(s: Any) -> bool:
    return isinstance(s, int) and not isinstance(s, bool) and s >= 0


def _brief(x: Any) -> str:
    """A short description of a value of the wrong type (an array's repr can run to many lines)."""
    return repr(x) if isinstance(x, (str, int, float, bytes, type(None))) and len(repr(x)) <= 80 else type(x).__name__


def encode(body: Any, kind: str) -> bytes:
    return msgpack.packb({"schema": SCHEMA, "kind": kind, "body": body}, default=_default, use_bin_type=True)


def decode(data: bytes, kind: str, max_bytes: int = MAX_BYTES) -> Any:
    """Decode a message of `kind`, refusing anything larger than max_bytes or of another schema/kind."""
    if len(data) > max_bytes:
        raise CodecError(f"{kind} message of {len(data)} bytes exceeds the limit of {max_bytes} bytes")
    try:
        msg = msgpack.unpackb(
            data,
            raw=False,
            ext_hook=_ext_hook,
            strict_map_key=False,
            max_str_len=16 * 1024 * 1024,
            max_bin_len=max_bytes,
            max_array_len=16 * 1024 * 1024,
            max_map_len=1024 * 1024,
            max_ext_len=max_bytes,
        )
    except CodecError:
        raise
    except Exception as e:
        raise CodecError(f"malformed {kind} message ({type(e).__name__}: {e})") from None
    if not isinstance(msg, dict) or "schema" not in msg or "body" not in msg:
        raise CodecError(f"malformed {kind} message: not a soma-edge envelope")
    # Type first: comparing an array with != gives an array, whose truth value raises ValueError.
    schema, got = msg["schema"], msg.get("kind")
    if not isinstance(schema, int) or isinstance(schema, bool) or schema != SCHEMA:
        raise CodecError(f"{kind} message has schema {_brief(schema)}; this soma-edge reads schema {SCHEMA}")
    if not isinstance(got, str) or got != kind:
        raise CodecError(f"expected a {kind} message, got {_brief(got)}")
    return msg["body"]
