"""SPSA throughput on this machine: the looped ORT loss graph, the population graph (full-rank signs and
rank-1 probes) and torch eager, beside the matmul peak and the SPSA step overhead.

    .venv/bin/python -m bench.spsa_throughput [--seconds 3] [--sizes 124K,S,L] [--json]

Prints one table per run. Everything is measured in the same run, so the ratios are what to read. Rates are
forward evaluations per second, each population member counting as one: a population call of K directions
is 2K + 1 evaluations (the clean forward with its decoder gradient, then w ± eps z_j on the body, the
default `decoder = "delta"` setting), where the loop makes 2K + 1 LossEvaluator calls. Noise is drawn
before the clock starts, for the loop and the population alike.

`chosen` is the evaluator `spsa.evaluator = "auto"` would pick on this CPU: the loop (at the trainer's
concurrency plan), unless the full-rank population measured faster here. Rank-1 is the user's choice
(`spsa.noise`), never auto's, so it is reported beside full-rank but never chosen. With `--json` the last
stdout line is one object {"sizes": [{"name", "params", "chosen", "chosen_vs_torch", ...}, ...]}. torch is
optional: without it the torch row and every ratio to it are left out, with a note.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from bench.common import forward_flops
from soma_edge import params, spsa
from soma_edge.config import ModelConfig, SPSAConfig
from soma_edge.population import PopulationEvaluator, noise_feeds
from soma_edge.population_graph import Noise
from soma_edge.runtime import LossEvaluator, cpu_count, plan_concurrency
from soma_edge.spsa import State, Stepper
from worker.doctor import DEMO_MODEL

SIZES = {
    "124K": DEMO_MODEL,  # the demo expert (soma-worker doctor)
    "S": ModelConfig(embed=64, hidden=416, layers=1),
    "L": ModelConfig(embed=64, hidden=1344, layers=1),
}
LOOP, POPULATION, RANK1, TORCH = "loop", "population", "rank1", "torch_eager"


@dataclass
class Shape:
    """What one run measures at: batch, sequence length and SPSA directions per step."""

    batch: int = 16
    seq_len: int = 128
    k: int = 8


@dataclass
class SizeResult:
    """One size's verdict, one entry of --json's "sizes": `chosen` is auto's CPU evaluator and its ratio to
    torch eager (None without torch); `evals_per_s` every row measured, by evaluator name."""

    name: str
    params: int
    chosen: str
    chosen_vs_torch: float | None
    population_vs_loop: float
    rank1_vs_population: float
    evals_per_s: dict[str, float]


def rate(fn, seconds: float) -> float:
    """Calls per second of fn() over about `seconds` (after one warm-up call)."""
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return n / (time.perf_counter() - t0)


def has_torch() -> bool:
    try:
        import torch  # noqa: F401  (optional, the bench extra: only probed here)
    except ImportError:
        return False
    return True


def matmul_peak(seconds: float, torch_ok: bool) -> float:
    n = 2048
    an, bn = np.random.default_rng(0).standard_normal((2, n, n), dtype=np.float32)
    best = rate(lambda: an @ bn, seconds)
    if torch_ok:
        import torch  # optional (the bench extra): only the peak and the torch rows need it

        torch.set_num_threads(cpu_count())
        a, b = torch.from_numpy(an), torch.from_numpy(bn)
        best = max(best, rate(lambda: a @ b, seconds))
    return best * 2 * n**3 / 1e9


def torch_rate(m: ModelConfig, w: np.ndarray, x: np.ndarray, seconds: float) -> float:
    import torch  # optional (the bench extra): only the peak and the torch rows need it

    from bench.torch_ref import TorchExpert  # torch, as above

    torch.set_num_threads(cpu_count())
    model = TorchExpert(m).load_flat(w).eval()
    xt = torch.from_numpy(x)

    def one():
        with torch.no_grad():
            model(xt, xt)

    return rate(one, seconds)


def loop_rates(m: ModelConfig, w: np.ndarray, x: np.ndarray, seconds: float) -> dict[str, float]:
    """The looped LSTM-op loss graph, one LossEvaluator call per evaluation: all cores on one call, and
    (with 2+ cores) two calls side by side on half the cores each."""
    cores = cpu_count()
    seq = LossEvaluator(m, "cpu", threads=cores, parallel=1)
    out = {f"{LOOP}_1x{cores}thr": rate(lambda: seq.loss(w, x, x), seconds)}
    if cores >= 2:
        half = max(1, cores // 2)
        par = LossEvaluator(m, "cpu", threads=half, parallel=2)
        pool = ThreadPoolExecutor(1)

        def pair():
            f = pool.submit(par.loss, w, x, x)
            par.loss(w, x, x)
            f.result()

        out[f"{LOOP}_2x{half}thr"] = 2 * rate(pair, seconds)
        pool.shutdown()
    return out


def population_feeds(m: ModelConfig, k: int, noise: Noise) -> tuple[tuple[str, ...], dict[str, np.ndarray]]:
    """The body's tensors and K keyed directions over them as the graph's int8 inputs: full-rank Rademacher
    signs cut from the Stepper's flat z, or the rank-1 factors spsa.rank1_factors draws."""
    lay = params.layout(m)
    body = tuple(lay.names[: lay.names.index(lay.decoder[0])])
    if noise is Noise.SIGNS:
        z = np.stack([spsa.noise(0, 0, 0, j, lay.body) for j in range(k)])
        return body, noise_feeds(lay, body, noise, z)
    shapes = [lay.shapes[lay.names.index(n)] for n in body]
    draws = [spsa.rank1_factors(0, 0, 0, j, shapes) for j in range(k)]
    feeds = {}
    for i, (name, shape) in enumerate(zip(body, shapes)):
        if isinstance(draws[0][i], spsa.Rank1):
            feeds[f"a.{name}"] = np.stack([d[i].a for d in draws]).astype(np.int8)
            feeds[f"b.{name}"] = np.stack([d[i].b for d in draws]).astype(np.int8)
        else:
            feeds[f"z.{name}"] = np.stack([d[i].reshape(shape) for d in draws]).astype(np.int8)
    return body, feeds


