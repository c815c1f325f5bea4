"""The first checks on an NVIDIA box, installing nothing:

    python -m bench.gpu_check [--device cuda:0] [--steps 100] [--audit-steps 8] [--out runs/gpu_check]
                              [--only-throughput | --no-throughput] [--seconds 2] [--budget 450]
                              [--sizes 124K,S,L] [--batches 16,64] [--ks 1,8,64] [--seq-len 128]

1. libraries: onnxruntime-gpu with its CUDA EP, an NVIDIA driver, the CUDA and cuDNN libraries. Each one
   missing is named in one line (what to install beside it), and the check exits 2 before anything runs.
2. placement: every graph a worker opens on its device (kinds lstm and soma: soma_edge.graph's modes loss,
   train, logprobs and stream; the population graph in each noise form, full-rank signs, gaussian and
   rank-1; the update graph soma_edge.resident builds beside it, in each form) opens on a CUDA-only
   session with CPU fallback disabled, and ORT's own placement report puts no node on the CPU; a graph
   that fails is named with the EP its nodes landed on and their op types.
3. numerics: the loss of the CPU EP and of the device agree to within soma_edge.numerics.DELTA (relative),
   for both kinds, at several weights and batches; the decoder gradients' largest difference is reported.
4. a log round: the device trains the demo expert for --steps SPSA steps with federation.reply = "log", and
   the coordinator's own checks accept the log as `coordinator.intake` runs them: the audit recomputes
   --audit-steps sampled steps on the CPU EP (one thread, as the coordinator does), and the replay of the
   log hashes to the weights the device ended at.
5. update bits (no verdict): whether the update graph (soma_edge.update_graph) gives the host's bits on the
   device, for both kinds and each noise form, so that the worker keeps the expert resident there (else it
   keeps the host update and uploads the weights every step), and the demo expert's population steps/s
   both ways: what the host update and the upload cost.
6. throughput (a table; its GPU targets' verdicts do not change the exit status): forward evaluations per
   second at the sizes of bench/spsa_throughput.py (124K, the demo expert; S ~0.9M; L ~7.9M), each B and K,
   about --seconds a cell, of
   - loop: one ORT call per evaluation, the weights fed from the host (runtime.LossEvaluator, the trainer's);
   - loop_resident: the same session with its inputs bound on the device once (IOBinding), the loop's best
     case, and the baseline of the GPU targets ("vs loop" below);
   - population and rank1: one call per step of 2K + 1 members, weights and noise fed from the host;
   - population_resident and rank1_resident (at the targets' B, 16): soma_edge.resident.Resident.step, the
     worker's training path on a device (weights and moments resident, noise drawn on the host and
     uploaded, the update graph on the device), with its host share: the part of a step's wall time
     outside ORT's run calls;
   - population+cuda_graph (CUDA only): full-rank with every input and output at a fixed device address
     and the CUDA EP's enable_cuda_graph, a session per B;
   - clean_forward (at the targets' B): the loss graph (the ONNX LSTM op) on one batch of P*B sequences,
     P = 2K + 1, its inputs bound on the device: the unit of the rank-1 target ("vs clean" below);
   - torch_eager: the torch reference, in a subprocess (bench/torch_eager.py) since torch's CUDA libraries
     may differ from ORT's; without torch, or without CUDA in it, one line says so and there is no row.
   Each row has its ratio to loop_resident and to torch eager at the same size and B, its time per call or
   step over the clean forward's of the same P*B rows, and its device memory: MiB nvidia-smi reports after
   the row less before its session was made (ORT's arena keeps its peak), torch's peak allocated for torch
   rows, n/a off CUDA. Full-rank noise crosses as the keyed bits the trainer sends (K x body / 8 bytes:
   61 MB at L, K = 64); cells whose bits would pass HOST_NOISE (1 GiB, none of the sizes here) are left
   out as one row that says why and what would lift it: the draw would be the step, not the call the row
   times. A cell whose estimated time (--seconds plus
   two calls at the rate last measured at its size: `estimate`) would end more than --budget seconds after
   the script started is a row noted "skipped: time", so one run stays within its time on a lent GPU
   (about 5 minutes for the table on an H100/H200-class GPU by estimate, checks 1-5 about one more); a
   cell that fails (out of memory, say) is a row noted "failed: ...". Then the GPU targets' verdicts,
   PASS, FAIL or not measured, from the rows (bench/gpu_targets.py): the population >= 5x loop_resident at
   K = 8 and >= 15x at K = 64, B = 16; a rank-1 step <= 1.5x one clean forward of its P*B rows; the device
   waiting on the host <= 10% of a resident step. On the CPU EP they are labelled as the CPU's.

Results go to OUT/gpu_check.md and OUT/gpu_check.json (the table as "throughput": rows of name, params, B,
K, evaluator, evals_per_s, vs_loop, vs_torch, vs_clean, host_share, memory, note; "throughput_notes"; and
"targets": target, verdict, detail, cpu, figures). Exit 0 when every check passes, 1 when one fails, 2
when a library is missing. `--device cpu` runs checks 2-6 with the CPU EP standing in for the GPU: the
test suite runs it so, to keep this script working on boxes without one (its figures then say nothing
about a GPU).
"""

