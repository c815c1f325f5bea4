"""bench/gpu_learn.py runs end to end on the CPU with tiny arms: every arm's curve, passes and steps, the
device arm's measured probes, the torch reference in its own process (the path it takes on a GPU), the JSON
and plot after each arm, the table and the targets' lines; a deadline too short skips the later arms and
the run ends in time (the claim is the GPU run in docs/BENCHMARKS.md, not a test)."""

import importlib.util
import json
import time

import numpy as np
import pytest

from bench import body, gpu_learn

TEXT = np.frombuffer(b"".join(bytes([i % 91 + 32]) * (i % 4 + 1) for i in range(6000)), dtype=np.uint8)
TINY = ["--tiny", "--device", "cpu", "--threads", "1"]


@pytest.fixture(autouse=True)
def tiny_corpus(monkeypatch):
    """A few KB of text instead of the default corpus (loading it takes seconds); windows as body's."""
    windows = (np.stack([TEXT[i : i + 128] for i in range(0, 2048, 128)]).astype(np.int64),) * 2
    monkeypatch.setattr(body, "_DATA", {"train": TEXT, "val": windows, "test": windows})


def test_gpu_learn_dry_run(tmp_path, capsys):
    out, png = tmp_path / "gpu_learn.json", tmp_path / "gpu_learn.png"
    argv = [*TINY, "--seconds", "1.5", "--every", "0.5", "--probe-seconds", "0.15", "--bptt-process", "child"]
    gpu_learn.run([*argv, "--json", str(out), "--plot", str(png)])
    printed = capsys.readouterr().out
    rec = json.loads(out.read_text())
    assert list(rec["arms"]) == list(gpu_learn.ARMS) and png.stat().st_size > 0
    for name, arm in rec["arms"].items():
        assert arm["status"] == "done", (name, arm["reason"])
        seconds = [p["seconds"] for p in arm["curve"]]
        assert len(seconds) >= 2 and seconds == sorted(set(seconds)) and seconds[0] == 0
        assert all(p["test"] > 0 for p in arm["curve"]) and arm["test"] == arm["curve"][-1]["test"]
        assert arm["steps"] > 0 and arm["forward_passes"] > 0 and arm["seconds"] >= 1.5
    # the same initial weights for every arm: one first point
    assert len({a["curve"][0]["test"] for a in rec["arms"].values()}) == 1
    # the device arm: its probes chosen from K = 4 ... 64 and rank-1 at the pick, timed on its own clock
    dev = rec["arms"]["device"]
    assert dev["measure"]["probes"]["split_rows"] is False and dev["measure"]["probes"]["density"] == 1.0
    table = dev["measure"]["table"]
    assert [m["probes"]["directions"] for m in table[:5]] == [4, 8, 16, 32, 64] and len(table) == 6
    assert table[-1]["probes"]["noise"] == "rank1" and all(m["steps_per_s"] > 0 for m in table)
    assert dev["curve"][1]["steps"] == 0 and dev["curve"][1]["seconds"] >= dev["measure"]["seconds"]
    assert f"K={dev['measure']['probes']['directions']}" in dev["settings"]
    # passes per step: k1-sparse 3 (2 probes + the clean forward), default 2 (split rows, probes' gradient)
    assert rec["arms"]["k1-sparse"]["forward_passes"] == 3 * rec["arms"]["k1-sparse"]["steps"]
    assert rec["arms"]["default"]["forward_passes"] == 2 * rec["arms"]["default"]["steps"]
    assert rec["arms"]["bptt"]["evaluator"] == "torch"
    rows = {line.split("|")[1].strip(): line for line in printed.splitlines() if line.startswith("|")}
    assert set(gpu_learn.ARMS) <= set(rows)
    gain = rec["arms"]["frozen"]["test"] - rec["arms"]["default"]["test"]
    assert f"| {gain:+.4f} |" in rows["default"]
    assert "device reaches default's loss" in printed and "body gain device/default:" in printed


def test_gpu_learn_deadline_skips_later_arms(tmp_path, capsys):
    out = tmp_path / "gpu_learn.json"
    # Each arm needs its 2 s plus the margin before it starts: the first has 1.5 s more than that for the
    # setup, and once it has trained its 2 s the next finds too little left.
    deadline = 2 + gpu_learn.margin(2) + 1.5
    argv = ["--seconds", "2", "--arms", "frozen,default,device", "--deadline", str(deadline), "--json", str(out)]
    t0 = time.perf_counter()
    gpu_learn.run([*TINY, *argv])
    assert time.perf_counter() - t0 < deadline
    rec = json.loads(out.read_text())
    assert rec["arms"]["frozen"]["status"] == "done"
    for name in ("default", "device"):
        assert rec["arms"][name]["status"] == "skipped" and rec["arms"][name]["reason"].startswith("deadline")
    printed = capsys.readouterr().out
    assert "| default | skipped: deadline" in printed and "n/a" in printed


def test_gpu_learn_without_torch(tmp_path, monkeypatch):
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else find(name, *a))
    rec = gpu_learn.run([*TINY, "--seconds", "0.2", "--arms", "bptt"])
    assert rec["arms"]["bptt"] == {**rec["arms"]["bptt"], "status": "skipped", "reason": "torch is not importable"}
