"""torch eager's forward rate, the throughput benches' reference, on the CPU or one CUDA device.

    python -m bench.torch_eager --device cuda:0 --sizes 124K,S,L --batches 16,64 [--seq-len 128] [--seconds 2]
                                [--budget 120]

bench/gpu_check.py runs this module as a subprocess: torch's CUDA libraries may differ from onnxruntime-gpu's,
and must not be loaded into the process that runs ORT (this process never imports onnxruntime). It prints
one JSON line, {"torch", "device", "onnxruntime_loaded", "skipped", "rows": [{"name", "batch",
"evals_per_s", "memory", "note"}]}: `skipped` says in one line why nothing ran (torch missing, or without
CUDA for a cuda device), with no rows; `memory` is torch's peak allocated device memory in MiB (null on the
CPU); a cell whose estimate (--seconds and two calls at the rate last measured at its size) would end past
--budget seconds has a null rate and the note "skipped: time". TF32 is off, as in ORT's CUDA sessions
(soma_edge.engine.runtime), so both sides round alike.

bench/spsa_throughput.py imports `torch_rate` in-process: on the CPU there are no CUDA libraries to clash.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from bench.sizes import SIZES, rate  # no onnxruntime: this process must never load it
from soma_edge.config import ModelConfig
from soma_edge.engine.runtime import cpu_count
from soma_edge.expert import params


def torch_device(device: str) -> str | None:
    """torch's name for a soma-edge device (cpu, cuda, cuda:i); None where torch has no counterpart."""
    return device if device == "cpu" or device == "cuda" or device.startswith("cuda:") else None


def torch_rate(m: ModelConfig, w: np.ndarray, x: np.ndarray, seconds: float, device: str = "cpu") -> float:
    """Forward evaluations (loss included) per second of the torch reference expert at weights w on x."""
    import torch  # optional (the bench extra): only the torch rows need it

    from bench.torch_ref import reference  # torch, as above

    if device == "cpu":
        torch.set_num_threads(cpu_count())
    model = reference(m, w).eval().to(device)
    xt = torch.from_numpy(x).to(device)

    def one() -> float:
        with torch.no_grad():
            return float(model(xt, xt))  # float() waits for the device: each call is a whole forward

    return rate(one, seconds)


def why_not(device: str) -> str | None:
    """One line saying why torch cannot run on `device` here; None when it can."""
    if torch_device(device) is None:
        return f"torch eager reference: device {device!r} has no torch counterpart (cpu or cuda only)"
    try:
        import torch  # optional (the bench extra): probed here
    except ImportError:
        return "torch eager reference: torch is not installed (pip install torch for the reference row)"
    if device != "cpu" and not torch.cuda.is_available():
        return f"torch eager reference: torch {torch.__version__} has no CUDA here (torch.cuda.is_available() is False)"
    return None


def measure(
    device: str, sizes: dict[str, ModelConfig], batches: list[int], seq_len: int, seconds: float, budget: float
):
    """One row per (size, batch), in that order; a cell whose estimate would end after `budget` seconds is
    skipped."""
    import torch  # optional (the bench extra): why_not has checked it is here

    if device != "cpu":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.cuda.init()  # the memory statistics below refuse a device before CUDA is initialized
    deadline, rows = time.perf_counter() + budget, []
    for name, m in sizes.items():
        w = params.init(m, 0)
        per_row = 0.0  # seconds a sequence takes through this size, as last measured: a call's price
        for b in batches:
            row = {"name": name, "batch": b, "evals_per_s": None, "memory": None, "note": ""}
            rows.append(row)
            # The cell's estimate: its measuring time, a warm-up call and the last call's overrun.
            if time.perf_counter() + seconds + 2 * per_row * b > deadline:
                row["note"] = "skipped: time"
                continue
            x = np.random.default_rng(0).integers(0, 256, (b, seq_len)).astype(np.int64)
            if device != "cpu":
                torch.cuda.reset_peak_memory_stats(device)
            row["evals_per_s"] = torch_rate(m, w, x, seconds, device)
            per_row = 1.0 / (row["evals_per_s"] * b)
            if device != "cpu":
                row["memory"] = round(torch.cuda.max_memory_allocated(device) / (1 << 20))
                torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.torch_eager", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:i")
    ap.add_argument("--sizes", default="124K,S,L", help=f"comma-separated, of {','.join(SIZES)}")
    ap.add_argument("--batches", default="16,64", help="comma-separated batch sizes")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=2.0, help="measuring time per cell")
    ap.add_argument("--budget", type=float, default=600.0, help="seconds by which every cell must end, by estimate")
    a = ap.parse_args(argv)
    out = {"torch": None, "device": a.device, "skipped": why_not(a.device), "rows": []}
    if out["skipped"] is None:
        import torch  # optional, as above: why_not found it

        out["torch"] = torch.__version__
        sizes = {n: SIZES[n] for n in a.sizes.split(",")}
        batches = [int(b) for b in a.batches.split(",")]
        out["rows"] = measure(a.device, sizes, batches, a.seq_len, a.seconds, a.budget)
    out["onnxruntime_loaded"] = "onnxruntime" in sys.modules
    print(json.dumps(out))


if __name__ == "__main__":
    main()
