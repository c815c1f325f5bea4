"""bench/gpu_check.py, the first run on an NVIDIA box: without CUDA it names what is missing and exits 2; with
`--device cpu` standing in for the GPU, its checks run and pass and its throughput cells run at a tiny shape;
its deadline stops it, its cells are priced in time and memory, and what it measured survives a kill."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from bench import gpu_cells, gpu_check, gpu_checks, gpu_clock, gpu_memory, gpu_prices, gpu_targets
from bench.common import ROOT
from bench.gpu_report import Report, Row, RowKind
from bench.sizes import SIZES
from bench.spsa_throughput import BoundPopulation, body_tensors, population_setup
from soma_edge import devices
from soma_edge.devices import CPU, CUDA
from soma_edge.engine import resident, runtime
from soma_edge.expert import params
from soma_edge.expert.graph import build
from soma_edge.expert.population_graph import Noise, build_population

TINY = ["--sizes", "124K", "--batches", "2", "--ks", "1,2", "--seconds", "0.01", "--seq-len", "8"]
CHECKS = ["placement", "numerics", "log round", "update bits", "capture"]
SHORT_T = 16  # bytes a window: the checks' population graphs unroll over it (bench/gpu_checks.py)


def _short_windows(monkeypatch) -> None:
    """The checks' configs at SHORT_T bytes instead of the demo's 128: the population graph is unrolled over
    the window, and at 128 each of the log round's, update's and capture's sessions takes ~2 s to open (at 16,
    0.1 s). No verdict or figure asserted here depends on T; the subprocess tests run the real 128."""
    real = gpu_checks.Config

    def config(*args, **kwargs):
        cfg = real(*args, **kwargs)
        cfg.data.seq_len = SHORT_T
        return cfg

    monkeypatch.setattr(gpu_checks, "Config", config)


@pytest.mark.skipif(bool(devices.gpus()), reason="needs a box without an NVIDIA GPU")
def test_without_cuda_it_names_what_is_missing_and_exits_2(tmp_path, capsys):
    assert gpu_check.main(["--device", "cuda:0", "--out", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and all(line.startswith("error: ") for line in lines)
    # the CPU wheel has no CUDA EP; onnxruntime-gpu here lacks the driver and the CUDA libraries
    assert any("no CUDA EP" in line or "does not load" in line or "no NVIDIA GPU" in line for line in lines)
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


def test_cpu_dry_run_passes_every_check_and_writes_markdown_and_json(tmp_path, capsys, monkeypatch):
    _short_windows(monkeypatch)
    # --seconds: how long the update's and the capture's steps/s are timed; nothing below needs more than one step
    argv = ["--device", "cpu", "--steps", "12", "--audit-steps", "4", "--no-throughput", "--seconds", "0.1"]
    assert gpu_check.main([*argv, "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["ok"] and record["status"] == "complete" and [c["name"] for c in record["checks"]] == CHECKS
    assert record["checks"][0]["figures"]["graphs"] == 24  # 2 kinds x (4 modes + 4 population + 4 update)
    log_round = record["checks"][2]
    assert log_round["figures"]["steps"] == 12 and len(log_round["figures"]["audited"]) == 4
    update = record["checks"][3]["figures"]  # the CPU EP's update graph gives the host's bits
    assert len(update["same_bits"]) == 6 and update["on_device"] and all(r > 0 for r in update["steps_per_s"].values())
    assert set(update["steps_per_s"]) == {"resident", "host update"}  # both timed: the `all` above is not vacuous
    capture = record["checks"][4]["figures"]  # CUDA graph capture's fixed-address calls, uncaptured on the CPU EP
    assert capture["active"] and capture["replays"] and capture["same_bits"] and capture["loss_rel"] == 0.0
    assert record["memory"]["peak_rss_mib"] > 0 and record["memory"]["peak_device_mib"] is None
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| log round | pass |" in md and "| capture | pass |" in md and md in capsys.readouterr().out


def test_a_log_the_device_did_not_compute_is_refused(monkeypatch):
    """The log round's verdict is the coordinator's: a scalar off by far more than δ allows fails it."""
    real = gpu_checks.record_log

    def lying(*a, **k):
        log = real(*a, **k)
        log.grads[:] *= 3.0
        return log

    monkeypatch.setattr(gpu_checks, "record_log", lying)
    check = gpu_checks.log_round_check("cpu", gpu_checks.corpus_bytes(1 << 18), 6, 6, time.perf_counter() + 60)
    assert not check.ok and not check.skipped and check.detail.startswith("refused: ")


@pytest.mark.parametrize("fault", ["losses", "weights"])
def test_the_capture_check_fails_on_losses_off_by_more_than_delta_or_a_log_that_does_not_replay(monkeypatch, fault):
    """The captured arm judged as the issue asks: its losses within δ of the plain arm's, and its update log
    replayed on the host to its own weights bit for bit; whether both arms' bits match is only reported."""
    data = gpu_checks.corpus_bytes(1 << 18)
    real_step, real_download = resident.Resident.step, resident.Resident.download

    def step(self, batches, decoder_grad=False):
        out = real_step(self, batches, decoder_grad)
        if fault == "losses" and self.capture:
            out.loss *= 1 + 1e-4  # 100 δ
        return out

    def download(self):
        state = real_download(self)
        if fault == "weights" and self.capture:
            state.weights.view(np.uint32)[0] ^= 1  # one last bit: no longer what its log replays to
        return state

    monkeypatch.setattr(resident.Resident, "step", step)
    monkeypatch.setattr(resident.Resident, "download", download)
    _short_windows(monkeypatch)
    check = gpu_checks.capture_check("cpu", data, 0.05, time.perf_counter() + 60)
    assert not check.ok and not check.skipped
    if fault == "losses":
        assert check.figures["loss_rel"] > 1e-6 and check.figures["replays"]
    else:
        assert check.figures["loss_rel"] == 0.0 and not check.figures["replays"] and not check.figures["same_bits"]


