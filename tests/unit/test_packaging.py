"""The base install is a worker's: its wheel requires no torch, matplotlib or tensorboard reader, and the
worker and export commands run from it with those blocked and no network (the `report` extra draws
plots, `dev` and `bench` bring torch)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from export import bundle
from soma_edge.config import ModelConfig
from tests.helpers.export_run import domains, make_run

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "matplotlib", "tensorboard")  # tensorboardX, the event writer, is not among them
BLOCK = f"""
import socket, sys
for name in {HEAVY!r}:
    sys.modules[name] = None  # import now raises ImportError
def _offline(*args, **kwargs):
    raise OSError("the packaging test allows no network")
socket.socket.connect = socket.socket.connect_ex = _offline
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built offline from a copy of its sources (the checkout stays clean)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("soma_edge", "coordinator", "worker", "export"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("soma_edge-*.whl")
    return whl


def _requires(whl: Path) -> list[tuple[str, str | None]]:
    """(distribution name, extra or None) of every Requires-Dist line."""
    with zipfile.ZipFile(whl) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        text = z.read(meta).decode()
    out = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            name = re.match(r"[A-Za-z0-9_.-]+", line.split(":", 1)[1].strip()).group(0).lower()
            extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", line)
            out.append((name, extra.group(1) if extra else None))
    return out


def test_the_wheel_requires_what_a_worker_needs_and_no_more(wheel):
    req = _requires(wheel)
    base = {name for name, extra in req if extra is None}
    assert {"flwr", "numpy", "onnx", "msgpack", "typer", "tensorboardx"} <= base
    assert not base & set(HEAVY), base
    assert ("matplotlib", "report") in req and ("torch", "dev") in req and ("torch", "bench") in req
    assert ("tensorboard", "dev") in req  # tests read the event files back with it


def test_worker_and_export_run_from_the_wheel_without_torch_matplotlib_or_network(wheel, tmp_path):
    target, block = tmp_path / "site", tmp_path / "block"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    block.mkdir()
    (block / "sitecustomize.py").write_text(BLOCK)
    make_run(tmp_path / "run", ModelConfig(embed=8, hidden=16, layers=1), 2, domains())
    bundle.write(tmp_path / "run", tmp_path / "deploy")
    data = tmp_path / "held-out.txt"
    data.write_bytes(b"def held_out(x):\n    return x * 2  # a few hundred bytes of text\n" * 8)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(block), str(target)])}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
        )

    where = run("-c", "import soma_edge, worker, export; import torch")
    assert "ImportError" in where.stderr or "ModuleNotFoundError" in where.stderr  # the block works
    mods = run("-c", "import soma_edge, worker.cli, export.cli; print(soma_edge.__file__, worker.cli.__file__)")
    assert mods.returncode == 0 and all(p.startswith(str(target)) for p in mods.stdout.split()), (
        mods.stdout + mods.stderr
    )
    helped = run("-c", "from worker.cli import main; main()", "--help")
    assert helped.returncode == 0 and "join" in helped.stdout, helped.stdout + helped.stderr
    ev = run(
        "-c", "from export.cli import main; main()", "eval", str(tmp_path / "deploy"), "--data", str(data), "--json"
    )
    assert ev.returncode == 0, ev.stdout + ev.stderr
    report = json.loads(ev.stdout)
    assert 0 < report["nats_per_byte"] < 20, report
