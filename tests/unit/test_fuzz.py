"""Fuzz and bad-input suite for the four loaders of untrusted bytes.

1. the codec (`soma_edge.codec.decode`): hypothesis over random bytes, truncated and mutated encodings,
   random envelopes and random array headers, plus explicit cases;
2. the protocol checks (`soma_edge.wire.protocol`: `unpack`, `check_reply_header`, `check_caps`, `check_result`);
3. the checkpoint loader (`soma_edge.checkpoint.load`) and the run state (`soma_edge.rundir.layout.RunDir.read_state`);
4. the deploy bundle (`export.bundle.read`, and `export.infer.Deployment` where it loads one).

Every case names its input (the parametrize id), expects the loader's own error type with a specific
fragment of its one-line message, and checks that what it was given (dicts, files) is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import threading
import tracemalloc
import warnings
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from coordinator import replay as replay_mod
from soma_edge import checkpoint, codec
from soma_edge.config import Config
from soma_edge.errors import CheckpointError, CodecError, ValidationError
from soma_edge.spsa.optim import OptState, State
from soma_edge.spsa.recipe import Recipe
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


def _params(cases):
    """Cases written as (id, *values), as pytest params with readable ids."""
    return [pytest.param(*c[1:], id=c[0]) for c in cases]


# ======================================================================================================
# 1. the codec


_DROP = object()  # a field left out of the envelope


def env(body=None, **over) -> bytes:
    """A hand-built envelope (msgpack.packb, not codec.encode, so that anything can go in it)."""
    d = {"schema": 1, "kind": "k", "body": body}
    d.update(over)
    return msgpack.packb({k: v for k, v in d.items() if v is not _DROP}, use_bin_type=True)


def arr_ext(header, payload: bytes = b"", code: int = 1) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(header, use_bin_type=True) + payload)


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
    ("no-schema", env(schema=_DROP), "not a soma-edge envelope"),
    ("no-body", env(body=_DROP), "not a soma-edge envelope"),
    # wrong schema
    ("schema-99", env(schema=99), "has schema 99"),
    ("schema-str", env(schema="1"), "has schema '1'"),
    ("schema-bool", env(schema=True), "has schema True"),
    ("schema-float", env(schema=1.0), "has schema 1.0"),
    ("schema-ndarray", env(schema=_ext_arr(np.array([1, 1]))), "has schema ndarray"),
    # wrong kind
    ("kind-other", env(kind="other"), "expected a k message, got 'other'"),
    ("kind-missing", env(kind=_DROP), "expected a k message, got None"),
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


# ======================================================================================================
# 2. the protocol checks

SHA_A, SHA_B = "a" * 64, "b" * 64


def good_result():
    """A result `check_result` accepts (as in test_federation_unit), its Expected and the current hashes."""
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


def _set(**kv):
    def fn(res, exp, cur):
        res.update(kv)

    return fn


def _opt(**kv):
    def fn(res, exp, cur):
        res["opt"] = {**res["opt"], **kv}

    return fn


def _weights(w):
    """New weights with a matching claimed sha256, so that only the weights themselves are wrong."""

    def fn(res, exp, cur):
        res["weights"] = w
        res["sha256"] = protocol.weights_sha256(w)

    return fn


def _nan_at(i, value):
    w = np.ones(10, dtype=np.float16)
    w[i] = value
    return _weights(w)


def _current(sha):
    def fn(res, exp, cur):  # the coordinator accepted another version of the expert since it sent this one
        cur[0] = sha
        res["base_sha256"] = sha

    return fn


def _unassigned(res, exp, cur):
    cur[1] = SHA_B
    res.update(expert=1, base_sha256=SHA_B)


def _drop(key):
    def fn(res, exp, cur):
        del res[key]

    return fn


ARR3 = np.arange(3)

RESULT_CASES = [
    ("not-a-map", lambda r, e, c: ["not", "a", "map"], "result is not a map"),
    ("expert-missing", _drop("expert"), "names no expert (None)"),
    ("expert-str", _set(expert="0"), "names no expert ('0')"),
    ("expert-bool", _set(expert=False), "names no expert (False)"),
    ("expert-float", _set(expert=0.0), "names no expert (0.0)"),
    ("expert-list", _set(expert=[0]), "names no expert ([0])"),
    ("expert-unknown", _set(expert=99), "unknown expert 99"),
    ("expert-not-assigned", _unassigned, "expert 1 was not assigned to node 5"),
    ("base-stale", _set(base_sha256="0" * 64), "stale base version 000000000000"),
    ("base-missing", _drop("base_sha256"), "stale base version None"),
    ("base-sent-is-stale", _current(SHA_B), "stale base version bbbbbbbbbbbb"),
    ("base-ndarray", _set(base_sha256=ARR3), "stale base version"),
    ("version-same", _set(version=0), "version 0, expected 1"),
    ("version-plus-two", _set(version=2), "version 2, expected 1"),
    ("version-bool", _set(version=True), "version True, expected 1"),
    ("version-str", _set(version="1"), "version '1', expected 1"),
    ("steps-zero", _set(steps=0, step=0), "ran 0 steps, asked for 1..3"),
    ("steps-too-many", _set(steps=4, step=4), "ran 4 steps, asked for 1..3"),
    ("steps-negative", _set(steps=-1, step=-1), "ran -1 steps"),
    ("steps-bool", _set(steps=True, step=1), "ran True steps"),
    ("steps-float", _set(steps=3.0), "ran 3.0 steps"),
    ("step-counter-wrong", _set(step=4), "step counter 4, expected 3"),
    ("step-counter-missing", _drop("step"), "step counter None, expected 3"),
    ("weights-missing", _set(weights=None), "weights missing"),
    ("weights-list", _set(weights=[1.0] * 10), "weights missing"),
    ("weights-bytes", _set(weights=b"\0" * 20), "weights missing"),
    ("weights-float32", _weights(np.ones(10, np.float32)), "weights are float32, expected float16"),
    ("weights-float64", _weights(np.ones(10, np.float64)), "weights are float64, expected float16"),
    ("weights-int32", _weights(np.ones(10, np.int32)), "weights are int32, expected float16"),
    ("weights-short", _weights(np.ones(9, np.float16)), "shape [9], expected [10]"),
    ("weights-long", _weights(np.ones(11, np.float16)), "shape [11], expected [10]"),
    ("weights-2d", _weights(np.ones((2, 5), np.float16)), "shape [2, 5], expected [10]"),
    ("weights-0d", _weights(np.array(1, np.float16)), "shape [], expected [10]"),
    ("weights-nan", _nan_at(3, np.nan), "weights contain NaN or infinity"),
    ("weights-inf", _nan_at(0, np.inf), "weights contain NaN or infinity"),
    ("weights-minus-inf", _nan_at(9, -np.inf), "weights contain NaN or infinity"),
    ("opt-not-map", _set(opt=[1, 2]), "optimizer state: not a map"),
    ("opt-unknown-field", _opt(extra=1), "unknown fields ['extra']"),
    ("opt-adam_m-short", _opt(adam_m=np.zeros(9, np.float32)), "adam_m is float32[9]"),
    ("opt-adam_v-float16", _opt(adam_v=np.ones(10, np.float16)), "adam_v is float16[10]"),
    ("opt-adam_v-nan", _opt(adam_v=np.full(10, np.nan, np.float32)), "adam_v is float32[10], not a finite"),
    ("opt-adam_v-negative", _opt(adam_v=-np.ones(10, np.float32)), "Adam moments are incomplete or negative"),
    ("opt-adam_m-missing", _opt(adam_m=None), "Adam moments are incomplete"),
    ("opt-momentum-list", _opt(momentum=[0.0] * 10), "momentum is list"),
    ("opt-adam_t-zero", _opt(adam_t=0), "adam_t 0 does not fit"),
    ("opt-adam_t-bool", _opt(adam_t=True), "adam_t True does not fit"),
    ("opt-adam_t-negative", _opt(adam_t=-1), "adam_t -1 does not fit"),
    ("opt-lr_scale-above-1", _opt(lr_scale=3.0), "lr_scale 3.0 is not in (0, 1]"),
    ("opt-lr_scale-zero", _opt(lr_scale=0.0), "lr_scale 0.0 is not in (0, 1]"),
    ("opt-best_val-nan", _opt(best_val=float("nan")), "best_val nan is not a finite number"),
    ("opt-best_step-negative", _opt(best_step=-1), "best_step -1 is not a step count"),
    ("lr-scale-not-the-rounds", _opt(lr_scale=1.0), "trained at lr scale 1, the round's is 0.5"),
    ("train-loss-nan", _set(train_loss=float("nan")), "train loss nan is not finite"),
    ("train-loss-inf", _set(train_loss=float("inf")), "train loss inf is not finite"),
    ("train-loss-str", _set(train_loss="1.0"), "train loss '1.0' is not finite"),
    ("train-loss-bool", _set(train_loss=True), "train loss True is not finite"),
    ("train-loss-missing", _drop("train_loss"), "train loss None is not finite"),
    ("forward-evals-negative", _set(forward_evals=-1), "forward_evals -1 is not a count"),
    ("forward-evals-float", _set(forward_evals=1.5), "forward_evals 1.5 is not a count"),
    ("forward-evals-bool", _set(forward_evals=True), "forward_evals True is not a count"),
    ("seconds-str", _set(seconds="x"), "seconds 'x' is not a finite duration"),
    ("seconds-nan", _set(seconds=float("nan")), "seconds nan is not a finite duration"),
    ("seconds-negative", _set(seconds=-1.0), "seconds -1.0 is not a finite duration"),
    ("seconds-missing", _drop("seconds"), "seconds None is not a finite duration"),
    ("trained-str", _set(trained="soon"), "trained is not a list of at most 64 stretches"),
    ("trained-too-many", _set(trained=[[0.0, 1.0]] * 65), "trained is not a list of at most 64 stretches"),
    ("trained-one-number", _set(trained=[[1.0]]), "trained holds [1.0], not a [start, end] pair"),
    ("trained-backwards", _set(trained=[[2.0, 1.0]]), "trained holds [2.0, 1.0], not a [start, end] pair"),
    ("trained-nan", _set(trained=[[0.0, float("nan")]]), "not a [start, end] pair of seconds"),
    ("trained-bool", _set(trained=[[True, 2.0]]), "not a [start, end] pair of seconds"),
    ("sha-mismatch", _set(sha256="f" * 64), "do not match the sha256 the worker claims"),
    ("sha-of-other-weights", _set(sha256=protocol.weights_sha256(np.zeros(10, np.float16))), "do not match the sha256"),
    ("sha-missing", _drop("sha256"), "do not match the sha256"),
    ("sha-ndarray", _set(sha256=ARR3), "do not match the sha256"),
]


def _snap(*objs) -> bytes:
    """The exact bytes of the inputs (arrays included), to show that a check leaves them as they were."""
    return codec.encode([vars(o) if isinstance(o, protocol.Expected) else o for o in objs], "snapshot")


def test_good_result_is_accepted():
    res, exp, cur = good_result()
    w, opt = protocol.check_result(res, exp, cur)
    assert w is res["weights"] and opt.lr_scale == 0.5 and opt.adam_t == 3


@pytest.mark.parametrize("mutate,fragment", _params(RESULT_CASES))
def test_check_result_refuses(mutate, fragment):
    res, exp, cur = good_result()
    res = mutate(res, exp, cur) or res  # a mutation edits the result in place or returns its replacement
    before = _snap(res, exp, cur)
    with pytest.raises(ValidationError) as got:
        protocol.check_result(res, exp, cur)
    assert fragment in one_line(got.value), got.value
    assert _snap(res, exp, cur) == before  # neither the result, nor what was sent, nor the current hashes change


FIELD_VALUES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=4)
    | st.binary(max_size=4)
    | st.lists(st.integers(0, 3), max_size=3)
    | st.dictionaries(st.text(max_size=3), st.integers(-9, 9), max_size=2)
)


def _acceptable(key, value, original) -> bool:
    """The oracle: which replacement values are as good as the original."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if key == "forward_evals":
        return type(value) is int and value >= 0
    if key == "seconds":
        return number and value >= 0
    if key == "train_loss":
        return number
    return type(value) is type(original) and value == original


