"""Bad input to the codec (`soma_edge.codec.decode`): hypothesis over random bytes, truncated and mutated encodings,
random envelopes and random array headers, plus explicit cases.

Every case names its input (the parametrize id), expects the loader's own error type with a specific
fragment of its one-line message, and checks that what it was given (dicts, files) is unchanged.
"""

from __future__ import annotations

import math
import tracemalloc
import warnings

import msgpack
import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from soma_edge import codec
from soma_edge.errors import CodecError
from tests.helpers.fuzz import (
    ALLOWED,
    ALLOWED_STRS,
    DROP,
    FUZZ,
    arr_ext,
    env,
    one_line,
)


def raw_body(body: bytes) -> bytes:
    """An envelope whose body is the given raw msgpack bytes."""
    head = msgpack.packb({"schema": 1, "kind": "k"})
    return bytes([head[0] + 1]) + head[1:] + msgpack.packb("body") + body


def _ext_arr(a: np.ndarray) -> msgpack.ExtType:
    return arr_ext([a.dtype.str, list(a.shape)], a.tobytes())


GOOD = codec.encode({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": 3, "s": "x"}, "k")

# (id, data, fragment of the CodecError)
CODEC_CASES = [
    # oversized
    ("oversize-by-one", ("max", len(GOOD) - 1), "exceeds the limit"),
    ("oversize-tiny-limit", ("max", 1), "exceeds the limit"),
    # not msgpack
    ("empty", b"", "malformed k message (ValueError: Unpack failed: incomplete input)"),
    ("reserved-byte-c1", b"\xc1", "malformed k message (FormatError"),
    ("truncated-envelope", GOOD[:-3], "malformed k message (ValueError: Unpack failed: incomplete input)"),
    ("trailing-data", GOOD + b"\x00", "malformed k message (ExtraData"),
    ("invalid-utf8-str", raw_body(b"\xa2\xff\xfe"), "malformed k message (UnicodeDecodeError"),
    # declared lengths beyond the data or the limits
    ("str32-declared-4GiB", b"\xdb\xff\xff\xff\xff", "incomplete input"),
    ("bin32-declared-4GiB", b"\xc6\xff\xff\xff\xff", "incomplete input"),
    ("array32-declared-4G-items", b"\xdd\xff\xff\xff\xff", "exceeds max_array_len"),
    ("map32-declared-4G-items", b"\xdf\xff\xff\xff\xff", "exceeds max_map_len"),
    # not an envelope
    ("list-not-map", msgpack.packb([1, 2, 3]), "not a soma-edge envelope"),
    ("int-not-map", msgpack.packb(7), "not a soma-edge envelope"),
    ("no-schema", env(schema=DROP), "not a soma-edge envelope"),
    ("no-body", env(body=DROP), "not a soma-edge envelope"),
    # wrong schema
    ("schema-99", env(schema=99), "has schema 99"),
    ("schema-str", env(schema="1"), "has schema '1'"),
    ("schema-bool", env(schema=True), "has schema True"),
    ("schema-float", env(schema=1.0), "has schema 1.0"),
    ("schema-ndarray", env(schema=_ext_arr(np.array([1, 1]))), "has schema ndarray"),
    # wrong kind
    ("kind-other", env(kind="other"), "expected a k message, got 'other'"),
    ("kind-missing", env(kind=DROP), "expected a k message, got None"),
    ("kind-bytes", env(kind=b"k"), "expected a k message, got b'k'"),
    ("kind-ndarray", env(kind=_ext_arr(np.arange(3))), "expected a k message, got ndarray"),
    # unknown extension types (1 is the only one; msgpack itself owns -1, the timestamp)
    ("ext-code-2", env(msgpack.ExtType(2, b"")), "unknown msgpack extension type 2"),
    ("ext-code-127", env(msgpack.ExtType(127, b"\x00" * 4)), "unknown msgpack extension type 127"),
    ("ext-code-minus-5", raw_body(b"\xd4\xfb\x00"), "unknown msgpack extension type -5"),
    # ndarray header malformed
    ("header-empty", env(msgpack.ExtType(1, b"")), "malformed array header"),
    ("header-truncated", env(msgpack.ExtType(1, b"\x92\xa3<f")), "malformed array header"),
    ("header-three-items", env(arr_ext(["<f4", [1], 3], b"\0" * 4)), "malformed array header"),
    ("header-one-item", env(arr_ext(["<f4"], b"\0" * 4)), "malformed array header"),
    ("header-dtype-too-long", env(arr_ext(["x" * 100, [1]])), "malformed array header"),
    ("header-shape-too-many-dims", env(arr_ext(["<f4", [1] * 100], b"\0" * 4)), "malformed array header"),
    ("header-dtype-as-bin", env(arr_ext([b"<f4", [1]], b"\0" * 4)), "malformed array header"),
    ("header-deeply-nested", env(msgpack.ExtType(1, b"\x91" * 5000)), "malformed array header"),
    # dtype not allowed, not a string, or unknown
    ("dtype-object", env(arr_ext(["|O", [1]], b"\0" * 8)), "refusing array of dtype '|O'"),
    ("dtype-complex", env(arr_ext(["<c8", [1]], b"\0" * 8)), "refusing array of dtype '<c8'"),
    ("dtype-unicode-U5", env(arr_ext(["<U5", [1]], b"\0" * 20)), "refusing array of dtype '<U5'"),
    ("dtype-datetime", env(arr_ext(["<M8[s]", [1]], b"\0" * 8)), "refusing array of dtype '<M8[s]'"),
    ("dtype-structured", env(arr_ext(["f4,f4", [1]], b"\0" * 8)), "refusing array of dtype 'f4,f4'"),
    ("dtype-void", env(arr_ext(["|V8", [1]], b"\0" * 8)), "refusing array of dtype '|V8'"),
    ("dtype-unknown-name", env(arr_ext(["zz", [1]], b"\0" * 8)), "unknown array dtype 'zz'"),
    ("dtype-none-is-not-float64", env(arr_ext([None, [1]], b"\0" * 8)), "unknown array dtype None"),
    ("dtype-int", env(arr_ext([5, [1]], b"\0" * 8)), "unknown array dtype 5"),
    (
        "dtype-record-map",
        env(arr_ext([{"names": ["a"], "formats": ["<f4"]}, [1]], b"\0" * 4)),
        "unknown array dtype dict",
    ),
    # shape and bytes disagree
    ("bytes-short", env(arr_ext(["<f4", [1000]], b"\0" * 8)), "does not match its 8 bytes"),
    ("bytes-long", env(arr_ext(["<f4", [1]], b"\0" * 8)), "does not match its 8 bytes"),
    ("scalar-bytes-missing", env(arr_ext(["<f8", []], b"")), "does not match its 0 bytes"),
    # shape not a list of non-negative ints
    ("shape-negative", env(arr_ext(["<f4", [-1]])), "refusing array of dtype '<f4' and shape [-1]"),
    ("shape-float", env(arr_ext(["<f4", [1.0]], b"\0" * 4)), "shape [1.0]"),
    ("shape-bool", env(arr_ext(["<f4", [True]], b"\0" * 4)), "shape [True]"),
    ("shape-str", env(arr_ext(["<f4", "ab"], b"\0" * 4)), "shape 'ab'"),
    ("shape-int-not-list", env(arr_ext(["<f4", 1], b"\0" * 4)), "shape 1"),
    ("shape-nested", env(arr_ext(["<f4", [[1]]], b"\0" * 4)), "shape [[1]]"),
    # huge declared shapes (none may allocate: see test_codec_huge_shape_does_not_allocate)
    ("shape-u64-max", env(arr_ext(["<f4", [2**64 - 1]])), "does not match its 0 bytes"),
    ("shape-1e12", env(arr_ext(["<f8", [10**12]])), "does not match its 0 bytes"),
    ("shape-int64-wraps-to-0", env(arr_ext(["<f4", [2**32, 2**32]])), "does not match its 0 bytes"),
    ("shape-int64-wraps-2", env(arr_ext(["<f4", [2**63, 2]])), "does not match its 0 bytes"),
    ("shape-empty-but-unindexable", env(arr_ext(["<f4", [0, 2**62]])), "too large to index"),
    # nesting depth and unhashable keys
    ("nested-lists-100k", b"\x91" * 100_000 + b"\xc0", "malformed k message (StackError"),
    ("nested-maps-100k", b"\x81\xc0" * 100_000 + b"\xc0", "malformed k message (StackError"),
    ("map-key-list", raw_body(b"\x81\x91\x01\x01"), "unhashable type: 'list'"),
    ("map-key-ndarray", raw_body(b"\x81" + msgpack.packb(_ext_arr(np.zeros(2, np.float32))) + b"\x01"), "unhashable"),
]


@pytest.mark.parametrize("data,fragment", [c[1:] for c in CODEC_CASES], ids=[c[0] for c in CODEC_CASES])
def test_codec_refuses(data, fragment):
    if isinstance(data, tuple):  # ("max", limit): the good message under a smaller limit
        data, limit = GOOD, data[1]
    else:
        limit = codec.MAX_BYTES
    before = bytes(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numpy's overflow RuntimeWarning is not what is checked here
        with pytest.raises(CodecError) as got:
            codec.decode(data, "k", limit)
    assert fragment in one_line(got.value), got.value
    assert data == before


def test_codec_good_message_decodes():
    """The baseline every case breaks: the same encoder's output decodes, arrays and all."""
    out = codec.decode(GOOD, "k", len(GOOD))
    assert np.array_equal(out["w"], np.arange(6, dtype=np.float32).reshape(2, 3)) and out["n"] == 3
    for ok in ALLOWED_STRS:
        a = codec.decode(env(arr_ext([ok, [2]], b"\x01" * 2 * np.dtype(ok).itemsize)), "k")
        assert a.dtype.name in ALLOWED and a.shape == (2,)


@pytest.mark.parametrize("shape", [[2**64 - 1], [2**40, 2**20], [2**32, 2**32], [0, 2**62]], ids=str)
def test_codec_huge_shape_does_not_allocate(shape):
    """A header may declare any shape; what is allocated is bounded by the bytes actually received."""
    data = env(arr_ext(["<f8", shape]))
    tracemalloc.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(CodecError):
                codec.decode(data, "k")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"decoding a {len(data)}-byte message allocated {peak} bytes"


# --- hypothesis --------------------------------------------------------------------------------------


@st.composite
def small_arrays(draw):
    dt = np.dtype(draw(st.sampled_from(ALLOWED_STRS)))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    n = math.prod(shape)
    raw = draw(st.binary(min_size=n * dt.itemsize, max_size=n * dt.itemsize))
    if dt.kind == "b":
        raw = bytes(b & 1 for b in raw)
    return np.frombuffer(raw, dtype=dt).reshape(shape).copy()


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
VALUES = st.recursive(
    SCALARS | small_arrays(),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6) | st.integers(-9, 9), kids, max_size=4)
    ),
    max_leaves=16,
)


