"""The GPU learning run: the demo expert trained by each recipe in turn on one device, at equal wall time.

    .venv/bin/python -m bench.gpu_learn --device cuda:0 --json gpu_learn.json --plot docs/img/gpu_learn.png
        [--seconds 60] [--arms frozen,k1-sparse,default,device,bptt] [--deadline 360] [--threads 0]
        [--test-windows 256] [--every 5] [--seed 0] [--probe-seconds 1.5] [--tiny]

The demo expert (`ModelConfig()`, E32/H128 LSTM) on the default corpus's train split, every arm from the same
initial weights, on the same minibatches (step s draws what SPSA step s draws), for `--seconds` each, one
after the other on `--device` (auto | cuda:i | cpu: the dry run). The arms:

    frozen     today's defaults with the body frozen (bench/body.py's twin: the Stepper's `freeze_body`):
               only the head learns, by the delta rule; what the body adds is measured against it
    k1-sparse  the recipe shipped before: one sparse direction (density 0.5) on all rows (bench/body.py)
    default    today's shipped defaults: 4 dense directions, each on its own quarter of the batch
    device     the probes a worker on this device measures for itself (worker.device_recipe.choose, timed
               by worker.probe.steps_per_s); the measurement runs on the arm's clock, before it trains
    bptt       torch backprop through time with Adam from the same weights on the same batches (the
               reference; in a child process on a GPU, so that torch's CUDA libraries never load beside ORT's)

The SPSA arms train with the worker's own loop (worker.trainer.train; the frozen arm with the Stepper, as
bench/body.py's twin does), on the evaluator `evaluator_for` gives the device: the population evaluator on an
accelerator. Every `--every` seconds of an arm's training its test nats/byte is scored (`--test-windows`
windows of the test split) and the plateau rule sees the val split's loss, as at a round's end; scoring is
not counted in the arm's seconds, and neither is building its evaluator (the device arm's measurement is).
A forward pass is data.batch rows, however many calls (config.evals_per_step); the frozen arm's and bptt's
are one a step (the clean forward; bptt's forward, its backward not counted).

After each arm the JSON (`--json`) and the plot (`--plot`, test nats/byte against seconds) are rewritten, so
a run cut short keeps what it measured. An arm that would not end before `--deadline` (seconds from the
start, for the whole run) is skipped and recorded so; one running when the deadline nears stops early and
says so (`cut_short`). The table at the end gives each arm's body gain (the frozen arm's final test loss
minus the arm's) and when it reached the default arm's final test loss; the issue's targets: the device
recipe reaches it in <= 12 s, and its body gain is >= 5x the default's. Results go to docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench import body
from bench.common import ROOT, machine, md_head, md_row, pyplot, savefig, say
from soma_edge import devices
from soma_edge.config import Config, Evaluator, ModelConfig, validate
from soma_edge.engine import runtime
from soma_edge.engine.evaluator import evaluator_for, evaluator_kind, mean_loss
from soma_edge.expert import params
from soma_edge.expert.steps import batches, objectives
from soma_edge.expert.steps import stepper as make_stepper
from soma_edge.spsa.optim import State, plateau
from soma_edge.spsa.recipe import Probes
from worker import device_recipe, probe
from worker.trainer import train as spsa_train

ARMS = ("frozen", "k1-sparse", "default", "device", "bptt")
BPTT_LR = 1e-2  # the Adam lr the val split chose for this expert (docs/RESULTS.md, bench/recipe.py's sweep)
POINTS = 12  # curve points per arm when --every is not given
# Before an arm starts it must have its seconds plus this margin left: its evaluator's build, the scoring
# between stretches and (bptt) the torch process's start are not on its clock but are on the deadline's.
MARGIN_FRAC, MARGIN_S = 0.2, 4.0
TAIL_S = 2.0  # kept free at the deadline for the last JSON, plot and table
TINY = {"model": ModelConfig(embed=8, hidden=16), "batch": 4, "seq_len": 32, "windows": 8}


@dataclass
class Setup:
    """The run's fixed choices, from the command line."""

    model: ModelConfig
    batch: int
    seq_len: int
    windows: int
    device: str
    threads: int
    seed: int
    seconds: float
    every: float
    probe_seconds: float
    bptt_lr: float
    bptt_process: str
    spin: bool = True
    parallel: int = 0  # the worker's own choice (0 = auto), as a worker alone on its box