@FUZZ
@given(key=st.sampled_from(sorted(good_result()[0])), value=FIELD_VALUES)
def test_check_result_random_field_values(key, value):
    """One field replaced by any non-array value: a ValidationError or acceptance, never another error, and
    acceptance exactly where the oracle says the value is as good as the original."""
    res, exp, cur = good_result()
    original = res[key]
    res[key] = value
    before = _snap(res, exp, cur)
    try:
        protocol.check_result(res, exp, cur)
        accepted = True
    except ValidationError as e:
        one_line(e)
        accepted = False
    event("accepted" if accepted else "refused")
    assert accepted == _acceptable(key, value, original), (key, value)
    assert _snap(res, exp, cur) == before


def good_header():
    return {
        "node": 5,
        "round": 1,
        "results": [],
        "torch_importable": False,
        "missing": {"weights": [SHA_A], "shards": []},
        "errors": ["x"],
    }


HEADER_CASES = [
    ("src-node-other", "src", 6, "came from node 6 claiming node 5"),
    ("node-other", "node", 6, "claiming node 6"),
    ("node-missing", "node", _DROP, "claiming node None"),
    ("node-str", "node", "5", "claiming node '5'"),
    ("node-ndarray", "node", ARR3, "claiming node"),
    ("round-other", "round", 2, "reply is for round 2, expected round 1"),
    ("round-missing", "round", _DROP, "reply is for round None"),
    ("round-str", "round", "1", "reply is for round '1'"),
    ("round-ndarray", "round", ARR3, "reply is for round"),
    ("results-missing", "results", _DROP, "reply has no results list"),
    ("results-map", "results", {"0": {}}, "reply has no results list"),
    ("results-str", "results", "[]", "reply has no results list"),
    ("torch-bytes", "torch_importable", b"yes", "torch_importable is bytes, not a bool"),
    ("torch-str", "torch_importable", "true", "torch_importable is str, not a bool"),
    ("torch-list", "torch_importable", [True], "torch_importable is list, not a bool"),
    ("torch-ndarray", "torch_importable", ARR3, "torch_importable"),
    ("torch-ndarray-1", "torch_importable", np.array([True]), "torch_importable is ndarray"),
    ("missing-list", "missing", [SHA_A], "missing is not a map"),
    ("missing-str", "missing", "weights", "missing is not a map"),
    ("missing-weights-int", "missing", {"weights": 5}, "missing.weights is not a list of sha256 hex digests"),
    ("missing-weights-upper-hex", "missing", {"weights": ["A" * 64]}, "missing.weights is not a list"),
    ("missing-shards-short-hex", "missing", {"shards": ["ab"]}, "missing.shards is not a list"),
    ("missing-shards-bytes", "missing", {"shards": [b"a" * 64]}, "missing.shards is not a list"),
    ("errors-str", "errors", "boom", "errors is not a list of strings"),
    ("errors-ints", "errors", [1], "errors is not a list of strings"),
    ("errors-map", "errors", {"a": "b"}, "errors is not a list of strings"),
]


