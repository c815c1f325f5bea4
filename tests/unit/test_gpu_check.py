"""bench/gpu_check.py, the first script on an NVIDIA box: without CUDA it names what is missing and exits 2;
with `--device cpu` standing in for the GPU, its placement, numerics and log-round checks run and pass, and
its throughput table runs at a tiny shape (torch eager in a subprocess that never loads onnxruntime)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from bench import gpu_check, gpu_targets
from bench.common import ROOT
from bench.gpu_check import Evaluator, Row
from bench.spsa_throughput import SIZES, BoundPopulation, population_setup
from soma_edge import devices, params, runtime, spsa
from soma_edge.devices import CPU, CUDA
from soma_edge.population_graph import Noise

TINY = ["--sizes", "124K", "--batches", "2", "--ks", "1,2", "--seconds", "0.01", "--seq-len", "8"]


@pytest.mark.skipif(bool(devices.gpus()), reason="needs a box without an NVIDIA GPU")
def test_without_cuda_it_names_what_is_missing_and_exits_2(tmp_path, capsys):
    assert gpu_check.main(["--device", "cuda:0", "--out", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and all(line.startswith("error: ") for line in lines)
    # the CPU wheel has no CUDA EP; onnxruntime-gpu here lacks the driver and the CUDA libraries
    assert any("no CUDA EP" in line or "does not load" in line or "no NVIDIA GPU" in line for line in lines)
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


def test_cpu_dry_run_passes_every_check_and_writes_markdown_and_json(tmp_path, capsys):
    argv = ["--device", "cpu", "--steps", "12", "--audit-steps", "4", "--no-throughput", "--seconds", "0.2"]
    assert gpu_check.main([*argv, "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    names = ["placement", "numerics", "log round", "update bits"]
    assert record["ok"] and [c["name"] for c in record["checks"]] == names
    assert record["checks"][0]["figures"]["graphs"] == 24  # 2 kinds x (4 modes + 4 population + 4 update)
    log_round = record["checks"][2]
    assert log_round["figures"]["steps"] == 12 and len(log_round["figures"]["audited"]) == 4
    update = record["checks"][3]["figures"]  # the CPU EP's update graph gives the host's bits
    assert len(update["same_bits"]) == 6 and all(update["same_bits"].values())
    assert all(r > 0 for r in update["steps_per_s"].values())
    capture = update["capture"]  # the fixed-address calls of CUDA graph capture, uncaptured on the CPU EP
    assert capture["ran"] and capture["same_bits"] and capture["captured_active"]
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


def _no_torch(monkeypatch) -> None:
    """Leave the torch subprocess out (2 s of importing torch) where a test is about the ORT rows' layout."""
    monkeypatch.setattr(gpu_check, "_torch_rows", lambda t, device: t.notes.append("torch eager: left out here"))


def _table(tmp_path, *extra: str) -> tuple[dict, str]:
    assert gpu_check.main(["--device", "cpu", "--only-throughput", *TINY, *extra, "--out", str(tmp_path)]) == 0
    return json.loads((tmp_path / "gpu_check.json").read_text()), (tmp_path / "gpu_check.md").read_text()


