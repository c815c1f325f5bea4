"""bench/gpu_check.py's correctness checks, in the order a first GPU run settles them. Each is time-boxed:
it takes `until` (a time.perf_counter() deadline) and, where it runs out before it can settle, returns its
Check `skipped` for "time" (the run then exits non-zero) with what it had seen.

1. libraries (`missing_libraries`): onnxruntime-gpu with its CUDA EP, an NVIDIA driver, the CUDA and cuDNN
   libraries; each one missing is named in one line.
2. placement: every graph a worker opens on its device (kinds lstm and soma: soma_edge.expert.graph's modes; the
   population graph in each noise form; the update graph beside it, in each form) opens on a session of the
   device alone with CPU fallback disabled, and ORT's own placement report puts no node elsewhere.
3. numerics: the loss of the CPU EP and of the device agree within soma_edge.engine.numerics.DELTA (relative), for
   both kinds, at several weights and batches; the decoder gradients' largest difference is reported.
4. log round: the device trains the demo expert with federation.reply = "log"; the coordinator's own
   checks accept the log: the audit recomputes sampled steps on the CPU EP, and the replay of the log
   hashes to the weights the device ended at.
5. update bits (no verdict): whether the update graph gives the host's bits on the device, for both kinds
   and each noise form (where it does, a worker keeps the expert resident there), and the demo expert's
   population steps/s resident and with the host update.
6. capture: resident steps under CUDA graph capture against the same steps plain: their losses agree within
   DELTA, and the captured run's update log replays on the host to the captured weights bit for bit.
   Whether the captured and plain weights are the same bits is reported, not judged: a captured graph runs
   on its own stream with its own cuBLAS workspace, and cuBLAS promises identical bits only on one stream.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench.gpu_report import Check
from coordinator import replay
from soma_edge import devices
from soma_edge.config import Config, ModelConfig, SPSAConfig
from soma_edge.devices import CPU, CUDA
from soma_edge.engine import evaluator as evaluators
from soma_edge.engine import resident, runtime
from soma_edge.engine.numerics import DELTA
from soma_edge.engine.population import graph_noise
from soma_edge.errors import DeviceError
from soma_edge.expert import params, steps, update_graph
from soma_edge.expert.graph import MODES, build
from soma_edge.expert.population_graph import build_population
from soma_edge.expert.update_graph import build_update
from soma_edge.spsa.log import record_log
from soma_edge.spsa.optim import State
from soma_edge.spsa.stepper import StepResult
from soma_edge.wire import protocol
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
PLACEMENT_K, PLACEMENT_T = 2, 2  # the ops do not depend on K or T (T = 2: a step that reads the last one)
UPDATE_SETTINGS = {"default": {}, "rank1": {"noise": "rank1", "density": 1.0}, "decoder spsa": {"decoder": "spsa"}}


def missing_libraries(device: str) -> list[str]:
    """One line per missing piece that `device` needs; empty when it can run here."""
    try:
        ort = runtime.load_ort()
    except DeviceError as e:
        return [str(e)]
    d = devices.parse(device)
    if d.cuda_id is None:
        return []
    if CUDA not in ort.get_available_providers():
        return [f"this onnxruntime ({runtime.ort_package()}) has no CUDA EP: {runtime.INSTALL_CUDA}"]
    out = []
    if not devices.gpus():
        out.append("no NVIDIA GPU or driver found (nvidia-smi, /proc/driver/nvidia): install a driver for CUDA 13")
    libs = runtime.cuda_libraries()
    for what, why in (("CUDA 13", libs.cuda), ("cuDNN 9", libs.cudnn)):
        if why:
            out.append(f"{what} does not load ({why}): {runtime.INSTALL_CUDA} brings it")
    return out


def expert_graphs():
    """(label, graph) for every graph a worker opens on its device, both kinds: soma_edge.expert.graph's modes; the
    population graph in each noise form, its decoder gradient on and the body perturbed, as
    soma_edge.engine.population.for_config builds it for the delta rule; and the update graph soma_edge.engine.resident
    builds beside it (the default Adam update, k = spsa.directions * spsa.accumulate)."""
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


def placement_check(device: str, until: float) -> Check:
    """Every expert graph (expert_graphs) opens strict on `device`, and ORT places none of its nodes on
    another EP; a graph that does not is named with the EP and the op types its nodes landed on."""
    plan = runtime.plan(device)
    off, n, late = [], 0, []
    for label, model in expert_graphs():
        if time.perf_counter() > until:
            late.append(label)
            continue
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
    if late:
        detail += f"; not reached in time: {', '.join(late)}"
    figures = {"graphs": n, "off_device": off, "not_reached": late}
    return Check("placement", not off and not late, detail, figures, "time" if late and not off else "")


def numerics_check(device: str, data: np.ndarray, until: float) -> Check:
    """CPU EP against `device`: the largest relative loss difference, and the decoder gradients'."""
    worst_loss, worst_grad, done = 0.0, 0.0, 0
    for m in KINDS.values():
        cfg = Config(model=m)
        cpu = evaluators.LossEvaluator(m, "cpu", threads=1, parallel=1, decoder_grad=True)
        dev = evaluators.LossEvaluator(m, device, parallel=1, decoder_grad=True)
        rng = np.random.default_rng(0)
        for i in range(SAMPLES):
            if time.perf_counter() > until:
                break
            w = params.init(m, i) + rng.normal(0, 0.02, params.count(m)).astype(np.float32)
            x, y = _batch(data, cfg, rng)
            a, b = cpu.loss(w, x, y), dev.loss(w, x, y)
            worst_loss = max(worst_loss, abs(a - b) / abs(a))
            (_, ga), (_, gb) = cpu.clean(w, x, y), dev.clean(w, x, y)
            worst_grad = max(worst_grad, float(np.max(np.abs(ga - gb))))
            done += 1
    ok = worst_loss <= DELTA
    detail = f"largest relative loss difference {worst_loss:.2e} (δ = {DELTA:g}); decoder gradients {worst_grad:.2e}"
    late = done < SAMPLES * len(KINDS)
    if late:
        detail += f"; {done} of {SAMPLES * len(KINDS)} samples compared in time"
    figures = {"loss_rel": worst_loss, "decoder_grad_abs": worst_grad, "delta": DELTA, "samples": done}
    return Check("numerics", ok and not late, detail, figures, "time" if late and ok else "")