def _log_result(width: int, steps: int = 3):
    """A log reply's result for a task of `steps` steps, its scalars `width` a step, and an Expected whose
    config gives 2 a step (spsa.accumulate 1 x spsa.directions 2)."""
    res, exp, _ = good_result()
    exp.tasks[0]["reply"] = protocol.ReplyMode.LOG
    exp.width = 2
    grads = np.zeros((steps, width), np.float32)
    log = {"start": 0, "grads": grads, "lr_scale": 0.5, "decoder": None, "decoder_m": None, "decoder_v": None}
    return {**res, "steps": steps, "log": log}, exp


@pytest.mark.parametrize("width", [0, 1, 3, 64])
def test_a_log_of_the_wrong_width_is_refused_at_arrival(width):
    """Narrower, wider or empty scalars a step: one ValidationError line at the cheap checks, before the
    audit (audit_steps > 0) or the replay (either way) would index them and raise something else."""
    res, exp = _log_result(width)
    with pytest.raises(ValidationError) as got:
        protocol.check_log(res, exp)
    assert f"holds {width} scalars a step" in one_line(got.value) and "spsa.accumulate x spsa.directions" in str(
        got.value
    )
    ok, exp = _log_result(2)
    assert protocol.check_log(ok, exp).grads.shape == (3, 2)


def _recipe_record(**spsa) -> dict:
    rec = Recipe.of(Config()).to_record()
    rec["spsa"].update(spsa)
    return rec


RECIPE_CASES = [
    ("not-a-map", [1, 2], "not a recipe record"),
    ("no-spsa", {"batch": 16, "seq_len": 128}, "not a recipe record"),
    ("spsa-list", {"spsa": [], "batch": 16, "seq_len": 128}, "not a recipe record"),
    ("unknown-setting", _recipe_record(evil=1), "its spsa settings are not"),
    ("missing-setting", {**_recipe_record(), "spsa": {"lr": 1e-3}}, "its spsa settings are not"),
    ("directions-str", _recipe_record(directions="4"), "spsa.directions is str, not int"),
    ("directions-bool", _recipe_record(directions=True), "spsa.directions is bool, not int"),
    ("directions-zero", _recipe_record(directions=0), "spsa.directions must be between 1 and 65536"),
    ("lr-nan", _recipe_record(lr=float("nan")), "spsa.lr must be a finite number"),
    ("shaping-unknown", _recipe_record(shaping="softmax"), "spsa.shaping must be"),
    ("split-int", _recipe_record(split_rows=1), "spsa.split_rows is int, not bool"),
    ("split-odd-rows", _recipe_record(split_rows=True, directions=3), "spsa.split_rows needs data.batch"),
    ("batch-ndarray", {**_recipe_record(), "batch": np.array([16])}, "batch is not an integer"),
]


