"""soma-export: deploy bundle, exported loss == training loss, streaming == scoring, routed eval, bad input.

The run directory is built here with soma_edge.checkpoint in the coordinator's layout, with a real router
fitted on three small domains, so these tests need neither a federation nor the corpus cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from export import bundle
from export.cli import app
from export.infer import Deployment, generate
from soma_edge import checkpoint
from soma_edge.cli import run as run_cli
from soma_edge.config import ModelConfig
from soma_edge.corpus import mixture, router
from soma_edge.engine.evaluator import LossEvaluator
from tests.helpers.export_run import T, domains, make_run

ROOT = Path(__file__).resolve().parents[2]
N = 3


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def docs():
    return domains()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, docs):
    """(run dir, bundle dir, float32 weights by expert): 3 one-layer experts, expert 2 stored as float16."""
    base = tmp_path_factory.mktemp("export")
    m = ModelConfig(embed=8, hidden=16, layers=1)
    weights = make_run(base / "run", m, N, docs, f16=(2,))
    bundle.write(base / "run", base / "deploy")
    return base / "run", base / "deploy", weights


SOMA = ModelConfig(kind="soma", embed=12, hidden=12, layers=2)


@pytest.fixture(scope="module")
def soma_exported(tmp_path_factory, docs):
    """The same, for the paper's expert kind (tied E, residual blocks)."""
    base = tmp_path_factory.mktemp("export-soma")
    weights = make_run(base / "run", SOMA, N, docs)
    bundle.write(base / "run", base / "deploy")
    return base / "run", base / "deploy", weights


@pytest.fixture(scope="module")
def dep(exported):
    return Deployment(exported[1], device="cpu", threads=1)


@pytest.fixture(scope="module", params=["lstm", "soma"])
def any_dep(request, exported, soma_exported):
    """A deployment of each model kind."""
    return Deployment((exported if request.param == "lstm" else soma_exported)[1], device="cpu", threads=1)


@pytest.fixture(scope="module")
def eval_file(tmp_path_factory, docs):
    """Held-out-like text that moves between the domains, so routing changes along the file."""
    path = tmp_path_factory.mktemp("data") / "mixed.txt"
    path.write_bytes(docs[3][:500] + docs[15][:700] + docs[30][:600] + docs[5][:333])
    return path


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = run_cli(app, [str(a) for a in argv], prog="soma-export")
    out, err = capsys.readouterr()
    return rc, out, err


