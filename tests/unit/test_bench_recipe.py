"""bench/recipe.py runs end to end on a tiny corpus: both tables, the plot, and the JSON line (the claim is
the result in docs/RESULTS.md, not a test)."""

import json
import math

import pytest

from tests.helpers.corpus import write_stdlib_corpus

pytest.importorskip("torch")

from bench import recipe  # noqa: E402 - after importorskip: the recipe bench imports torch


def test_recipe_bench_tiny(tmp_path, capsys):
    src = write_stdlib_corpus(tmp_path / "corpus")
    png = tmp_path / "recipe.png"
    assert (
        recipe.main(
            [
                "--seconds",
                "1.5",
                "--corpus",
                str(src),
                "--arms",
                "today,+delta,default,soma",
                "--check-steps",
                "5",
                "--work",
                str(tmp_path / "work"),
                "--plot",
                str(png),
                "--seed-evals",
                "150",
                "--json",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "Table 1: equal wall time" in out and "Table 2: equal forward passes" in out and "Table 3: N = 4" in out
    result = json.loads(out.strip().splitlines()[-1])
    arms = result["arms"]
    assert [a["name"] for a in arms] == ["today", "+delta", "default", "soma", "bptt"]
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
        assert abs(r["evals_per_expert"] - 150) <= 4 and all(0 < r[k] < 10 for k in ("stream", "paper"))
    assert rows["soma"]["seed_steps"] == 0 and rows["soma + seed (E frozen)"]["seed_steps"] > 0
    assert rows["soma + seed (E frozen)"]["expert_steps"] < rows["soma"]["expert_steps"] * 3 / 2  # the seed was paid


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
