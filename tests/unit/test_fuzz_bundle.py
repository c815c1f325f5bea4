"""Bad input to the deploy bundle (`export.bundle.read`, and `export.infer.Deployment` where it loads one).

Every case names its input (the parametrize id), expects the loader's own error type with a specific
fragment of its one-line message, and checks that what it was given (dicts, files) is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from soma_edge import checkpoint, codec
from soma_edge.errors import CheckpointError
from soma_edge.wire import protocol
from tests.helpers.fuzz import (
    cases,
    flip,
    one_line,
    tree,
)


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
        lambda d: (d / SCORE0).write_bytes(flip((d / SCORE0).read_bytes(), 500)),
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


@pytest.mark.parametrize("breaker,fragment", cases(BUNDLE_CASES))
def test_bundle_read_refuses(deploy, breaker, fragment):
    from export.bundle import BundleError, read

    root = deploy
    if breaker == "not-a-dir":
        root = deploy / "manifest.json"
    else:
        breaker(deploy)
    before = tree(deploy)
    with pytest.raises(BundleError) as got:
        read(root)
    assert fragment in one_line(got.value), got.value
    assert tree(deploy) == before


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


@pytest.mark.parametrize("breaker,action,fragment", cases(DEPLOY_CASES))
def test_deployment_refuses(deploy, bundle_src, breaker, action, fragment):
    from export.bundle import BundleError
    from export.infer import Deployment

    if breaker == "after-read":  # verified at load, changed before its session is made: checked again
        dep = Deployment(deploy)
        (deploy / SCORE0).write_bytes(flip((deploy / SCORE0).read_bytes(), 700))
        before = tree(deploy)
        with pytest.raises(BundleError) as got:
            dep.experts[0].logprobs(np.zeros((1, 4), np.int64))
    else:
        breaker(deploy, bundle_src[1])
        before = tree(deploy)
        with pytest.raises(BundleError) as got:
            Deployment(deploy) if action == "load" else _run_expert(deploy, action)
    assert fragment in one_line(got.value), got.value
    assert tree(deploy) == before


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
    before = tree(run)
    with pytest.raises(CheckpointError, match="weights hold NaN or infinity"):
        bundle.write(run, tmp_path / "out")
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert tree(run) == before
