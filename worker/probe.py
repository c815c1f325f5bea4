"""What a worker can do: providers, memory, and measured forward evaluations/s for the run's model shape.

Measured once per (model shape, batch, device, threads, versions) and cached on disk, because the
ClientApp process that answers the capability query lives for one message only.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

import numpy as np

from soma_edge import __version__, devices, params
from soma_edge.config import Config
from soma_edge.runtime import LossEvaluator, evaluator_for
from worker.cache import Cache

PROBE_SECONDS = 1.5


def host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def cuda_memory_bytes() -> int | None:
    """Total memory of GPU 0 (devices.gpus), None when there is none."""
    found = devices.gpus()
    return found[0].memory_bytes if found else None


def make_evaluator(cfg: Config, device: str, threads: int, spin: bool, parallel: int = 0) -> LossEvaluator:
    """The worker's evaluator. Workers sharing a box pass parallel=1 and threads=cores/workers, so that
    together they use each core once; a worker alone lets ORT and SPSA choose (0 = auto)."""
    return evaluator_for(cfg, device, threads, spin, parallel)


def _key(cfg: Config, device: str, threads: int, spin: bool, parallel: int) -> str:
    import onnxruntime  # for its version only; loaded (heavy) by the evaluator anyway, not at import

    what = {
        "soma": __version__,
        "ort": onnxruntime.__version__,
        "model": cfg.to_dict()["model"],
        "batch": cfg.data.batch,
        "seq_len": cfg.data.seq_len,
        "device": device,
        "threads": threads,
        "spin": spin,
        "parallel": parallel,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]


def measure(evaluator: LossEvaluator, cfg: Config, seconds: float = PROBE_SECONDS) -> float:
    """Forward (loss) evaluations per second of `evaluator` at the run's batch shape."""
    rng = np.random.default_rng(0)
    w = params.init(cfg.model, 0)
    x = rng.integers(0, 256, size=(cfg.data.batch, cfg.data.seq_len), dtype=np.int64)
    y = rng.integers(0, 256, size=(cfg.data.batch, cfg.data.seq_len), dtype=np.int64)
    evaluator.loss(w, x, y)  # warm-up: first run allocates
    n, t0 = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - t0 < seconds:
        evaluator.loss(w, x, y)
        n += 1
    return n / (time.perf_counter() - t0)


def capabilities(
    cfg: Config, cache: Cache, device: str, threads: int, spin: bool, parallel: int = 0, seconds: float = PROBE_SECONDS
) -> dict[str, Any]:
    """Measured (or cached) throughput plus static facts about this box."""
    key = _key(cfg, device, threads, spin, parallel)
    hit = cache.get_json(key)
    if isinstance(hit, dict) and isinstance(hit.get("evals_per_s"), (int, float)):
        return {**hit, "probe_cached": True}
    t0 = time.perf_counter()
    evaluator = make_evaluator(cfg, device, threads, spin, parallel)
    rate = measure(evaluator, cfg, seconds)
    on_cuda = evaluator.providers[0] == devices.CUDA
    out = {
        "evals_per_s": rate,
        "providers": list(evaluator.providers),
        "device": device,
        "threads": evaluator.threads,
        "parallel": evaluator.parallel,
        "device_memory": cuda_memory_bytes() if on_cuda else host_memory_bytes(),
        "probe_seconds": time.perf_counter() - t0,
    }
    cache.put_json(key, out)
    return {**out, "probe_cached": False}
