"""bench/gpu_check.py's throughput cells: each one row of the table, priced in time and memory before it
runs, its sessions built, measured for about --seconds and released before the next.

The targets come first (`targets`), size by size in the order given (124K, then L, as gpu_check asks), at the
targets' B: loop_resident (the baseline); then per K the resident training step (Resident.step, the worker's
path on a device, CUDA graph capture included where it runs) at density 0.5 (as shipped, sparse probes) and
1.0 (dense), rank-1 (dense), and the clean forward of P*B rows. The rest of the table (`table`) follows while
time is left: the loop fed from the host at each B, loop_resident at the other B, the population fed from
the host (dense keyed bits, and rank-1) at each B, and (CUDA) the dense population under CUDA graph capture,
after torch eager in a subprocess, the reference of every row's "vs torch".

A cell whose price would end after the deadline is a row noted "skipped: time"; one priced over the free
memory of its device, "skipped: memory"; one that fails (out of memory, an EP refusing), "failed: ...".
Prices (bench.gpu_prices): time = its sessions' builds at the seconds per node measured so far + --seconds
+ its warm-up and last calls at the rate last measured at its size (per member-row); memory = its graphs'
priced memory at its batch.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from bench import gpu_targets
from bench.common import ROOT, say
from bench.gpu_clock import Clock
from bench.gpu_memory import Memory
from bench.gpu_prices import ARENA_CPU, ARENA_CUDA, FREE_SHARE, Builds, graph_mib
from bench.gpu_report import Report, Row, RowKind
from bench.sizes import SIZES
from bench.spsa_throughput import (
    BoundPopulation,
    body_tensors,
    bound_rate,
    loop_rate,
    population_feeds,
    population_rate,
    population_setup,
    resident_loop_rate,
)
from soma_edge import devices
from soma_edge.config import ModelConfig
from soma_edge.engine import evaluator
from soma_edge.engine.population import PopulationEvaluator
from soma_edge.expert import params
from soma_edge.expert.graph import build
from soma_edge.expert.population_graph import Noise, build_population
from soma_edge.expert.update_graph import build_update

DENSITY = {Noise.SPARSE_BITS: 0.5, Noise.BITS: 1.0, Noise.RANK1: 1.0}  # the probes each noise form stands for
# Calls a cell makes outside its --seconds: warm-ups and the last call, which ends after the time is up.
EXTRA_CALLS = {RowKind.RESIDENT: 3, RowKind.RANK1_RESIDENT: 3, RowKind.CUDA_GRAPH: 4}
# CUDA errors after which the process's CUDA context is lost: every later call fails alike.
CUDA_STICKY = ("cudaErrorIllegalAddress", "cudaErrorLaunchFailure", "cudaErrorIllegalInstruction", "CUDA failure 700")
# Over the calls' and builds' prices: a call at another K or density than the row it is priced from can be
# slower per member-row (CPU EP: 124K resident steps 25% slower a member at K = 64 than at K = 8).
SAFETY = 1.3
MARGIN_S = 5.0  # kept before the deadline: a cell's price is an estimate, and the report is written last
# Where a row with no measured row of its own evaluator at its size takes the price of a call from.
_BASIS = {
    RowKind.CLEAN: RowKind.LOOP_RESIDENT,
    RowKind.RESIDENT: RowKind.POPULATION,
    RowKind.RANK1_RESIDENT: RowKind.RANK1,
    RowKind.CUDA_GRAPH: RowKind.POPULATION,
}


@dataclass
class Cells:
    """What every cell needs: where it runs, the run's clock, memory and report, and the table's shape."""

    device: str
    report: Report
    clock: Clock
    memory: Memory
    seq_len: int
    seconds: float
    target_b: int
    builds: Builds
    broken: str = ""  # a CUDA error that leaves the device unusable to this process: no cell runs after it

    @property
    def cuda(self) -> bool:
        return devices.parse(self.device).cuda_id is not None

    def estimate(self, row: Row, graphs: list) -> float:
        """Seconds the cell would take (module docstring); a first cell at --seconds and its builds."""
        done = [r for r in self.report.rows if r.evals_per_s and r.evaluator is not RowKind.TORCH]
        calls = 0.0
        for pick in (
            lambda r: r.name == row.name and r.evaluator is row.evaluator,
            lambda r: r.name == row.name and r.evaluator is _BASIS.get(row.evaluator),
            lambda r: r.name == row.name,
            lambda r: True,
        ):
            got = [r for r in done if pick(r)]
            if got:
                per_row = row.params / (got[-1].evals_per_s * got[-1].B * got[-1].params)
                calls = EXTRA_CALLS.get(row.evaluator, 2) * per_row * _members(row) * row.B
                break
        return self.seconds + SAFETY * (self.builds.price(graphs) + calls)

    def run(self, row: Row, graphs: list[tuple[Any, int]], make: Callable[[], Any], measure: Callable[[Any], float]):
        """One cell: priced (time, and memory of `graphs`, each (model, batch)), then its sessions made by
        `make` (timed: the next builds' price), measured by `measure`, and released. The row goes to the
        report whatever happens."""
        models = [g for g, _ in graphs]
        arena = ARENA_CUDA if self.cuda else ARENA_CPU
        row.price = sum(graph_mib(g, b, self.seq_len, arena) for g, b in graphs)
        need, left, free = self.estimate(row, models), self.clock.left() - MARGIN_S, self.memory.free_mib()
        if self.broken:
            row.note = f"skipped: the device failed in an earlier cell ({self.broken})"
        elif need > left:
            row.note = f"skipped: time (needs ~{need:.1f} s, {max(left, 0.0):.1f} s left)"
        elif free is not None and row.price > FREE_SHARE * free:
            row.note = f"skipped: memory (priced {row.price:,} MiB, {free:,} MiB free)"
        else:
            self._measure(row, models, make, measure)
        got = row.note if row.evals_per_s is None else f"{row.evals_per_s:.1f} evals/s"
        say(f"  {row.label()}: {got}")
        self.report.add_row(row)

    def _measure(self, row: Row, models: list, make: Callable[[], Any], measure: Callable[[Any], float]) -> None:
        self.report.current, self.report.running = f"throughput {row.label()}", row
        base = self.memory.cell_start()
        try:
            t0 = time.perf_counter()
            held = make()
            self.builds.record(models, time.perf_counter() - t0)
            row.evals_per_s = measure(held)
        except Exception as e:  # one cell failing (out of memory, an EP refusing) must not lose the table
            said = " ".join(str(e).split())
            row.note = f"failed: {type(e).__name__}: {said[:200]}"
            if any(sticky in said for sticky in CUDA_STICKY):  # the CUDA context is lost for the process
                self.broken = next(s for s in CUDA_STICKY if s in said)
        finally:
            held = None  # the sessions go before the memory is read: what stays is the arena's peak
            gc.collect()
        row.memory = self.memory.cell_used(base)


def _members(row: Row) -> int:
    return 1 if row.K is None else 2 * row.K + 1


def _ids(batch: int, seq_len: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (batch, seq_len)).astype(np.int64)


def _loss_evaluator(m: ModelConfig, device: str):
    return evaluator.LossEvaluator(m, device, parallel=1)


def loop_cell(c: Cells, name: str, w: np.ndarray, b: int, resident: bool) -> None:
    """The loop (one ORT call an evaluation) at batch b: its weights fed from the host, or bound on the
    device once (loop_resident, the targets' baseline)."""
    m = SIZES[name]
    row = Row(name, params.count(m), b, None, RowKind.LOOP_RESIDENT if resident else RowKind.LOOP)
    fn = resident_loop_rate if resident else loop_rate
    x = _ids(b, c.seq_len)
    c.run(row, [(build(m, "loss"), b)], lambda: _loss_evaluator(m, c.device), lambda ev: fn(ev, w, x, c.seconds))


def clean_cell(c: Cells, name: str, w: np.ndarray, k: int) -> None:
    """The loss graph on one batch of P*B sequences, bound on the device: the rank-1 target's unit."""
    m, b, p = SIZES[name], c.target_b, 2 * k + 1
    row = Row(name, params.count(m), b, k, RowKind.CLEAN)
    x = _ids(p * b, c.seq_len)
    c.run(
        row,
        [(build(m, "loss"), p * b)],
        lambda: _loss_evaluator(m, c.device),
        lambda ev: p * resident_loop_rate(ev, w, x, c.seconds),
    )


def resident_cell(c: Cells, name: str, w: np.ndarray, k: int, noise: Noise) -> None:
    """Resident.step as a worker trains on a device (bench.gpu_targets.resident_runner, then runner_timing),
    at the targets' B, with its host share: full-rank at density 0.5 (SPARSE_BITS) or 1.0 (BITS), or rank-1."""
    m, b = SIZES[name], c.target_b
    ev = RowKind.RANK1_RESIDENT if noise is Noise.RANK1 else RowKind.RESIDENT
    row = Row(name, params.count(m), b, k, ev, density=DENSITY[noise])
    x = _ids(b, c.seq_len)
    cfg = gpu_targets.resident_config(m, k, noise, x, c.device)
    body = body_tensors(m)
    population = build_population(m, k, body, noise, True, c.seq_len)
    update = build_update(m, cfg.spsa, k, body, noise, True)
    # On CUDA the resident step runs captured, in a second pair of sessions (soma_edge.engine.capture): the first
    # pair is made but never run, and ORT allocates a session's tensors when it runs.
    graphs = [(population, b), (update, b)]

    def make():  # every session of the cell: the population's, the update's, (CUDA) the captured pair
        pop = PopulationEvaluator(m, k, body, noise, c.seq_len, True, c.device)
        return gpu_targets.resident_runner(pop, cfg, w, x)

    def measure(runner) -> float:
        got = gpu_targets.runner_timing(runner, x, c.seconds)
        row.host_share = round(got.host_share, 4)
        return _members(row) * got.steps_per_s

    c.run(row, graphs, make, measure)


def population_cell(c: Cells, name: str, w: np.ndarray, k: int, b: int, noise: Noise) -> None:
    """One population call a step (2K + 1 members), the weights and noise fed from the host: dense keyed
    bits (BITS) or rank-1."""
    m = SIZES[name]
    row = Row(name, params.count(m), b, k, RowKind.RANK1 if noise is Noise.RANK1 else RowKind.POPULATION, 1.0)
    x = _ids(b, c.seq_len)
    graph = build_population(m, k, body_tensors(m), noise, True, c.seq_len)
    c.run(
        row,
        [(graph, b)],
        lambda: population_setup(m, k, noise, c.seq_len, c.device),
        lambda made: population_rate(made[0], made[1], w, x, c.seconds),
    )


def cuda_graph_cell(c: Cells, name: str, w: np.ndarray, k: int, b: int) -> None:
    """(CUDA) The dense population with every input and output at a fixed device address, replayed as a
    captured CUDA graph: a session per B (a captured graph has fixed shapes)."""
    m = SIZES[name]
    row = Row(name, params.count(m), b, k, RowKind.CUDA_GRAPH, 1.0)
    x = _ids(b, c.seq_len)
    graph = build_population(m, k, body_tensors(m), Noise.BITS, True, c.seq_len)
    _, feeds = population_feeds(m, k, Noise.BITS)

    def make():
        return BoundPopulation(m, k, Noise.BITS, c.seq_len, b, c.device, cuda_graph=True)

    c.run(row, [(graph, b)], make, lambda bp: bound_rate(bp, feeds, w, x, c.seconds))


def warm_up(device: str) -> None:
    """One loss on `device`: its CUDA context, cuBLAS and cuDNN load before any cell is timed or priced."""
    m = SIZES["124K"]
    _loss_evaluator(m, device).loss(params.init(m, 0), _ids(1, 8), _ids(1, 8))


def targets(c: Cells, sizes: list[str], ks: list[int]) -> None:
    """The GPU targets' rows (module docstring), size by size, then their verdicts."""
    for name in sizes:
        w = params.init(SIZES[name], 0)
        loop_cell(c, name, w, c.target_b, resident=True)
        for k in ks:
            for noise in (Noise.SPARSE_BITS, Noise.BITS, Noise.RANK1):
                resident_cell(c, name, w, k, noise)
            clean_cell(c, name, w, k)
        settle(c, sizes, ks)


def table(c: Cells, sizes: list[str], ks: list[int], batches: list[int]) -> None:
    """The rest of the table while time is left (module docstring), then the ratios and verdicts."""
    torch_rows(c, sizes, batches)  # the reference of every row's "vs torch": first
    for name in sizes:
        w = params.init(SIZES[name], 0)
        for b in batches:
            loop_cell(c, name, w, b, resident=False)
            if b != c.target_b:
                loop_cell(c, name, w, b, resident=True)
        for k in ks:
            for b in batches:
                population_cell(c, name, w, k, b, Noise.BITS)
                population_cell(c, name, w, k, b, Noise.RANK1)
                if c.cuda:
                    cuda_graph_cell(c, name, w, k, b)
    if not c.cuda:
        c.report.notes.append(f"population+cuda_graph: not measured (CUDA only; device {c.device})")
    settle(c, sizes, ks)


def settle(c: Cells, sizes: list[str], ks: list[int]) -> None:
    """Ratios and the targets' verdicts from the rows so far, into the report."""
    ratios(c.report.rows)
    c.report.verdicts = gpu_targets.verdicts(c.report.rows, sizes, ks, c.target_b, cpu=not c.cuda)
    c.report.save()


def torch_rows(c: Cells, sizes: list[str], batches: list[int]) -> None:
    """torch eager in its own process (its CUDA libraries must not load into this one), time-boxed: one row
    per size and B, or one note saying why there are none."""
    left = c.clock.left() - 5.0  # its own start-up
    if left < c.seconds:
        c.report.notes.append("torch eager reference: skipped: time")
        return
    cmd = [sys.executable, "-m", "bench.torch_eager", "--device", c.device, "--sizes", ",".join(sizes)]
    cmd += ["--batches", ",".join(map(str, batches)), "--seq-len", str(c.seq_len), "--seconds", str(c.seconds)]
    c.report.current = "throughput torch eager (subprocess)"
    try:
        r = subprocess.run(cmd + ["--budget", f"{left:.1f}"], capture_output=True, text=True, cwd=ROOT, timeout=left)
        got = json.loads(r.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as e:
        said = (
            (r.stderr.strip().splitlines() or ["no output"])[-1] if not isinstance(e, subprocess.SubprocessError) else e
        )
        c.report.notes.append(f"torch eager reference: skipped, its subprocess gave no result ({said})")
        return
    if got["skipped"]:
        c.report.notes.append(f"{got['skipped']}: no torch row, no ratio to it")
        return
    c.report.notes.append(f"torch eager: torch {got['torch']}, in a subprocess; used MiB = torch's peak allocated")
    for g in got["rows"]:
        n = params.count(SIZES[g["name"]])
        row = Row(g["name"], n, g["batch"], None, RowKind.TORCH, None, g["evals_per_s"], memory=g["memory"])
        row.note = g["note"]
        c.report.add_row(row)


def ratios(rows: list[Row]) -> None:
    by = {(r.name, r.B, r.evaluator): r.evals_per_s for r in rows if r.K is None}
    clean = {(r.name, r.B, r.K): r.evals_per_s for r in rows if r.evaluator is RowKind.CLEAN}
    for r in rows:
        if r.evals_per_s is None:
            continue
        loop, torch_r = by.get((r.name, r.B, RowKind.LOOP_RESIDENT)), by.get((r.name, r.B, RowKind.TORCH))
        r.vs_loop = _ratio(r.evals_per_s, loop) if loop else None
        r.vs_torch = _ratio(r.evals_per_s, torch_r) if torch_r else None
        c = clean.get((r.name, r.B, r.K))
        if c and r.evaluator is not RowKind.CLEAN:  # both count P evaluations a call: time over time
            r.vs_clean = _ratio(c, r.evals_per_s)


def _ratio(a: float, b: float) -> float:
    """a / b to 4 significant digits: a ratio of 0.026 keeps its precision, where 3 decimals cut it by 2%."""
    return float(f"{a / b:.4g}")
