"""bench/recipe.py runs end to end on a tiny corpus: its three tables, the BPTT reference's lr sweep, the plot,
and the JSON line (the claim is the result in docs/RESULTS.md, not a test); the reference starts where the
default arm starts."""

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.corpus import write_stdlib_corpus

torch = pytest.importorskip("torch")

from bench import recipe  # noqa: E402 - after importorskip: the recipe bench imports torch
from bench.common import Result  # noqa: E402
from bench.torch_ref import reference  # noqa: E402

SEED_EVALS = 8  # table 3's passes per expert: 4 steps each, or a 4-step seed then 3 each (the seed paid for)


def _small_corpus(folder: Path) -> Path:
    """The standard-library sample cut to its files' first 4 KB: ~7 KB of test split, not ~36 KB, for table 3
    to score 6 arms' mixtures on (each cluster keeps its train, val and test bytes)."""
    src = write_stdlib_corpus(folder)
    for f in src.iterdir():
        f.write_bytes(f.read_bytes()[:4000])
    return src


def test_recipe_bench_tiny(tmp_path, capsys):
    src = _small_corpus(tmp_path / "corpus")
    png = tmp_path / "recipe.png"
    lrs = [3e-3, 3e-2]
    argv = ["--seconds", "0.15", "--corpus", str(src), "--arms", "today,default,soma", "--check-steps", "10"]
    argv += ["--bptt-lrs", ",".join(map(str, lrs)), "--work", str(tmp_path / "work"), "--plot", str(png)]
    assert recipe.main([*argv, "--seed-evals", str(SEED_EVALS), "--json"]) == 0
    out = capsys.readouterr().out
    assert "Table 1: equal wall time" in out and "Table 2: equal forward passes" in out and "Table 3: N = 4" in out
    result = json.loads(out.strip().splitlines()[-1])
    arms = result["arms"]
    assert [a["name"] for a in arms] == ["today", "default", "soma", "bptt"]
    # The reference's lr sweep: every swept lr ran, and the row is the run with the lowest val loss.
    sweep = result["bptt_sweep"]
    assert sorted(r["lr"] for r in sweep) == lrs and all(r["steps"] > 0 for r in sweep)
    best = min(sweep, key=lambda r: r["val_nats_per_byte"])
    assert arms[-1]["lr"] == best["lr"] and arms[-1]["test_nats_per_byte"] == best["test_nats_per_byte"]
    assert arms[-1]["init"] == "default" and f"bptt (lr {best['lr']:g})" in out
    bptt = arms[-1]["test_nats_per_byte"]
    assert arms[-1]["captured"] == 1.0
    for a in arms:
        assert math.isfinite(a["test_nats_per_byte"]) and 0 < a["test_nats_per_byte"] < 10
    # captured is (unigram - arm) / (unigram - bptt): two arms' captured values fix the unigram they imply
    (x1, c1), (x2, c2) = [(a["test_nats_per_byte"], a["captured"]) for a in arms[:2]]
    assert c1 != c2 and math.isclose((x1 - c1 * bptt) / (1 - c1), (x2 - c2 * bptt) / (1 - c2), rel_tol=1e-6)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {r["name"]: r for r in result["seed_table"]}
    assert list(rows) == [
        "lstm default",
        "soma",
        "soma + seed (E frozen)",
        "soma + seed (E by delta)",
        "lstm + seed (head frozen)",
        "lstm + seed (head by delta)",
    ]
    for r in rows.values():  # equal forward passes per expert, the seed's included (to a step's rounding)
        assert abs(r["evals_per_expert"] - SEED_EVALS) <= 4 and all(0 < r[k] < 10 for k in ("stream", "paper"))
    assert rows["soma"]["seed_steps"] == 0 and rows["soma + seed (E frozen)"]["seed_steps"] > 0
    assert rows["soma + seed (E frozen)"]["expert_steps"] < rows["soma"]["expert_steps"] * 3 / 2  # the seed was paid


def test_bptt_starts_from_the_default_arms_weights_on_its_batches():
    """The reference's torch model holds the default arm's initial weights bit for bit (its input gain
    included), and scores the default arm's first SPSA minibatch as ORT does at those weights."""
    from soma_edge.engine.evaluator import evaluator_for
    from soma_edge.expert import params, steps

    cfg, model = recipe.bptt_model(seed=0)
    default = recipe.arm_config("default")
    assert cfg.model == default.model and cfg.data == default.data and cfg.seed == default.seed
    w0 = recipe.arm_init(default)
    assert np.array_equal(model.flat_weights(), w0)
    data = np.frombuffer(Path(recipe.__file__).read_bytes() * 4, dtype=np.uint8)
    ((x, y),) = steps.batches(data, default, 0, 0)
    with torch.no_grad():
        ref = float(model(torch.from_numpy(x), torch.from_numpy(y)))
    ort = evaluator_for(default, "cpu", threads=1, parallel=1).loss(w0, x, y)
    assert abs(ref - ort) <= 1e-5, (ref, ort)
    # Guard the guard: the old reference's init (input gain 1) is another vector with another loss.
    weak = params.init(replace(default.model, input_gain=1.0), default.seed)
    assert default.model.input_gain == 4.0 and not np.array_equal(weak, w0)
    with torch.no_grad():
        old = float(reference(default.model, weak)(torch.from_numpy(x), torch.from_numpy(y)))
    assert abs(old - ref) > 1e-3


def test_the_sweep_picks_by_val_never_by_test():
    def run(lr: float, val: float, test: float) -> Result:
        return Result(name="bptt", test=test, steps=1, evals=1, seconds=0.0, val=val, lr=lr)

    sweep = [run(1e-3, 1.50, 1.20), run(1e-2, 1.40, 1.30), run(3e-2, float("nan"), 1.00)]
    assert recipe.pick_by_val(sweep).lr == 1e-2  # the lowest test (1.20) and the diverged run (NaN) lose


def test_recipe_arms_are_cumulative_and_default_is_the_shipped_config():
    from soma_edge.config import Config

    today, delta, sparse = (recipe.arm_config(n) for n in ("today", "+delta", "+sparse"))
    assert (today.spsa.decoder, today.spsa.update, today.spsa.directions, today.model.input_gain) == (
        "spsa",
        "rms",
        8,
        1.0,
    )
    assert delta.spsa.decoder == "delta" and delta.spsa.update == "rms" and delta.spsa.density == 1.0
    assert sparse.spsa.update == "adam" and sparse.spsa.density == 0.5  # +adam is kept below +sparse
    default = recipe.arm_config("default")
    assert default.spsa == Config().spsa and default.model.input_gain == Config().model.input_gain