@dataclass
class Arm:
    """One arm's record: its curve of {seconds, steps, forward_passes, test, val} points, the first at 0."""

    name: str
    status: str = "done"  # done | skipped | failed
    reason: str = ""
    settings: str = ""
    evaluator: str = ""
    steps: int = 0
    forward_passes: int = 0
    seconds: float = 0.0  # on the arm's clock: training (and the device arm's measurement), scoring not
    setup_seconds: float = 0.0  # building its evaluator (or starting torch), not on its clock
    cut_short: bool = False  # stopped before its seconds because the run's deadline was near
    test: float | None = None
    curve: list[dict[str, Any]] = field(default_factory=list)
    measure: dict[str, Any] | None = None  # the device arm: the probes it chose and what it measured


def arm_config(s: Setup, name: str) -> Config:
    """bench/body.py's config of arm `name` (the frozen twin: today's defaults), at this run's shape."""
    cfg = body.arm_config(body.TWIN if name == "frozen" else name, "lstm", s.seed)
    cfg.model, cfg.data.batch, cfg.data.seq_len = s.model, s.batch, s.seq_len
    cfg.device, cfg.threads, cfg.parallel = s.device, s.threads, s.parallel
    return validate(cfg)


def windows(s: Setup) -> dict[str, Any]:
    """bench/body.py's train stream and val/test windows, thinned to `s.windows` spread over each split and
    cut to `s.seq_len` (a window's first bytes and their next bytes are a window too)."""
    d = body.data()

    def thin(xy: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        step = max(1, len(xy[0]) // s.windows)
        return tuple(np.ascontiguousarray(a[::step][: s.windows, : s.seq_len]) for a in xy)

    return {"train": d["train"], "val": thin(d["val"]), "test": thin(d["test"])}


# --- an arm's clock -----------------------------------------------------------------------------------


@dataclass
class Clock:
    """Train in stretches of `every` seconds until `budget`, a curve point after each; stop early at
    `stop_at` (perf_counter) and say so."""

    budget: float
    every: float
    stop_at: float

    def run(self, arm: Arm, advance: Callable[[float], tuple[int, int]], snap: Callable[[dict], None]) -> None:
        """`advance(s)` trains about s seconds and returns (steps, forward passes); `snap(point)` scores."""
        while arm.seconds < self.budget:
            chunk = min(self.every, self.budget - arm.seconds)
            if self.budget - arm.seconds - chunk < 0.25 * self.every:
                chunk = self.budget - arm.seconds  # no sliver of a last stretch: it would be a point of one step
            room = self.stop_at - time.perf_counter()
            if room <= 0:
                arm.cut_short = True
                return
            t0 = time.perf_counter()
            steps, passes = advance(min(chunk, room))
            arm.seconds += time.perf_counter() - t0
            arm.steps, arm.forward_passes = arm.steps + steps, arm.forward_passes + passes
            point(arm, snap)


def point(arm: Arm, snap: Callable[[dict], None]) -> None:
    p = {"seconds": round(arm.seconds, 4), "steps": arm.steps, "forward_passes": arm.forward_passes}
    snap(p)
    arm.curve.append(p)
    arm.test = p.get("test", arm.test)


class Scorer:
    """Val and test nats/byte of a weight vector, by one ORT evaluator on the device for every arm (bptt's
    too), so that the arms' losses are computed alike."""

    def __init__(self, s: Setup, data: dict[str, Any]):
        self.ev = evaluator_for(arm_config(s, "default"), s.device, s.threads, s.spin, s.parallel, Evaluator.LOOP)
        self.data = data
        self.init = self.score(params.init(s.model, s.seed))

    def score(self, w: np.ndarray, val: bool = True) -> dict[str, float]:
        out = {"test": mean_loss(self.ev, w, *self.data["test"])}
        return {**out, "val": mean_loss(self.ev, w, *self.data["val"])} if val else out

    def snap(self, cfg: Config, state: State) -> Callable[[dict], None]:
        """Score the state and let the plateau rule see its val loss, as a round's end does."""

        def fill(p: dict) -> None:
            p.update(self.score(state.weights))
            plateau(cfg.spsa, state.opt, p["val"], state.step)

        return fill


# --- the SPSA arms --------------------------------------------------------------------------------------


def spsa_arm(s: Setup, name: str, data: dict[str, Any], scorer: Scorer, stop_at: float) -> Arm:
    """frozen, k1-sparse, default or device: from the seed's init, on the worker's loop (frozen: the Stepper
    with the body switched off, as bench/body.py's twin)."""
    arm, cfg = Arm(name), arm_config(s, name)
    arm.curve.append({"seconds": 0.0, "steps": 0, "forward_passes": 0, **scorer.init})
    t_arm = time.perf_counter()
    if name == "device":
        cfg = measure_device(s, cfg, arm)  # on the arm's clock: a worker measures before it trains
        arm.seconds = time.perf_counter() - t_arm
        point(arm, lambda p: p.update(scorer.init))
    t0 = time.perf_counter()
    ev = evaluator_for(cfg, s.device, s.threads, s.spin, s.parallel, Evaluator.LOOP if name == "frozen" else None)
    arm.setup_seconds = time.perf_counter() - t0
    arm.evaluator = evaluator_kind(ev).value
    arm.settings = settings(cfg, name)
    state = State(params.init(cfg.model, cfg.seed))
    clock = Clock(s.seconds, s.every, stop_at)
    if name == "frozen":
        stepper = make_stepper(cfg, 0, ev.parallel)
        stepper.freeze_body = True
        try:
            clock.run(arm, frozen_advance(stepper, state, data["train"], cfg, ev), scorer.snap(cfg, state))
        finally:
            stepper.close()
    else:

        def advance(seconds: float) -> tuple[int, int]:
            rep = spsa_train(state, data["train"], cfg, ev, seconds=seconds)
            return rep.steps, rep.forward_evals

        clock.run(arm, advance, scorer.snap(cfg, state))
    return arm


def frozen_advance(stepper, state: State, train: np.ndarray, cfg: Config, ev) -> Callable[[float], tuple[int, int]]:
    """The frozen arm's stretches: its step is the head's clean forward (one pass a batch), no probes."""
    per = cfg.spsa.accumulate if cfg.spsa.decoder == "delta" else 0

    def advance(seconds: float) -> tuple[int, int]:
        t0, n = time.perf_counter(), 0
        while n == 0 or time.perf_counter() - t0 < seconds:
            stepper.step(state, objectives(train, cfg, ev, 0, state.step))
            n += 1
        return n, n * per

    return advance


def measure_device(s: Setup, cfg: Config, arm: Arm) -> Config:
    """The device arm's probes, as a worker chooses them (worker.device_recipe.choose), and its config."""
    t0 = time.perf_counter()
    probes, table = device_recipe.choose(
        cfg, lambda c: probe.steps_per_s(c, s.device, s.threads, s.spin, s.parallel, s.probe_seconds)
    )
    arm.measure = {
        "seconds": round(time.perf_counter() - t0, 4),
        "probe_seconds": s.probe_seconds,
        "probes": probes.to_record(),
        "line": device_recipe.summary(probes, table),
        "table": [
            {"probes": m.probes.to_record(), "steps_per_s": m.steps_per_s, "directions_per_s": m.directions_per_s}
            for m in table
        ],
    }
    say(f"  device: {arm.measure['line']} ({arm.measure['seconds']:.1f} s)")
    return probes.apply(cfg)


def settings(cfg: Config, name: str) -> str:
    """The table's recipe cell: the probes (none when frozen) and the body lr."""
    if name == "frozen":
        return f"body frozen; head by the delta rule (decoder lr {cfg.spsa.decoder_lr:g})"
    return f"{Probes.of(cfg).describe()}, lr {cfg.spsa.lr:g}"


# --- the BPTT reference ----------------------------------------------------------------------------------


def torch_device(device: str) -> str | None:
    """torch's name for the device ORT resolved `device` to; None where torch has no counterpart."""
    first = runtime.plan(device).first
    if first == devices.CPU:
        return "cpu"
    if first in devices.NVIDIA:
        return f"cuda:{devices.parse(device).cuda_id or 0}"
    return None


def bptt_spec(s: Setup, stop_at: float) -> dict[str, Any]:
    """What the torch trainer needs, as JSON (a child process gets it so); `stop_wall`: time.time() to stop."""
    return {
        "model": asdict(s.model),
        "batch": s.batch,
        "seq_len": s.seq_len,
        "seed": s.seed,
        "lr": s.bptt_lr,
        "device": torch_device(s.device),
        "threads": s.threads,
        "seconds": s.seconds,
        "every": s.every,
        "stop_wall": time.time() + (stop_at - time.perf_counter()),
    }


def bptt_curve(spec: dict[str, Any], train: np.ndarray) -> tuple[Arm, list[np.ndarray]]:
    """Torch BPTT with Adam from the seed's init on the SPSA arms' batches (as bench/recipe.py's reference,
    on `spec["device"]`): the arm, its curve unscored, and the weights at each point (the parent scores them)."""
    import torch  # optional (the bench extra): only this arm needs it

    from bench.torch_ref import reference  # torch, as above

    cfg = Config(model=ModelConfig(**spec["model"]), seed=spec["seed"])
    cfg.data.batch, cfg.data.seq_len = spec["batch"], spec["seq_len"]
    dev, on_cuda = spec["device"], spec["device"].startswith("cuda")
    if on_cuda:  # TF32 off, as in ORT's CUDA sessions (soma_edge.engine.runtime.tf32_off)
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    else:
        torch.set_num_threads(spec["threads"] or runtime.cpu_count())
    torch.manual_seed(spec["seed"])
    t0 = time.perf_counter()
    model = reference(cfg.model, params.init(cfg.model, cfg.seed)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=spec["lr"])
    arm = Arm("bptt", settings=f"torch BPTT on {dev}, Adam lr {spec['lr']:g}", evaluator="torch")
    arm.setup_seconds = time.perf_counter() - t0
    arm.curve.append({"seconds": 0.0, "steps": 0, "forward_passes": 0})
    step, snaps = 0, [params.init(cfg.model, cfg.seed)]

    def advance(seconds: float) -> tuple[int, int]:
        nonlocal step
        t0, n, passes = time.perf_counter(), 0, 0
        while n == 0 or time.perf_counter() - t0 < seconds:
            opt.zero_grad()
            parts = batches(train, cfg, 0, step)
            for x, y in parts:  # `accumulate` batches: their mean loss, as SPSA averages them
                xt, yt = torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev)
                (model(xt, yt) / len(parts)).backward()
            opt.step()
            step, n, passes = step + 1, n + 1, passes + len(parts)
        if on_cuda:
            torch.cuda.synchronize()  # the stretch's seconds include the kernels it queued
        return n, passes

    def snap(p: dict) -> None:
        snaps.append(copy.deepcopy(model).cpu().flat_weights())

    stop_at = time.perf_counter() + spec["stop_wall"] - time.time()
    Clock(spec["seconds"], spec["every"], stop_at).run(arm, advance, snap)
    return arm, snaps


def bptt_arm(s: Setup, data: dict[str, Any], scorer: Scorer, stop_at: float) -> Arm:
    """The reference, in this process on the CPU, in a child on a GPU; its points scored here by ORT."""
    spec = bptt_spec(s, stop_at)
    if importlib.util.find_spec("torch") is None:
        return Arm("bptt", status="skipped", reason="torch is not importable")
    if spec["device"] is None:
        return Arm("bptt", status="skipped", reason=f"torch has no counterpart of device {s.device!r}")
    child = s.bptt_process == "child" or (s.bptt_process == "auto" and spec["device"] != "cpu")
    if child:
        got = bptt_in_child(spec, data["train"], stop_at)
        if isinstance(got, str):
            return Arm("bptt", status="skipped", reason=got)
        arm, snaps = got
    else:
        arm, snaps = bptt_curve(spec, data["train"])
    for p, w in zip(arm.curve, snaps):
        p.update(scorer.score(w, val=False))  # bptt has no plateau rule: test alone
    arm.test = arm.curve[-1]["test"]
    return arm


def bptt_in_child(spec: dict[str, Any], train: np.ndarray, stop_at: float) -> tuple[Arm, list[np.ndarray]] | str:
    """bptt_curve in `python -m bench.gpu_learn --bptt-child DIR` (torch's CUDA libraries must not load into
    the process that runs ORT's: bench/torch_eager.py); the arm and its weights, or why it failed."""
    with tempfile.TemporaryDirectory(prefix="gpu_learn-") as tmp:
        d = Path(tmp)
        (d / "spec.json").write_text(json.dumps(spec))
        np.save(d / "train.npy", train)
        cmd = [sys.executable, "-m", "bench.gpu_learn", "--bptt-child", str(d)]
        try:
            r = subprocess.run(
                cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(1.0, stop_at - time.perf_counter() + TAIL_S)
            )
        except subprocess.TimeoutExpired:
            return "the torch process did not end before the deadline"
        if r.returncode != 0 or not (d / "arm.json").exists():
            tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
            return f"the torch process failed (exit {r.returncode}): {tail}"
        rec = json.loads((d / "arm.json").read_text())
        return Arm(**rec), list(np.load(d / "weights.npy"))


def bptt_child(folder: str) -> None:
    d = Path(folder)
    arm, snaps = bptt_curve(json.loads((d / "spec.json").read_text()), np.load(d / "train.npy"))
    np.save(d / "weights.npy", np.stack(snaps))
    (d / "arm.json").write_text(json.dumps(asdict(arm)))


# --- the run --------------------------------------------------------------------------------------------


def margin(seconds: float) -> float:
    return MARGIN_FRAC * seconds + MARGIN_S


def run_arms(s: Setup, arms: list[str], deadline: float, t_start: float, save: Callable[[dict], None]) -> dict:
    """Each arm in turn (skipped where it would not end before the deadline), the record saved after each."""
    t0 = time.perf_counter()
    data = windows(s)
    scorer = Scorer(s, data)
    rec = record(s, deadline, arms)
    rec["setup_seconds"] = round(time.perf_counter() - t0, 3)
    stop_at = t_start + deadline - TAIL_S
    for name in arms:
        left, need = t_start + deadline - time.perf_counter(), s.seconds + margin(s.seconds)
        if left < need:
            why = f"{left:.1f} s left, the arm needs {need:.1f} s ({s.seconds:g} s + {margin(s.seconds):.1f} s margin)"
            arm = Arm(name, status="skipped", reason=f"deadline: {why}")
        else:
            say(f"{name}: {s.seconds:g} s on {s.device}")
            try:
                arm = bptt_arm(s, data, scorer, stop_at) if name == "bptt" else spsa_arm(s, name, data, scorer, stop_at)
            except Exception as e:  # one arm failing (out of memory, an EP refusing) must not lose the others
                traceback.print_exc()
                first = (str(e).strip().splitlines() or [""])[0]
                arm = Arm(name, status="failed", reason=f"{type(e).__name__}: {first}")
        say(f"  {name}: {arm.status} {arm.reason}" if arm.status != "done" else f"  {name}: {summary_line(arm)}")
        rec["arms"][name] = asdict(arm)
        rec["elapsed"] = round(time.perf_counter() - t_start, 3)
        save(rec)
    return rec


def record(s: Setup, deadline: float, arms: list[str]) -> dict[str, Any]:
    return {
        "bench": "gpu_learn",
        "device": s.device,
        "providers": runtime.plan(s.device).names,
        "machine": machine(),
        "model": asdict(s.model),
        "batch": s.batch,
        "seq_len": s.seq_len,
        "test_windows": s.windows,
        "seconds": s.seconds,
        "every": s.every,
        "seed": s.seed,
        "deadline": deadline,
        "order": arms,
        "arms": {},
    }


def summary_line(arm: Arm) -> str:
    cut = " (cut short)" if arm.cut_short else ""
    return f"{arm.steps} steps, {arm.forward_passes} forward passes, {arm.seconds:.1f} s, test {arm.test:.4f}{cut}"


def done(rec: dict[str, Any], name: str) -> dict[str, Any] | None:
    a = rec["arms"].get(name)
    return a if a and a["status"] == "done" and a["test"] is not None else None


def reach(arm: dict[str, Any], target: float) -> float | None:
    """Seconds of the arm's first point at or below `target` test nats/byte; None if none is."""
    return next((p["seconds"] for p in arm["curve"] if p.get("test") is not None and p["test"] <= target), None)


def table(rec: dict[str, Any]) -> str:
    frozen, default = done(rec, "frozen"), done(rec, "default")
    cols = ["arm", "recipe", "steps", "forward passes", "seconds", "test nats/byte", "body gain over frozen"]
    lines = [md_head([*cols, "s to default's final loss"])]
    for name in rec["order"]:
        a = rec["arms"].get(name)
        if a is None or a["status"] != "done":
            why = a["reason"] if a else "not run"
            lines.append(md_row([name, f"{a['status'] if a else 'skipped'}: {why}", "", "", "", "", "", ""]))
            continue
        gain = f"{frozen['test'] - a['test']:+.4f}" if frozen and name != "frozen" else ""
        when = reach(a, default["test"]) if default else None
        cells = [name, a["settings"], str(a["steps"]), str(a["forward_passes"]), f"{a['seconds']:.1f}"]
        cells += [f"{a['test']:.4f}" + (" (cut short)" if a["cut_short"] else ""), gain]
        lines.append(md_row([*cells, "" if not default else f"{when:.1f}" if when is not None else "not reached"]))
    return "\n".join(lines)


def targets(rec: dict[str, Any]) -> list[str]:
    """The issue's two ratios: when the device arm reaches the default's final loss, and its body gain."""
    frozen, default, dev = done(rec, "frozen"), done(rec, "default"), done(rec, "device")
    if not (default and dev):
        return ["device reaches default's loss: n/a (the device and default arms did not both run)"]
    when = reach(dev, default["test"])
    if when is not None:
        lines = [f"device reaches default's loss in {when:.1f} s (target <= 12 s)"]
    else:
        lines = [f"device reaches default's loss: not reached in {dev['seconds']:.1f} s (target <= 12 s)"]
    if not frozen:
        return [*lines, "body gain device/default: n/a (no frozen arm)"]
    g_dev, g_def = frozen["test"] - dev["test"], frozen["test"] - default["test"]
    ratio = f"{g_dev / g_def:.2f} x" if g_def > 0 else f"n/a (default's gain {g_def:+.4f} <= 0; device's {g_dev:+.4f})"
    return [*lines, f"body gain device/default: {ratio} (target >= 5x)"]


def plot(rec: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in rec["order"]:
        a = done(rec, name)
        if a is None:
            continue
        pts = [p for p in a["curve"] if p.get("test") is not None]
        style = {"ls": ":" if name == "frozen" else "-", "lw": 2 if name in ("device", "bptt") else 1.3}
        ax.plot([p["seconds"] for p in pts], [p["test"] for p in pts], marker=".", label=name, **style)
    if done(rec, "default"):
        ax.axhline(rec["arms"]["default"]["test"], color="grey", lw=0.6, ls="--", label="default's final")
    ax.set(xlabel=f"seconds of training on {rec['device']} ({rec['providers'][0]})", ylabel="test nats/byte")
    m = rec["model"]
    ax.set_title(f"equal wall time, {m['kind']} E{m['embed']}/H{m['hidden']}, batch {rec['batch']}x{rec['seq_len']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    savefig(fig, path, 110)
    plt.close(fig)


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_learn", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="training seconds per arm (equal wall time)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, in order, of {', '.join(ARMS)}")
    p.add_argument("--deadline", type=float, default=360.0, help="seconds for the whole run: later arms skip")
    p.add_argument("--device", default="auto", help="auto | cuda:i | cpu (the dry run)")
    p.add_argument("--threads", type=int, default=0, help="ORT intra-op threads (0: the worker's choice)")
    p.add_argument("--test-windows", type=int, default=body.WINDOWS, help=f"val and test windows (<= {body.WINDOWS})")
    p.add_argument("--every", type=float, default=None, help=f"seconds between points (default --seconds/{POINTS})")
    p.add_argument("--json", help="write the record here (after every arm)")
    p.add_argument("--plot", help="the curves' plot (after every arm)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--probe-seconds", type=float, default=probe.PROBE_SECONDS, help="the device arm's probe time")
    p.add_argument("--bptt-lr", type=float, default=BPTT_LR)
    p.add_argument("--bptt-process", choices=("auto", "same", "child"), default="auto", help="auto: child on a GPU")
    p.add_argument("--tiny", action="store_true", help="E8/H16, batch 4x32, 8 windows: the CPU dry run")
    p.add_argument("--bptt-child", help=argparse.SUPPRESS)  # the torch process's folder (bptt_in_child)
    return p.parse_args(argv), p


def setup(a: argparse.Namespace, p: argparse.ArgumentParser) -> Setup:
    unknown = [x for x in a.arms.split(",") if x not in ARMS]
    if unknown:
        p.error(f"unknown arms {unknown}: use {', '.join(ARMS)}")
    if not 1 <= a.test_windows <= body.WINDOWS:
        p.error(f"--test-windows must be 1 to {body.WINDOWS} (bench/body.py's windows)")
    if a.seconds <= 0 or (a.every is not None and a.every <= 0):
        p.error("--seconds and --every must be > 0")
    tiny = TINY if a.tiny else {"model": ModelConfig(), "batch": Config().data.batch, "seq_len": Config().data.seq_len}
    return Setup(
        model=tiny["model"],
        batch=tiny["batch"],
        seq_len=tiny["seq_len"],
        windows=min(a.test_windows, tiny.get("windows", a.test_windows)),
        device=a.device,
        threads=a.threads,
        seed=a.seed,
        seconds=a.seconds,
        every=a.every or a.seconds / POINTS,
        probe_seconds=a.probe_seconds,
        bptt_lr=a.bptt_lr,
        bptt_process=a.bptt_process,
    )


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """The whole run: every arm, the JSON and plot after each, the table and the targets printed."""
    t_start = time.perf_counter()
    a, p = parse(argv)
    if a.bptt_child:
        bptt_child(a.bptt_child)
        return {}
    s = setup(a, p)

    def save(rec: dict[str, Any]) -> None:
        if a.json:
            tmp = Path(a.json).with_suffix(".tmp")
            tmp.write_text(json.dumps(rec, indent=1))
            tmp.replace(a.json)
        if a.plot:
            try:
                plot(rec, Path(a.plot))
            except ImportError as e:  # a GPU box may lack matplotlib: the JSON is the record, keep measuring
                say(f"no plot: {e}")
                a.plot = None

    rec = run_arms(s, a.arms.split(","), a.deadline, t_start, save)
    print(table(rec))
    print("\n".join(targets(rec)))
    say(f"done in {time.perf_counter() - t_start:.0f} s of a {a.deadline:g} s deadline")
    return rec


def main(argv: list[str] | None = None) -> None:
    run(argv)


if __name__ == "__main__":
    main()