def test_cpu_dry_run_of_the_throughput_table(tmp_path):
    record, md = _table(tmp_path)
    assert record["checks"] == []  # --only-throughput: checks 2-4 did not run
    rows = {(r["evaluator"], r["K"]): r for r in record["throughput"]}
    per_k = ("population", "population_resident", "rank1", "rank1_resident", "clean_forward")
    ort_rows = [("loop", None), ("loop_resident", None)] + [(e, k) for k in (1, 2) for e in per_k]
    torch_ok = ("torch_eager", None) in rows
    try:
        import torch  # noqa: F401  (the dev venv has it: then its row must be there)

        assert torch_ok
    except ImportError:
        assert any(n.startswith("torch eager reference: torch is not installed") for n in record["throughput_notes"])
    assert set(rows) == set(ort_rows) | ({("torch_eager", None)} if torch_ok else set())
    loop = rows[("loop_resident", None)]["evals_per_s"]
    for key in ort_rows:
        r = rows[key]
        assert r["name"] == "124K" and r["params"] == params.count(SIZES["124K"]) and r["B"] == 2
        assert r["evals_per_s"] > 0 and r["note"] == "" and r["memory"] is None  # no device memory on the CPU
        assert r["vs_loop"] == pytest.approx(r["evals_per_s"] / loop, rel=1e-2)
        if torch_ok:
            assert r["vs_torch"] == pytest.approx(
                r["evals_per_s"] / rows[("torch_eager", None)]["evals_per_s"], rel=1e-2
            )
        if r["K"] is not None and r["evaluator"] != "clean_forward":  # time per call over the clean forward's
            clean = rows[("clean_forward", r["K"])]["evals_per_s"]
            assert r["vs_clean"] == pytest.approx(clean / r["evals_per_s"], rel=1e-2)
        assert (r["host_share"] is not None) == (r["evaluator"] in ("population_resident", "rank1_resident"))
        if r["host_share"] is not None:
            assert 0 <= r["host_share"] < 1
    assert "population+cuda_graph: not measured (CUDA only; device cpu)" in record["throughput_notes"]
    assert "| 124K | 124,160 | 2 | 2 | rank1 |" in md and "## Throughput" in md
    # the GPU targets' verdicts, computed on the CPU EP and labelled so; K = 8 and 64 were not in --ks
    targets = record["targets"]
    assert [t["verdict"] for t in targets[:2]] == ["not measured"] * 2 and all(t["cpu"] for t in targets)
    assert {t["verdict"] for t in targets[2:]} <= {"PASS", "FAIL"}
    assert set(targets[2]["figures"]) == {"124K K=1", "124K K=2"} and len(targets[3]["figures"]) == 4
    assert "## GPU targets" in md and md.count("(not measured; not the GPU target)") == 2


def test_a_tiny_budget_skips_every_cell_that_would_overrun_it(tmp_path):
    """Each cell's estimate is at least --seconds: with 1 s a cell and a 0.5 s budget none starts (cells
    that started before the deadline used to run past it), and the table says why."""
    record, md = _table(tmp_path, "--budget", "0.5", "--seconds", "1")
    assert record["throughput"] and all(
        r["evals_per_s"] is None and r["note"].startswith("skipped: time") for r in record["throughput"]
    )
    assert any(n.startswith("skipped: time: the cell would end after --budget") for n in record["throughput_notes"])
    assert all(t["verdict"] == "not measured" for t in record["targets"])


def test_a_cell_is_skipped_when_the_rate_measured_before_it_says_it_would_overrun():
    n = params.count(SIZES["124K"])
    t = gpu_check.Table(["124K"], [2], [8], 8, 1.0, deadline=time.perf_counter() + 2.0)
    first = Row("124K", n, 2, None, Evaluator.LOOP)
    assert gpu_check.estimate(t, first) == 1.0  # nothing measured yet: --seconds alone
    gpu_check._cell(t, first, "cpu", None, lambda: 10.0)  # 10 calls/s of B = 2: 0.05 s a member-row
    assert gpu_check.estimate(t, Row("124K", n, 2, None, Evaluator.LOOP_RESIDENT)) == pytest.approx(1.2)
    slow = Row("124K", n, 2, 8, Evaluator.POPULATION)  # 17 members x 2 rows x 0.05 s a call
    assert gpu_check.estimate(t, slow) == pytest.approx(1.0 + 2 * 1.7)

    def never() -> float:
        raise AssertionError("a cell past the deadline by its estimate must not start")

    gpu_check._cell(t, slow, "cpu", None, never)
    assert slow.evals_per_s is None and slow.note.startswith("skipped: time (needs ~4.4 s, ")
    resident = Row("124K", n, 2, 8, Evaluator.RESIDENT)  # priced at its basis, the population, measured now
    t.rows.append(Row("124K", n, 2, 8, Evaluator.POPULATION, evals_per_s=340.0))
    assert gpu_check.estimate(t, resident) == pytest.approx(1.0 + 2 * 17 / 340.0)