def _batch(data: np.ndarray, cfg: Config, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    b, t = cfg.data.batch, cfg.data.seq_len
    starts = rng.integers(0, len(data) - t - 1, size=b)
    win = np.stack([data[s : s + t + 1] for s in starts]).astype(np.int64)
    return win[:, :-1], win[:, 1:]


def log_round_check(device: str, data: np.ndarray, n_steps: int, audit_steps: int, until: float) -> Check:
    """The device trains (at most `n_steps`, within half the time left); the coordinator's audit and replay,
    on the CPU EP, must accept its log."""
    cfg = Config(model=DEMO_MODEL, device=device)
    cfg.federation.reply, cfg.federation.audit_steps = protocol.ReplyMode.LOG, audit_steps
    base = State(params.init(cfg.model, cfg.seed))
    state = State(base.weights.copy())
    evaluator = evaluators.evaluator_for(cfg)
    seconds = max((until - time.perf_counter()) / 2, 0.0)  # the rest for the audit on the CPU
    rep = train(state, data, cfg, evaluator, steps=n_steps, seconds=seconds)
    figures = {"steps": rep.steps, "steps_per_s": rep.steps_per_s, "train_loss": rep.loss}
    if rep.steps == 0:
        return Check("log round", False, "no step fitted in the time left", figures, "time")
    log = record_log(base.step, state.opt.lr_scale, rep.grads, state, steps.log_body(cfg))
    auditor = evaluators.evaluator_for(cfg, "cpu", threads=1, spin=False, parallel=1)
    picks = replay.sample_steps(log.steps, audit_steps, replay.audit_key(), 0, 1)
    try:
        replay.audit(cfg, base, log, 0, data, auditor, picks)
        got = replay.rebuild(cfg, base, log, 0)
    except Exception as e:  # the coordinator's refusal, said as it would say it
        return Check("log round", False, f"refused: {e}", figures)
    same = protocol.weights_sha256(got.weights) == protocol.weights_sha256(state.weights)
    detail = f"{rep.steps} steps at {rep.steps_per_s:.1f} steps/s ({rep.evaluator.value}); audit of steps {picks} "
    detail += "passed; " + (
        "the replay hashes to the device's weights" if same else "the replay hashes to OTHER weights"
    )
    return Check("log round", same, detail, {**figures, "audited": picks})


def update_check(device: str, data: np.ndarray, seconds: float, until: float) -> Check:
    """Whether the update graph gives the host's bits on `device` (soma_edge.engine.resident.Resident.verified),
    for both kinds and each noise form; then the demo expert's population steps/s resident and with the
    host update, `seconds` each where time allows. No verdict (either way the weights are right)."""
    same = {}
    for kind, m in KINDS.items():
        for name, setting in UPDATE_SETTINGS.items():
            if time.perf_counter() > until:
                return Check("update bits", False, f"not settled in time: {same}", {"same_bits": same}, "time")
            cfg = Config(model=m, device=device)
            # The update graph does not depend on T; a short population graph opens in a fraction of the time.
            cfg.spsa.evaluator, cfg.data.seq_len = "population", 2
            for key, value in setting.items():
                setattr(cfg.spsa, key, value)
            ev = evaluators.evaluator_for(cfg, device)
            same[f"{kind}, {name}"] = resident.Resident(cfg, 0, ev.population, State(params.init(m, 0))).verified()
    on_device = all(same.values())
    detail = (
        "the update runs on the device: its bits equal the host's"
        if on_device
        else f"bits DIFFER from the host's ({sorted(k for k, v in same.items() if not v)}): it stays on the host"
    )
    rates = {}
    if until - time.perf_counter() > 4 * seconds:
        cfg = Config(model=DEMO_MODEL, device=device)
        cfg.spsa.evaluator = "population"
        ev = evaluators.evaluator_for(cfg, device)
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
        cost = 1 / rates["host update"] - 1 / rates["resident"]
        detail += (
            f"; demo expert, population steps/s: resident {rates['resident']:.1f}, host update "
            f"{rates['host update']:.1f} (the host update and the weights' upload cost {1000 * cost:.2f} ms a step)"
        )
    return Check("update bits", True, detail, {"same_bits": same, "on_device": on_device, "steps_per_s": rates})


@dataclass
class CaptureArms:
    """The capture check's figures: per arm, each step's clean loss and scalars, and steps/s."""

    n_steps: int
    active: bool  # the captured arm really ran captured (CUDA) or at fixed addresses (CPU EP)
    loss_rel: float  # the largest relative difference of a loss, captured against plain
    replays: bool  # the captured log replays on the host to the captured weights, bit for bit
    same_bits: bool  # the captured and plain weights are the same bits (reported, not judged)
    steps_per_s: dict[str, float]

    @property
    def losses_within_delta(self) -> bool:
        return self.loss_rel <= DELTA


def capture_check(device: str, data: np.ndarray, seconds: float, until: float, on_device: bool = True) -> Check:
    """Resident steps of the demo expert captured (soma_edge.engine.capture) against the same steps plain (module
    docstring, item 6). On the CPU EP the captured arm's fixed-address calls run uncaptured. Where the
    update graph's bits differ from the host's (`on_device` False) workers never train resident, so the
    replay is reported, not judged."""
    got = _capture_arms(device, data, seconds, until)
    if got is None:
        return Check("capture", False, "not settled in time", {}, "time")
    how = "captured" if devices.parse(device).cuda_id is not None else "fixed buffers, uncaptured on the CPU EP"
    if not got.active:
        how = "capture REFUSED, ran uncaptured"
    rates = got.steps_per_s
    detail = (
        f"CUDA graph capture ({how}), {got.n_steps} steps: losses within {got.loss_rel:.1e} of plain steps' "
        f"(δ = {DELTA:g}); the captured log {'replays' if got.replays else 'does NOT replay'} on the host to "
        f"its weights bit for bit{'' if on_device else ' (not judged: the update stays on the host here)'}; "
        f"captured and plain weights {'the same bits' if got.same_bits else 'differ in their last bits'}; "
        f"steps/s {rates['captured']:.1f} vs {rates['plain']:.1f} plain ({rates['captured'] / rates['plain']:.2f}x)"
    )
    ok = got.losses_within_delta and (got.replays or not on_device) and got.active
    return Check("capture", ok, detail, asdict(got))


def _capture_arms(device: str, data: np.ndarray, seconds: float, until: float, n_steps: int = 12):
    """Both arms from the same state and batches: `n_steps` steps each, then steps/s for `seconds` where
    time allows; None when even the steps did not fit before `until`."""
    cfg = Config(model=DEMO_MODEL, device=device)
    cfg.spsa.evaluator = "population"
    base = State(params.init(cfg.model, cfg.seed))
    results, weights, rates, active = {}, {}, {}, True
    for arm, capture in (("captured", True), ("plain", False)):
        if time.perf_counter() > until:
            return None
        ev = evaluators.evaluator_for(cfg, device)  # its own sessions: capture keeps buffers on the evaluator
        state = State(base.weights.copy())
        runner = resident.Resident(cfg, 0, ev.population, state, capture=capture)
        results[arm] = [runner.step(steps.batches(data, cfg, 0, t)) for t in range(n_steps)]
        if capture:
            active = runner.captured is not None
        weights[arm] = runner.download().weights.copy()
        if capture:
            log = record_log(base.step, base.opt.lr_scale, [r.grads for r in results[arm]], state, steps.log_body(cfg))
            replayed = replay.rebuild(cfg, base, log, 0).weights
        n, t0 = 0, time.perf_counter()
        while n == 0 or (time.perf_counter() - t0 < seconds and time.perf_counter() < until):
            runner.step(steps.batches(data, cfg, 0, n_steps + n))
            n += 1
        rates[arm] = n / (time.perf_counter() - t0)
    return CaptureArms(
        n_steps=n_steps,
        active=active,
        loss_rel=_loss_rel(results["captured"], results["plain"]),
        replays=_same(replayed, weights["captured"]),
        same_bits=_same(weights["captured"], weights["plain"]),
        steps_per_s=rates,
    )


def _loss_rel(captured: list[StepResult], plain: list[StepResult]) -> float:
    """The largest relative difference of a step's losses: its clean loss, and each direction's L+ - L-
    (g_k 2 eps, a difference of two losses, so within 2 δ |L| where each loss is within δ)."""
    worst = 0.0
    for a, b in zip(captured, plain):
        worst = max(worst, abs(a.loss - b.loss) / abs(b.loss))
        diff = np.abs(np.asarray(a.grads) - np.asarray(b.grads)) * 2 * b.eps
        worst = max(worst, float(np.max(diff)) / (2 * abs(b.loss)))
    return worst


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


def corpus_bytes(limit: int = 1 << 21) -> np.ndarray:
    """Text to train on without a network: this Python's own standard library sources."""
    chunks, size = [], 0
    for p in sorted(Path(os.__file__).parent.glob("*.py")):
        chunks.append(p.read_bytes())
        size += len(chunks[-1])
        if size >= limit:
            break
    return np.frombuffer(b"".join(chunks)[:limit], dtype=np.uint8)
