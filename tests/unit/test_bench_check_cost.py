"""bench/check_cost.py runs end to end at a tiny shape: a table row and a JSON cell per (size, noise, K),
at the shipped config but for the model, K, the noise and the batch split rows need."""

import dataclasses
import json

from bench import check_cost
from bench.sizes import SIZES
from coordinator import check_budget
from soma_edge.config import Config, check_threads


def test_check_cost_tiny_json(capsys):
    argv = ["--sizes", "124K", "--noises", "rademacher,rank1", "--ks", "1,32", "--steps", "1", "--json"]
    assert check_cost.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    cells = json.loads(lines[-1])["cells"]
    assert [(c["noise"], c["k"], c["batch"]) for c in cells] == [
        ("rademacher", 1, 16),
        ("rademacher", 32, 32),  # split rows: a batch that K divides
        ("rank1", 1, 16),
        ("rank1", 32, 32),
    ]
    for c in cells:
        assert all(c[k] > 0 for k in ("replay_ms", "audit_ms", "clean_ms", "steps_per_s"))
        assert c["steps_per_s"] == 1e3 / c["replay_ms"]
        assert c["budget_steps_per_s"] == c["steps_per_s"] * check_budget.CHECK_SHARE * check_threads(Config())
    assert len([ln for ln in lines if ln.split()[:1] == ["124K"]]) == len(cells)


def test_a_cell_runs_the_shipped_config_but_for_what_it_names():
    got, shipped = check_cost.config("124K", "rank1", 32), Config()
    assert got.model == SIZES["124K"] and got.data.batch == 32 and got.data.seq_len == shipped.data.seq_len
    assert dataclasses.replace(got.spsa, directions=shipped.spsa.directions, noise=shipped.spsa.noise) == shipped.spsa
    assert got.federation == shipped.federation and got.seed == shipped.seed