def test_full_rank_over_the_host_noise_cap_is_one_line_saying_why_and_what_lifts_it(tmp_path, monkeypatch):
    _no_torch(monkeypatch)
    monkeypatch.setattr(gpu_check, "HOST_NOISE", 0)  # every full-rank cell's noise is over the cap
    record, md = _table(tmp_path, "--ks", "1", "--batches", "2,3")
    full = [r for r in record["throughput"] if r["evaluator"].startswith("population")]
    assert len(full) == 1 and full[0]["B"] is None and full[0]["K"] == 1 and full[0]["evals_per_s"] is None
    note = full[0]["note"]
    assert (
        note.startswith("skipped: host noise: full-rank at K = 1 draws K directions' keyed bits")
        and "Lifted by" in note
    )
    assert "population_resident" in note and "every B" in note
    assert [r["B"] for r in record["throughput"] if r["evaluator"] == "rank1"] == [2, 3]
    assert all(r["evals_per_s"] > 0 for r in record["throughput"] if r["evaluator"].startswith("rank1"))
    assert "| 124K | 124,160 | - | 1 | population |" in md


@pytest.mark.parametrize("noise", [Noise.BITS, Noise.RANK1])
def test_the_bound_population_computes_the_population_evaluators_losses(noise):
    """The fixed-address (IOBinding) session the CUDA graph row replays: same losses, every input copied in
    afresh each step (a second step at other weights gives that step's losses, not the first's)."""
    m = SIZES["124K"]
    x = np.random.default_rng(0).integers(0, 256, (2, 8)).astype(np.int64)
    pop, feeds = population_setup(m, 2, noise, 8)
    bound = BoundPopulation(m, 2, noise, 8, 2, "cpu", cuda_graph=False)
    for seed in (1, 2):
        w = params.init(m, seed)
        want = pop.evaluate(w, feeds, 1e-3, x, x)
        got = bound.step(w, feeds, 1e-3, x, x)
        np.testing.assert_array_equal(got, np.r_[want.loss, np.c_[want.lp, want.lm].ravel()].astype(np.float32))


def test_torch_eager_runs_apart_from_onnxruntime_or_says_why_not():
    pytest.importorskip("torch")
    cmd = [sys.executable, "-m", "bench.torch_eager", "--device", "cpu", "--sizes", "124K", "--batches", "2,3"]
    r = subprocess.run(cmd + ["--seq-len", "8", "--seconds", "0.01"], capture_output=True, text=True, cwd=ROOT)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["skipped"] is None and got["onnxruntime_loaded"] is False
    assert [(g["batch"], g["evals_per_s"] > 0) for g in got["rows"]] == [(2, True), (3, True)]
    no_torch = (
        'import runpy, sys; sys.modules["torch"] = None; runpy.run_module("bench.torch_eager", run_name="__main__")'
    )
    r = subprocess.run([sys.executable, "-c", no_torch], capture_output=True, text=True, cwd=ROOT)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["rows"] == [] and got["skipped"].startswith("torch eager reference: torch is not installed")