@contextlib.contextmanager
def _frozen_heap():
    """Every cell ends in a full gc.collect() (bench/gpu_cells.py: its sessions go before its memory is
    read). In a test process that walks every object pytest and the earlier tests left, ~80 ms a cell here
    and more in the whole suite; frozen, they are skipped, and what the cells make is still collected."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _table(tmp_path, *extra: str) -> tuple[dict, str]:
    with _frozen_heap():
        code = gpu_check.main(["--device", "cpu", "--only-throughput", *TINY, *extra, "--out", str(tmp_path)])
    assert code == 0
    return json.loads((tmp_path / "gpu_check.json").read_text()), (tmp_path / "gpu_check.md").read_text()


def _no_torch(monkeypatch) -> None:
    """Leave the torch subprocess out (2 s of importing torch) where a test is about the ORT rows' layout."""
    monkeypatch.setattr(gpu_cells, "torch_rows", lambda c, sizes, batches: c.report.notes.append("torch: left out"))


def test_cpu_dry_run_of_the_throughput_table(tmp_path):
    record, md = _table(tmp_path)
    assert record["checks"] == [] and record["status"] == "complete"
    rows = {(r["evaluator"], r["K"], r["density"], r["B"]): r for r in record["throughput"]}
    targets = [("loop_resident", None, None, 2)]
    for k in (1, 2):
        targets += [("population_resident", k, 0.5, 2), ("population_resident", k, 1.0, 2)]
        targets += [("rank1_resident", k, 1.0, 2), ("clean_forward", k, None, 2)]
    rest = [("loop", None, None, 2)] + [(e, k, 1.0, 2) for k in (1, 2) for e in ("population", "rank1")]
    got = [(r["evaluator"], r["K"], r["density"], r["B"]) for r in record["throughput"]]
    torch_ok = ("torch_eager", None, None, 2) in rows
    # The dev venv has torch: then its row must be there. find_spec, not an import: importing torch here
    # costs seconds, and the row comes from bench.torch_eager's own process anyway.
    if importlib.util.find_spec("torch") is not None:
        assert torch_ok
    else:
        assert any(n.startswith("torch eager reference: torch is not installed") for n in record["throughput_notes"])
    assert got == targets + ([("torch_eager", None, None, 2)] if torch_ok else []) + rest  # the targets first
    loop = rows[("loop_resident", None, None, 2)]["evals_per_s"]
    for key in targets + rest:
        r = rows[key]
        assert r["name"] == "124K" and r["params"] == params.count(SIZES["124K"])
        assert r["evals_per_s"] > 0 and r["note"] == "" and r["price"] > 0 and r["memory"] >= 0
        assert r["vs_loop"] == pytest.approx(r["evals_per_s"] / loop, rel=1e-2)
        if r["K"] is not None and r["evaluator"] != "clean_forward":  # time per call over the clean forward's
            clean = rows[("clean_forward", r["K"], None, 2)]["evals_per_s"]
            assert r["vs_clean"] == pytest.approx(clean / r["evals_per_s"], rel=1e-2)
        assert (r["host_share"] is not None) == (r["evaluator"] in ("population_resident", "rank1_resident"))
    assert "population+cuda_graph: not measured (CUDA only; device cpu)" in record["throughput_notes"]
    assert "| 124K | 124,160 | 2 | 2 | rank1_resident | 1 |" in md and "## Throughput" in md
    # the GPU targets' verdicts, computed on the CPU EP and labelled so; K = 8 and 64 were not in --ks
    verdicts = record["targets"]
    assert [v["verdict"] for v in verdicts[:4]] == ["not measured"] * 4 and all(v["cpu"] for v in verdicts)
    assert {v["verdict"] for v in verdicts[4:]} <= {"PASS", "FAIL"}
    assert set(verdicts[5]["figures"]) == {"124K K=1 population_resident", "124K K=2 population_resident"}
    assert len(verdicts[6]["figures"]) == 4  # density 1: full-rank and rank-1, each K
    assert "## GPU targets" in md and md.count("(not measured; not the GPU target)") == 4


