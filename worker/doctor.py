"""`soma-worker doctor`: the first command on a new box. What runs here, what is missing, and what to install.

It prints, one line each: the onnxruntime build and its execution providers; the GPUs, their driver and
memory; whether the CUDA and cuDNN libraries load; the device the worker would run on; for each graph a
worker runs for the demo expert (`expert_graphs`: the loop evaluator's loss, the delta rule's clean forward
`train`, the population evaluator's `population`, and the `update` that keeps the expert on its device), the
EP its nodes really run on (ORT's own placement report) and whether each node has a kernel on the CUDA EP
(a static check against its kernel list, soma_edge.expert.cuda_kernels); and steps/s for the demo expert, measured as
worker/probe.py measures a worker. On a CPU box one line says that it runs on the CPU, and it exits 0.
Whatever stops the GPU from being used is said once, with what to install. A named device that cannot run
here ends the report with a DeviceError (the CLI's one `error:` line, exit 2).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from soma_edge import devices
from soma_edge.config import Config, ModelConfig, evals_per_step
from soma_edge.devices import CPU, CUDA
from soma_edge.engine import evaluator as evaluators
from soma_edge.engine import runtime
from soma_edge.errors import DeviceError
from soma_edge.expert import cuda_kernels as cuda_ops
from soma_edge.expert import params
from worker import probe

if TYPE_CHECKING:
    import onnx

    from soma_edge.expert.population_graph import Noise as GraphNoise

# examples/demo.toml's expert (`make demo`), everything else the default recipe; a test keeps them equal.
DEMO_MODEL = ModelConfig(embed=32, hidden=128, layers=1)
GRAPHS = ("loss", "train", "population", "update")  # what `expert_graphs` reports, in its order
# The population graph is unrolled over the window's bytes, the same ops at each; ORT places a few-byte
# unroll the same way in a fraction of the time (~1.5 s for the demo's 128 bytes), and its line says so.
PLACE_BYTES = 4
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
    said = _cuda(ort, found, say)
    # The runtime says once that `auto` runs on the CPU; here the report's own line says it.
    level = runtime.log.level
    runtime.log.setLevel(logging.ERROR)
    try:
        _device(device, seconds, said, say)
    finally:
        runtime.log.setLevel(level)


def _gpus(found: list[devices.Gpu], say: Callable[[str], None]) -> None:
    if not found:
        say("gpu: none found (no nvidia-smi answer, no /proc/driver/nvidia)")
    for i, g in enumerate(found):
        mem = "memory unknown" if g.memory_bytes is None else f"{g.memory_bytes / (1 << 30):.1f} GiB"
        say(f"gpu {i}: {g.name}, driver {g.driver}, {mem}")


def _cuda(ort, found: list[devices.Gpu], say: Callable[[str], None]) -> str | None:
    """The `cuda:` line. Returns what it named as keeping a GPU unused (with what to install), if anything."""
    if CUDA not in ort.get_available_providers():
        if not found:
            say("cuda: not used, this onnxruntime has no CUDA EP")
            return None
        why = runtime.no_cuda_ep()
        say(f"cuda: not used, {why}")
        return why
    why = runtime.cuda_libraries().error
    say(f"cuda: {why}" if why else "cuda: the CUDA and cuDNN 9 libraries load")
    return why


def _device(device: str, seconds: float, said: str | None, say: Callable[[str], None]) -> None:
    plan = runtime.plan(device)  # DeviceError for a named device that cannot run here
    if plan.why_cpu is not None:
        # Said once: where the cuda line already gave the reason and what to install, point to it.
        why = "the cuda line says why" if plan.why_cpu == said else plan.why_cpu
        say(f"device {device}: runs on the CPU ({why})")
    else:
        say(f"device {device}: {plan.first}" + (", the CPU EP behind it" if len(plan.providers) > 1 else ""))
    cfg = demo_config(device)
    for name, (what, graph) in expert_graphs(cfg).items():
        say(f"graph {name}: {what}; " + (graph if isinstance(graph, str) else _placed(graph, plan)))
    evaluator = evaluators.evaluator_for(cfg)
    rate = probe.measure(evaluator, cfg, seconds) / evals_per_step(cfg.spsa)  # evaluations/s -> steps/s
    say(
        f"demo expert ({params.count(cfg.model)} params, batch {cfg.data.batch} x {cfg.data.seq_len} bytes, "
        f"{evaluators.evaluator_kind(evaluator).value} evaluator): {rate:.1f} steps/s on {evaluator.providers[0]}"
    )


def population_args(cfg: Config) -> tuple[int, list[str], GraphNoise]:
    """K, the perturbed tensors and the noise form of the population evaluator that population.for_config
    makes for `cfg`, without its session (a test keeps the two equal)."""
    # imports onnx (heavy): only where graphs are built
    from soma_edge.engine.population import graph_noise, perturbed_tensors

    return cfg.spsa.directions, perturbed_tensors(cfg), graph_noise(cfg.spsa)


def expert_graphs(cfg: Config) -> dict[str, tuple[str, onnx.ModelProto | str]]:
    """Each graph (GRAPHS) a worker on `cfg` runs for one expert: what runs it, and the graph, or why `cfg`
    does not run it. The population graph is the PLACE_BYTES-byte unroll (see PLACE_BYTES)."""
    from soma_edge.expert import graph, update_graph  # import onnx (heavy): only where graphs are built
    from soma_edge.expert.population_graph import build_population

    m, s, delta = cfg.model, cfg.spsa, cfg.spsa.decoder == "delta"
    k, perturbed, noise = population_args(cfg)
    short = min(PLACE_BYTES, cfg.data.seq_len)
    why_host = update_graph.supported(s)
    return {
        "loss": ("the loop evaluator's probes, and val losses", graph.build(m, "loss")),
        "train": (
            "the loop evaluator's clean forward (delta rule)",
            graph.build(m, "train") if delta else f"not run: spsa.decoder = {s.decoder!r}",
        ),
        "population": (
            f"the population evaluator (clean forward and 2K probes), placed unrolled over {short} of its "
            f"{cfg.data.seq_len} bytes, the same ops each",
            build_population(m, k, perturbed, noise, delta, short),
        ),
        "update": (
            "the population evaluator's update, the expert kept on the device",
            update_graph.build_update(m, s, k * s.accumulate, perturbed, noise, delta)
            if why_host is None
            else f"not run: {why_host}",
        ),
    }


def _placed(model: onnx.ModelProto, plan: runtime.Plan) -> str:
    providers = plan.providers if CPU in plan.providers else plan.providers + [CPU]
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


def _cuda_kernels(model: onnx.ModelProto) -> str:
    """What the static check against the CUDA EP's kernel list says, on any box: a CPU box can tell a GPU
    worker's graph would not run whole before anyone installs CUDA."""
    missing = cuda_ops.nodes_without_cuda_kernel(model)
    if not missing:
        return f"every node has a CUDA kernel in onnxruntime-gpu {cuda_ops.ORT_VERSION}"
    return "no CUDA kernel for " + ", ".join(f"{n.op} ({n.reason})" for n in missing)