def test_the_cuda_rows_are_laid_out_as_on_a_gpu(tmp_path, monkeypatch):
    """The CUDA-only paths, which first run on the one-shot GPU run, exercised on the CPU: a device taken for
    CUDA gets a population+cuda_graph row per B after each full-rank session (the bound session, here without
    graph capture), skipped as full-rank is where it is over the noise cap, and device memory on every ORT
    row."""
    _no_torch(monkeypatch)
    used = iter(range(1000, 100000, 7))
    monkeypatch.setattr(gpu_check, "ort_device", lambda device: ("cuda", 0))
    monkeypatch.setattr(gpu_check, "gpu_memory_mib", lambda device: next(used))
    monkeypatch.setattr(gpu_check, "BoundPopulation", lambda *a, cuda_graph: BoundPopulation(*a, cuda_graph=False))
    body = params.layout(SIZES["124K"]).body
    monkeypatch.setattr(gpu_check, "HOST_NOISE", 2 * spsa.bits_bytes(body) - 1)  # keyed bits: K = 1 under, K = 2 over
    record, md = _table(tmp_path, "--batches", "2,3")
    got = [(r["evaluator"], r["K"], r["B"]) for r in record["throughput"] if r["evaluator"] != "torch_eager"]
    loops = [(e, None, b) for b in (2, 3) for e in ("loop", "loop_resident")]
    k1 = [("population", 1, 2), ("population", 1, 3), ("population_resident", 1, 2)]
    k1 += [("population+cuda_graph", 1, 2), ("population+cuda_graph", 1, 3)]
    k1 += [("rank1", 1, 2), ("rank1", 1, 3), ("rank1_resident", 1, 2), ("clean_forward", 1, 2)]
    k2 = [("population", 2, None), ("rank1", 2, 2), ("rank1", 2, 3), ("rank1_resident", 2, 2), ("clean_forward", 2, 2)]
    assert got == loops + k1 + k2
    for r in record["throughput"]:
        if r["evaluator"] == "population" and r["K"] == 2:  # one line for every full-rank row at K = 2
            assert r["note"].startswith("skipped: host noise") and r["evals_per_s"] is None
        elif r["evaluator"] != "torch_eager":
            assert r["evals_per_s"] > 0 and r["memory"] > 0 and r["vs_loop"] > 0, r
    assert not any(t["cpu"] for t in record["targets"])  # taken for CUDA: the GPU targets, unlabelled
    assert not any("cuda_graph: not measured" in n for n in record["throughput_notes"])
    assert "| population+cuda_graph |" in md


def test_a_node_off_the_device_fails_the_placement_check_and_the_run(tmp_path, monkeypatch):
    """The device taken for CUDA (no session opened: there is no GPU here) and ORT's placement report faked
    so that one node of the lstm kind's rank-1 update graph lands on the CPU: the check fails naming the
    graph, the EP and the node's op, and the script exits 1."""
    monkeypatch.setattr(runtime, "plan", lambda device: runtime.Plan([(CUDA, {})], strict=True))
    monkeypatch.setattr(runtime, "make_session", lambda *a, **k: None)
    seen = []

    def placement(model, providers, threads=1):
        assert providers[-1] == CPU  # taken with CPU fallback allowed, so that every node lands somewhere
        seen.append(model.graph.name)
        doc = model.graph.doc_string
        if model.graph.name == "soma_expert_update" and "'lstm'" in doc and "'rank1'" in doc:
            return {CUDA: runtime.Placed(40, []), CPU: runtime.Placed(1, ["Mul"])}
        return {CUDA: runtime.Placed(50, [])}

    monkeypatch.setattr(runtime, "placement", placement)
    for name in ("numerics_check", "log_round_check", "update_check"):  # not what this test is about
        monkeypatch.setattr(gpu_check, name, lambda *a, name=name: gpu_check.Check(name, True, "not run here"))
    assert gpu_check.main(["--device", "cpu", "--no-throughput", "--out", str(tmp_path)]) == 1
    check = json.loads((tmp_path / "gpu_check.json").read_text())["checks"][0]
    off = "lstm/update rank1: 1 node(s) on CPUExecutionProvider (Mul)"
    assert not check["ok"] and check["figures"]["off_device"] == [off] and check["figures"]["graphs"] == 24
    assert seen.count("soma_expert_population") == 8 and seen.count("soma_expert_update") == 8
    assert f"| placement | FAIL | {off} |" in (tmp_path / "gpu_check.md").read_text()


