"""SPSA throughput on this machine: the looped ORT loss graph, the population graph (full-rank signs and
rank-1 probes) and torch eager, beside the matmul peak and the SPSA step overhead.

    .venv/bin/python -m bench.spsa_throughput [--seconds 3] [--sizes 124K,S,L] [--json]

Prints one table per run. Everything is measured in the same run, so the ratios are what to read. Rates are
forward evaluations per second, each population member counting as one: a population call of K directions
is 2K + 1 evaluations (the clean forward with its decoder gradient, then w ± eps z_j on the body, the
default `decoder = "delta"` setting), where the loop makes 2K + 1 LossEvaluator calls. Noise is drawn
before the clock starts, for the loop and the population alike.

`chosen` is the evaluator the trainer runs with `spsa.evaluator = "auto"` on the device measured (this CPU):
`evaluator.choose_evaluator`'s fixed choice, the loop, whatever the rates say; on an accelerator, where auto
measures both (`evaluator.measures_auto`), the faster of the two as worker/probe.py keeps it. Whether the
full-rank population beat the loop here is said apart, on the line under each size's rows. Rank-1 is the
user's choice (`spsa.noise`), never auto's, so it is reported beside full-rank but never chosen. With
`--json` the last stdout line is one object {"sizes": [{"name", "params", "chosen", "chosen_vs_torch"},
...]}, and the line before it {"measured": [{"name", "population_vs_loop", "population_beats_loop",
"rank1_vs_population", "evals_per_s"}, ...]} with the figures behind it. torch is optional: without it the
torch row and every ratio to it are left out, with a note.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from bench.common import forward_flops
from bench.sizes import SIZES, Shape, rate
from soma_edge import devices
from soma_edge.config import Evaluator, ModelConfig, SPSAConfig
from soma_edge.devices import CUDA
from soma_edge.engine.evaluator import LossEvaluator, choose_evaluator, measures_auto, plan_concurrency
from soma_edge.engine.population import PopulationEvaluator, noise_feeds
from soma_edge.engine.runtime import cpu_count, cuda_options, load_ort, plan, session_options
from soma_edge.expert import params
from soma_edge.expert.population_graph import Noise, build_population, noise_inputs
from soma_edge.spsa import noise as keyed
from soma_edge.spsa.optim import State
from soma_edge.spsa.stepper import Stepper

LOOP, POPULATION, RANK1, TORCH = "loop", "population", "rank1", "torch_eager"


@dataclass
class SizeResult:
    """One size's verdict, one entry of --json's last line: `chosen`, what auto trains with on the device
    measured (`chosen_evaluator`), and its ratio to torch eager (None without torch)."""

    name: str
    params: int
    chosen: str
    chosen_vs_torch: float | None


@dataclass
class Measured:
    """One size's figures behind its verdict, one entry of --json's "measured" line: every row measured, by
    evaluator name, and whether the full-rank population beat the loop at the trainer's plan."""

    name: str
    population_vs_loop: float
    population_beats_loop: bool
    rank1_vs_population: float
    evals_per_s: dict[str, float]


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


def loop_rate(ev: LossEvaluator, w: np.ndarray, x: np.ndarray, seconds: float) -> float:
    """Forward evaluations per second of the loop: one LossEvaluator call (one ORT run) per evaluation,
    the weights fed from the host each time, as the trainer's loop feeds each probe."""
    return rate(lambda: ev.loss(w, x, x), seconds)


def loop_rates(m: ModelConfig, w: np.ndarray, x: np.ndarray, seconds: float) -> tuple[dict[str, float], list[str]]:
    """The looped LSTM-op loss graph, one LossEvaluator call per evaluation: all cores on one call, and
    (with 2+ cores) two calls side by side on half the cores each; and the providers its sessions got."""
    cores = cpu_count()
    seq = LossEvaluator(m, "cpu", threads=cores, parallel=1)
    out = {f"{LOOP}_1x{cores}thr": loop_rate(seq, w, x, seconds)}
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
    return out, seq.providers


def body_tensors(m: ModelConfig) -> tuple[str, ...]:
    """The tensors the population rows perturb: the body, the decoder learning by the delta rule."""
    lay = params.layout(m)
    return tuple(lay.names[: lay.names.index(lay.decoder[0])])


