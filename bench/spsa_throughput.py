"""SPSA throughput on this machine: ORT loss graph vs torch eager, matmul peak, SPSA step overhead.

    .venv/bin/python -m bench.spsa_throughput [--seconds 3] [--sizes S,L]

Prints one table. Everything is measured in the same run, so the ratios are what to read.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from bench.common import forward_flops
from soma_edge import params
from soma_edge.config import ModelConfig, SPSAConfig
from soma_edge.runtime import LossEvaluator, cpu_count
from soma_edge.spsa import State, Stepper

SIZES = {"S": ModelConfig(embed=64, hidden=416, layers=1), "L": ModelConfig(embed=64, hidden=1344, layers=1)}
B, T, K = 16, 128, 8


def rate(fn, seconds: float) -> float:
    """Calls per second of fn() over about `seconds` (after one warm-up call)."""
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return n / (time.perf_counter() - t0)


def matmul_peak(seconds: float) -> float:
    import torch  # optional (the bench extra): only the peak and the torch rows need it

    torch.set_num_threads(cpu_count())
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch_rate = rate(lambda: a @ b, seconds) * 2 * n**3
    an, bn = a.numpy(), b.numpy()
    numpy_rate = rate(lambda: an @ bn, seconds) * 2 * n**3
    return max(torch_rate, numpy_rate) / 1e9


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


def ort_rates(m: ModelConfig, w: np.ndarray, x: np.ndarray, seconds: float) -> dict[str, float]:
    cores = cpu_count()
    seq = LossEvaluator(m, "cpu", threads=cores, parallel=1)
    out = {"ort_1x%dthr" % cores: rate(lambda: seq.loss(w, x, x), seconds)}
    if cores >= 2:
        par = LossEvaluator(m, "cpu", threads=max(1, cores // 2), parallel=2)
        pool = ThreadPoolExecutor(1)

        def pair():
            f = pool.submit(par.loss, w, x, x)
            par.loss(w, x, x)
            f.result()

        out["ort_2x%dthr" % max(1, cores // 2)] = 2 * rate(pair, seconds)
    return out


def spsa_step_time(m: ModelConfig, w: np.ndarray, x: np.ndarray, noise: str, seconds: float) -> tuple[float, int]:
    ev = LossEvaluator(m, "cpu")  # the auto plan the trainer uses
    # Dense probes and the unit-RMS update over every weight: the setting docs/BENCHMARKS.md measured.
    cfg = SPSAConfig(directions=K, noise=noise, density=1.0, update="rms", decoder="spsa")
    stepper = Stepper(cfg, seed=0, parallel=ev.parallel)
    state = State(w.copy())
    per_s = rate(lambda: stepper.step(state, lambda v: ev.loss(v, x, x)), seconds)
    stepper.close()
    return 1.0 / per_s, ev.parallel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="measuring time per cell")
    ap.add_argument("--sizes", default="S,L")
    args = ap.parse_args()
    print(
        f"machine: {platform.machine()}, {cpu_count()} cores, {platform.python_version()}, "
        f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '-')}; B={B} T={T} K={K}"
    )
    peak = matmul_peak(args.seconds)
    print(f"matmul peak (2048^2 float32, best of torch/numpy): {peak:.1f} GFLOP/s\n")
    header = f"{'size':>4} {'params':>9} {'evaluator':>12} {'evals/s':>9} {'GFLOP/s':>8} {'% peak':>7} {'vs torch':>8}"
    print(header)
    print("-" * len(header))
    overheads = []
    for name in args.sizes.split(","):
        m = SIZES[name]
        w = params.init(m, 0)
        x = np.random.default_rng(0).integers(0, 256, (B, T)).astype(np.int64)
        flops = forward_flops(m, B, T)
        rates = {"torch_eager": torch_rate(m, w, x, args.seconds), **ort_rates(m, w, x, args.seconds)}
        for ev, r in rates.items():
            g = r * flops / 1e9
            print(
                f"{name:>4} {params.count(m):>9,} {ev:>12} {r:>9.1f} {g:>8.1f} {100 * g / peak:>6.0f}% "
                f"{r / rates['torch_eager']:>7.2f}x"
            )
        for noise in ("rademacher", "gaussian"):
            step, parallel = spsa_step_time(m, w, x, noise, args.seconds)
            fwd_rate = [r for k, r in rates.items() if k.startswith(f"ort_{parallel}x")][0]
            overheads.append((name, noise, parallel, step, 2 * K / fwd_rate))
    print(f"\n{'size':>4} {'noise':>10} {'concurrency':>11} {'step s':>8} {'2K fwd s':>9} {'overhead':>8}")
    for name, noise, parallel, step, fwd in overheads:
        print(f"{name:>4} {noise:>10} {parallel:>11} {step:>8.3f} {fwd:>9.3f} {100 * (step - fwd) / step:>7.1f}%")


if __name__ == "__main__":
    main()