def assert_user_error(rc: int, err: str, *fragments: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for f in fragments:
        assert f in lines[0], lines[0]


# ---------------------------------------------------------------------------------------------- the bundle


def test_bundle_lists_and_checks_every_file(exported):
    run, deploy, weights = exported
    manifest = json.loads((deploy / "manifest.json").read_text())
    on_disk = {str(p.relative_to(deploy)) for p in deploy.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk
    assert len([f for f in on_disk if f.endswith(".onnx")]) == 2 * N + 1  # + the router featurizer
    for rel, meta in manifest["files"].items():
        data = (deploy / rel).read_bytes()
        assert hashlib.sha256(data).hexdigest() == meta["sha256"] and len(data) == meta["bytes"]
        if rel.endswith(".onnx"):
            model = onnx.load_model_from_string(data)
            onnx.checker.check_model(model, full_check=True)
            # weights are initializers: the only inputs are the bytes (and the LSTM state when streaming)
            inputs = [i.name for i in model.graph.input]
            assert inputs == ["context"] if rel == "router_features.onnx" else inputs[0] == "x"
            assert set(inputs) <= {"x", "h0", "c0", "context"}
    assert (deploy / "router.msgpack").read_bytes() == (run / "router.msgpack").read_bytes()
    assert manifest["seq_len"] == T and manifest["router"]["n_experts"] == N and manifest["quantize"] is None
    assert manifest["run"]["round"] == 4
    for e in manifest["experts"]:
        i = e["id"]
        assert (e["version"], e["step"], e["val_loss"]) == (i + 1, 10 * (i + 1), 2.5 + i if i else None)
        assert e["config"]["model"] == {
            "kind": "lstm",
            "embed": 8,
            "hidden": 16,
            "layers": 1,
            "input_gain": 4.0,
            "seed_decoder": "frozen",
        }
        assert e["params"] == weights[i].size
    assert not [p for p in deploy.parent.iterdir() if p.name.startswith(".")]  # no temp folder left


@pytest.mark.parametrize("layers", [1, 2, "soma"])
def test_exported_loss_equals_training_loss(tmp_path, docs, exported, soma_exported, layers):
    if layers == 1:
        deploy, weights, m = exported[1], exported[2], ModelConfig(embed=8, hidden=16, layers=1)
    elif layers == "soma":
        deploy, weights, m = soma_exported[1], soma_exported[2], SOMA
    else:
        m = ModelConfig(embed=8, hidden=12, layers=2)
        weights = make_run(tmp_path / "run", m, 2, docs[::3])
        deploy = tmp_path / "deploy"
        bundle.write(tmp_path / "run", deploy)
    d = Deployment(deploy, device="cpu", threads=1)
    ev = LossEvaluator(m, device="cpu", threads=1)
    rng = np.random.default_rng(7)
    batch = rng.integers(0, 256, size=(3, 41))
    x, y = batch[:, :-1], batch[:, 1:]
    losses = []
    for e, w in weights.items():
        lp = d.experts[e].logprobs(x)
        exported_loss = float(-np.take_along_axis(lp, y[..., None], -1).mean())
        training_loss = ev.loss(w, x, y)
        assert abs(exported_loss - training_loss) <= 1e-5, (e, exported_loss, training_loss)
        losses.append(training_loss)
    assert abs(losses[0] - np.log(256)) > 0.1 and abs(losses[0] - losses[1]) > 1e-2  # the weights matter


def test_streaming_graph_reproduces_scoring(any_dep):
    x = np.frombuffer(b"def stream(self):\n    return 'bytes one at a time'\n", dtype=np.uint8).astype(np.int64)[None]
    for expert in any_dep.experts:
        want = expert.logprobs(x)[0]
        for chunks in ([1] * x.shape[1], [5, 1, 17, 2, x.shape[1] - 25]):  # byte by byte, and uneven pieces
            state, got, i = expert.zero_state(), [], 0
            for n in chunks:
                logits, state = expert.step(x[:, i : i + n], state)
                got.append(logits[0])
                i += n
            z = np.concatenate(got).astype(np.float64)
            z -= z.max(1, keepdims=True)
            z -= np.log(np.exp(z).sum(1, keepdims=True))
            np.testing.assert_allclose(z, want, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------- routed eval


def test_generation_mixture_equals_eval_mixture(any_dep):
    """Every sampled byte's log-prob under the streaming mixture equals eval's on the same text."""
    dep = any_dep
    prompt = b"import json\nfrom textwrap import dedent\n"  # crosses a window boundary (T = 32)
    for k, temp in ((1, 1.0), (2, 1.0), (N, 0.5)):
        out = list(generate(dep, prompt, 3 * T + 7, k, temperature=temp, seed=k))
        text = prompt + bytes(b for b, _ in out)
        scored = dep.score(np.frombuffer(text, np.uint8), k, keep_logprobs=True)
        np.testing.assert_allclose([lp for _, lp in out], scored.logprobs[len(prompt) - 1 :], rtol=0, atol=1e-5)
    # and the prompt itself, fed one byte at a time
    s = dep.stream(prompt[:1], 2)
    got = []
    for b in prompt[1:]:
        got.append(s.logprobs[b])
        s.feed(bytes([b]))
    np.testing.assert_allclose(
        got, dep.score(np.frombuffer(prompt, np.uint8), 2, keep_logprobs=True).logprobs, atol=1e-5
    )


def test_uniform_top_all_equals_independent_numpy_mixture(exported, eval_file, capsys):
    _, deploy, _ = exported
    rc, out, err = cli(["eval", deploy, "--data", eval_file, "--top-k", N, "--uniform", "--json"], capsys)
    assert rc == 0, err
    got = json.loads(out)
    # Independently: plain ORT sessions on the bundle's files, the file cut into T-byte windows, p = mean_e p_e.
    data = np.frombuffer(eval_file.read_bytes(), np.uint8).astype(np.int64)
    manifest = json.loads((deploy / "manifest.json").read_text())
    sessions = [
        ort.InferenceSession(str(deploy / e["score"]), providers=["CPUExecutionProvider"]) for e in manifest["experts"]
    ]
    nll = []
    for s in range(0, data.size - 1, T):
        x, y = data[s : min(s + T, data.size - 1)], data[s + 1 : min(s + T, data.size - 1) + 1]
        p = np.mean([np.exp(sess.run(None, {"x": x[None]})[0][0, np.arange(y.size), y]) for sess in sessions], axis=0)
        nll.append(-np.log(p.astype(np.float64)))
    nll = np.concatenate(nll)
    assert got["bytes"] == data.size - 1 == nll.size
    assert got["nats_per_byte"] == pytest.approx(nll.mean(), abs=1e-6)
    # every expert ran on every window
    assert all(e["windows"] == -(-(data.size - 1) // T) for e in got["experts"])


def test_routed_eval_uses_only_preceding_bytes(dep, eval_file):
    data = np.frombuffer(eval_file.read_bytes(), np.uint8)
    base = dep.score(data, 2, keep_logprobs=True)
    assert len(set(base.experts[:, 0].tolist())) > 1  # the file moves between domains and routing follows
    i = 20
    changed = data.copy()
    changed[i * T : (i + 1) * T] = np.frombuffer(b"0123456789,-.\n"[:1] * T, np.uint8)  # window i's bytes
    other = dep.score(changed, 2, keep_logprobs=True)
    # windows up to and including i were routed on bytes before window i's targets, which did not change...
    np.testing.assert_array_equal(other.experts[: i + 1], base.experts[: i + 1])
    np.testing.assert_array_equal(other.weights[: i + 1], base.weights[: i + 1])
    # ...and window i+1 is routed on window i, which did
    assert (
        not np.allclose(other.weights[i + 1], base.weights[i + 1])
        or (other.experts[i + 1] != base.experts[i + 1]).any()
    )
    # the scores before window i are untouched (a leak would move them)
    np.testing.assert_array_equal(other.logprobs[: i * T - 1], base.logprobs[: i * T - 1])


# ---------------------------------------------------------------------------------------------- paper protocol


@pytest.fixture(scope="module")
def paper_file(tmp_path_factory, docs):
    """Six 1,025-byte windows from alternating domains, plus a tail shorter than a window."""
    path = tmp_path_factory.mktemp("paper") / "paper.txt"
    parts = [docs[i][:1025] for i in (3, 15, 30, 4, 16, 31)]
    assert all(len(p) == 1025 for p in parts)
    path.write_bytes(b"".join(parts) + docs[5][:400])
    return path


def test_paper_protocol_equals_an_independent_uniform_mixture(soma_exported, paper_file, capsys):
    """Plain ORT sessions: each 1,025-byte window from a reset state, routed on its first 256 bytes, the
    uniform top-min(4, N) average, only its last 768 targets scored."""
    _, deploy, _ = soma_exported
    rc, out, err = cli(["eval", deploy, "--data", paper_file, "--protocol", "paper", "--json"], capsys)
    assert rc == 0, err
    got = json.loads(out)
    assert (got["protocol"], got["top_k"], got["uniform"], got["bytes"]) == ("paper", N, True, 6 * 768)
    data = np.frombuffer(paper_file.read_bytes(), np.uint8)
    manifest = json.loads((deploy / "manifest.json").read_text())
    sessions = [
        ort.InferenceSession(str(deploy / e["score"]), providers=["CPUExecutionProvider"]) for e in manifest["experts"]
    ]
    r = router.load(deploy / "router.msgpack")
    nll = []
    for s in range(0, 6 * 1025, 1025):
        w = data[s : s + 1025].astype(np.int64)
        chosen, _ = r.route(r.distances([data[s : s + 256]]), N, r.temperature)
        p = np.mean(
            [np.exp(sessions[e].run(None, {"x": w[None, :-1]})[0][0, np.arange(1024), w[1:]]) for e in chosen[0]],
            axis=0,
        )
        nll.append(-np.log(p[256:].astype(np.float64)))
    assert got["nats_per_byte"] == pytest.approx(np.concatenate(nll).mean(), abs=1e-6)
    rc, out, _ = cli(["eval", deploy, "--data", paper_file, "--protocol", "paper"], capsys)
    assert out.strip().splitlines()[-1].startswith(f"top-{N} uniform mixture of {N} experts, paper protocol, ")


def test_paper_protocol_routes_only_on_the_prefix(soma_exported, paper_file):
    dep = Deployment(soma_exported[1], device="cpu", threads=1)
    data = np.frombuffer(paper_file.read_bytes(), np.uint8)
    base = dep.score(data, 2, uniform=False, keep_logprobs=True, protocol="paper")
    assert base.positions.size == base.logprobs.size == 6 * 768 and base.positions[0] == 256
    assert len(set(base.experts[:, 0].tolist())) > 1  # the windows come from different domains
    # Every byte after each window's prefix replaced by one domain's text: routing must not move at all.
    changed = data.copy()
    for s in range(0, 6 * 1025, 1025):
        changed[s + 256 : s + 1025] = np.frombuffer(domains()[0][: 1025 - 256], np.uint8)
    other = dep.score(changed, 2, uniform=False, keep_logprobs=True, protocol="paper")
    np.testing.assert_array_equal(other.experts, base.experts)
    np.testing.assert_array_equal(other.weights, base.weights)
    assert not np.allclose(other.logprobs, base.logprobs)  # the scored bytes did change
    # A window's prefix drives its routing: window 0 given window 1's prefix is routed like window 1.
    swapped = data.copy()
    swapped[:256] = data[1025 : 1025 + 256]
    moved = dep.score(swapped, 2, uniform=False, protocol="paper")
    np.testing.assert_array_equal(moved.experts[0], base.experts[1])
    np.testing.assert_array_equal(moved.experts[1:], base.experts[1:])


def test_paper_protocol_compared_on_the_same_bytes(dep, paper_file, capsys):
    rc, out, err = cli(
        ["eval", dep.bundle.root, "--data", paper_file, "--protocol", "paper", "--compare", "--json"], capsys
    )
    assert rc == 0, err
    got = json.loads(out)
    data = np.frombuffer(paper_file.read_bytes(), np.uint8)
    stream = dep.score(data, 2, keep_logprobs=True)
    positions = mixture.paper_positions(data.size)
    assert got["stream_same_bytes"] == pytest.approx(-stream.logprobs[positions].mean(), abs=1e-9)
    assert got["stream_same_bytes"] != pytest.approx(stream.nats_per_byte, abs=1e-6)  # a subset, not all bytes


@pytest.mark.parametrize(
    "argv,fragments",
    [
        (["--protocol", "sliding"], ["--protocol", "stream, paper", "sliding"]),
        (["--compare"], ["--compare", "--protocol paper"]),
        (["--protocol", "paper", "--data", "{short}"], ["1025-byte window"]),
    ],
)
def test_paper_protocol_bad_input(argv, fragments, exported, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_bytes(b"x" * 1024)
    data = [] if "--data" in argv else ["--data", str(short)]
    rc, _, err = cli(["eval", exported[1], *data, *[a.format(short=short) for a in argv]], capsys)
    assert_user_error(rc, err, *fragments)


def test_router_runs_from_onnx_and_manifest_alone(exported, dep, eval_file):
    """Routing with plain ORT + the manifest (no soma-edge router code) picks what eval picked."""
    _, deploy, _ = exported
    manifest = json.loads((deploy / "manifest.json").read_text())
    r = manifest["router"]
    sess = ort.InferenceSession(str(deploy / r["features"]), providers=["CPUExecutionProvider"])
    prior, temp = np.array(r["prior"]), r["temperature"]
    data = np.frombuffer(eval_file.read_bytes(), np.uint8)
    k = 2
    want = dep.score(data, k)
    for i in range(want.experts.shape[0]):
        if i == 0:
            scores = np.log(prior)
        else:
            d = sess.run(None, {"context": data[(i - 1) * T : i * T]})[0][0]
            np.testing.assert_allclose(d, dep.router.distances([data[(i - 1) * T : i * T]])[0], atol=1e-5)
            scores = -d.astype(np.float64) / temp
        top = np.argsort(-scores, kind="stable")[:k]
        w = np.exp(scores[top] - scores[top].max())
        np.testing.assert_array_equal(top, want.experts[i])
        np.testing.assert_allclose(w / w.sum(), want.weights[i], atol=1e-5)


def test_top1_runs_one_expert_per_window(dep, eval_file):
    data = np.frombuffer(eval_file.read_bytes(), np.uint8)
    r1, r3 = dep.score(data, 1), dep.score(data, N)
    n_windows = -(-(data.size - 1) // T)
    assert sum(r1.expert_windows.values()) == n_windows and sum(r3.expert_windows.values()) == N * n_windows
    assert r1.nats_per_byte != pytest.approx(r3.nats_per_byte)


def test_eval_cli_tables_and_json(exported, eval_file, tmp_path, capsys):
    _, deploy, _ = exported
    folder = tmp_path / "heldout"
    (folder / "sub").mkdir(parents=True)
    shutil.copy(eval_file, folder / "a.txt")
    (folder / "sub" / "b.bin").write_bytes(bytes(range(256)) * 3)
    (folder / ".hidden").write_bytes(b"skipped")
    rc, out, err = cli(["eval", deploy, "--data", folder, "--data", eval_file, "--top-k", 2], capsys)
    assert rc == 0, err
    assert "expert" in out and "nats/byte alone" in out
    assert str(folder / "sub" / "b.bin") in out and ".hidden" not in out
    last = out.strip().splitlines()[-1]
    # none of these files is a shard of the bundle's run, so nothing says they were held out
    assert last.startswith("top-2 routed mixture of 3 experts, stream protocol, nats/byte of 3 files: ")
    rc, out, err = cli(["eval", deploy, "--data", folder, "--data", eval_file, "--top-k", 2, "--json"], capsys)
    got = json.loads(out)
    size = eval_file.stat().st_size
    assert got["bytes"] == (size - 1) + (size - 1) + (768 - 1)
    assert [f["bytes"] for f in got["files"]] == [size - 1, 767, size - 1]
    per_file = sum(f["nats_per_byte"] * f["bytes"] for f in got["files"]) / got["bytes"]
    assert got["nats_per_byte"] == pytest.approx(per_file) and 0 < got["nats_per_byte"] < 20
    assert got["held_out"] is False and [f["split"] for f in got["files"]] == [None] * 3
    assert float(last.split(": ")[1].split()[0]) == pytest.approx(got["nats_per_byte"], abs=1e-4)


def test_eval_scores_a_file_named_twice_once(exported, eval_file, capsys):
    _, deploy, _ = exported
    again = eval_file.parent / ".." / eval_file.parent.name / eval_file.name  # the same file, spelt otherwise
    rc, out, err = cli(
        ["eval", deploy, "--data", eval_file, "--data", again, "--data", eval_file.parent, "--json"], capsys
    )
    assert rc == 0
    got = json.loads(out)
    assert [f["path"] for f in got["files"]] == [str(eval_file)] and got["bytes"] == eval_file.stat().st_size - 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: 2 data file(s) named more than once"), err


def test_eval_says_held_out_only_of_the_bundles_own_test_shards(tmp_path, capsys):
    """Whether bytes were held out is known only of a shard of the bundle's own run (RUN/shards/<sha256>.bin,
    listed in RUN/prepare.json beside the bundle's router): `make demo` scores those, and its last line
    says held-out. Any other file is named, and nothing is claimed of it."""
    deploy, run = ROOT / "tests" / "fixtures" / "old_bundle", ROOT / "tests" / "fixtures" / "old_run"
    splits = {
        split: sha
        for c in json.loads((run / "prepare.json").read_text())["clusters"][:1]
        for split, sha in c["shards"].items()
    }
    test = run / "shards" / f"{splits['test']}.bin"
    rc, out, err = cli(["eval", deploy, "--data", test], capsys)
    assert rc == 0 and err == ""
    assert "held-out nats/byte: " in out.strip().splitlines()[-1]
    assert f"{test}   test " in out

    rc, out, _ = cli(["eval", deploy, "--data", test, "--data", run / "shards" / f"{splits['train']}.bin"], capsys)
    assert "held-out" not in out and "nats/byte of 2 files: " in out.strip().splitlines()[-1]
    assert " train " in out

    (tmp_path / "shards").mkdir()  # the same bytes, under the same name, but of no run that this bundle knows
    copy = tmp_path / "shards" / test.name
    shutil.copy(test, copy)
    rc, out, _ = cli(["eval", deploy, "--data", copy, "--json"], capsys)
    got = json.loads(out)
    assert got["held_out"] is False and got["files"][0]["split"] is None
    shutil.copy(run / "prepare.json", tmp_path)  # of the bundle's run now, but not its bytes
    copy.write_bytes(copy.read_bytes()[:-1] + b"!")
    rc, out, _ = cli(["eval", deploy, "--data", copy], capsys)
    assert "held-out" not in out and f"nats/byte of {test.name}: " in out.strip().splitlines()[-1]


@pytest.mark.parametrize("kind", ["lstm", "soma"])
def test_quantized_export(kind, exported, soma_exported, eval_file, tmp_path, capsys):
    run, deploy, _ = exported if kind == "lstm" else soma_exported
    rc, out, err = cli(["onnx", run, "--out", tmp_path / "q", "--quantize", "int8"], capsys)
    assert rc == 0, err
    manifest = json.loads((tmp_path / "q" / "manifest.json").read_text())
    assert manifest["quantize"] == "int8"
    for e in manifest["experts"]:
        model = onnx.load(str(tmp_path / "q" / e["score"]))
        assert any(n.op_type == "DynamicQuantizeLSTM" for n in model.graph.node)
        if kind == "soma":  # the residual MLP's matrices are quantized too
            assert any(n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul") for n in model.graph.node)
        assert (tmp_path / "q" / e["score"]).stat().st_size < 0.6 * (deploy / e["score"]).stat().st_size
    f = json.loads(cli(["eval", deploy, "--data", eval_file, "--json"], capsys)[1])["nats_per_byte"]
    q = json.loads(cli(["eval", tmp_path / "q", "--data", eval_file, "--json"], capsys)[1])["nats_per_byte"]
    assert q != f and abs(q - f) < 0.05 * f


def test_export_is_atomic_and_refuses_to_clobber(exported, tmp_path, capsys):
    run, _, _ = exported
    out = tmp_path / "deploy"
    rc, text, err = cli(["onnx", run, "--out", out], capsys)
    assert rc == 0, err and "wrote" in text
    first = (out / "manifest.json").read_bytes()
    rc, _, err = cli(["onnx", run, "--out", out], capsys)
    assert_user_error(rc, err, "already exists", "--force")
    rc, _, err = cli(["onnx", run, "--out", out, "--force"], capsys)
    assert rc == 0, err
    assert (out / "manifest.json").read_bytes() == first  # same run, same bytes: the export is deterministic
    # a broken run leaves neither a bundle nor a temp folder behind
    bad = tmp_path / "bad_run"
    shutil.copytree(run, bad)
    p = bad / "experts" / "1" / "v2.msgpack"
    data = bytearray(p.read_bytes())
    data[-5] ^= 0xFF
    p.write_bytes(bytes(data))
    rc, _, err = cli(["onnx", bad, "--out", tmp_path / "never"], capsys)
    assert_user_error(rc, err, "v2.msgpack", "checksum")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad_run", "deploy"]


# ---------------------------------------------------------------------------------------------- bad input


@pytest.fixture
def deploy_copy(exported, tmp_path):
    dst = tmp_path / "deploy"
    shutil.copytree(exported[1], dst)
    return dst


def _rehash(deploy: Path, rel: str) -> None:
    manifest = json.loads((deploy / "manifest.json").read_text())
    data = (deploy / rel).read_bytes()
    manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (deploy / "manifest.json").write_text(json.dumps(manifest))


def test_missing_file(deploy_copy, eval_file, capsys):
    (deploy_copy / "experts" / "1" / "stream.onnx").unlink()
    rc, _, err = cli(["eval", deploy_copy, "--data", eval_file], capsys)
    assert_user_error(rc, err, "stream.onnx", "missing")


def test_tampered_file(deploy_copy, eval_file, capsys):
    p = deploy_copy / "experts" / "2" / "score.onnx"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one weight
    p.write_bytes(bytes(data))
    rc, _, err = cli(["generate", deploy_copy, "--prompt", "x"], capsys)
    assert_user_error(rc, err, "score.onnx", "sha256")


def test_tampered_router(deploy_copy, eval_file, capsys):
    (deploy_copy / "router.msgpack").write_bytes(b"not a router")
    _rehash(deploy_copy, "router.msgpack")
    rc, _, err = cli(["eval", deploy_copy, "--data", eval_file], capsys)
    assert_user_error(rc, err, "router.msgpack")


def test_malformed_manifest(deploy_copy, eval_file, capsys):
    manifest = json.loads((deploy_copy / "manifest.json").read_text())
    del manifest["experts"][1]["config"]["model"]["hidden"]
    (deploy_copy / "manifest.json").write_text(json.dumps(manifest))
    rc, _, err = cli(["eval", deploy_copy, "--data", eval_file], capsys)
    assert_user_error(rc, err, "experts[1]", "hidden")
    (deploy_copy / "manifest.json").write_text("{not json")
    rc, _, err = cli(["eval", deploy_copy, "--data", eval_file], capsys)
    assert_user_error(rc, err, "manifest.json", "not valid JSON")


def test_kind_or_shapes_that_do_not_match_the_weights(deploy_copy, soma_exported, eval_file, capsys):
    manifest = json.loads((deploy_copy / "manifest.json").read_text())
    good = json.dumps(manifest)
    manifest["experts"][0]["config"]["model"]["kind"] = "transformer"
    (deploy_copy / "manifest.json").write_text(json.dumps(manifest))
    rc, _, err = cli(["eval", deploy_copy, "--data", eval_file], capsys)
    assert_user_error(rc, err, "experts[0]", "model.kind", "'transformer'")
    manifest = json.loads(good)
    manifest["experts"][0]["config"]["model"].update(kind="soma", embed=16)  # valid, but not these weights
    (deploy_copy / "manifest.json").write_text(json.dumps(manifest))
    rc, _, err = cli(["eval", deploy_copy, "--data", eval_file], capsys)
    assert_user_error(rc, err, "experts[0]", "'soma'", "weights")
    # a graph of the other kind, re-hashed into the manifest: the manifest no longer describes it
    (deploy_copy / "manifest.json").write_text(good)
    shutil.copy(soma_exported[1] / "experts/0/score.onnx", deploy_copy / "experts/0/score.onnx")
    _rehash(deploy_copy, "experts/0/score.onnx")
    rc, _, err = cli(["eval", deploy_copy, "--data", eval_file, "--top-k", N], capsys)
    assert_user_error(rc, err, "score.onnx", "does not match the manifest")


def test_export_refuses_a_checkpoint_whose_kind_does_not_fit_its_weights(tmp_path, docs, capsys):
    make_run(tmp_path / "run", ModelConfig(embed=8, hidden=8, layers=1), 2, docs[::3])
    body = checkpoint.load(tmp_path / "run/experts/1/v2.msgpack", "expert")
    body["config"]["model"]["kind"] = "soma"
    checkpoint.save(tmp_path / "run/experts/1/v2.msgpack", body, "expert")
    rc, _, err = cli(["onnx", tmp_path / "run", "--out", tmp_path / "deploy"], capsys)
    assert_user_error(rc, err, "v2.msgpack", "weights")
    cfg = body["config"]
    cfg["model"]["embed"] = 4
    checkpoint.save(tmp_path / "run/experts/1/v2.msgpack", body, "expert")
    rc, _, err = cli(["onnx", tmp_path / "run", "--out", tmp_path / "deploy"], capsys)
    assert_user_error(rc, err, "v2.msgpack", "model.embed must equal model.hidden")


def test_truncated_onnx(deploy_copy, eval_file, capsys):
    p = deploy_copy / "experts" / "0" / "score.onnx"
    p.write_bytes(p.read_bytes()[:1000])
    rc, _, err = cli(["eval", deploy_copy, "--data", eval_file, "--top-k", N], capsys)
    assert_user_error(rc, err, "score.onnx", "sha256")
    _rehash(deploy_copy, "experts/0/score.onnx")  # a manifest that agrees: now ORT itself must refuse it
    rc, _, err = cli(["eval", deploy_copy, "--data", eval_file, "--top-k", N], capsys)
    assert_user_error(rc, err, "score.onnx", "not a loadable ONNX model")


@pytest.mark.parametrize(
    "argv,fragments",
    [
        (["eval", "{deploy}", "--data", "{empty}"], ["empty.txt", "empty data file"]),
        (["eval", "{deploy}", "--data", "{one}"], ["one.txt", "1 byte"]),
        (["eval", "{deploy}", "--data", "{nowhere}"], ["nowhere", "no such file"]),
        (["eval", "{deploy}", "--data", "{emptydir}"], ["emptydir", "no files"]),
        (["eval", "{deploy}", "--data", "{file}", "--top-k", "0"], ["top-k must be between 1", "got 0"]),
        (
            ["eval", "{deploy}", "--data", "{file}", "--top-k", str(N + 1)],
            ["top-k must be between 1", f"({N})", f"got {N + 1}"],
        ),
        (["generate", "{deploy}", "--prompt", "hi", "--top-k", "0"], ["top-k must be between 1"]),
        (["generate", "{deploy}", "--prompt", "hi", "--top-k", str(N + 1)], ["top-k must be between 1"]),
        (["generate", "{deploy}", "--prompt", ""], ["prompt"]),
        (["generate", "{deploy}", "--prompt", "hi", "--temperature", "nan"], ["temperature", "finite", "nan"]),
        (["generate", "{deploy}", "--prompt", "hi", "--temperature", "inf"], ["temperature", "finite", "inf"]),
        (["generate", "{deploy}", "--prompt", "hi", "--temperature", "-1"], ["--temperature"]),
        (["generate", "{deploy}", "--prompt", "hi", "--router-temperature", "nan"], ["router temperature", "nan"]),
        (["eval", "{deploy}", "--data", "{file}", "--router-temperature", "inf"], ["router temperature", "inf"]),
        (["eval", "{deploy}", "--data", "{file}", "--router-temperature", "0"], ["router temperature", "0.0"]),
        (["eval", "{nowhere}", "--data", "{file}"], ["nowhere", "not a directory"]),
        (["eval", "{tmp}", "--data", "{file}"], ["manifest.json", "missing"]),
        (["onnx", "{nowhere}", "--out", "{tmp}/x"], ["nowhere", "not a run directory"]),
        (["onnx", "{run}", "--out", "{tmp}/x", "--quantize", "int4"], ["int8"]),
    ],
)
def test_bad_input_one_line_exit_2(argv, fragments, exported, eval_file, tmp_path, capsys):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "one.txt").write_bytes(b"a")
    (tmp_path / "emptydir").mkdir()
    paths = {
        "deploy": exported[1],
        "run": exported[0],
        "file": eval_file,
        "empty": tmp_path / "empty.txt",
        "one": tmp_path / "one.txt",
        "nowhere": tmp_path / "nowhere",
        "emptydir": tmp_path / "emptydir",
        "tmp": tmp_path,
    }
    rc, _, err = cli([a.format(**paths) for a in argv], capsys)
    assert_user_error(rc, err, *fragments)


def test_sampling_at_a_tiny_temperature_is_greedy_not_byte_255():
    """A temperature so small that log(p)/T overflows still picks the most likely byte (it once gave NaN,
    and NaN sampled byte 255 every time)."""
    from export.infer import sample

    p = np.full(256, 1e-3)
    p[38] = 0.5
    rng = np.random.default_rng(0)
    assert {sample(p, t, rng)[0] for t in (1e-320, 1e-3) for _ in range(5)} == {38}


# ---------------------------------------------------------------------------------------------- deploy box


def test_eval_and_generate_without_torch_flwr_or_onnx(exported, eval_file):
    """The inference path as real subprocesses, with torch, flwr and onnx unimportable."""
    _, deploy, _ = exported
    prelude = textwrap.dedent(
        """
        import sys
        for name in ("torch", "flwr", "onnx"):
            sys.modules[name] = None  # any import of these now raises ImportError
        from export.cli import app
        from soma_edge.cli import run
        rc = run(app, sys.argv[1:], prog="soma-export")
        assert not {"torch", "flwr", "onnx"} & {m.split(".")[0] for m, v in sys.modules.items() if v is not None}
        sys.exit(rc)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def sub(*argv):
        args = [a if isinstance(a, bytes) else str(a) for a in argv]
        return subprocess.run([sys.executable, "-c", prelude, *args], capture_output=True, env=env, timeout=120)

    r = sub("eval", deploy, "--data", eval_file, "--json")
    assert r.returncode == 0, r.stderr.decode()
    got = json.loads(r.stdout)
    assert got["bytes"] == eval_file.stat().st_size - 1 and 0 < got["nats_per_byte"] < 20

    g1 = sub("generate", deploy, "--prompt", "def f(x):", "--bytes", 80, "--seed", 3, "--top-k", 2)
    g2 = sub("generate", deploy, "--prompt", "def f(x):", "--bytes", 80, "--seed", 3, "--top-k", 2)
    g3 = sub("generate", deploy, "--prompt", "def f(x):", "--bytes", 80, "--seed", 4, "--top-k", 2)
    assert g1.returncode == 0, g1.stderr.decode()
    assert g1.stdout.startswith(b"def f(x):") and len(g1.stdout) == len(b"def f(x):") + 80 + 1
    assert g1.stdout == g2.stdout and g1.stdout != g3.stdout  # the seed decides the sample
    raw = sub("generate", deploy, "--prompt", b"caf\xe9 \xff", "--bytes", 5)  # not UTF-8: bytes as given
    assert raw.returncode == 0 and raw.stdout.startswith(b"caf\xe9 \xff"), raw.stderr.decode()

    bad = sub("eval", deploy, "--data", eval_file, "--top-k", 0)
    assert bad.returncode == 2 and bad.stderr.decode().strip().count("\n") == 0
    assert bad.stderr.decode().startswith("error: ") and b"Traceback" not in bad.stderr
