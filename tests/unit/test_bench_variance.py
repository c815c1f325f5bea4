"""bench/variance.py runs end to end at a tiny size and prints well-formed JSON (the claim is the result, not
a test)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]
ARGV = ["--params", "12000", "--trials", "3", "--k", "1,4", "--experts", "1,2", "--noise", "rademacher,rank1"]


def _printed(kind: str, capsys) -> dict:
    """The bench's JSON: lstm from its command line, soma from main() in-process (a second subprocess would
    only import torch again, ~2 s, for the same code path)."""
    argv = [*ARGV, "--kind", kind, "--json"]
    if kind == "lstm":
        r = subprocess.run(
            [sys.executable, "-m", "bench.variance", *argv], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)
    from bench import variance

    variance.main(argv)
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("kind", ["lstm", "soma"])
def test_variance_bench_tiny_json(kind, capsys):
    out = _printed(kind, capsys)
    rows = out["rows"]
    assert sorted((row["noise"], row["N"], row["K"]) for row in rows) == [
        (noise, n, k) for noise in ("rademacher", "rank1") for n in (1, 2) for k in (1, 4)
    ]
    for row in rows:
        for key in ("shared", "separable", "theory_shared", "theory_separable"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert -1 <= row["cos_shared"] <= 1 and -1 <= row["cos_separable"] <= 1
        assert row["M"] == row["N"] * row["expert_params"]
        assert abs(row["M"] - 12000) / 12000 < 0.15  # M (for soma: the body SPSA perturbs) held fixed
        assert row["theory_shared"] == (row["M"] - 1) / row["K"]  # rank-1 has Rademacher's second moment
    assert out["kind"] == kind
    for row in rows:
        if row["N"] == 1:
            assert row["shared"] == pytest.approx(row["separable"])
