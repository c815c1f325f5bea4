"""bench/gpu_check.py, the first script on an NVIDIA box: without CUDA it names what is missing and exits 2;
with `--device cpu` standing in for the GPU, its placement, numerics and log-round checks run and pass."""

from __future__ import annotations

import json

import pytest

from bench import gpu_check
from soma_edge import devices


@pytest.mark.skipif(bool(devices.gpus()), reason="needs a box without an NVIDIA GPU")
def test_without_cuda_it_names_what_is_missing_and_exits_2(tmp_path, capsys):
    assert gpu_check.main(["--device", "cuda:0", "--out", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and all(line.startswith("error: ") for line in lines)
    # the CPU wheel has no CUDA EP; onnxruntime-gpu here lacks the driver and the CUDA libraries
    assert any("no CUDA EP" in line or "does not load" in line or "no NVIDIA GPU" in line for line in lines)
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


def test_cpu_dry_run_passes_every_check_and_writes_markdown_and_json(tmp_path, capsys):
    assert gpu_check.main(["--device", "cpu", "--steps", "12", "--audit-steps", "4", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["ok"] and [c["name"] for c in record["checks"]] == ["placement", "numerics", "log round"]
    log_round = record["checks"][2]
    assert log_round["figures"]["steps"] == 12 and len(log_round["figures"]["audited"]) == 4
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| log round | pass |" in md and md in capsys.readouterr().out


def test_a_log_the_device_did_not_compute_is_refused(tmp_path, monkeypatch):
    """The log round's verdict is the coordinator's: a scalar off by far more than δ allows fails it."""
    real = gpu_check.record_log

    def lying(*a, **k):
        log = real(*a, **k)
        log.grads[:] *= 3.0
        return log

    monkeypatch.setattr(gpu_check, "record_log", lying)
    check = gpu_check.log_round_check("cpu", gpu_check.corpus_bytes(1 << 18), 6, 6)
    assert not check.ok and check.detail.startswith("refused: ")