@pytest.mark.parametrize("rec,fragment", [c[1:] for c in RECIPE_CASES], ids=[c[0] for c in RECIPE_CASES])
def test_a_hostile_recipe_in_a_log_is_one_line(rec, fragment):
    res, exp = _log_result(2)
    res["log"]["recipe"] = rec
    with pytest.raises(ValidationError) as got:
        protocol.check_log(res, exp)
    assert fragment in one_line(got.value), got.value


def test_a_log_of_another_recipe_is_refused_at_arrival_and_by_the_replay():
    res, exp = _log_result(2)
    exp.recipe = Recipe.of(Config())
    res["log"]["recipe"] = _recipe_record(directions=2, split_rows=False)
    with pytest.raises(ValidationError) as got:
        protocol.check_log(res, exp)
    assert "ran another recipe than this node's (spsa.directions: 2 vs 4; spsa.split_rows: False vs True" in one_line(
        got.value
    )
    res["log"].pop("recipe")  # a log that says nothing of its recipe, to a node with one of its own
    with pytest.raises(ValidationError, match="expert 0: the log carries no recipe"):
        protocol.check_log(res, exp)
    res["log"]["recipe"] = _recipe_record()
    log = protocol.check_log(res, exp)
    assert log.recipe == exp.recipe
    log.recipe = Recipe.from_record(_recipe_record(lr=1e-3))
    with pytest.raises(ValidationError, match=r"expert 0: the log ran another recipe than its node's \(spsa.lr: 0.001"):
        replay_mod.rebuild(Config(), State(np.zeros(10, np.float32)), log, 0)


def test_good_header_and_caps_are_accepted():
    exp = good_result()[1]
    protocol.check_reply_header(good_header(), exp, 5)
    assert protocol.check_caps(good_caps()) == 10.0


@pytest.mark.parametrize("key,value,fragment", _params(HEADER_CASES))
def test_check_reply_header_refuses(key, value, fragment):
    body, exp, src = good_header(), good_result()[1], 5
    if key == "src":
        src = value
    elif value is _DROP:
        del body[key]
    else:
        body[key] = value
    before = _snap(body, exp)
    with pytest.raises(ValidationError) as got:
        protocol.check_reply_header(body, exp, src)
    assert fragment in one_line(got.value), got.value
    assert _snap(body, exp) == before


def good_caps():
    return {
        "evals_per_s": 10.0,
        "name": "n1",
        "soma_version": "0.1.0",
        "providers": ["CPUExecutionProvider"],
        "torch_importable": True,
        "cache": {"weights": [SHA_A], "shards": [SHA_B]},
    }


CAPS_CASES = [
    ("rate-zero", "evals_per_s", 0, "throughput 0 is not a positive number"),
    ("rate-negative", "evals_per_s", -5.0, "throughput -5.0 is not a positive number"),
    ("rate-nan", "evals_per_s", float("nan"), "throughput nan is not a positive number"),
    ("rate-inf", "evals_per_s", float("inf"), "throughput inf is not a positive number"),
    ("rate-bool", "evals_per_s", True, "throughput True is not a positive number"),
    ("rate-str", "evals_per_s", "10", "throughput '10' is not a positive number"),
    ("rate-missing", "evals_per_s", _DROP, "throughput None is not a positive number"),
    ("name-int", "name", 7, "name is int, not a string"),
    ("name-bytes", "name", b"n1", "name is bytes, not a string"),
    ("soma-version-float", "soma_version", 0.1, "soma_version is float, not a string"),
    ("providers-str", "providers", "CPUExecutionProvider", "providers is not a list of strings"),
    ("providers-ints", "providers", [1], "providers is not a list of strings"),
    ("providers-map", "providers", {"CPU": 1}, "providers is not a list of strings"),
    ("torch-str", "torch_importable", "no", "torch_importable is str, not a bool"),
    ("torch-ndarray", "torch_importable", ARR3, "torch_importable"),
    ("cache-list", "cache", [SHA_A], "cache is not a map"),
    ("cache-weights-not-hex", "cache", {"weights": ["z" * 64]}, "cache.weights is not a list of sha256"),
    ("cache-shards-str", "cache", {"shards": SHA_A}, "cache.shards is not a list of sha256"),
]


@pytest.mark.parametrize("key,value,fragment", _params(CAPS_CASES))
def test_check_caps_refuses(key, value, fragment):
    caps = good_caps()
    if value is _DROP:
        del caps[key]
    else:
        caps[key] = value
    before = _snap(caps)
    with pytest.raises(ValidationError) as got:
        protocol.check_caps(caps)
    assert fragment in one_line(got.value), got.value
    assert _snap(caps) == before


def _record(data: bytes, stype: str = protocol.STYPE):
    from flwr.app import Array, ArrayRecord, RecordDict

    return RecordDict({"soma": ArrayRecord({"body": Array(dtype="uint8", shape=(len(data),), stype=stype, data=data)})})