def population_rate(m: ModelConfig, w: np.ndarray, x: np.ndarray, shape: Shape, noise: Noise, s: float) -> float:
    """Forward evaluations per second of one population call (2K + 1 members) on all cores."""
    body, feeds = population_feeds(m, shape.k, noise)
    pop = PopulationEvaluator(m, shape.k, body, noise, shape.seq_len, decoder_grad=True, device="cpu")
    return (2 * shape.k + 1) * rate(lambda: pop.evaluate(w, feeds, 1e-3, x, x), s)


def spsa_step_time(m: ModelConfig, w: np.ndarray, x: np.ndarray, k: int, noise: str, s: float) -> tuple[float, int]:
    ev = LossEvaluator(m, "cpu")  # the auto plan the trainer uses
    # Dense probes and the unit-RMS update over every weight: the setting docs/BENCHMARKS.md measured.
    cfg = SPSAConfig(directions=k, noise=noise, density=1.0, update="rms", decoder="spsa")
    stepper = Stepper(cfg, seed=0, parallel=ev.parallel)
    state = State(w.copy())
    per_s = rate(lambda: stepper.step(state, lambda v: ev.loss(v, x, x)), s)
    stepper.close()
    return 1.0 / per_s, ev.parallel


def loop_row() -> str:
    """The loop row the trainer's auto concurrency plan uses on this CPU."""
    threads, parallel = plan_concurrency("cpu")
    return f"{LOOP}_{parallel}x{threads}thr"


def verdict(name: str, m: ModelConfig, rates: dict[str, float]) -> SizeResult:
    loop, pop = rates[loop_row()], rates[POPULATION]
    chosen = POPULATION if pop > loop else LOOP
    torch_r = rates.get(TORCH)
    chosen_rate = pop if chosen == POPULATION else loop
    return SizeResult(
        name=name,
        params=params.count(m),
        chosen=chosen,
        chosen_vs_torch=None if torch_r is None else round(chosen_rate / torch_r, 3),
        population_vs_loop=round(pop / loop, 3),
        rank1_vs_population=round(rates[RANK1] / pop, 3),
        evals_per_s={k: round(v, 2) for k, v in rates.items()},
    )


