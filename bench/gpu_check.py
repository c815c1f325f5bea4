"""The first checks on an NVIDIA box, installing nothing:

    python -m bench.gpu_check [--device cuda:0] [--steps 100] [--audit-steps 8] [--out runs/gpu_check]

1. libraries: onnxruntime-gpu with its CUDA EP, an NVIDIA driver, the CUDA and cuDNN libraries. Each one
   missing is named in one line (what to install beside it), and the check exits 2 before anything runs.
2. placement: every expert graph (kinds lstm and soma; modes loss, train, logprobs and stream) opens on a
   CUDA-only session with CPU fallback disabled, and ORT's own placement report puts no node on the CPU.
3. numerics: the loss of the CPU EP and of the device agree to within soma_edge.numerics.DELTA (relative),
   for both kinds, at several weights and batches; the decoder gradients' largest difference is reported.
4. a log round: the device trains the demo expert for --steps SPSA steps with federation.reply = "log", and
   the coordinator's own checks accept the log as `coordinator.intake` runs them: the audit recomputes
   --audit-steps sampled steps on the CPU EP (one thread, as the coordinator does), and the replay of the
   log hashes to the weights the device ended at.

Results go to OUT/gpu_check.md and OUT/gpu_check.json. Exit 0 when every check passes, 1 when one fails,
2 when a library is missing. `--device cpu` runs checks 2-4 with the CPU EP standing in for the GPU: the
test suite runs it so, to keep this script working on boxes without one (its figures then say nothing
about a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench.common import machine, md_head, md_row, say
from coordinator import replay
from soma_edge import devices, params, protocol, runtime, steps
from soma_edge.config import Config, ModelConfig
from soma_edge.devices import CPU, CUDA
from soma_edge.errors import DeviceError
from soma_edge.graph import MODES, build
from soma_edge.numerics import DELTA
from soma_edge.spsa import State, record_log
from worker.doctor import DEMO_MODEL
from worker.trainer import train

KINDS = {"lstm": DEMO_MODEL, "soma": ModelConfig(kind="soma", embed=64, hidden=64, layers=2)}
SAMPLES = 3  # weights and batches per kind in the numerics check


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


def placement_check(device: str) -> Check:
    """Every expert graph opens strict on `device`, and ORT places none of its nodes on another EP."""
    plan = runtime.plan(device)
    off = []
    for kind, m in KINDS.items():
        for mode in MODES:
            model = build(m, mode)
            try:
                runtime.make_session(model, device, threads=1)
            except DeviceError as e:
                off.append(f"{kind}/{mode}: {e}")
                continue
            placed = runtime.placement(model, plan.providers + ([] if CPU in plan.providers else [CPU]))
            elsewhere = {ep: p for ep, p in placed.items() if ep != plan.first}
            if elsewhere or not placed:
                off.append(f"{kind}/{mode}: {elsewhere or 'no placement report'}")
    n = len(KINDS) * len(MODES)
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


def corpus_bytes(limit: int = 1 << 21) -> np.ndarray:
    """Text to train on without a network: this Python's own standard library sources."""
    chunks, size = [], 0
    for p in sorted(Path(os.__file__).parent.glob("*.py")):
        chunks.append(p.read_bytes())
        size += len(chunks[-1])
        if size >= limit:
            break
    return np.frombuffer(b"".join(chunks)[:limit], dtype=np.uint8)


def write(out: Path, device: str, checks: list[Check]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    head = f"# GPU check on {device}\n\n{machine()}; onnxruntime {runtime.ort_package()}\n\n"
    rows = [md_row([c.name, "pass" if c.ok else "FAIL", c.detail]) for c in checks]
    (out / "gpu_check.md").write_text(head + md_head(["check", "result", "detail"]) + "\n" + "\n".join(rows) + "\n")
    record = {"device": device, "machine": machine(), "ok": all(c.ok for c in checks)}
    record["checks"] = [asdict(c) for c in checks]
    (out / "gpu_check.json").write_text(json.dumps(record, indent=1, default=float) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0", help="cuda:i, or cpu to dry-run checks 2-4 on the CPU EP")
    ap.add_argument("--steps", type=int, default=100, help="SPSA steps of the log round")
    ap.add_argument("--audit-steps", type=int, default=8, help="steps the coordinator's audit recomputes")
    ap.add_argument("--out", type=Path, default=Path("runs/gpu_check"), help="where the .md and .json go")
    a = ap.parse_args(argv)
    missing = missing_libraries(a.device)
    if missing:
        for line in missing:
            print(f"error: {line}", file=sys.stderr)
        return 2
    data = corpus_bytes()
    checks = []
    for name, run in (
        ("placement", lambda: placement_check(a.device)),
        ("numerics", lambda: numerics_check(a.device, data)),
        ("log round", lambda: log_round_check(a.device, data, a.steps, a.audit_steps)),
    ):
        t0 = time.perf_counter()
        say(f"{name} ...")
        checks.append(run())
        say(f"{name}: {'pass' if checks[-1].ok else 'FAIL'} ({time.perf_counter() - t0:.1f} s): {checks[-1].detail}")
    write(a.out, a.device, checks)
    print((a.out / "gpu_check.md").read_text(), end="")
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