def _unpack_input(case: str):
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    K = protocol.KIND_REPLY
    P = protocol.PROTOCOL
    return {
        "none": (None, None),
        "empty-recorddict": (RecordDict({}), None),
        "no-body-array": (RecordDict({"soma": ArrayRecord({"other": Array(np.zeros(3, np.uint8))})}), None),
        "config-record": (RecordDict({"soma": ConfigRecord({"body": b"\x80"})}), None),
        "numpy-stype": (RecordDict({"soma": ArrayRecord({"body": Array(np.zeros(3, dtype=np.uint8))})}), None),
        "foreign-stype": (_record(codec.encode({"protocol": P}, K), "other/stype"), None),
        "garbage": (_record(b"\xc1garbage"), None),
        "oversize": (_record(codec.encode({"protocol": P, "x": "y" * 5000}, K)), 1000),
        "wrong-kind": (_record(codec.encode({"protocol": P}, protocol.KIND_CAPS)), None),
        "body-list": (_record(codec.encode([1, 2], K)), None),
        "body-int": (_record(codec.encode(3, K)), None),
        "protocol-missing": (_record(codec.encode({"x": 1}, K)), None),
        "protocol-older": (_record(codec.encode({"protocol": P - 1}, K)), None),
        "protocol-newer": (_record(codec.encode({"protocol": P + 1}, K)), None),
        "protocol-str": (_record(codec.encode({"protocol": str(P)}, K)), None),
        "protocol-ndarray": (_record(codec.encode({"protocol": ARR3}, K)), None),
    }[case]


PROTO = protocol.PROTOCOL
UNPACK_CASES = [  # (id: the input `_unpack_input` builds, fragment of the CodecError)
    ("none", "train_reply: not a soma-edge message (no 'soma' record)"),
    ("empty-recorddict", "no 'soma' record"),
    ("no-body-array", "no 'soma' record"),
    ("config-record", "unexpected payload type None"),
    ("numpy-stype", "unexpected payload type 'numpy.ndarray'"),
    ("foreign-stype", "unexpected payload type 'other/stype'"),
    ("garbage", "malformed train_reply message"),
    ("oversize", "exceeds the limit of 1000 bytes"),
    ("wrong-kind", "expected a train_reply message, got 'capabilities'"),
    ("body-list", "train_reply: body is not a map"),
    ("body-int", "train_reply: body is not a map"),
    ("protocol-missing", f"train_reply: protocol None, this soma-edge speaks {PROTO}"),
    ("protocol-older", f"protocol {PROTO - 1}, this soma-edge speaks {PROTO}"),
    ("protocol-newer", f"protocol {PROTO + 1}, this soma-edge speaks {PROTO}"),
    ("protocol-str", f"protocol '{PROTO}', this soma-edge speaks {PROTO}"),
    ("protocol-ndarray", "this soma-edge speaks"),
]


@pytest.mark.parametrize("case,fragment", [pytest.param(*c, id=c[0]) for c in UNPACK_CASES])
def test_unpack_refuses(case, fragment):
    content, limit = _unpack_input(case)
    args = (content, protocol.KIND_REPLY) + ((limit,) if limit else ())
    with pytest.raises(CodecError) as got:
        protocol.unpack(*args)
    assert fragment in one_line(got.value), got.value


def test_unpack_accepts_the_good_message():
    body = protocol.unpack(protocol.pack({"x": 1}, protocol.KIND_REPLY), protocol.KIND_REPLY)
    assert body == {"protocol": protocol.PROTOCOL, "x": 1}


# ======================================================================================================
# 3. the checkpoint loader and the run state

BODY = {"weights": np.arange(16, dtype=np.float32), "expert": 0, "version": 1, "note": "x"}


def _ck_payload(obj, kind="expert") -> bytes:
    return codec.encode(obj, kind)


def _signed(payload: bytes) -> bytes:
    """A checkpoint file with a valid checksum around `payload`, whatever it holds."""
    return checkpoint.MAGIC + hashlib.sha256(payload).digest() + payload


def _flip(data: bytes, i: int) -> bytes:
    b = bytearray(data)
    b[i] ^= 0x01
    return bytes(b)


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
    ("bad-magic", _flip(GOOD_CK, 0), None, "bad magic"),
    ("other-magic-version", b"SOMACKP2" + GOOD_CK[8:], None, "bad magic"),
    ("flipped-payload-byte", _flip(GOOD_CK, len(GOOD_CK) - 5), None, "checksum mismatch"),
    ("flipped-first-payload-byte", _flip(GOOD_CK, HEAD), None, "checksum mismatch"),
    ("flipped-digest-byte", _flip(GOOD_CK, 8 + 7), None, "checksum mismatch"),
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


def _tree(root: Path) -> dict[str, bytes | str]:
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


@pytest.mark.parametrize("data,max_bytes,fragment", _params(CKPT_CASES))
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
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError) as got:
        _load_guarded(path, "expert", max_bytes)
    assert fragment in one_line(got.value), got.value
    assert _tree(tmp_path) == before  # a failed load changes nothing on disk


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
    path.write_bytes(_flip(path.read_bytes(), -3))


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


@pytest.mark.parametrize("breaker,verify,fragment", _params(STATE_CASES))
def test_load_state_falls_back_to_the_commit_before(tmp_path, breaker, verify, fragment):
    rd = _run_dir(tmp_path / "run")
    assert rd.read_state(verify=True).round == 2 and rd.fallback is None  # the baseline: no fallback
    breaker(rd)
    before = _tree(rd.root)
    state = rd.read_state(verify=verify)
    assert state.round == 1 and state.expert(0).version == 1
    assert (
        fragment in rd.fallback and "falling back to the commit before it (state.prev.msgpack, round 1)" in rd.fallback
    )
    assert "\n" not in rd.fallback
    assert _tree(rd.root) == before


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


@pytest.mark.parametrize("breaker,verify,fragments", _params(BOTH_CASES))
def test_load_state_refuses_when_no_commit_loads(tmp_path, breaker, verify, fragments):
    rd = _run_dir(tmp_path / "run")
    breaker(rd)
    before = _tree(rd.root)
    with pytest.raises(CheckpointError) as got:
        rd.read_state(verify=verify)
    msg = one_line(got.value)
    assert "no committed state loads" in msg and "the run cannot resume" in msg
    for f in fragments:
        assert f in msg, msg
    assert _tree(rd.root) == before


