"""What the throughput benches measure: the expert sizes (124K, the demo expert; S ~0.9M; L ~7.9M), the shape
of a measurement, and the rate of a call. Shared by bench/spsa_throughput.py, bench/torch_eager.py (which
must not load onnxruntime) and bench/gpu_check.py."""

from __future__ import annotations

import time
from dataclasses import dataclass

from soma_edge.config import ModelConfig
from worker.doctor import DEMO_MODEL

SIZES = {
    "124K": DEMO_MODEL,  # the demo expert (soma-worker doctor)
    "S": ModelConfig(embed=64, hidden=416, layers=1),
    "L": ModelConfig(embed=64, hidden=1344, layers=1),
}


@dataclass
class Shape:
    """What one run measures at: batch, sequence length and SPSA directions per step."""

    batch: int = 16
    seq_len: int = 128
    k: int = 8


def rate(fn, seconds: float) -> float:
    """Calls per second of fn() over about `seconds` (after one warm-up call)."""
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return n / (time.perf_counter() - t0)