from __future__ import annotations

import argparse
import enum
import functools
import gc
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench import gpu_targets
from bench.common import ROOT, machine, md_head, md_row, say
from bench.spsa_throughput import (
    SIZES,
    BoundPopulation,
    Shape,
    bound_rate,
    loop_rate,
    ort_device,
    population_rate,
    population_setup,
    resident_loop_rate,
)
from coordinator import replay
from soma_edge import devices, params, protocol, runtime, spsa, steps
from soma_edge.config import Config, ModelConfig, SPSAConfig
from soma_edge.devices import CPU, CUDA
from soma_edge.errors import DeviceError
from soma_edge.graph import MODES, build
from soma_edge.numerics import DELTA
from soma_edge.population import graph_noise
from soma_edge.population_graph import Noise
from soma_edge.spsa import State, record_log
from worker.doctor import DEMO_MODEL
from worker.trainer import train

KINDS = {"lstm": DEMO_MODEL, "soma": ModelConfig(kind="soma", embed=64, hidden=64, layers=2)}
SAMPLES = 3  # weights and batches per kind in the numerics check
# spsa settings whose noise crosses in each form a worker uses: dense and sparse Rademacher bits, Gaussian, rank-1
PROBE_SETTINGS = (
    {"density": 1.0},
    {"density": 0.5},
    {"noise": "gaussian", "density": 1.0},
    {"noise": "rank1", "density": 1.0},
)
HOST_NOISE = 1 << 30  # full-rank throughput cells whose keyed bits (K x body / 8 bytes) are larger are skipped


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    figures: dict = field(default_factory=dict)


def missing_libraries(device: str) -> list[str]:
    """One line per missing piece that `device` needs; empty when it can run here."""
    try:
        ort = runtime.load_ort()
    except DeviceError as e:
        return [str(e)]
    d = devices.parse(device)
    if d.cuda_id is None:
        return []
    out = []
    if CUDA not in ort.get_available_providers():
        out.append(f"this onnxruntime ({runtime.ort_package()}) has no CUDA EP: {runtime.INSTALL_CUDA}")
        return out
    if not devices.gpus():
        out.append("no NVIDIA GPU or driver found (nvidia-smi, /proc/driver/nvidia): install a driver for CUDA 13")
    libs = runtime.cuda_libraries()
    for what, why in (("CUDA 13", libs.cuda), ("cuDNN 9", libs.cudnn)):
        if why:
            out.append(f"{what} does not load ({why}): {runtime.INSTALL_CUDA} brings it")
    return out


PLACEMENT_K, PLACEMENT_T = 2, 2  # the ops do not depend on K or T (T = 2: a step that reads the last one)


def expert_graphs():
    """(label, graph) for every graph a worker opens on its device, both kinds: soma_edge.graph's modes; the
    population graph in each noise form, its decoder gradient on and the body perturbed, as
    soma_edge.population.for_config builds it for the delta rule; and the update graph soma_edge.resident
    builds beside it (the default Adam update, k = spsa.directions * spsa.accumulate)."""
    from soma_edge.population_graph import build_population  # imports onnx (heavy), as graph does
    from soma_edge.update_graph import build_update  # as above

    for kind, m in KINDS.items():
        for mode in MODES:
            yield f"{kind}/{mode}", build(m, mode)
        lay = params.layout(m)
        body = [n for n in lay.names if n not in lay.decoder]
        for probes in PROBE_SETTINGS:  # each form a worker's noise crosses in (population.graph_noise)
            setting = SPSAConfig(directions=PLACEMENT_K, **probes)
            noise = graph_noise(setting)
            yield f"{kind}/population {noise.value}", build_population(m, PLACEMENT_K, body, noise, True, PLACEMENT_T)
            yield f"{kind}/update {noise.value}", build_update(m, setting, PLACEMENT_K, body, noise, True)


def placement_check(device: str) -> Check:
    """Every expert graph (expert_graphs) opens strict on `device`, and ORT places none of its nodes on
    another EP; a graph that does not is named with the EP and the op types its nodes landed on."""
    plan = runtime.plan(device)
    off, n = [], 0
    for label, model in expert_graphs():
        n += 1
        try:
            runtime.make_session(model, device, threads=1)
        except DeviceError as e:
            off.append(f"{label}: {e}")
            continue
        placed = runtime.placement(model, plan.providers + ([] if CPU in plan.providers else [CPU]))
        if not placed:
            off.append(f"{label}: no placement report")
        for ep, p in placed.items():
            if ep != plan.first:
                off.append(f"{label}: {p.count} node(s) on {ep} ({', '.join(p.ops) or 'ops not listed'})")
    detail = f"{n} graphs, every node on {plan.first}" if not off else "; ".join(off)
    return Check("placement", not off, detail, {"graphs": n, "off_device": off})


