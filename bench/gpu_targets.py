"""The issue's GPU targets for population-batched SPSA, as bench/gpu_check.py's throughput table settles them:
what the table measures for them beyond its rates, and the verdicts it reads from its rows.

- speed: the full-rank population >= 5x loop_resident (the loop with its weights resident on the device) at
  K = 8 and >= 15x at K = 64, B = 16: each size's best full-rank row (population, population_resident or
  population+cuda_graph, named in the line) against loop_resident at the same size and B;
- rank-1 cost: a rank-1 step costs <= 1.5x one clean forward of the same P*B rows (P = 2K + 1): the
  resident rank-1 training step (soma_edge.engine.resident.Resident.step, the worker's path on a GPU) against the
  loss graph (soma_edge.expert.graph, the ONNX LSTM op) on one batch of P*B sequences, its inputs bound on the
  device once; the share of that step spent in ORT's run calls is given beside it;
- host wait: the GPU waits on the host for <= 10% of a step: for the resident step (full-rank and rank-1),
  the share of its wall time spent outside ORT's run calls (drawing the noise, uploading it and the batch,
  numpy), timed by wrapping the sessions' run_with_iobinding. An ORT run on the CUDA EP returns when the
  device has finished, so the device is idle for at least that share; the gaps between kernels inside a run
  (launch overhead) are not seen, so the figure is a lower bound of the device's idle time.

Speed and host wait are judged at each probe density apart: 0.5, as shipped (sparse probes, each with a packed
mask the graph expands), and 1.0 (dense). Each verdict is PASS (every size or K measured meets it), FAIL
(one measured misses it), or not measured.
On the CPU EP (`--device cpu`) they are computed the same way and labelled as CPU: they say nothing of the
GPU targets.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from soma_edge.config import Config, ModelConfig
from soma_edge.expert.population_graph import Noise
from soma_edge.spsa.optim import State

SPEEDUPS = ((8, 5.0), (64, 15.0))  # (K, least ratio to loop_resident) of the speed target
TARGET_B = 16  # the batch the targets are set at
RANK1_COST = 1.5  # most a rank-1 step may cost, in clean forwards of its P*B rows
HOST_WAIT = 0.10  # most of a resident step the device may wait on the host
FULL_RANK = ("population", "population_resident", "population+cuda_graph")  # the speed target's rows
RESIDENT = ("population_resident", "rank1_resident")


@dataclass
class Verdict:
    """One target's verdict: PASS, FAIL or not measured; `cpu` when the CPU EP stood in for the GPU."""

    target: str
    verdict: str
    detail: str
    cpu: bool
    figures: dict = field(default_factory=dict)

    def line(self) -> str:
        label = f"CPU EP ({self.verdict}; not the GPU target)" if self.cpu else self.verdict
        return f"{self.target}: **{label}**: {self.detail}"


@dataclass
class StepTiming:
    """Resident steps measured: steps per second, and the share of their wall time outside ORT's run calls."""

    steps_per_s: float
    host_share: float


@contextlib.contextmanager
def timed_runs(*sessions: Any) -> Iterator[list[float]]:
    """Seconds each run_with_iobinding call of `sessions` takes, appended to the list yielded. The sessions'
    method is shadowed by a timing wrapper on the instance for the block, then unshadowed: the product's
    code runs as it is."""
    spent: list[float] = []

    def timing(real):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                spent.append(time.perf_counter() - t0)

        return run

    for s in sessions:
        s.run_with_iobinding = timing(s.run_with_iobinding)
    try:
        yield spent
    finally:
        for s in sessions:
            del s.run_with_iobinding


def resident_config(m: ModelConfig, k: int, noise: Noise, x: np.ndarray, device: str) -> Config:
    """The config of a worker training `m` with the population at K = k on batches shaped like x, whose
    noise crosses in the form `noise`: Adam and the delta-rule decoder from the clean member, every direction
    on the whole batch (the population graph the cells build), with sparse Rademacher probes (density 0.5) for
    SPARSE_BITS, dense ones for BITS and spsa.noise = rank1 for RANK1."""
    cfg = Config(model=m, device=device)
    cfg.spsa.evaluator, cfg.spsa.directions = "population", k
    cfg.spsa.split_rows, cfg.spsa.decoder_from, cfg.spsa.density = False, "clean", 1.0
    cfg.data.batch, cfg.data.seq_len = x.shape
    if noise is Noise.SPARSE_BITS:
        cfg.spsa.density = 0.5
    if noise is Noise.RANK1:
        cfg.spsa.noise, cfg.spsa.density = "rank1", 1.0
    return cfg


def resident_runner(population, cfg: Config, w: np.ndarray, x: np.ndarray):
    """soma_edge.engine.resident.Resident on `population` (a PopulationEvaluator of cfg's shape, K and noise
    form) from the weights w, after two warm-up steps on the batch (x, x): the first runs allocate, and on
    CUDA make the captured sessions and capture both A/B graphs. Its sessions are all made when it returns."""
    from soma_edge.engine import resident  # imports onnx (heavy), as population does

    runner = resident.Resident(cfg, 0, population, State(w.copy()))
    for _ in range(2):
        runner.step([(x, x)])
    return runner


