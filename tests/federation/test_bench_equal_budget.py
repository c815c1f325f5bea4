"""A tiny bench/equal_budget.py run (in-process fake Grid): well-formed output, budgets respected.

It asserts the shape of the result and that every arm spends the budget it was given (the coordinator's
federation.max_steps cap), never that SOMA wins: the claim is the result, not a test.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import equal_budget
from coordinator.server_app import Coordinator
from soma_edge.config import Config, evals_per_step
from soma_edge.rundir.layout import RunDir
from tests.helpers.corpus import write_stdlib_corpus
from tests.helpers.fakegrid import FakeGrid


@pytest.fixture
def quick(monkeypatch):
    """Dead time out of the three federations, nothing the bench computes."""
    # The Adam arm's torch threads: the bench gives torch every core, and two OpenMP threads on a busy 2-core
    # box (the suite runs 2 workers) wait on each other at every op, ~0.2 s a step instead of ~5 ms. One
    # thread leaves the arm's steps and budget what they were (the budget is SPSA's rate, measured on ORT).
    monkeypatch.setattr(equal_budget, "cpu_count", lambda: 1)
    # (the coordinator's 10 ms pulls: tests/federation/conftest.py, as in every fake-grid test)


def fake_federation(run: Path) -> None:  # the real ServerApp and ClientApp; only Flower's transport is faked
    rd = RunDir(run)
    cfg = rd.load_config() if rd.has_config() else None
    if cfg is None:
        from soma_edge import config as config_mod

        rd.save_config(config_mod.load(run / "bench.toml"))
    Coordinator(FakeGrid(run.parent / f"{run.name}-nodes", ["a", "b"]), rd).main()


def test_tiny_equal_budget_is_well_formed(tmp_path, capsys, quick):
    src = write_stdlib_corpus(tmp_path / "corpus")
    png = tmp_path / "eb.png"
    # 0.18 s of monolithic SPSA at the measured rate (~300 forward passes/s: 27 steps, 60 an expert at N = 2,
    # 18 Adam steps): a round or two, every curve 2+ points, and 1+ steps an arm on a box 10x slower.
    argv = ["--minutes", "0.003", "--corpus", str(src), "--params", "12000", "--ns", "2", "--lrs", "5e-3,2e-2"]
    argv += ["--adam-lrs", "1e-3", "--round-seconds", "0.5", "--rate-seconds", "0.3", "--test-bytes", "20000"]
    argv += ["--curve-bytes", "8000", "--work", str(tmp_path / "work"), "--plot", str(png), "--json"]
    out = equal_budget.main(argv, federate=fake_federation)
    printed = json.loads(capsys.readouterr().out)
    assert printed["arms"] == out["arms"] and printed["budget_flops"] == out["budget_flops"] > 0

    assert [a["arm"] for a in out["arms"]] == ["mono-spsa", "soma-n2", "adam"]
    assert [a["kind"] for a in out["arms"]] == ["monolithic-spsa", "soma", "backprop-reference"]
    budget = out["budget_flops"]
    for a in out["arms"]:
        assert math.isfinite(a["test_nats_per_byte"]) and 0 < a["test_nats_per_byte"] < 10
        assert 0 < a["test_paper"] < 10 and 0 < a["test_stream_paper_bytes"] < 10  # both protocols, same bytes
        assert a["lr"] in ((5e-3, 2e-2) if a["kind"] != "backprop-reference" else (1e-3,))
        # Equal total size: every arm within 10% of the target parameter count.
        assert abs(a["params_total"] - 12000) / 12000 < 0.1
        # Every arm spends its budget and no more (SPSA: max_steps per expert, all experts alike).
        assert 0.5 < a["flops"] / budget <= 1.0 + 1e-9, a
        assert len(set(a["steps_per_expert"])) == 1 and len(a["steps_per_expert"]) == a["experts"]
        # The curve starts untrained at zero compute and ends at the arm's spend.
        flops = [p["flops"] for p in a["curve"]]
        assert flops[0] == 0 and flops == sorted(flops) and flops[-1] == a["flops"] and len(flops) >= 2
        assert all(math.isfinite(p["loss"]) for p in a["curve"])
    soma = out["arms"][1]
    f1 = equal_budget.forward_flops(equal_budget.expert_shape(12000, 2), out["batch"], out["seq_len"])
    assert soma["forward_evals"] == 2 * evals_per_step(Config().spsa) * soma["steps_per_expert"][0]
    assert soma["flops"] == soma["forward_evals"] * f1
    # The federation stopped on the step cap, long before its nominal 100,000 rounds.
    assert soma["rounds"] < 100 and RunDir(tmp_path / "work" / "runs" / "soma-n2").read_state().round == soma["rounds"]
    assert set(out["sweep"]) == {"n1", "n2", "adam"} and set(out["lr"]) == {"n1", "n2", "adam"}
    assert set(out["soma_vs_mono"]) == {"2"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "work" / "results.json").read_text())["arms"] == out["arms"]

    # An extra monolithic arm at a pinned lr and the first run's budget (no sweep, no rate probe), merged.
    argv = ["--corpus", str(src), "--params", "12000", "--ns", "", "--no-adam", "--lr", "n1=1e-3"]
    argv += ["--budget-tflops", str(budget / 1e12), "--tag=-lr1e-3", "--round-seconds", "0.5"]
    argv += ["--test-bytes", "20000", "--curve-bytes", "8000", "--work", str(tmp_path / "work2")]
    extra = equal_budget.main(argv, federate=fake_federation)
    assert [a["arm"] for a in extra["arms"]] == ["mono-spsa-lr1e-3"] and extra["sweep"] == {}
    # the budget went through str(budget / 1e12) on the command line: equal to within its decimal rounding
    assert extra["arms"][0]["lr"] == 1e-3 and extra["budget_flops"] == pytest.approx(budget, rel=1e-12)
    capsys.readouterr()
    merged = equal_budget.main(
        [
            "--from-json",
            f"{tmp_path / 'work' / 'results.json'},{tmp_path / 'work2' / 'results.json'}",
            "--plot",
            str(png),
        ]
    )
    assert [a["arm"] for a in merged["arms"]] == ["mono-spsa", "soma-n2", "adam", "mono-spsa-lr1e-3"]
    best = min(a["test_nats_per_byte"] for a in merged["arms"] if a["kind"] == "monolithic-spsa")
    assert merged["soma_vs_mono"]["2"] == 1 - soma["test_nats_per_byte"] / best
    assert "| mono-spsa-lr1e-3 | 1 |" in capsys.readouterr().out