def print_rows(name: str, m: ModelConfig, rates: dict[str, float], shape: Shape, peak: float) -> None:
    flops = forward_flops(m, shape.batch, shape.seq_len)
    loop, torch_r = rates[loop_row()], rates.get(TORCH)
    for ev, r in rates.items():
        g = r * flops / 1e9
        vs_torch = f"{r / torch_r:>7.2f}x" if torch_r else f"{'-':>8}"
        print(
            f"{name:>4} {params.count(m):>9,} {ev:>14} {r:>9.1f} {g:>8.1f} {100 * g / peak:>6.0f}% "
            f"{r / loop:>7.2f}x {vs_torch}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="measuring time per cell")
    ap.add_argument("--sizes", default="124K,S,L", help=f"comma-separated, of {','.join(SIZES)}")
    ap.add_argument("--batch", type=int, default=Shape.batch)
    ap.add_argument("--seq-len", type=int, default=Shape.seq_len)
    ap.add_argument("--k", type=int, default=Shape.k, help="SPSA directions per step (2K + 1 members)")
    ap.add_argument("--no-overhead", action="store_true", help="skip the SPSA step-overhead table")
    ap.add_argument("--json", action="store_true", help="end with one JSON line: the chosen evaluator per size")
    args = ap.parse_args()
    shape = Shape(args.batch, args.seq_len, args.k)
    torch_ok = has_torch()
    print(
        f"machine: {platform.machine()}, {cpu_count()} cores, {platform.python_version()}, "
        f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '-')}; "
        f"B={shape.batch} T={shape.seq_len} K={shape.k}; loop as the trainer runs it: {loop_row()}"
    )
    peak = matmul_peak(args.seconds, torch_ok)
    print(f"matmul peak (2048^2 float32, best of {'torch/numpy' if torch_ok else 'numpy'}): {peak:.1f} GFLOP/s")
    if not torch_ok:
        print("torch not installed: no torch eager row, and no ratio to it")
    header = (
        f"\n{'size':>4} {'params':>9} {'evaluator':>14} {'evals/s':>9} {'GFLOP/s':>8} {'% peak':>7} "
        f"{'vs loop':>8} {'vs torch':>8}"
    )
    print(header)
    print("-" * len(header))
    results, overheads = [], []
    for name in args.sizes.split(","):
        m = SIZES[name]
        w = params.init(m, 0)
        x = np.random.default_rng(0).integers(0, 256, (shape.batch, shape.seq_len)).astype(np.int64)
        rates = {TORCH: torch_rate(m, w, x, args.seconds)} if torch_ok else {}
        rates.update(loop_rates(m, w, x, args.seconds))
        rates[POPULATION] = population_rate(m, w, x, shape, Noise.SIGNS, args.seconds)
        rates[RANK1] = population_rate(m, w, x, shape, Noise.RANK1, args.seconds)
        print_rows(name, m, rates, shape, peak)
        results.append(verdict(name, m, rates))
        r = results[-1]
        vs = "-" if r.chosen_vs_torch is None else f"{r.chosen_vs_torch:.2f}x"
        print(f"{name:>4} chosen (auto on this CPU): {r.chosen}, {vs} torch eager", flush=True)
        if not args.no_overhead:
            for noise in ("rademacher", "gaussian"):
                step, parallel = spsa_step_time(m, w, x, shape.k, noise, args.seconds)
                fwd_rate = [r for k, r in rates.items() if k.startswith(f"{LOOP}_{parallel}x")][0]
                overheads.append((name, noise, parallel, step, 2 * shape.k / fwd_rate))
    if overheads:
        print(f"\n{'size':>4} {'noise':>10} {'concurrency':>11} {'step s':>8} {'2K fwd s':>9} {'overhead':>8}")
        for name, noise, parallel, step, fwd in overheads:
            print(f"{name:>4} {noise:>10} {parallel:>11} {step:>8.3f} {fwd:>9.3f} {100 * (step - fwd) / step:>7.1f}%")
    if args.json:
        print(json.dumps({"sizes": [asdict(r) for r in results]}))


if __name__ == "__main__":
    main()