def runner_timing(runner, x: np.ndarray, seconds: float) -> StepTiming:
    """Resident.step of a warmed-up `runner` (resident_runner) for about `seconds`, every step on (x, x)."""
    captured = runner.captured  # None where the device refused capture: the plain sessions run
    population = runner.population
    sessions = (
        (population.session, runner.update) if captured is None else (captured.population, captured.update_session)
    )
    with timed_runs(*sessions) as inside:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds or n == 0:
            runner.step([(x, x)])
            n += 1
        wall = time.perf_counter() - t0
    return StepTiming(n / wall, max(0.0, 1.0 - sum(inside) / wall))


def _fmt_x(v: float) -> str:
    return f"{v:.2f}x"


def _decide(measured: list[bool]) -> str:
    if not measured:
        return "not measured"
    return "PASS" if all(measured) else "FAIL"


def _why_not(rows: list, name: str, k: int | None) -> str:
    """Why a size (and K) has no figure: the note of its first skipped or failed row, else that none ran."""
    notes = [r.note for r in rows if r.name == name and r.K in (k, None) and r.note and r.evals_per_s is None]
    if not notes:
        return "no row"
    return notes[0].split(" (")[0]  # "skipped: time (needs ~4.4 s, 1.0 s left)" -> "skipped: time"


DENSITIES = (0.5, 1.0)  # the probes' density the full-rank targets are judged at: as shipped, and dense


def speed_verdicts(rows: list, sizes: list[str], ks: list[int], b: int, cpu: bool, density: float) -> list[Verdict]:
    """The speed target per K of SPEEDUPS at one probe density: per size, its best full-rank row against
    loop_resident."""
    out = []
    for k, need in SPEEDUPS:
        target = f"population >= {need:g}x loop_resident at K = {k}, B = {b}, density {density:g}"
        if k not in ks:
            out.append(Verdict(target, "not measured", f"K = {k} not in --ks", cpu))
            continue
        parts, ok, figures = [], [], {}
        for name in sizes:
            got = [r for r in rows if (r.name, r.B, r.K, r.density) == (name, b, k, density)]
            got = [r for r in got if r.evaluator in FULL_RANK and r.vs_loop is not None]
            if not got:
                parts.append(f"{name} not measured ({_why_not(rows, name, k)})")
                continue
            best = max(got, key=lambda r: r.vs_loop)
            ok.append(best.vs_loop >= need)
            figures[name] = {"vs_loop": best.vs_loop, "row": str(best.evaluator.value)}
            parts.append(f"{name} {_fmt_x(best.vs_loop)} ({best.evaluator.value})")
        out.append(Verdict(target, _decide(ok), "; ".join(parts), cpu, figures))
    return out


def rank1_verdict(rows: list, sizes: list[str], ks: list[int], b: int, cpu: bool) -> Verdict:
    """The rank-1 cost target over every size and K measured: the resident rank-1 step's cost in clean
    forwards of its P*B rows, and (in brackets) that of its ORT calls alone."""
    target = f"a rank-1 step <= {RANK1_COST:g}x one clean forward of the same P*B rows, B = {b}"
    parts, ok, figures = [], [], {}
    for name in sizes:
        for k in ks:
            got = [r for r in rows if (r.name, r.B, r.K, r.evaluator) == (name, b, k, "rank1_resident")]
            if not got or got[0].vs_clean is None:
                parts.append(f"{name} K={k} not measured ({_why_not(rows, name, k)})")
                continue
            r = got[0]
            device_only = r.vs_clean * (1.0 - r.host_share)
            ok.append(r.vs_clean <= RANK1_COST)
            figures[f"{name} K={k}"] = {"vs_clean": r.vs_clean, "runs_vs_clean": round(device_only, 3)}
            parts.append(f"{name} K={k} {_fmt_x(r.vs_clean)} ({_fmt_x(device_only)} in ORT's runs)")
    return Verdict(target, _decide(ok), "; ".join(parts), cpu, figures)


def host_verdict(rows: list, sizes: list[str], ks: list[int], b: int, cpu: bool, density: float) -> Verdict:
    """The host-wait target over every resident row measured at one probe density (full-rank, and at
    density 1 rank-1 too), each size and K."""
    target = f"the device waits on the host <= {100 * HOST_WAIT:g}% of a resident step, B = {b}, density {density:g}"
    ours = [r for r in rows if r.evaluator in RESIDENT and (r.B, r.density) == (b, density)]
    ours = [r for r in ours if r.name in sizes and r.K in ks]
    got = [r for r in ours if r.host_share is not None]
    figures = {f"{r.name} K={r.K} {r.evaluator.value}": r.host_share for r in got}
    parts = [f"{key} {100 * v:.0f}%" for key, v in figures.items()]
    parts += [f"{r.name} K={r.K} {r.evaluator.value} not measured ({r.note})" for r in ours if r.evals_per_s is None]
    return Verdict(target, _decide([v <= HOST_WAIT for v in figures.values()]), "; ".join(parts), cpu, figures)


def verdicts(rows: list, sizes: list[str], ks: list[int], b: int, cpu: bool) -> list[Verdict]:
    """Speed and host wait at each density of DENSITIES (as shipped first), and the rank-1 cost."""
    out = []
    for d in DENSITIES:
        out += speed_verdicts(rows, sizes, ks, b, cpu, d)
    out.append(rank1_verdict(rows, sizes, ks, b, cpu))
    return out + [host_verdict(rows, sizes, ks, b, cpu, d) for d in DENSITIES]
