"""`soma-worker doctor`: the first command on a new box. What runs here, what is missing, and what to install.

It prints, one line each: the onnxruntime build and its execution providers; the GPUs, their driver and
memory; whether the CUDA and cuDNN libraries load; the device the worker would run on; the EP each expert
graph's nodes really run on (ORT's own placement report), and whether each has a kernel on the CUDA EP
(a static check against its kernel list, soma_edge.cuda_ops); and steps/s for the demo expert. On a CPU box one
line says that it runs on the CPU, and it exits 0. A named device that cannot run here ends the report with
a DeviceError (the CLI's one `error:` line, exit 2).
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from soma_edge import cuda_ops, devices, params, runtime
from soma_edge.config import Config, ModelConfig
from soma_edge.devices import CPU, CUDA
from soma_edge.errors import DeviceError
from soma_edge.spsa import State
from worker.trainer import train

# examples/demo.toml's expert (`make demo`), everything else the default recipe; a test keeps them equal.
DEMO_MODEL = ModelConfig(embed=32, hidden=128, layers=1)
GRAPHS = ("loss", "train")  # what a worker builds: the SPSA loss, and the delta rule's clean forward
STEP_SECONDS = 2.0


def demo_config(device: str) -> Config:
    return Config(model=DEMO_MODEL, seed=0, device=device)


def report(device: str = "auto", seconds: float = STEP_SECONDS, say: Callable[[str], None] = print) -> None:
    """Print the report. DeviceError where onnxruntime is missing or a named device cannot run here."""
    devices.parse(device)  # a ConfigError for a misspelt name, before anything is measured
    found = devices.gpus()
    try:
        ort = runtime.load_ort()
    except DeviceError:
        _gpus(found, say)
        raise
    say(f"onnxruntime: {runtime.ort_package()}; execution providers: {', '.join(ort.get_available_providers())}")
    if len(runtime.ort_packages()) > 1:
        say(
            "onnxruntime: both packages are installed and own one module: pip uninstall -y "
            f"{' '.join(runtime.ORT_PACKAGES)}, then {runtime.INSTALL_CPU} or {runtime.INSTALL_CUDA}"
        )
    _gpus(found, say)
    _cuda(ort, found, say)
    # The runtime says once that `auto` runs on the CPU; here the report's own line says it.
    level = runtime.log.level
    runtime.log.setLevel(logging.ERROR)
    try:
        _device(device, seconds, say)
    finally:
        runtime.log.setLevel(level)


def _gpus(found: list[devices.Gpu], say: Callable[[str], None]) -> None:
    if not found:
        say("gpu: none found (no nvidia-smi answer, no /proc/driver/nvidia)")
    for i, g in enumerate(found):
        mem = "memory unknown" if g.memory_bytes is None else f"{g.memory_bytes / (1 << 30):.1f} GiB"
        say(f"gpu {i}: {g.name}, driver {g.driver}, {mem}")


def _cuda(ort, found: list[devices.Gpu], say: Callable[[str], None]) -> None:
    if CUDA not in ort.get_available_providers():
        hint = f": {runtime.INSTALL_CUDA} in a fresh environment to use the GPU" if found else ""
        say(f"cuda: not used, this onnxruntime has no CUDA EP{hint}")
        return
    why = runtime.cuda_libraries().error
    say(f"cuda: {why}" if why else "cuda: the CUDA and cuDNN 9 libraries load")


def _device(device: str, seconds: float, say: Callable[[str], None]) -> None:
    plan = runtime.plan(device)  # DeviceError for a named device that cannot run here
    if plan.why_cpu is not None:
        say(f"device {device}: runs on the CPU ({plan.why_cpu})")
    else:
        say(f"device {device}: {plan.first}" + (", the CPU EP behind it" if len(plan.providers) > 1 else ""))
    for mode in GRAPHS:
        say(f"graph {mode}: {_placed(mode, plan)}")
    cfg = demo_config(device)
    rate, evaluator = _steps_per_s(cfg, seconds)
    say(
        f"demo expert ({params.count(cfg.model)} params, batch {cfg.data.batch} x {cfg.data.seq_len} bytes): "
        f"{rate:.1f} steps/s on {evaluator.providers[0]}"
    )


def _placed(mode: str, plan: runtime.Plan) -> str:
    from soma_edge.graph import build  # graph imports onnx (heavy): only where a graph is built

    providers = plan.providers if CPU in plan.providers else plan.providers + [CPU]
    model = build(DEMO_MODEL, mode)
    placed = runtime.placement(model, providers)
    if not placed:
        return "ONNX Runtime cannot place it (see the error below)"
    parts = [
        f"{p.count} nodes on {ep}" + (f" ({', '.join(sorted(set(p.ops)))})" if p.ops else "")
        for ep, p in placed.items()
    ]
    off = [ep for ep in placed if ep != plan.first]
    if off and plan.strict:
        parts.append(f"so device {plan.first} refuses it: those ops need a kernel on {plan.first}")
    return "; ".join(parts + [_cuda_kernels(model)])


def _cuda_kernels(model) -> str:
    """What the static check against the CUDA EP's kernel list says, on any box: a CPU box can tell a GPU
    worker's graph would not run whole before anyone installs CUDA."""
    missing = cuda_ops.nodes_without_cuda_kernel(model)
    if not missing:
        return f"every node has a CUDA kernel in onnxruntime-gpu {cuda_ops.ORT_VERSION}"
    return "no CUDA kernel for " + ", ".join(f"{n.op} ({n.reason})" for n in missing)


def _steps_per_s(cfg: Config, seconds: float) -> tuple[float, runtime.LossEvaluator]:
    """SPSA steps/s of the worker's evaluator on a random byte stream (the rate does not depend on the bytes)."""
    evaluator = runtime.evaluator_for(cfg)
    data = np.random.default_rng(0).integers(0, 256, size=1 << 16, dtype=np.uint8)
    state = State(params.init(cfg.model, cfg.seed))
    train(state, data, cfg, evaluator, steps=1)  # warm-up: the first run allocates
    rep = train(state, data, cfg, evaluator, seconds=seconds)
    return rep.steps_per_s, evaluator