def test_a_cell_priced_past_the_deadline_is_skipped_for_time_and_one_over_free_memory_for_memory(monkeypatch):
    report = Report(ROOT / "runs" / "unused", "cpu", "ort", 10.0)
    monkeypatch.setattr(report, "save", lambda: None)
    memory = gpu_memory.Memory()
    c = gpu_cells.Cells("cpu", report, gpu_clock.Clock(10.0), memory, 8, 1.0, 2, gpu_prices.Builds())
    n, loss = params.count(SIZES["124K"]), build(SIZES["124K"], "loss")
    first = Row("124K", n, 2, None, RowKind.LOOP)
    nodes = len(loss.graph.node)
    first_build = gpu_cells.SAFETY * nodes * gpu_prices.FIRST_BUILD_S_PER_NODE
    assert c.estimate(first, [loss]) == pytest.approx(1.0 + first_build)
    c.run(first, [(loss, 2)], lambda: "session", lambda s: 10.0)  # 10 calls/s of B = 2: 0.05 s a member-row
    assert first.evals_per_s == 10.0 and c.builds.measured
    # the loss graph's next build is priced at the last one's seconds per node (here a few microseconds)
    assert c.builds.price([loss]) < nodes * gpu_prices.FIRST_BUILD_S_PER_NODE
    slow = Row("124K", n, 2, 8, RowKind.POPULATION)  # 17 members x 2 rows x 0.05 s: warm-up and last call

    def never(_) -> float:
        raise AssertionError("a cell past the deadline by its price must not start")

    assert c.estimate(slow, []) == pytest.approx(1.0 + gpu_cells.SAFETY * 2 * 1.7)  # 5.4 s
    c.clock.end = time.perf_counter() + gpu_cells.MARGIN_S + 5.0  # 5 s left: the 5.4 s it needs do not fit
    c.run(slow, [], lambda: None, never)
    assert slow.evals_per_s is None and slow.note.startswith("skipped: time (needs ~5.4 s, ")
    c.clock.end = time.perf_counter() + 100
    monkeypatch.setattr(memory, "free_mib", lambda: 100)  # MiB: far less than the graph's price
    big = Row("124K", n, 64, None, RowKind.LOOP)
    c.run(big, [(loss, 4096)], lambda: None, never)
    assert big.note.startswith(f"skipped: memory (priced {big.price:,} MiB, 100 MiB free)") and big.price > 100
    assert [r.note[:15] for r in report.rows] == ["", "skipped: time (", "skipped: memory"]