def test_load_state_of_a_run_that_never_committed(tmp_path):
    from soma_edge.rundir.layout import RunDir

    assert RunDir(tmp_path).read_state(verify=True) is None


# ======================================================================================================
# 4. the deploy bundle


@pytest.fixture(scope="module")
def bundle_src(tmp_path_factory):
    """A real two-expert bundle (tiny LSTMs, a real router), exported once per module from a run directory
    built the way test_export builds it; each case breaks a copy."""
    from export import bundle
    from soma_edge.config import ModelConfig
    from tests.helpers.export_run import domains, make_run

    base = tmp_path_factory.mktemp("fuzz-bundle")
    docs = domains()[::3]
    make_run(base / "run", ModelConfig(embed=8, hidden=8, layers=1), 2, docs)
    bundle.write(base / "run", base / "deploy")
    return base / "deploy", docs, base / "run"


@pytest.fixture
def deploy(bundle_src, tmp_path):
    dst = tmp_path / "deploy"
    shutil.copytree(bundle_src[0], dst)
    return dst


def _manifest(deploy: Path) -> dict:
    return json.loads((deploy / "manifest.json").read_text())


def _write_manifest(deploy: Path, m) -> None:
    (deploy / "manifest.json").write_text(json.dumps(m))


def _rehash(deploy: Path, rel: str) -> None:
    """Make the manifest agree with a changed file, so that the check after the sha256 one is reached."""
    m = _manifest(deploy)
    data = (deploy / rel).read_bytes()
    m["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    _write_manifest(deploy, m)


def _edit(fn):
    """Edit the manifest in place (what fn returns is ignored: dict.pop returns the value)."""

    def breaker(deploy):
        m = _manifest(deploy)
        fn(m)
        _write_manifest(deploy, m)

    return breaker


def _whole(fn):
    """Replace the manifest by what fn returns."""
    return lambda deploy: _write_manifest(deploy, fn(_manifest(deploy)))


def _params_for(model: dict) -> int:
    from soma_edge import config as config_mod
    from soma_edge.expert import params

    return params.count(config_mod.from_dict({"model": model}).model)


SCORE0 = "experts/0/score.onnx"
BUNDLE_CASES = [
    # the manifest file itself
    ("manifest-missing", lambda d: (d / "manifest.json").unlink(), "manifest.json: missing; is"),
    ("manifest-not-json", lambda d: (d / "manifest.json").write_text("{not json"), "not valid JSON"),
    ("manifest-empty", lambda d: (d / "manifest.json").write_bytes(b""), "not valid JSON"),
    ("manifest-not-utf8", lambda d: (d / "manifest.json").write_bytes(b"\xff\xfe\xfa{"), "not valid JSON"),
    (
        "manifest-truncated",
        lambda d: (d / "manifest.json").write_bytes((d / "manifest.json").read_bytes()[:200]),
        "not valid JSON",
    ),
    (
        "manifest-a-directory",
        lambda d: ((d / "manifest.json").unlink(), (d / "manifest.json").mkdir()),
        "manifest.json: cannot read (Is a directory)",
    ),
    ("bundle-not-a-directory", "not-a-dir", "not a directory (expected a bundle written by `soma-export onnx`)"),
    ("manifest-a-list", _whole(lambda m: [m]), "not a soma-edge deploy manifest"),
    ("manifest-a-string", _whole(lambda m: "soma-edge-deploy"), "not a soma-edge deploy manifest"),
    # format
    ("format-other", _edit(lambda m: m.update(format="other")), "not a soma-edge deploy manifest"),
    ("format-missing", _edit(lambda m: m.pop("format")), "not a soma-edge deploy manifest"),
    ("format-version-2", _edit(lambda m: m.update(format_version=2)), "format_version 2; this soma-edge reads 1"),
    ("format-version-0", _edit(lambda m: m.update(format_version=0)), "format_version 0; this soma-edge reads 1"),
    (
        "format-version-str",
        _edit(lambda m: m.update(format_version="1")),
        "field 'format_version' has the wrong type (str)",
    ),
    (
        "format-version-bool",
        _edit(lambda m: m.update(format_version=True)),
        "'format_version' has the wrong type (bool)",
    ),
    ("format-version-missing", _edit(lambda m: m.pop("format_version")), "missing field 'format_version'"),
    # files: listing, paths, hashes
    ("files-missing", _edit(lambda m: m.pop("files")), "missing field 'files'"),
    ("files-a-list", _edit(lambda m: m.update(files=list(m["files"]))), "field 'files' has the wrong type (list)"),
    (
        "file-entry-not-a-map",
        _edit(lambda m: m["files"].update({"router.msgpack": "abc"})),
        "files['router.msgpack']: missing field 'sha256'",
    ),
    (
        "file-sha-an-int",
        _edit(lambda m: m["files"]["router.msgpack"].update(sha256=5)),
        "'sha256' has the wrong type (int)",
    ),
    (
        "path-dotdot",
        _edit(lambda m: m["files"].update({"../x": m["files"]["router.msgpack"]})),
        "refusing file path '../x' outside the bundle",
    ),
    (
        "path-dotdot-inside",
        _edit(lambda m: m["files"].update({"experts/../../x": m["files"]["router.msgpack"]})),
        "refusing file path 'experts/../../x'",
    ),
    (
        "path-absolute",
        _edit(lambda m: m["files"].update({"/etc/passwd": m["files"]["router.msgpack"]})),
        "refusing file path '/etc/passwd'",
    ),
    ("path-empty", _edit(lambda m: m["files"].update({"": m["files"]["router.msgpack"]})), "refusing file path ''"),
    ("path-dot", _edit(lambda m: m["files"].update({".": m["files"]["router.msgpack"]})), "refusing file path '.'"),
    (
        "path-a-directory",
        _edit(lambda m: m["files"].update({"experts": m["files"]["router.msgpack"]})),
        "experts: missing from the bundle (listed in manifest.json)",
    ),
    (
        "file-sha-mismatch",
        _edit(lambda m: m["files"][SCORE0].update(sha256="0" * 64)),
        "score.onnx: sha256 does not match",
    ),
    (
        "onnx-flipped-byte",
        lambda d: (d / SCORE0).write_bytes(_flip((d / SCORE0).read_bytes(), 500)),
        "score.onnx: sha256 does not match manifest.json; the file was modified or corrupted",
    ),
    (
        "onnx-truncated",
        lambda d: (d / SCORE0).write_bytes((d / SCORE0).read_bytes()[:1000]),
        "score.onnx: sha256 does not",
    ),
    ("onnx-missing", lambda d: (d / "experts/1/stream.onnx").unlink(), "stream.onnx: missing from the bundle"),
    (
        "router-file-corrupt",
        lambda d: (d / "router.msgpack").write_bytes(b"not a router"),
        "router.msgpack: sha256 does not",
    ),
    # router section
    ("router-missing", _edit(lambda m: m.pop("router")), "missing field 'router'"),
    ("router-file-not-listed", _edit(lambda m: m["router"].update(file="other.msgpack")), "router file is not listed"),
    (
        "router-file-an-int",
        _edit(lambda m: m["router"].update(file=1)),
        "router: field 'file' has the wrong type (int)",
    ),
    (
        "router-temperature-str",
        _edit(lambda m: m["router"].update(temperature="1")),
        "'temperature' has the wrong type",
    ),
    (
        "router-temperature-nan",
        _edit(lambda m: m["router"].update(temperature=float("nan"))),
        "router temperature nan is not a positive finite number",
    ),
    ("router-temperature-inf", _edit(lambda m: m["router"].update(temperature=float("inf"))), "router temperature inf"),
    ("router-temperature-zero", _edit(lambda m: m["router"].update(temperature=0)), "router temperature 0 is not"),
    ("router-temperature-negative", _edit(lambda m: m["router"].update(temperature=-1.5)), "router temperature -1.5"),
    (
        "router-temperature-huge-int",
        _edit(lambda m: m["router"].update(temperature=10**400)),
        "is not a positive finite number",
    ),
    (
        "router-n-experts-3",
        _edit(lambda m: m["router"].update(n_experts=3)),
        "the router maps 3 experts but 2 are listed",
    ),
    (
        "router-n-experts-str",
        _edit(lambda m: m["router"].update(n_experts="2")),
        "'n_experts' has the wrong type (str)",
    ),
    # experts
    ("experts-missing", _edit(lambda m: m.pop("experts")), "missing field 'experts'"),
    ("experts-a-map", _edit(lambda m: m.update(experts={"0": m["experts"][0]})), "'experts' has the wrong type (dict)"),
    ("experts-empty", _edit(lambda m: m.update(experts=[])), "the bundle has no experts"),
    ("expert-not-a-map", _edit(lambda m: m["experts"].__setitem__(0, 5)), "experts[0]: missing field 'id'"),
    ("expert-one-dropped", _edit(lambda m: m["experts"].pop()), "the router maps 2 experts but 1 are listed"),
    ("expert-id-out-of-order", _edit(lambda m: m["experts"].reverse()), "experts[0]: id 1, expected 0"),
    ("expert-id-bool", _edit(lambda m: m["experts"][0].update(id=False)), "experts[0]: field 'id' has the wrong type"),
    (
        "expert-version-str",
        _edit(lambda m: m["experts"][1].update(version="1")),
        "experts[1]: field 'version' has the wrong",
    ),
    (
        "expert-val-loss-str",
        _edit(lambda m: m["experts"][1].update(val_loss="low")),
        "experts[1]: field 'val_loss' has the wrong type (str)",
    ),
    (
        "expert-params-off-by-one",
        _edit(lambda m: m["experts"][0].update(params=m["experts"][0]["params"] + 1)),
        "weights, but the entry lists",
    ),
    (
        "expert-hidden-not-the-params",
        _edit(lambda m: m["experts"][1]["config"]["model"].update(hidden=9)),
        "expert of embed 8, hidden 9, layers 1 has",
    ),
    (
        "expert-kind-unknown",
        _edit(lambda m: m["experts"][0]["config"]["model"].update(kind="transformer")),
        "experts[0]: config: model.kind",
    ),
    ("expert-layers-zero", _edit(lambda m: m["experts"][0]["config"]["model"].update(layers=0)), "model.layers"),
    (
        "expert-config-no-model",
        _edit(lambda m: m["experts"][0]["config"].pop("model")),
        "config: missing field 'model'",
    ),
    (
        "expert-config-unknown-setting",
        _edit(lambda m: m["experts"][0]["config"].update(bogus=1)),
        "bogus: unknown setting",
    ),
    (
        "expert-score-not-listed",
        _edit(lambda m: m["experts"][0].update(score="experts/0/other.onnx")),
        "experts/0/other.onnx is not listed under files",
    ),
    (
        "expert-stream-outside",
        _edit(lambda m: m["experts"][1].update(stream="../deploy/experts/1/stream.onnx")),
        "is not listed under files",
    ),
    # seq_len
    ("seq-len-zero", _edit(lambda m: m.update(seq_len=0)), "seq_len must be >= 1, got 0"),
    ("seq-len-str", _edit(lambda m: m.update(seq_len="32")), "field 'seq_len' has the wrong type (str)"),
    ("seq-len-missing", _edit(lambda m: m.pop("seq_len")), "missing field 'seq_len'"),
]


@pytest.mark.parametrize("breaker,fragment", _params(BUNDLE_CASES))
def test_bundle_read_refuses(deploy, breaker, fragment):
    from export.bundle import BundleError, read

    root = deploy
    if breaker == "not-a-dir":
        root = deploy / "manifest.json"
    else:
        breaker(deploy)
    before = _tree(deploy)
    with pytest.raises(BundleError) as got:
        read(root)
    assert fragment in one_line(got.value), got.value
    assert _tree(deploy) == before


def test_bundle_baseline_reads_and_runs(deploy):
    """The baseline the cases break: the copy reads, loads and scores."""
    from export.infer import Deployment

    dep = Deployment(deploy)
    assert dep.n_experts == 2 and dep.experts[0].logprobs(np.zeros((1, 4), np.int64)).shape == (1, 4, 256)


def _router_bytes(docs, n: int = 2, **over) -> bytes:
    from soma_edge.corpus import router

    data = router.fit(docs, n, seed=0, dim=256)[0].to_bytes()
    if not over:
        return data
    return codec.encode({**codec.decode(data, "router"), **over}, "router")


def _swap_router(data_fn):
    def breaker(deploy, docs):
        (deploy / "router.msgpack").write_bytes(data_fn(docs))
        _rehash(deploy, "router.msgpack")

    return breaker


def _file_rehashed(rel, fn):
    def breaker(deploy, docs):
        (deploy / rel).write_bytes(fn(deploy))
        _rehash(deploy, rel)

    return breaker


def _sparse_model(deploy, docs):
    """A model table that leaves out hidden, with params for its default: read accepts it, and what runs
    must use the default (128), not crash on the missing key."""
    m = _manifest(deploy)
    model = m["experts"][0]["config"]["model"]
    del model["hidden"]
    m["experts"][0]["params"] = _params_for(model)
    _write_manifest(deploy, m)


def _run_expert(deploy, which="score"):
    from export.infer import Deployment

    dep = Deployment(deploy)
    x = np.zeros((1, 4), np.int64)
    if which == "score":
        dep.experts[0].logprobs(x)
    else:
        dep.experts[0].step(x, dep.experts[0].zero_state())


DEPLOY_CASES = [
    # (id, break(deploy, docs), what to run, fragment)
    (
        "router-not-msgpack",
        _swap_router(lambda docs: b"not a router"),
        "load",
        "router.msgpack: cannot load the router",
    ),
    ("router-wrong-kind", _swap_router(lambda docs: codec.encode({}, "expert")), "load", "expected a router message"),
    (
        "router-3-experts",
        _swap_router(lambda docs: _router_bytes(docs, 3)),
        "load",
        "the router maps 3 experts, the manifest lists 2",
    ),
    (
        "router-prior-not-a-distribution",
        _swap_router(lambda docs: _router_bytes(docs, prior=np.array([0.9, 0.9]))),
        "load",
        "prior is not a distribution",
    ),
    (
        "router-temperature-nan",
        _swap_router(lambda docs: _router_bytes(docs, temperature=float("nan"))),
        "load",
        "temperature nan is not positive",
    ),
    (
        "router-bucket-bits-huge",
        _swap_router(lambda docs: _router_bytes(docs, bucket_bits=2**64 - 1)),
        "load",
        "bucket_bits",
    ),
    (
        "onnx-truncated-rehashed",
        _file_rehashed(SCORE0, lambda d: (d / SCORE0).read_bytes()[:1000]),
        "score",
        "score.onnx: not a loadable ONNX model (truncated or corrupt)",
    ),
    ("onnx-garbage-rehashed", _file_rehashed(SCORE0, lambda d: b"\x00" * 64), "score", "not a loadable ONNX model"),
    (
        "stream-is-a-score-graph",
        _file_rehashed("experts/0/stream.onnx", lambda d: (d / SCORE0).read_bytes()),
        "stream",
        "stream.onnx: the graph (model.kind 'lstm', inputs [('x', ['B', 'T'])]) does not match the manifest's expert",
    ),
    ("model-hidden-left-to-default", _sparse_model, "stream", "stream.onnx: the graph"),
    ("onnx-modified-after-read", "after-read", "score", "score.onnx: sha256 does not match manifest.json"),
]


@pytest.mark.parametrize("breaker,action,fragment", _params(DEPLOY_CASES))
def test_deployment_refuses(deploy, bundle_src, breaker, action, fragment):
    from export.bundle import BundleError
    from export.infer import Deployment

    if breaker == "after-read":  # verified at load, changed before its session is made: checked again
        dep = Deployment(deploy)
        (deploy / SCORE0).write_bytes(_flip((deploy / SCORE0).read_bytes(), 700))
        before = _tree(deploy)
        with pytest.raises(BundleError) as got:
            dep.experts[0].logprobs(np.zeros((1, 4), np.int64))
    else:
        breaker(deploy, bundle_src[1])
        before = _tree(deploy)
        with pytest.raises(BundleError) as got:
            Deployment(deploy) if action == "load" else _run_expert(deploy, action)
    assert fragment in one_line(got.value), got.value
    assert _tree(deploy) == before


def test_export_refuses_nan_weights_and_leaves_nothing(bundle_src, tmp_path):
    """NaN weights cannot reach a bundle: the exporter refuses the run (and writes nothing)."""
    from export import bundle

    run = tmp_path / "run"
    shutil.copytree(bundle_src[2], run)
    state = checkpoint.load(run / "state.msgpack", "run_state")
    rel = state["experts"]["1"]["path"]
    body = checkpoint.load(run / rel, "expert")
    body["weights"] = body["weights"].copy()
    body["weights"][5] = np.nan
    body["sha256"] = state["experts"]["1"]["sha256"] = protocol.weights_sha256(body["weights"])
    checkpoint.save(run / rel, body, "expert")
    checkpoint.save(run / "state.msgpack", state, "run_state")
    before = _tree(run)
    with pytest.raises(CheckpointError, match="weights hold NaN or infinity"):
        bundle.write(run, tmp_path / "out")
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert _tree(run) == before