@FUZZ
@given(data=st.binary(max_size=256))
def test_codec_random_bytes_only_codec_errors(data):
    try:
        codec.decode(data, "k")
    except CodecError as e:
        one_line(e)


def half(good, other):
    """Draws from `good` half the time (`|` would weigh it as one branch of many), so that the oracle tests
    below see acceptance as often as refusal."""
    return st.booleans().flatmap(lambda g: good if g else other)


@FUZZ
@given(body=VALUES, cut=st.floats(0, 1, exclude_max=True))
def test_codec_truncated_encodings_refused(body, cut):
    data = codec.encode(body, "k")
    assert codec.encode(codec.decode(data, "k"), "k") == data  # the whole message round-trips
    with pytest.raises(CodecError, match="malformed k message"):
        codec.decode(data[: int(cut * len(data))], "k")


def _check_decoded(x):
    """What a decode may return: msgpack's own types and arrays of an allowed dtype whose bytes fit."""
    if isinstance(x, np.ndarray):
        assert x.dtype.name in ALLOWED and x.nbytes == x.size * x.dtype.itemsize
    elif isinstance(x, list):
        for v in x:
            _check_decoded(v)
    elif isinstance(x, dict):
        for k, v in x.items():
            _check_decoded(k)
            _check_decoded(v)
    else:
        assert x is None or isinstance(x, (bool, int, float, str, bytes, msgpack.Timestamp)), type(x)