def test_a_graphs_memory_price_follows_its_tensors():
    """Priced from the tensor shapes: a population graph's price grows with B and K, and at the size and
    batch that ran a 24 GB box out of memory (L, B = 64, K = 64) it is far over that box's memory."""
    m = SIZES["124K"]
    small, wide = (build_population(m, k, body_tensors(m), Noise.BITS, True, 16) for k in (2, 8))
    assert (
        gpu_prices.graph_mib(small, 16, 16) < gpu_prices.graph_mib(small, 64, 16) < gpu_prices.graph_mib(wide, 64, 16)
    )
    big = SIZES["L"]
    graph = build_population(big, 64, body_tensors(big), Noise.BITS, True, 128)
    assert gpu_prices.graph_mib(graph, 64, 128) > 40_000


def test_the_deadline_stops_the_run_and_says_so(tmp_path):
    """A deadline shorter than the checks: the watchdog ends the process on time, the check it stopped and
    the ones after it are "skipped: time", and the exit status says a correctness check did not settle."""
    # 3 s, not 6: at 3 s the run is still inside the checks (the capture's sessions take ~2 s each to open at
    # T = 128), so the watchdog still stops one mid-call; on a loaded box fewer settle first, as allowed below.
    cmd = [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--deadline", "3", "--out", str(tmp_path)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    took = time.perf_counter() - t0
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert r.returncode == 3 and took < 3 + 15, (r.returncode, took, r.stderr[-2000:])  # 15 s: imports, slack
    assert record["status"].startswith("stopped at the deadline (3 s)") or record["status"] == "complete"
    assert [c["name"] for c in record["checks"]] == CHECKS
    assert any(c["skipped"] == "time" for c in record["checks"]) and not record["ok"]
    assert "error: " in r.stderr


def test_what_was_measured_survives_a_kill(tmp_path):
    """The report is rewritten after every check: a run killed mid-way leaves the checks it had settled."""
    cmd = [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--out", str(tmp_path), "--steps", "2"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, record = time.monotonic() + 120, {}
        while time.monotonic() < deadline and len(record.get("checks", [])) < 2:
            time.sleep(0.1)
            try:
                record = json.loads((tmp_path / "gpu_check.json").read_text())
            except (OSError, ValueError):  # not written yet (each write is whole: never half a file)
                continue
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["status"] == "running" and [c["name"] for c in record["checks"]][:2] == CHECKS[:2]
    assert all(c["ok"] for c in record["checks"])
    assert "| placement | pass |" in (tmp_path / "gpu_check.md").read_text()


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
    """The CUDA-only cells, which first run on the one-shot GPU run, exercised on the CPU: taken for CUDA,
    the table gets a population+cuda_graph row per K and B (the bound session, here without capture), the
    cells are priced at the CUDA EP's arena factor, and the verdicts are the GPU's."""
    _no_torch(monkeypatch)
    monkeypatch.setattr(gpu_cells.Cells, "cuda", property(lambda self: True))
    monkeypatch.setattr(gpu_cells, "BoundPopulation", lambda *a, cuda_graph: BoundPopulation(*a, cuda_graph=False))
    record, md = _table(tmp_path)
    graph_rows = [(r["K"], r["B"]) for r in record["throughput"] if r["evaluator"] == "population+cuda_graph"]
    assert graph_rows == [(1, 2), (2, 2)]
    assert all(r["evals_per_s"] > 0 for r in record["throughput"])
    priced = {(r["evaluator"], r["K"], r["density"]): r["price"] for r in record["throughput"]}
    m = SIZES["124K"]
    graph = build_population(m, 1, body_tensors(m), Noise.BITS, True, 8)
    on_cuda = gpu_prices.graph_mib(graph, 2, 8, gpu_prices.ARENA_CUDA)
    assert on_cuda > gpu_prices.graph_mib(graph, 2, 8) and priced[("population", 1, 1.0)] == on_cuda
    assert not any(v["cpu"] for v in record["targets"])
    assert not any("cuda_graph: not measured" in n for n in record["throughput_notes"])


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
    for name in ("numerics_check", "log_round_check", "update_check", "capture_check"):  # not this test's
        monkeypatch.setattr(gpu_check, name, lambda *a, name=name: gpu_checks.Check(name, True, "not run here"))
    assert gpu_check.main(["--device", "cpu", "--no-throughput", "--out", str(tmp_path)]) == 1
    check = json.loads((tmp_path / "gpu_check.json").read_text())["checks"][0]
    off = "lstm/update rank1: 1 node(s) on CPUExecutionProvider (Mul)"
    assert not check["ok"] and check["figures"]["off_device"] == [off] and check["figures"]["graphs"] == 24
    assert seen.count("soma_expert_population") == 8 and seen.count("soma_expert_update") == 8
    assert f"| placement | FAIL | {off} |" in (tmp_path / "gpu_check.md").read_text()


def _rows() -> list[Row]:
    n = {name: params.count(m) for name, m in SIZES.items()}
    return [
        Row("124K", n["124K"], 16, 8, RowKind.POPULATION, 1.0, 600.0, vs_loop=4.0),
        Row("124K", n["124K"], 16, 8, RowKind.RESIDENT, 1.0, 900.0, vs_loop=6.0, host_share=0.05),
        Row("124K", n["124K"], 16, 8, RowKind.RESIDENT, 0.5, 450.0, vs_loop=3.0, host_share=0.15),
        Row("124K", n["124K"], 64, 8, RowKind.POPULATION, 1.0, 900.0, vs_loop=9.0),  # another B: not the target's
        Row("S", n["S"], 16, 8, RowKind.POPULATION, 1.0, 99.0, vs_loop=5.5),
        Row("L", n["L"], 16, 8, RowKind.RESIDENT, 1.0, note="skipped: time (needs ~40 s, 3 s left)"),
        Row("124K", n["124K"], 16, 64, RowKind.CUDA_GRAPH, 1.0, 9000.0, vs_loop=16.0),
        Row("S", n["S"], 16, 64, RowKind.POPULATION, 1.0, 990.0, vs_loop=14.9),
        Row("124K", n["124K"], 16, 8, RowKind.RANK1_RESIDENT, 1.0, 800.0, vs_clean=1.4, host_share=0.08),
        Row("S", n["S"], 16, 8, RowKind.RANK1_RESIDENT, 1.0, 80.0, vs_clean=1.6, host_share=0.25),
    ]


def test_the_gpu_targets_verdicts_are_pass_fail_or_not_measured_at_each_density():
    """Per target: PASS when every figure measured meets it, FAIL when one misses, not measured when none
    was; speed and host wait at density 0.5 (as shipped) and 1.0 apart."""
    got = gpu_targets.verdicts(_rows(), ["124K", "S", "L"], [8, 64], 16, cpu=False)
    speed8_sparse, speed64_sparse, speed8, speed64, rank1, host_sparse, host = got
    assert speed8_sparse.verdict == "FAIL" and speed8_sparse.figures == {
        "124K": {"vs_loop": 3.0, "row": "population_resident"}
    }
    assert speed64_sparse.verdict == "not measured"
    assert speed8.verdict == "PASS" and speed8.figures == {
        "124K": {"vs_loop": 6.0, "row": "population_resident"},
        "S": {"vs_loop": 5.5, "row": "population"},
    }
    assert "L not measured (skipped: time)" in speed8.detail
    assert speed64.verdict == "FAIL" and "S 14.90x (population)" in speed64.detail
    assert rank1.verdict == "FAIL" and rank1.figures["S K=8"] == {"vs_clean": 1.6, "runs_vs_clean": 1.2}
    assert "124K K=64 not measured" in rank1.detail
    assert host_sparse.verdict == "FAIL" and host_sparse.figures == {"124K K=8 population_resident": 0.15}
    assert host.verdict == "FAIL" and host.figures["S K=8 rank1_resident"] == 0.25
    assert "L K=8 population_resident not measured (skipped: time" in host.detail
    assert host.line().startswith("the device waits on the host <= 10% of a resident step, B = 16, density 1: **FAIL**")
    none = gpu_targets.verdicts([], ["124K"], [1], 16, cpu=True)
    assert [v.verdict for v in none] == ["not measured"] * 7
    assert "**CPU EP (not measured; not the GPU target)**" in none[0].line()


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
    quick = gpu_targets.runner_timing(gpu_targets.resident_runner(pop, cfg, w, x), x, 0.1)
    real = pop.noise_of
    monkeypatch.setattr(pop, "noise_of", lambda probes: time.sleep(0.02) or real(probes))
    slow = gpu_targets.runner_timing(gpu_targets.resident_runner(pop, cfg, w, x), x, 0.1)
    assert 0 <= quick.host_share < slow.host_share and slow.host_share > 0.5
    assert slow.steps_per_s < quick.steps_per_s


def test_after_a_sticky_cuda_error_no_cell_runs(monkeypatch):
    """An illegal memory access leaves the process's CUDA context unusable (every later call fails alike,
    as on the H200 once a cell ran it out of memory): the cells after it are skipped, saying why."""
    report = Report(ROOT / "runs" / "unused", "cpu", "ort", 10.0)
    monkeypatch.setattr(report, "save", lambda: None)
    c = gpu_cells.Cells("cpu", report, gpu_clock.Clock(60.0), gpu_memory.Memory(), 8, 0.1, 2, gpu_prices.Builds())
    n, loss = params.count(SIZES["124K"]), build(SIZES["124K"], "loss")

    def crash(_) -> float:
        raise RuntimeError("CUDA error cudaErrorIllegalAddress:an illegal memory access was encountered")

    c.run(Row("124K", n, 2, None, RowKind.LOOP), [(loss, 2)], lambda: None, crash)
    c.run(Row("124K", n, 2, None, RowKind.LOOP_RESIDENT), [(loss, 2)], lambda: None, lambda _: 1.0)
    first, second = report.rows
    assert first.note.startswith("failed: RuntimeError: CUDA error cudaErrorIllegalAddress")
    assert second.evals_per_s is None and second.note == (
        "skipped: the device failed in an earlier cell (cudaErrorIllegalAddress)"
    )


def test_the_watchdog_writes_the_cell_it_stopped_and_the_checks_it_never_ran(tmp_path):
    report = Report(tmp_path, "cpu", "ort", 10.0)
    report.add_check(gpu_checks.Check("placement", True, "fine"))
    report.current = "throughput 124K B=2 K=- loop_resident"
    report.running = Row("124K", params.count(SIZES["124K"]), 2, None, RowKind.LOOP_RESIDENT)
    assert gpu_check.at_deadline(report, gpu_memory.Memory(), ["placement", "numerics"]) == 3
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["status"] == "stopped at the deadline (10 s) during throughput 124K B=2 K=- loop_resident"
    assert [(c["name"], c["skipped"]) for c in record["checks"]] == [("placement", ""), ("numerics", "time")]
    (row,) = record["throughput"]
    assert row["evals_per_s"] is None and row["note"] == "skipped: time (stopped at the deadline while it ran)"