def numerics_check(device: str, data: np.ndarray) -> Check:
    """CPU EP against `device`: the largest relative loss difference, and the decoder gradients'."""
    worst_loss, worst_grad = 0.0, 0.0
    for m in KINDS.values():
        cfg = Config(model=m)
        cpu = runtime.LossEvaluator(m, "cpu", threads=1, parallel=1, decoder_grad=True)
        dev = runtime.LossEvaluator(m, device, parallel=1, decoder_grad=True)
        rng = np.random.default_rng(0)
        for i in range(SAMPLES):
            w = params.init(m, i) + rng.normal(0, 0.02, params.count(m)).astype(np.float32)
            x, y = _batch(data, cfg, rng)
            a, b = cpu.loss(w, x, y), dev.loss(w, x, y)
            worst_loss = max(worst_loss, abs(a - b) / abs(a))
            (_, ga), (_, gb) = cpu.clean(w, x, y), dev.clean(w, x, y)
            worst_grad = max(worst_grad, float(np.max(np.abs(ga - gb))))
    ok = worst_loss <= DELTA
    detail = f"largest relative loss difference {worst_loss:.2e} (δ = {DELTA:g}); decoder gradients {worst_grad:.2e}"
    return Check("numerics", ok, detail, {"loss_rel": worst_loss, "decoder_grad_abs": worst_grad, "delta": DELTA})