@FUZZ
@given(
    body=VALUES,
    flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=4),
)
def test_codec_mutated_encodings_only_codec_errors(body, flips):
    data = bytearray(codec.encode(body, "k"))
    for where, xor in flips:
        data[int(where * len(data))] ^= xor
    try:
        out = codec.decode(bytes(data), "k")
    except CodecError as e:
        one_line(e)
    else:
        _check_decoded(out)


@FUZZ
@given(
    schema=half(
        st.just(1), st.integers(-5, 5) | st.booleans() | st.floats() | st.text(max_size=3) | st.none() | small_arrays()
    ),
    kind=half(
        st.just("k"), st.text(max_size=3) | st.binary(max_size=2) | st.integers(-(2**63), 2**64 - 1) | small_arrays()
    ),
    body=VALUES,
    drop=st.sets(st.sampled_from(["schema", "kind", "body"]), max_size=1),
)
def test_codec_random_envelopes_follow_the_rules(schema, kind, body, drop):
    """An oracle for the envelope: accepted exactly when schema is the int 1 and kind is "k"."""
    msg = {k: v for k, v in (("schema", schema), ("kind", kind), ("body", body)) if k not in drop}
    data = msgpack.packb(msg, default=lambda a: _ext_arr(a), use_bin_type=True)
    good_schema = type(schema) is int and schema == 1
    good_kind = type(kind) is str and kind == "k"
    event("accepted" if good_schema and good_kind and not drop else "refused")
    if "schema" in drop or "body" in drop:
        with pytest.raises(CodecError, match="not a soma-edge envelope"):
            codec.decode(data, "k")
    elif not good_schema:
        with pytest.raises(CodecError, match="has schema"):
            codec.decode(data, "k")
    elif "kind" in drop or not good_kind:
        with pytest.raises(CodecError, match="expected a k message"):
            codec.decode(data, "k")
    else:
        assert codec.encode(codec.decode(data, "k"), "k") == codec.encode(body, "k")