def _rows() -> list[Row]:
    n = {name: params.count(m) for name, m in SIZES.items()}
    return [
        Row("124K", n["124K"], 16, 8, Evaluator.POPULATION, 600.0, vs_loop=4.0),
        Row("124K", n["124K"], 16, 8, Evaluator.RESIDENT, 900.0, vs_loop=6.0, host_share=0.05),
        Row("124K", n["124K"], 64, 8, Evaluator.POPULATION, 900.0, vs_loop=9.0),  # another B: not the target's
        Row("S", n["S"], 16, 8, Evaluator.POPULATION, 99.0, vs_loop=5.5),
        Row("L", n["L"], None, 8, Evaluator.POPULATION, note="skipped: host noise: over the cap"),
        Row("124K", n["124K"], 16, 64, Evaluator.CUDA_GRAPH, 9000.0, vs_loop=16.0),
        Row("S", n["S"], 16, 64, Evaluator.POPULATION, 990.0, vs_loop=14.9),
        Row("124K", n["124K"], 16, 8, Evaluator.RANK1_RESIDENT, 800.0, vs_clean=1.4, host_share=0.08),
        Row("S", n["S"], 16, 8, Evaluator.RANK1_RESIDENT, 80.0, vs_clean=1.6, host_share=0.25),
    ]


def test_the_gpu_targets_verdicts_are_pass_fail_or_not_measured():
    """Per target: PASS when every figure measured meets it, FAIL when one misses, not measured when none
    was; the speed target takes each size's best full-rank row at the targets' B and names it."""
    speed8, speed64, rank1, host = gpu_targets.verdicts(_rows(), ["124K", "S", "L"], [8, 64], 16, cpu=False)
    assert speed8.verdict == "PASS" and speed8.figures == {
        "124K": {"vs_loop": 6.0, "row": "population_resident"},
        "S": {"vs_loop": 5.5, "row": "population"},
    }
    assert "L not measured (skipped: host noise)" in speed8.detail
    assert speed64.verdict == "FAIL" and "S 14.90x (population)" in speed64.detail
    assert rank1.verdict == "FAIL" and rank1.figures["S K=8"] == {"vs_clean": 1.6, "runs_vs_clean": 1.2}
    assert "124K K=64 not measured" in rank1.detail
    assert host.verdict == "FAIL" and host.figures["S K=8 rank1_resident"] == 0.25
    assert host.line().startswith("the device waits on the host <= 10% of a resident step, B = 16: **FAIL**")
    only_fast = [r for r in _rows() if r.name == "124K"]
    _, _, rank1, host = gpu_targets.verdicts(only_fast, ["124K"], [8], 16, cpu=True)
    assert (rank1.verdict, host.verdict) == ("PASS", "PASS")
    assert "**CPU EP (PASS; not the GPU target)**" in host.line()
    none = gpu_targets.verdicts([], ["124K"], [1], 16, cpu=True)
    assert [v.verdict for v in none] == ["not measured"] * 4


def test_timed_runs_times_each_run_call_and_leaves_the_session_as_it_was():
    class Session:
        def run_with_iobinding(self, io):
            time.sleep(0.01)
            return io

    s = Session()
    with gpu_targets.timed_runs(s) as spent:
        assert s.run_with_iobinding("io") == "io"
    assert len(spent) == 1 and spent[0] >= 0.01 and "run_with_iobinding" not in vars(s)


def test_the_host_share_of_a_resident_step_grows_with_the_hosts_work(monkeypatch):
    """Resident.step timed as a worker runs it: the same step with 20 ms more host work (its noise) has most
    of its wall time outside ORT's run calls."""
    m, x = SIZES["124K"], np.random.default_rng(0).integers(0, 256, (2, 8)).astype(np.int64)
    pop, _ = population_setup(m, 1, Noise.SIGNS, 8)
    cfg, w = gpu_targets.resident_config(m, 1, Noise.SIGNS, x, "cpu"), params.init(m, 0)
    quick = gpu_targets.resident_timing(pop, cfg, w, x, 0.1)
    real = pop.noise_of
    monkeypatch.setattr(pop, "noise_of", lambda probes: time.sleep(0.02) or real(probes))
    slow = gpu_targets.resident_timing(pop, cfg, w, x, 0.1)
    assert 0 <= quick.host_share < slow.host_share and slow.host_share > 0.5
    assert slow.steps_per_s < quick.steps_per_s