def _batch(data: np.ndarray, cfg: Config, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    b, t = cfg.data.batch, cfg.data.seq_len
    starts = rng.integers(0, len(data) - t - 1, size=b)
    win = np.stack([data[s : s + t + 1] for s in starts]).astype(np.int64)
    return win[:, :-1], win[:, 1:]


def log_round_check(device: str, data: np.ndarray, n_steps: int, audit_steps: int) -> Check:
    """The device trains; the coordinator's audit and replay, on the CPU EP, must accept its log."""
    cfg = Config(model=DEMO_MODEL, device=device)
    cfg.federation.reply, cfg.federation.audit_steps = protocol.ReplyMode.LOG, audit_steps
    base = State(params.init(cfg.model, cfg.seed))
    state = State(base.weights.copy())
    rep = train(state, data, cfg, runtime.evaluator_for(cfg), steps=n_steps)
    log = record_log(base.step, state.opt.lr_scale, rep.grads, state, steps.log_body(cfg))
    figures = {"steps": rep.steps, "steps_per_s": rep.steps_per_s, "train_loss": rep.loss}
    auditor = runtime.evaluator_for(cfg, "cpu", threads=1, spin=False, parallel=1)
    picks = replay.sample_steps(log.steps, audit_steps, cfg.seed, 0, 1)
    try:
        replay.audit(cfg, base, log, 0, data, auditor, picks)
        got = replay.rebuild(cfg, base, log, 0)
    except Exception as e:  # the coordinator's refusal, said as it would say it
        return Check("log round", False, f"refused: {e}", figures)
    same = protocol.weights_sha256(got.weights) == protocol.weights_sha256(state.weights)
    detail = f"{rep.steps} steps at {rep.steps_per_s:.1f} steps/s; audit of steps {picks} passed; " + (
        "the replay hashes to the device's weights" if same else "the replay hashes to OTHER weights"
    )
    return Check("log round", same, detail, {**figures, "audited": picks})


UPDATE_SETTINGS = {"default": {}, "rank1": {"noise": "rank1", "density": 1.0}, "decoder spsa": {"decoder": "spsa"}}


def update_check(device: str, data: np.ndarray, seconds: float = 2.0) -> Check:
    """Whether the update graph gives the host's bits on `device` (soma_edge.resident.Resident.verified),
    for both kinds and each noise form; where it does, the worker keeps the expert resident there, else it
    keeps the host update and feeds the weights every step. Then what that costs: the demo expert's
    population steps/s, resident and with the host update, for `seconds` each. No verdict on that (either
    way the weights are right): the detail says which happened. Last, CUDA graph capture (`capture_arm`):
    it fails the check if captured steps give other bits than plain resident calls."""
    from soma_edge import resident, update_graph

    same = {}
    for kind, m in KINDS.items():
        for name, setting in UPDATE_SETTINGS.items():
            cfg = Config(model=m, device=device)
            # The update graph does not depend on T; a short population graph opens in a fraction of the time.
            cfg.spsa.evaluator, cfg.data.seq_len = "population", 2
            for key, value in setting.items():
                setattr(cfg.spsa, key, value)
            ev = runtime.evaluator_for(cfg, device)
            same[f"{kind}, {name}"] = resident.Resident(cfg, 0, ev.population, State(params.init(m, 0))).verified()
    cfg = Config(model=DEMO_MODEL, device=device)
    cfg.spsa.evaluator = "population"
    ev = runtime.evaluator_for(cfg, device)
    rates = {}
    for where in ("resident", "host update"):
        state = State(params.init(cfg.model, cfg.seed))
        real = update_graph.supported
        if where == "host update":  # what a device whose bits differ runs: the Stepper's host update
            update_graph.supported = lambda s: "measured on the host"
        try:
            train(state, data, cfg, ev, steps=2)  # warm-up: sessions allocate on the first runs
            rates[where] = train(state, data, cfg, ev, seconds=seconds).steps_per_s
        finally:
            update_graph.supported = real
    on_device = all(same.values())
    cost = 1 / rates["host update"] - 1 / rates["resident"]
    detail = (
        (
            "the update runs on the device: its bits equal the host's"
            if on_device
            else "bits DIFFER from the host's "
            f"({sorted(k for k, v in same.items() if not v)}): the update stays on the host"
        )
        + f"; demo expert, population steps/s: resident {rates['resident']:.1f}, host update "
        f"{rates['host update']:.1f} (the host update and the weights' upload cost {1000 * cost:.2f} ms a step)"
    )
    capture = capture_arm(device, data, seconds) if on_device else {"ran": False, "same_bits": True}
    if capture["ran"]:
        detail += f"; {capture['line']}"
    figures = {"same_bits": same, "steps_per_s": rates, "host_cost_s": cost, "capture": capture}
    return Check("update bits", capture["same_bits"], detail, figures)


def capture_arm(device: str, data: np.ndarray, seconds: float, n_steps: int = 12) -> dict:
    """CUDA graph capture of resident steps (soma_edge.capture), demo expert: `n_steps` steps captured and
    `n_steps` plain from the same state must give the same bits; then each one's steps/s for `seconds`. On
    the CPU EP the fixed-address calls run uncaptured (what is measured is their bookkeeping)."""
    from soma_edge import resident

    cfg = Config(model=DEMO_MODEL, device=device)
    cfg.spsa.evaluator = "population"
    out: dict = {"ran": True}
    weights, rates = {}, {}
    for arm, capture in (("captured", True), ("plain", False)):
        ev = runtime.evaluator_for(cfg, device)  # its own sessions: capture keeps buffers on the evaluator
        state = State(params.init(cfg.model, cfg.seed))
        runner = resident.Resident(cfg, 0, ev.population, state, capture=capture)
        for t in range(n_steps):
            runner.step(steps.batches(data, cfg, 0, t))
        out[f"{arm}_active"] = runner.captured is not None
        weights[arm] = runner.download().weights.copy()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds or n == 0:
            runner.step(steps.batches(data, cfg, 0, n_steps + n))
            n += 1
        rates[arm] = n / (time.perf_counter() - t0)
    out["same_bits"] = bool(np.array_equal(weights["captured"].view(np.uint32), weights["plain"].view(np.uint32)))
    out["steps_per_s"] = rates
    how = "captured" if device.startswith("cuda") and out["captured_active"] else "fixed buffers, uncaptured"
    if not out["captured_active"]:
        how = "capture refused, ran uncaptured"
    out["line"] = (
        f"CUDA graph capture ({how}): {'same bits' if out['same_bits'] else 'bits DIFFER'} as plain resident "
        f"calls after {n_steps} steps; steps/s {rates['captured']:.1f} vs {rates['plain']:.1f} plain "
        f"({rates['captured'] / rates['plain']:.2f}x)"
    )
    return out


def corpus_bytes(limit: int = 1 << 21) -> np.ndarray:
    """Text to train on without a network: this Python's own standard library sources."""
    chunks, size = [], 0
    for p in sorted(Path(os.__file__).parent.glob("*.py")):
        chunks.append(p.read_bytes())
        size += len(chunks[-1])
        if size >= limit:
            break
    return np.frombuffer(b"".join(chunks)[:limit], dtype=np.uint8)


# --- 6. throughput -------------------------------------------------------------------------------------


class Evaluator(str, enum.Enum):
    """A row of the throughput table: what evaluates the losses."""

    LOOP = "loop"  # one ORT call per evaluation, the weights fed from the host (the trainer's loop)
    LOOP_RESIDENT = "loop_resident"  # the same, its inputs bound on the device once: the loop's best case
    POPULATION = "population"  # one call per step (2K + 1 members), full-rank keyed bits fed from the host
    RESIDENT = "population_resident"  # full-rank: Resident.step, the worker's training path on a device
    CUDA_GRAPH = "population+cuda_graph"  # full-rank, every input at a fixed device address, replayed
    RANK1 = "rank1"  # the population with rank-1 probes
    RANK1_RESIDENT = "rank1_resident"  # Resident.step with rank-1 probes
    CLEAN = "clean_forward"  # the loss graph on one batch of P*B sequences, bound: the rank-1 target's unit
    TORCH = "torch_eager"  # the torch reference expert, one forward per evaluation, in a subprocess


@dataclass
class Row:
    """One cell of the throughput table: `evals_per_s` forward evaluations per second (a population call,
    a resident step and a clean forward of P*B rows each count P = 2K + 1), None when skipped or failed
    (`note` says which); `vs_loop` its ratio to loop_resident, `vs_torch` to torch eager; `vs_clean` its
    time per call or step over the clean forward's of the same P*B rows; `host_share` (resident rows) the
    share of a step outside ORT's run calls; `memory` in MiB (module docstring); None where not measured."""

    name: str
    params: int
    B: int | None  # None: one line that stands for every B (full-rank over the host-noise cap)
    K: int | None  # None: a row whose rate does not depend on K (the loop, torch)
    evaluator: Evaluator
    evals_per_s: float | None = None
    vs_loop: float | None = None
    vs_torch: float | None = None
    vs_clean: float | None = None
    host_share: float | None = None
    memory: int | None = None
    note: str = ""


@dataclass
class Table:
    """What the throughput table measures, and until when (a time.perf_counter() deadline); `verdicts`, the
    GPU targets' (bench.gpu_targets), once it has measured."""

    sizes: list[str]
    batches: list[int]
    ks: list[int]
    seq_len: int
    seconds: float
    deadline: float
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    verdicts: list[gpu_targets.Verdict] = field(default_factory=list)

    @property
    def target_b(self) -> int:
        """The B of the targets' rows (resident steps, clean forwards): theirs, else the first measured."""
        return gpu_targets.TARGET_B if gpu_targets.TARGET_B in self.batches else self.batches[0]


def gpu_memory_mib(device: str) -> int | None:
    """The device's used memory in MiB (nvidia-smi, every process's); None off CUDA or without nvidia-smi.
    nvidia-smi's index is taken as CUDA's: true on a one-GPU box, which is what this check is for."""
    cuda_id = devices.parse(device).cuda_id
    if cuda_id is None:
        return None
    cmd = ["nvidia-smi", f"--id={cuda_id}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    try:
        return int(subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout.strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


# Where a row with no measured row of its own evaluator at its size takes the price of a call from.
_BASIS = {
    Evaluator.CLEAN: Evaluator.LOOP_RESIDENT,
    Evaluator.RESIDENT: Evaluator.POPULATION,
    Evaluator.RANK1_RESIDENT: Evaluator.RANK1,
    Evaluator.CUDA_GRAPH: Evaluator.POPULATION,
}


def estimate(t: Table, row: Row) -> float:
    """Seconds a cell would take: --seconds of measuring plus two of its calls (the warm-up, and the last
    one, which starts before the time is up and ends after it). A call is priced per member-row (B
    sequences through one member) at the latest row measured of its evaluator at its size, else of its
    basis (_BASIS), else of any evaluator there, else at the latest size measured scaled by parameters; a
    first cell at --seconds alone."""
    done = [r for r in t.rows if r.evals_per_s and r.B and r.evaluator is not Evaluator.TORCH]
    for pick in (
        lambda r: r.name == row.name and r.evaluator is row.evaluator,
        lambda r: r.name == row.name and r.evaluator is _BASIS.get(row.evaluator),
        lambda r: r.name == row.name,
        lambda r: True,
    ):
        got = [r for r in done if pick(r)]
        if got:
            per_row = row.params / (got[-1].evals_per_s * got[-1].B * got[-1].params)
            return t.seconds + 2 * per_row * _members(row) * (row.B or 1)
    return t.seconds


def _members(row: Row) -> int:
    return 1 if row.K is None else 2 * row.K + 1


def _fits(t: Table, row: Row) -> str:
    """No note when the cell's estimate ends before the deadline, else the note that skips it."""
    left, need = t.deadline - time.perf_counter(), estimate(t, row)
    return "" if need <= left else f"skipped: time (needs ~{need:.1f} s, {max(left, 0.0):.1f} s left)"


def _cell(t: Table, row: Row, device: str, base: int | None, measure) -> None:
    """Measure one row (unless its estimate would overrun the deadline), its memory as the device's use now
    less `base`, the use before its session was made: ORT's arena keeps what a session's runs needed at most."""
    t.rows.append(row)
    row.note = _fits(t, row)
    if row.note:
        say(f"  {row.name} B={row.B} K={row.K or '-'} {row.evaluator.value}: {row.note}")
        return
    try:
        row.evals_per_s = measure()
    except Exception as e:  # one cell failing (out of memory, an EP refusing) must not lose the table
        row.note = _failed(e)
    now = gpu_memory_mib(device)
    row.memory = None if now is None or base is None else now - base
    got = row.note if row.evals_per_s is None else f"{row.evals_per_s:.1f} evals/s"
    say(f"  {row.name} B={row.B} K={row.K or '-'} {row.evaluator.value}: {got}")


def _failed(e: Exception) -> str:
    return f"failed: {type(e).__name__}: {' '.join(str(e).split())[:200]}"


def _torch_rows(t: Table, device: str) -> None:
    """torch eager in its own process (its CUDA libraries must not load into this one): one row per size and
    B, or one note saying why there are none."""
    cmd = [sys.executable, "-m", "bench.torch_eager", "--device", device, "--sizes", ",".join(t.sizes)]
    cmd += ["--batches", ",".join(map(str, t.batches)), "--seq-len", str(t.seq_len), "--seconds", str(t.seconds)]
    left = t.deadline - time.perf_counter()
    if left < t.seconds:  # no cell of it would fit: no process to start
        for name in t.sizes:
            n = params.count(SIZES[name])
            _skip(t, [Row(name, n, b, None, Evaluator.TORCH) for b in t.batches], "skipped: time")
        return
    try:
        r = subprocess.run(
            cmd + ["--budget", f"{max(left, 0):.1f}"], capture_output=True, text=True, cwd=ROOT, timeout=left + 60
        )
        got = json.loads(r.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as e:
        why = (r.stderr.strip().splitlines() or ["no output"])[-1] if isinstance(e, ValueError | IndexError) else e
        t.notes.append(f"torch eager reference: skipped, its subprocess gave no result ({why})")
        return
    if got["skipped"]:
        t.notes.append(f"{got['skipped']}: no torch row, no ratio to it")
        return
    t.notes.append(f"torch eager: torch {got['torch']}, in a subprocess; memory = torch's peak allocated MiB")
    for g in got["rows"]:
        n = params.count(SIZES[g["name"]])
        t.rows.append(
            Row(g["name"], n, g["batch"], None, Evaluator.TORCH, g["evals_per_s"], memory=g["memory"], note=g["note"])
        )


def _skip(t: Table, rows: list[Row], note: str) -> None:
    for r in rows:
        r.note = note
    t.rows += rows


def _open(t: Table, rows: list[Row], device: str, make):
    """(make(), the device's memory use before it) for a session that `rows` measure; None, with the rows
    noted skipped, when its first cell would not fit before the deadline or it cannot be made."""
    late = _fits(t, rows[0])
    if late:
        _skip(t, rows, late)
        return None
    base = gpu_memory_mib(device)
    try:
        return make(), base
    except Exception as e:  # as in _cell: an EP refusing the graph, or the device out of memory
        _skip(t, rows, _failed(e))
        return None


def _loop_rows(t: Table, name: str, m: ModelConfig, device: str, w: np.ndarray):
    """The loop's rows at every B; (its session, the memory before it) for the clean forwards, or None."""
    evs = (Evaluator.LOOP, Evaluator.LOOP_RESIDENT)
    rows = [Row(name, params.count(m), b, None, e) for b in t.batches for e in evs]
    opened = _open(t, rows, device, lambda: runtime.LossEvaluator(m, device, parallel=1))
    if opened is None:
        return None
    ev, base = opened
    for row in rows:
        fn = loop_rate if row.evaluator is Evaluator.LOOP else resident_loop_rate
        _cell(t, row, device, base, functools.partial(fn, ev, w, _ids(row.B, t.seq_len), t.seconds))
    return opened


def _too_big(m: ModelConfig, k: int) -> bool:
    """Full-rank noise the host cannot draw in step with the device: K directions' keyed bits over HOST_NOISE."""
    return k * spsa.bits_bytes(params.layout(m).body) > HOST_NOISE


def _host_noise_row(name: str, m: ModelConfig, k: int) -> Row:
    """The one line that stands for every full-rank row the host-noise cap leaves out at this size and K."""
    each = spsa.bits_bytes(params.layout(m).body)
    note = (
        f"skipped: host noise: full-rank at K = {k} draws K directions' keyed bits on the host each step, "
        f"{k * each / (1 << 30):.2f} GiB > {HOST_NOISE / (1 << 30):g} GiB: the draw would be what the row times "
        "(population, population_resident, population+cuda_graph: every B). Lifted by a host draw under the "
        f"cap (K <= {HOST_NOISE // each} at this size)"
    )
    return Row(name, params.count(m), None, k, Evaluator.POPULATION, note=note)


def _population_rows(t: Table, name: str, m: ModelConfig, device: str, w: np.ndarray, k: int, loss) -> None:
    """Full-rank, then rank-1, at K: one session each for every B, then its resident training step at the
    targets' B (same session); (CUDA) full-rank under CUDA graph capture, a session per B (a captured graph
    has fixed shapes); last the clean forward of the targets' P*B rows on the loop's session `loss`."""
    n = params.count(m)
    for ev, noise, res in (
        (Evaluator.POPULATION, Noise.BITS, Evaluator.RESIDENT),
        (Evaluator.RANK1, Noise.RANK1, Evaluator.RANK1_RESIDENT),
    ):
        if noise is Noise.BITS and _too_big(m, k):
            t.rows.append(_host_noise_row(name, m, k))
            continue
        rows = [Row(name, n, b, k, ev) for b in t.batches]
        feeds = _session_rows(t, rows, Row(name, n, t.target_b, k, res), m, device, w, noise)
        if noise is Noise.BITS and ort_device(device)[0] == "cuda":
            for row in [Row(name, n, b, k, Evaluator.CUDA_GRAPH) for b in t.batches]:
                if feeds is None:  # the population's session was not made: skipped for time, or failed
                    _skip(t, [row], rows[0].note)
                else:
                    _cuda_graph_cell(t, row, m, device, w, feeds)
    clean = Row(name, n, t.target_b, k, Evaluator.CLEAN)
    if loss is None:  # the loop's session was not made: as its rows, skipped for time, or failed
        _skip(t, [clean], next(r.note for r in t.rows if (r.name, r.evaluator) == (name, Evaluator.LOOP_RESIDENT)))
        return
    p, x = 2 * k + 1, _ids((2 * k + 1) * t.target_b, t.seq_len)
    _cell(t, clean, device, loss[1], lambda: p * resident_loop_rate(loss[0], w, x, t.seconds))


def _session_rows(t: Table, rows: list[Row], res: Row, m: ModelConfig, device: str, w: np.ndarray, noise: Noise):
    """One population session's rows (B is free in its graph), then `res`: Resident.step on that session,
    as a worker trains (bench.gpu_targets); the noise the rows were fed, None when no session was made."""
    opened = _open(t, rows + [res], device, lambda: population_setup(m, rows[0].K, noise, t.seq_len, device))
    if opened is None:
        return None
    (pop, feeds), base = opened
    for row in rows:
        _cell(
            t, row, device, base, functools.partial(population_rate, pop, feeds, w, _ids(row.B, t.seq_len), t.seconds)
        )
    x = _ids(res.B, t.seq_len)
    _cell(t, res, device, base, functools.partial(_resident_rate, pop, res, noise, m, device, w, x, t.seconds))
    del pop, opened
    gc.collect()  # the session's device memory goes before the next baseline
    return feeds


def _resident_rate(pop, res: Row, noise: Noise, m: ModelConfig, device: str, w, x, seconds: float) -> float:
    """Evaluations/s of Resident.step on `pop` (bench.gpu_targets), its host share written into `res`."""
    cfg = gpu_targets.resident_config(m, res.K, noise, x, device)
    got = gpu_targets.resident_timing(pop, cfg, w, x, seconds)
    res.host_share = round(got.host_share, 4)
    return _members(res) * got.steps_per_s


def _cuda_graph_cell(t: Table, row: Row, m: ModelConfig, device: str, w: np.ndarray, feeds: dict) -> None:
    base, x = gpu_memory_mib(device), _ids(row.B, t.seq_len)
    held = []  # the session, alive until _cell has read the memory it holds

    def measure() -> float:
        held.append(BoundPopulation(m, row.K, Noise.BITS, t.seq_len, row.B, device, cuda_graph=True))
        return bound_rate(held[0], feeds, w, x, t.seconds)

    _cell(t, row, device, base, measure)
    held.clear()
    gc.collect()


def _ids(batch: int, seq_len: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (batch, seq_len)).astype(np.int64)


def _ratios(rows: list[Row]) -> None:
    by = {(r.name, r.B, r.evaluator): r.evals_per_s for r in rows if r.K is None}
    clean = {(r.name, r.B, r.K): r.evals_per_s for r in rows if r.evaluator is Evaluator.CLEAN}
    for r in rows:
        if r.evals_per_s is None:
            continue
        loop, torch_r = by.get((r.name, r.B, Evaluator.LOOP_RESIDENT)), by.get((r.name, r.B, Evaluator.TORCH))
        r.vs_loop = round(r.evals_per_s / loop, 3) if loop else None
        r.vs_torch = round(r.evals_per_s / torch_r, 3) if torch_r else None
        c = clean.get((r.name, r.B, r.K))
        if c and r.evaluator is not Evaluator.CLEAN:  # both count P evaluations a call: time over time
            r.vs_clean = round(c / r.evals_per_s, 3)


def throughput(device: str, t: Table) -> Table:
    """The table: torch eager first (the reference of every row), then per size the loop, and per K the
    population and rank-1 (each with its resident step), (CUDA) the population under CUDA graph capture
    and the clean forward of P*B rows; then the GPU targets' verdicts. A cell whose estimate would end past
    the deadline is a row noted "skipped: time"."""
    _torch_rows(t, device)
    warm = runtime.LossEvaluator(DEMO_MODEL, device, parallel=1)  # the device's context before any baseline
    warm.loss(params.init(DEMO_MODEL, 0), _ids(1, 8), _ids(1, 8))
    for name in t.sizes:
        m = SIZES[name]
        w = params.init(m, 0)
        loss = _loop_rows(t, name, m, device, w)
        for k in t.ks:
            _population_rows(t, name, m, device, w, k, loss)
        del loss
        gc.collect()
    if any(r.note.startswith("skipped: time") for r in t.rows):
        t.notes.append(
            "skipped: time: the cell would end after --budget by its estimate (--seconds, plus two calls at "
            "the rate last measured at its size)"
        )
    if ort_device(device)[0] != "cuda":
        t.notes.append(f"population+cuda_graph: not measured (CUDA only; device {device})")
    _ratios(t.rows)
    t.rows.sort(key=lambda r: t.sizes.index(r.name))  # torch's rows, measured first, beside their size's
    cpu = ort_device(device)[0] != "cuda"
    t.verdicts = gpu_targets.verdicts(t.rows, t.sizes, t.ks, t.target_b, cpu)
    return t


def _fmt(v: float | None, spec: str, unit: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{unit}"


def throughput_md(t: Table) -> str:
    head = (
        f"## Throughput\n\nForward evaluations per second (a population call, a resident step and a clean "
        f"forward of P*B rows each count P = 2K + 1), T = {t.seq_len}, about {t.seconds:g} s a cell. vs loop: "
        "against loop_resident (the loop with its inputs bound on the device once, the GPU targets' baseline) "
        "at the same size and B. vs clean: time per call or step over that of one clean forward of the same "
        "P*B rows (clean_forward). host: the share of a resident step outside ORT's run calls. memory: MiB "
        "the device used after the row less before its session (nvidia-smi; ORT's arena keeps its peak), "
        "torch's peak allocated for torch rows, n/a off CUDA.\n\n"
    )
    cols = ["size", "params", "B", "K", "evaluator", "evals/s", "vs loop", "vs torch", "vs clean", "host"]
    cols += ["memory MiB", "note"]
    rows = [
        md_row(
            [
                r.name,
                f"{r.params:,}",
                "-" if r.B is None else str(r.B),
                "-" if r.K is None else str(r.K),
                r.evaluator.value,
                _fmt(r.evals_per_s, ".1f"),
                _fmt(r.vs_loop, ".2f", "x"),
                _fmt(r.vs_torch, ".2f", "x"),
                _fmt(r.vs_clean, ".2f", "x"),
                _fmt(None if r.host_share is None else 100 * r.host_share, ".0f", "%"),
                "n/a" if r.memory is None else str(r.memory),
                r.note,
            ]
        )
        for r in t.rows
    ]
    notes = "".join(f"\n- {n}" for n in t.notes)
    return head + md_head(cols) + "\n" + "\n".join(rows) + "\n" + (notes + "\n" if notes else "") + targets_md(t)


def targets_md(t: Table) -> str:
    """The GPU targets' verdict lines (bench.gpu_targets), said to be the CPU EP's where it stood in."""
    if not t.verdicts:
        return ""
    cpu = any(v.cpu for v in t.verdicts)
    head = "\n## GPU targets\n\n" + (
        "Measured on the CPU EP standing in for the GPU: the verdicts are the CPU's, not the GPU targets'.\n\n"
        if cpu
        else ""
    )
    return head + "".join(f"- {v.line()}\n" for v in t.verdicts)


def write(out: Path, device: str, checks: list[Check], table: Table | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    md = f"# GPU check on {device}\n\n{machine()}; onnxruntime {runtime.ort_package()}\n\n"
    if checks:
        md += md_head(["check", "result", "detail"]) + "\n"
        md += "\n".join(md_row([c.name, "pass" if c.ok else "FAIL", c.detail]) for c in checks) + "\n\n"
    if table is not None:
        md += throughput_md(table)
    (out / "gpu_check.md").write_text(md)
    record = {"device": device, "machine": machine(), "ok": all(c.ok for c in checks)}
    record["checks"] = [asdict(c) for c in checks]
    if table is not None:
        record["throughput"] = [asdict(r) for r in table.rows]
        record["throughput_notes"] = table.notes
        record["targets"] = [asdict(v) for v in table.verdicts]
    (out / "gpu_check.json").write_text(json.dumps(record, indent=1, default=float) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0", help="cuda:i, or cpu to dry-run checks 2-6 on the CPU EP")
    ap.add_argument("--steps", type=int, default=100, help="SPSA steps of the log round")
    ap.add_argument("--audit-steps", type=int, default=8, help="steps the coordinator's audit recomputes")
    ap.add_argument("--out", type=Path, default=Path("runs/gpu_check"), help="where the .md and .json go")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--only-throughput", action="store_true", help="run the throughput table alone (check 6)")
    which.add_argument("--no-throughput", action="store_true", help="run checks 1-5 only")
    ap.add_argument(
        "--seconds",
        type=float,
        default=2.0,
        help="measuring time per throughput cell (and per arm of the update check)",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=450.0,
        help="seconds from the start by which every cell must end, by its estimate",
    )
    ap.add_argument("--sizes", default="124K,S,L", help=f"throughput sizes, of {','.join(SIZES)}")
    ap.add_argument("--batches", default="16,64", help="throughput batch sizes B")
    ap.add_argument("--ks", default="1,8,64", help="throughput directions per step K")
    ap.add_argument("--seq-len", type=int, default=Shape.seq_len, help="throughput sequence length T")
    a = ap.parse_args(argv)
    start = time.perf_counter()
    missing = missing_libraries(a.device)
    if missing:
        for line in missing:
            print(f"error: {line}", file=sys.stderr)
        return 2
    data = corpus_bytes()
    checks = []
    for name, run in (
        ()
        if a.only_throughput
        else (
            ("placement", lambda: placement_check(a.device)),
            ("numerics", lambda: numerics_check(a.device, data)),
            ("log round", lambda: log_round_check(a.device, data, a.steps, a.audit_steps)),
            ("update bits", lambda: update_check(a.device, data, a.seconds)),
        )
    ):
        t0 = time.perf_counter()
        say(f"{name} ...")
        checks.append(run())
        say(f"{name}: {'pass' if checks[-1].ok else 'FAIL'} ({time.perf_counter() - t0:.1f} s): {checks[-1].detail}")
    table = None
    if not a.no_throughput:
        say("throughput ...")
        sizes, batches, ks = (
            a.sizes.split(","),
            [int(b) for b in a.batches.split(",")],
            [int(k) for k in a.ks.split(",")],
        )
        table = throughput(a.device, Table(sizes, batches, ks, a.seq_len, a.seconds, start + a.budget))
        say(f"throughput: {len(table.rows)} rows ({time.perf_counter() - start:.0f} s since the start)")
        for v in table.verdicts:
            say(f"target: {v.line()}")
    write(a.out, a.device, checks, table)
    print((a.out / "gpu_check.md").read_text(), end="")
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