def _oracle_dtype(s):
    if not isinstance(s, str) or len(s.encode()) > 16:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dt = np.dtype(s)
    except Exception:
        return None
    return dt if dt.name in ALLOWED else None


@FUZZ
@given(
    dtype=half(
        st.sampled_from(ALLOWED_STRS),
        st.sampled_from(["|O", "<c8", "<U5", "S3", "f4,f4", ">f4", "float32", "?"])
        | st.text(max_size=6)
        | st.none()
        | st.integers(-3, 300),
    ),
    shape=half(
        st.lists(st.integers(0, 4), max_size=4),
        st.lists(st.integers(-3, 4) | st.integers(-(2**63), 2**64 - 1) | st.booleans() | st.floats(0, 4), max_size=4)
        | st.integers(0, 4)
        | st.text(max_size=2),
    ),
    payload=st.binary(max_size=80),
    fit=st.booleans(),
)
def test_codec_random_array_headers_follow_the_rules(dtype, shape, payload, fit):
    """An oracle for the array extension: accepted exactly when the dtype string is allowed, the shape is a
    list of non-negative ints (not bools) and the payload holds exactly that many items."""
    dt = _oracle_dtype(dtype)
    dims = isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)
    if fit and dt is not None and dims and math.prod(shape) * dt.itemsize <= 4096:  # the size the header declares
        need = math.prod(shape) * dt.itemsize
        payload = (payload * (need // max(len(payload), 1) + 1))[:need] if payload else bytes(need)
    data = env(arr_ext([dtype, shape], payload))
    ok = dt is not None and dims and math.prod(shape) * dt.itemsize == len(payload)
    event("accepted" if ok else "refused")  # --hypothesis-show-statistics: both outcomes are exercised
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if ok:
            out = codec.decode(data, "k")
            assert out.dtype == dt and list(out.shape) == shape and out.tobytes() == payload
        else:
            with pytest.raises(CodecError) as got:
                codec.decode(data, "k")
            assert any(f in one_line(got.value) for f in ("array", "dtype", "malformed"))
