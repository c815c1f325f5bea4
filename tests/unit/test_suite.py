"""The suite's own machinery: `make test` runs tests in two processes (pytest-xdist, --dist loadgroup), and
the tests that share one real federation or one pair of SuperLinks rely on their xdist_group keeping them in
one process. A pytest that xdist does not fit (pytest 9.2 renamed what xdist 3.8 sets) ignores the groups
without a word, and those tests then fail far from the cause: this says it here."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TIERS = ("unit", "federation", "e2e")


def test_every_test_lives_in_a_tier_folder():
    """`pytest -m "not e2e"` and the markers work by folder: a test file outside the three has no tier."""
    stray = [
        str(f.relative_to(TESTS))
        for f in TESTS.rglob("test_*.py")
        if f.relative_to(TESTS).parts[0] not in TIERS and "fixtures" not in f.parts
    ]
    assert not stray, f"move these into tests/{{{','.join(TIERS)}}}/: {stray}"


def test_an_xdist_group_runs_in_one_process(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "test_grouped.py").write_text(
        textwrap.dedent(
            """
            import os

            import pytest


            @pytest.mark.xdist_group("together")
            @pytest.mark.parametrize("i", range(6))
            def test_member(i):
                with open(os.path.join(os.environ["GROUP_OUT"], f"member{i}"), "w") as out:
                    out.write(os.environ["PYTEST_XDIST_WORKER"])
            """
        )
    )
    # Autoloading off and xdist named: the venv's other plugins play no part in grouping, and loading them takes
    # ~1 s (hypothesis's) in each of the run's 3 processes.
    xdist_only = ["-p", "xdist.plugin", "-n", "2", "--dist", "loadgroup"]
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *xdist_only],
        cwd=tmp_path,
        env={**os.environ, "GROUP_OUT": str(out), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    workers = {f.read_text() for f in out.iterdir()}
    assert len(list(out.iterdir())) == 6
    assert len(workers) == 1, f"the group ran in {sorted(workers)}: --dist loadgroup ignores xdist_group"