def population_feeds(m: ModelConfig, k: int, noise: Noise) -> tuple[tuple[str, ...], dict[str, np.ndarray]]:
    """The body's tensors and K keyed directions over them as the graph's inputs: full-rank Rademacher as
    its keyed bits (BITS, what the trainer feeds) or as int8 signs cut from the Stepper's flat z (SIGNS),
    or the rank-1 factors spsa.noise.rank1_factors draws."""
    lay, body = params.layout(m), body_tensors(m)
    if noise is Noise.BITS:
        return body, {"bits": np.stack([keyed.noise_bits(0, 0, 0, j, lay.body) for j in range(k)])}
    if noise is Noise.SIGNS:
        z = np.stack([keyed.noise(0, 0, 0, j, lay.body) for j in range(k)])
        return body, noise_feeds(lay, body, noise, z)
    shapes = [lay.shapes[lay.names.index(n)] for n in body]
    draws = [keyed.rank1_factors(0, 0, 0, j, shapes) for j in range(k)]
    feeds = {}
    for i, (name, shape) in enumerate(zip(body, shapes)):
        if isinstance(draws[0][i], keyed.Rank1):
            feeds[f"a.{name}"] = np.stack([d[i].a for d in draws]).astype(np.int8)
            feeds[f"b.{name}"] = np.stack([d[i].b for d in draws]).astype(np.int8)
        else:
            feeds[f"z.{name}"] = np.stack([d[i].reshape(shape) for d in draws]).astype(np.int8)
    return body, feeds


def population_setup(
    m: ModelConfig, k: int, noise: Noise, seq_len: int, device: str = "cpu"
) -> tuple[PopulationEvaluator, dict[str, np.ndarray]]:
    """The population session of K directions (the delta rule's decoder gradient on, the default setting)
    and its keyed noise, drawn here: before any clock starts."""
    body, feeds = population_feeds(m, k, noise)
    return PopulationEvaluator(m, k, body, noise, seq_len, decoder_grad=True, device=device), feeds


def population_rate(pop: PopulationEvaluator, feeds: dict[str, np.ndarray], w: np.ndarray, x: np.ndarray, s: float):
    """Forward evaluations per second of one population call (2K + 1 members), the weights and the noise
    fed from the host each call, as the trainer's step feeds them."""
    return (2 * pop.k + 1) * rate(lambda: pop.evaluate(w, feeds, 1e-3, x, x), s)


def _torch_rate(m: ModelConfig, w: np.ndarray, x: np.ndarray, seconds: float) -> float:
    from bench.torch_eager import torch_rate  # imports torch (optional, the bench extra)

    return torch_rate(m, w, x, seconds)


# --- bound sessions (IOBinding): inputs and outputs at fixed addresses on the session's device ----------


def ort_device(device: str) -> tuple[str, int]:
    """Where an OrtValue for a session on `device` lives: (cuda, i) for cuda:i, else the host."""
    cuda_id = devices.parse(device).cuda_id
    return ("cpu", 0) if cuda_id is None else ("cuda", cuda_id)


def resident_loop_rate(ev: LossEvaluator, w: np.ndarray, x: np.ndarray, seconds: float) -> float:
    """The loop with its weights resident on the device: the loss session's inputs bound there once
    (IOBinding), only the loss copied back per call. Every call sees the same weights, where SPSA's probes
    differ, so this is the loop's best case: the baseline of the issue's GPU targets."""
    ort, (kind, dev) = load_ort(), ort_device(ev.device)
    binding = ev.session.io_binding()
    feeds = {"x": x, "y": x, **ev.layout.views(w)}
    held = {n: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), kind, dev) for n, a in feeds.items()}
    for name, value in held.items():
        binding.bind_ortvalue_input(name, value)
    binding.bind_output("loss")

    def one() -> float:
        ev.session.run_with_iobinding(binding)
        return float(binding.copy_outputs_to_cpu()[0])

    return rate(one, seconds)


class BoundPopulation:
    """A population graph's session for one batch size with every input and output at a fixed address on its
    device (IOBinding): a step copies its weights, noise and batch into the same buffers, runs, and copies
    the losses back. CUDA graph capture needs exactly that; with `cuda_graph` the CUDA EP's
    enable_cuda_graph records the first runs' kernels and replays them on each later run."""

    def __init__(self, m: ModelConfig, k: int, noise: Noise, seq_len: int, batch: int, device: str, cuda_graph: bool):
        ort, p = load_ort(), plan(device)
        self.k, self.layout = k, params.layout(m)
        kind, dev = ort_device(device)
        providers = p.providers
        if cuda_graph:
            if kind != "cuda":
                raise ValueError(f"CUDA graph capture needs a CUDA device, not {device!r}")
            providers = [(CUDA, {**cuda_options(dev), "enable_cuda_graph": "1"})]
        body = body_tensors(m)
        graph = build_population(m, k, body, noise, True, seq_len).SerializeToString()
        so = session_options(strict=p.strict)
        self.session = ort.InferenceSession(graph, sess_options=so, providers=providers, enable_fallback=0)
        shapes = {"x": ((batch, seq_len), np.int64), "y": ((batch, seq_len), np.int64), "eps": ((), np.float32)}
        shapes.update({n: (tuple(s), np.float32) for n, s in zip(self.layout.names, self.layout.shapes)})
        shapes.update({i.name: (i.shape, i.dtype) for i in noise_inputs(m, k, body, noise)})
        outs = {"losses": ((2 * k + 1,), np.float32)}
        outs.update(
            {
                f"grad.{n}": (tuple(self.layout.shapes[self.layout.names.index(n)]), np.float32)
                for n in self.layout.decoder
            }
        )
        self.binding = self.session.io_binding()
        self.inputs = {n: ort.OrtValue.ortvalue_from_shape_and_type(s, t, kind, dev) for n, (s, t) in shapes.items()}
        self.outputs = {n: ort.OrtValue.ortvalue_from_shape_and_type(s, t, kind, dev) for n, (s, t) in outs.items()}
        for name, value in self.inputs.items():
            self.binding.bind_ortvalue_input(name, value)
        for name, value in self.outputs.items():
            self.binding.bind_ortvalue_output(name, value)

    def step(self, flat: np.ndarray, noise: dict[str, np.ndarray], eps: float, x: np.ndarray, y: np.ndarray):
        """The losses float32 [2K + 1] (clean, then + and - per direction), as PopulationEvaluator's."""
        feeds = {"x": x, "y": y, "eps": np.array(eps, dtype=np.float32), **self.layout.views(flat), **noise}
        for name, a in feeds.items():
            self.inputs[name].update_inplace(np.ascontiguousarray(a))
        self.session.run_with_iobinding(self.binding)
        return self.outputs["losses"].numpy()


