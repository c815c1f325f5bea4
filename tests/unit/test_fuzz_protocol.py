"""Bad input to the protocol checks (`soma_edge.wire.protocol`: `unpack`, `check_reply_header`, `check_caps`,
`check_result`), and the logs and recipes a reply carries.

Every case names its input (the parametrize id), expects the loader's own error type with a specific
fragment of its one-line message, and checks that what it was given (dicts, files) is unchanged.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from coordinator import replay as replay_mod
from soma_edge import codec
from soma_edge.config import Config
from soma_edge.errors import CodecError, ValidationError
from soma_edge.spsa.optim import State
from soma_edge.spsa.recipe import Recipe
from soma_edge.wire import protocol
from tests.helpers.fuzz import (
    ARR3,
    DROP,
    FUZZ,
    SHA_A,
    cases,
    good_result,
    one_line,
)

SHA_B = "b" * 64


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


@pytest.mark.parametrize("mutate,fragment", cases(RESULT_CASES))
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
    ("node-missing", "node", DROP, "claiming node None"),
    ("node-str", "node", "5", "claiming node '5'"),
    ("node-ndarray", "node", ARR3, "claiming node"),
    ("round-other", "round", 2, "reply is for round 2, expected round 1"),
    ("round-missing", "round", DROP, "reply is for round None"),
    ("round-str", "round", "1", "reply is for round '1'"),
    ("round-ndarray", "round", ARR3, "reply is for round"),
    ("results-missing", "results", DROP, "reply has no results list"),
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


@pytest.mark.parametrize("key,value,fragment", cases(HEADER_CASES))
def test_check_reply_header_refuses(key, value, fragment):
    body, exp, src = good_header(), good_result()[1], 5
    if key == "src":
        src = value
    elif value is DROP:
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
    ("rate-missing", "evals_per_s", DROP, "throughput None is not a positive number"),
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


@pytest.mark.parametrize("key,value,fragment", cases(CAPS_CASES))
def test_check_caps_refuses(key, value, fragment):
    caps = good_caps()
    if value is DROP:
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
