"""Runs made by earlier versions keep working: a run directory and its bundle, both written at commit
a1c491c (tests/fixtures/README.md), are read, exported and resumed by today's code."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.loop import Coordinator
from soma_edge.rundir.layout import RunDir
from tests.helpers.fakegrid import FakeGrid, set_fed

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"  # tests/fixtures
VERSION_FIELDS = ("soma_edge",)  # the manifest's fields that name the writer's version
BIN = Path(sys.executable).parent


@pytest.fixture
def old_run(tmp_path) -> Path:
    dest = tmp_path / "old_run"  # the bundle's manifest names the run by its folder
    shutil.copytree(FIXTURES / "old_run", dest)
    return dest


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=120)


def _without_round_keys(run: Path, keys: tuple[str, ...]) -> None:
    """Drops keys from the round lines, as a run written before those keys existed has them."""
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for m in lines:
        if m["type"] == "round":
            for k in keys:
                m.pop(k, None)
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))


def test_old_status_and_metrics_still_read(old_run, tmp_path):
    _without_round_keys(old_run, ("next_round_ahead",))
    p = _cli("soma-coord", "status", str(old_run), "--json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert (s["round"], s["rounds"]) == (2, 2)
    assert s["mixture_val_loss"] == pytest.approx(3.5365609399789117)
    assert {e: (x["version"], x["step"]) for e, x in s["experts"].items()} == {"0": (2, 573), "1": (2, 572)}
    assert s["experts"]["1"]["best"]["version"] == 1
    p = _cli("soma-coord", "report", str(old_run), "--out", str(tmp_path / "report"))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "report" / "report.html").stat().st_size > 0


def test_old_run_exports_to_the_same_bundle(old_run, tmp_path):
    p = _cli("soma-export", "onnx", str(old_run), "--out", str(tmp_path / "deploy"))
    assert p.returncode == 0, p.stderr
    old, new = FIXTURES / "old_bundle", tmp_path / "deploy"
    names = sorted(str(f.relative_to(old)) for f in old.rglob("*") if f.is_file())
    assert names == sorted(str(f.relative_to(new)) for f in new.rglob("*") if f.is_file())
    for name in names:
        if name == "manifest.json":
            a, b = (json.loads((d / name).read_text()) for d in (old, new))
            for k in VERSION_FIELDS:
                a.pop(k), b.pop(k)
            assert a == b
        else:
            assert (old / name).read_bytes() == (new / name).read_bytes(), name


def test_old_run_resumes(old_run, tmp_path):
    rd = RunDir(old_run)
    before = rd.read_metrics()
    set_fed(rd, rounds=3)
    Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), rd).main()
    state = rd.read_state(verify=True)
    assert state.round == 3
    assert all(x.version == 3 for x in state.experts.values())
    after = rd.read_metrics()
    assert after[: len(before)] == before
    assert [m["round"] for m in after[len(before) :] if m["type"] == "round"] == [3]