def bound_rate(bp: BoundPopulation, feeds: dict[str, np.ndarray], w: np.ndarray, x: np.ndarray, s: float) -> float:
    """Forward evaluations per second of a bound population step; the first runs (CUDA graph: the
    capture) before the clock."""
    for _ in range(3):
        bp.step(w, feeds, 1e-3, x, x)
    return (2 * bp.k + 1) * rate(lambda: bp.step(w, feeds, 1e-3, x, x), s)


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


def chosen_evaluator(providers: list[str], rates: dict[str, float]) -> str:
    """What `spsa.evaluator = "auto"` trains with on a session whose providers are `providers`: where auto
    measures (an accelerator), the faster of the loop and the full-rank population, a tie to the population,
    as worker/probe.py keeps it; elsewhere evaluator.choose_evaluator's fixed choice (the CPU EP: the loop)."""
    if measures_auto(Evaluator.AUTO, providers):
        return POPULATION if rates[POPULATION] >= rates[loop_row()] else LOOP
    return choose_evaluator(Evaluator.AUTO, providers).value


def verdict(name: str, m: ModelConfig, rates: dict[str, float], providers: list[str]) -> SizeResult:
    chosen = chosen_evaluator(providers, rates)
    torch_r = rates.get(TORCH)
    chosen_rate = rates[POPULATION] if chosen == POPULATION else rates[loop_row()]
    vs_torch = None if torch_r is None else round(chosen_rate / torch_r, 3)
    return SizeResult(name=name, params=params.count(m), chosen=chosen, chosen_vs_torch=vs_torch)


def measured(name: str, rates: dict[str, float]) -> Measured:
    loop, pop = rates[loop_row()], rates[POPULATION]
    return Measured(
        name=name,
        population_vs_loop=round(pop / loop, 3),
        population_beats_loop=pop > loop,
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


def print_verdict(r: SizeResult, f: Measured, providers: list[str]) -> None:
    vs = "-" if r.chosen_vs_torch is None else f"{r.chosen_vs_torch:.2f}x"
    beat = "beat" if f.population_beats_loop else "did not beat"
    print(
        f"{r.name:>4} chosen (spsa.evaluator = auto on {providers[0]}): {r.chosen}, {vs} torch eager; "
        f"the population {beat} the loop here ({f.population_vs_loop:.2f}x)",
        flush=True,
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
    results, figures, overheads = [], [], []
    for name in args.sizes.split(","):
        m = SIZES[name]
        w = params.init(m, 0)
        x = np.random.default_rng(0).integers(0, 256, (shape.batch, shape.seq_len)).astype(np.int64)
        rates = {TORCH: _torch_rate(m, w, x, args.seconds)} if torch_ok else {}
        loops, providers = loop_rates(m, w, x, args.seconds)
        rates.update(loops)
        for ev, noise in ((POPULATION, Noise.BITS), (RANK1, Noise.RANK1)):
            rates[ev] = population_rate(*population_setup(m, shape.k, noise, shape.seq_len), w, x, args.seconds)
        print_rows(name, m, rates, shape, peak)
        results.append(verdict(name, m, rates, providers))
        figures.append(measured(name, rates))
        print_verdict(results[-1], figures[-1], providers)
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
        print(json.dumps({"measured": [asdict(f) for f in figures]}))
        print(json.dumps({"sizes": [asdict(r) for r in results]}))


if __name__ == "__main__":
    main()
