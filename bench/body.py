"""How much the zero-order body learns: each SPSA recipe against its frozen twin, on one core.

    .venv/bin/python -m bench.body screen [--arms k1-sparse,split16,...] [--evals 9000] [--kind lstm|soma]
        [--seeds 0] [--jobs 2] [--json out.json]
    .venv/bin/python -m bench.body cost [--arms ...] [--kind lstm|soma] [--cost-steps 40]
    .venv/bin/python -m bench.body final --from screen.json[,more.json] [--top 3] [--evals 36000] [--seeds 0,1]
        [--kind lstm|soma] [--jobs 2] [--json out.json] [--plot docs/img/body.png]

Every figure is a **body gain**: the frozen twin's test loss minus the arm's. The twin runs the arm's head
recipe and plateau rule (judged on its own val loss, every 100 steps, as each run's is), step for step, with
the body's probes and update switched off (the Stepper's bench-only `freeze_body`), so it isolates what the
zero-order part adds. A forward pass is data.batch = 16 rows of 128 bytes, however many calls it takes:
arms take 3 a step, or 2 where the delta rule takes its gradient from the probes (decoder_from = "probes"),
so at equal passes those take 1.5x the steps. One twin per seed and expert kind serves them all: it is
scored at each step count an arm reached.

Data: the whole default corpus (its train split), 256 val windows for the plateau rule and the lr sweep,
256 test windows for the figures; one ORT thread and one evaluation at a time per arm, `--jobs` arms side by
side (one per core). The plateau rule looks at val every 100 steps, as `soma-worker train` does; val and
test checks are not counted in an arm's seconds.

`screen` sweeps each arm's body lr (x2 steps around its default, extended while the best sits at an edge;
scored on val, never test) at `--evals` forward passes and prints the table. `final` takes the best `--top`
arms of a screen (by val) and the BASE arm (`k1-sparse`) at their screened lr, at `--evals` forward passes and
at equal wall time (the BASE arm's seconds for the same budget, measured in the same run), over `--seeds`, and
writes the curves (JSON, plot). `cost` times each arm's steps with the loop and with the population
evaluator (one at a time: run it alone on the box).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import map_jobs, md_head, md_row, pyplot, savefig, say
from soma_edge.config import Config, Evaluator, ModelConfig, evals_per_step, validate
from soma_edge.corpus import documents, sources
from soma_edge.engine.evaluator import evaluator_for, evaluator_kind, mean_loss
from soma_edge.expert import params
from soma_edge.expert.steps import objectives
from soma_edge.expert.steps import stepper as make_stepper
from soma_edge.spsa.optim import State, plateau
from worker.trainer import train as spsa_train

WINDOWS = 256  # val and test windows
CHECK_STEPS = 100  # steps between val checks (the plateau rule), as soma-worker train
TEST_EVERY = 1000  # steps between test points of a curve
KINDS = {"lstm": ModelConfig(), "soma": ModelConfig(kind="soma", embed=32, hidden=32, layers=2)}

# The arms: spsa.* settings over the config's. BASE is the recipe soma-edge shipped when this bench was
# written (one sparse direction on all rows, the delta rule's gradient from a clean forward), and every arm
# but `default` (today's defaults, whatever they are) names its settings against it, so the arms and the
# tables in docs/RESULTS.md stay what they were as the defaults move. Each pair of an arm's probes costs 2
# forward passes of the batch's 16 rows; with split_rows the K pairs share them (16 / K rows each).
BASE = "k1-sparse"
ARMS: dict[str, dict[str, Any]] = {
    BASE: {"directions": 1, "split_rows": False, "density": 0.5, "decoder_from": "clean", "lr": 1e-3},
    "default": {},
}
for _k in (2, 4, 8, 16):
    ARMS[f"split{_k}"] = {**ARMS[BASE], "directions": _k, "split_rows": True, "density": 1.0}
    ARMS[f"split{_k}-rank1"] = {**ARMS[f"split{_k}"], "noise": "rank1"}
for _s in ("zscore", "sign", "rank"):
    ARMS[f"split16-{_s}"] = {**ARMS["split16"], "shaping": _s}
    ARMS[f"split16-{_s}-sgd"] = {**ARMS["split16"], "shaping": _s, "update": "sgd"}
ARMS["split16-sgd"] = {**ARMS["split16"], "update": "sgd"}
# The delta rule's gradient from the probes' own forwards: 2 passes a step instead of 3.
ARMS["probes"] = {**ARMS[BASE], "decoder_from": "probes"}
ARMS["split4-probes"] = {**ARMS["split4"], "decoder_from": "probes"}
ARMS["split16-probes"] = {**ARMS["split16"], "decoder_from": "probes"}
# SGD's step is lr * the estimate itself (no per-weight normalization): its lr lives on another scale.
# Starting points from the shaped weights' size: per weight, (1/K) Σ w_j z_j has RMS ~ rms(w) / √K.
SGD_LR = {"none": 1e-4, "zscore": 4e-3, "sign": 4e-3, "rank": 1.5e-2}
TWIN = "frozen"


@dataclass
class Job:
    """One training run: an arm (or the frozen twin) at one body lr and seed, for a budget of forward
    passes or seconds; test scored every TEST_EVERY steps and at each of `marks` (step counts)."""

    arm: str
    kind: str
    seed: int
    lr: float | None = None
    evals: int | None = None
    seconds: float | None = None
    steps: int | None = None
    marks: list[int] = field(default_factory=list)


@dataclass
class Run:
    arm: str
    kind: str
    seed: int
    lr: float
    steps: int = 0
    evals: int = 0
    seconds: float = 0.0
    val: float = float("nan")
    test: float = float("nan")
    curve: list[dict[str, float]] = field(default_factory=list)  # {steps, evals, seconds, val, test}
    at: dict[int, float] = field(default_factory=dict)  # test at the job's marks (step counts)


def arm_config(arm: str, kind: str, seed: int, lr: float | None = None) -> Config:
    cfg = Config(model=KINDS[kind], seed=seed, device="cpu", threads=1, parallel=1)
    for key, value in ARMS.get(arm, {}).items():
        setattr(cfg.spsa, key, value)
    if cfg.spsa.update == "sgd" and lr is None:
        lr = SGD_LR[cfg.spsa.shaping]
    if lr is not None:
        cfg.spsa.lr = lr
        cfg.spsa.lr_floor = min(cfg.spsa.lr_floor, lr)
    return validate(cfg)


_DATA: dict[str, Any] = {}


def data() -> dict[str, Any]:
    """The default corpus's train stream and 256 val and test windows (loaded once per process)."""
    if not _DATA:
        splits = documents.by_split(sources.default_documents())
        seq = Config().data.seq_len
        _DATA["train"] = documents.to_stream(splits["train"])
        _DATA["val"] = documents.eval_windows(documents.to_stream(splits["val"]), seq, WINDOWS)
        _DATA["test"] = documents.eval_windows(documents.to_stream(splits["test"]), seq, WINDOWS)
    return _DATA


def run(job: Job) -> Run:
    """Train one job from its seed's init: the twin with the body frozen, an arm as configured."""
    d = data()
    cfg = arm_config(TWIN if job.arm == TWIN else job.arm, job.kind, job.seed, job.lr)
    ev = evaluator_for(cfg, "cpu", threads=1, parallel=1)
    stepper = make_stepper(cfg, 0, 1)
    stepper.freeze_body = job.arm == TWIN
    state = State(params.init(cfg.model, cfg.seed))
    # The twin's step counts as the BASE arm's (3 passes): its x-axis is the steps its arms take.
    per = evals_per_step(arm_config(BASE, job.kind, job.seed).spsa if job.arm == TWIN else cfg.spsa)
    cap = job.steps if job.steps is not None else (job.evals // per if job.evals else None)
    out = Run(job.arm, job.kind, job.seed, cfg.spsa.lr)
    marks = sorted(set(job.marks) | ({cap} if cap else set()))
    try:
        while (cap is None or out.steps < cap) and (job.seconds is None or out.seconds < job.seconds):
            t0 = time.perf_counter()
            for _ in range(CHECK_STEPS):
                stepper.step(state, objectives(d["train"], cfg, ev, 0, state.step))
                out.steps += 1
                if out.steps == cap or out.steps in marks:
                    break
                if job.seconds is not None and out.seconds + time.perf_counter() - t0 >= job.seconds:
                    break
            out.seconds += time.perf_counter() - t0
            out.evals = out.steps * per
            _check(out, ev, state, cfg, marks, d)
    finally:
        stepper.close()
    out.test = mean_loss(ev, state.weights, *d["test"])
    say(
        f"  {job.kind} {job.arm} lr {out.lr:g} seed {job.seed}: {out.steps} steps, {out.seconds:.0f} s, "
        f"val {out.val:.4f}, test {out.test:.4f}"
    )
    return out


def _check(out: Run, ev, state: State, cfg: Config, marks: list[int], d: dict[str, Any]) -> None:
    """Val (and the plateau rule) at every check; test at the curve's points and the job's marks."""
    out.val = mean_loss(ev, state.weights, *d["val"])
    plateau(cfg.spsa, state.opt, out.val, state.step)
    point = {"steps": out.steps, "evals": out.evals, "seconds": round(out.seconds, 3), "val": out.val}
    if out.steps % TEST_EVERY == 0 or out.steps in marks:
        point["test"] = mean_loss(ev, state.weights, *d["test"])
        if out.steps in marks:
            out.at[out.steps] = point["test"]
    out.curve.append(point)


def sweep(arms: list[str], kind: str, seed: int, evals: int, jobs: int) -> dict[str, list[Run]]:
    """Each arm's lr grid on val, all arms' runs packed onto the `jobs` cores together: its default lr /2,
    x1 and x2, extended by x2 past an edge that wins (at most 3 times)."""
    grid = {a: arm_config(a, kind, seed).spsa.lr for a in arms}
    todo = [Job(a, kind, seed, lr=lr * f, evals=evals) for a, lr in grid.items() for f in (0.5, 1.0, 2.0)]
    runs: dict[str, list[Run]] = {a: [] for a in arms}
    for _ in range(4):
        for r in map_jobs(run, todo, jobs):
            runs[r.arm].append(r)
        todo = []
        for a, rs in runs.items():
            rs.sort(key=lambda r: r.lr)
            i = min(range(len(rs)), key=lambda i: rs[i].val)
            if i in (0, len(rs) - 1) and len(rs) < 6:
                todo.append(Job(a, kind, seed, lr=rs[i].lr * (0.5 if i == 0 else 2.0), evals=evals))
        if not todo:
            break
    return runs


def screen(args: argparse.Namespace) -> dict[str, Any]:
    arms = args.arms.split(",")
    seed = int(args.seeds.split(",")[0])
    swept = sweep(arms, args.kind, seed, args.evals, args.jobs)
    marks = sorted({r.steps for runs in swept.values() for r in runs})
    twin = run(Job(TWIN, args.kind, seed, steps=max(marks), marks=marks))
    rec = _screen_record(args, twin, swept)
    _save(args, rec)
    return rec


def _screen_record(args, twin: Run, swept: dict[str, list[Run]]) -> dict[str, Any]:
    return {
        "stage": "screen",
        "kind": args.kind,
        "evals": args.evals,
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "twin": asdict(twin),
        "arms": {arm: [asdict(r) for r in runs] for arm, runs in swept.items()},
    }


def screen_table(rec: dict[str, Any]) -> str:
    at = {int(k): v for k, v in rec["twin"]["at"].items()} or {rec["twin"]["steps"]: rec["twin"]["test"]}
    lines = [md_head(["arm", "lr (best on val)", "lrs tried", "val", "test", "body gain", "ms/step", "steps"])]
    for arm, runs in rec["arms"].items():
        r = min(runs, key=lambda x: x["val"])
        lines.append(
            md_row(
                [
                    arm,
                    f"{r['lr']:g}",
                    " ".join(f"{x['lr']:g}" for x in runs),
                    f"{r['val']:.4f}",
                    f"{r['test']:.4f}",
                    f"{at[r['steps']] - r['test']:+.4f}",
                    f"{1e3 * r['seconds'] / max(r['steps'], 1):.1f}",
                    str(r["steps"]),
                ]
            )
        )
    for steps, test in sorted(at.items()):
        lines.append(md_row([f"{TWIN} ({steps} steps)", "", "", "", f"{test:.4f}", "0", "", str(steps)]))
    return "\n".join(lines)


def final(args: argparse.Namespace) -> dict[str, Any]:
    """The chosen arms and the BASE one, over the seeds: at equal forward passes, then at the BASE arm's
    wall time; then the twins, scored at every step count an arm reached."""
    screens = [json.loads(Path(p).read_text()) for p in args.source.split(",")]
    picked = _picked({"arms": {a: r for rec in screens for a, r in rec["arms"].items()}}, args.top, args.arms)
    seeds = [int(s) for s in args.seeds.split(",")]
    rec: dict[str, Any] = {"stage": "final", "kind": args.kind, "evals": args.evals, "arms": picked, "seeds": seeds}
    fp = map_jobs(
        run, [Job(a, args.kind, s, lr=lr, evals=args.evals) for a, lr in picked.items() for s in seeds], args.jobs
    )
    rec["equal_evals"] = [asdict(r) for r in fp]
    _save(args, rec)
    base = {r.seed: r.seconds for r in fp if r.arm == BASE}
    wall = map_jobs(
        run,
        [Job(a, args.kind, s, lr=lr, seconds=base[s]) for a, lr in picked.items() if a != BASE for s in seeds],
        args.jobs,
    )
    rec["equal_time"] = [asdict(r) for r in wall]
    _save(args, rec)
    marks = {s: sorted({r.steps for r in fp + wall if r.seed == s}) for s in seeds}
    twins = map_jobs(run, [Job(TWIN, args.kind, s, steps=max(marks[s]), marks=marks[s]) for s in seeds], args.jobs)
    rec["twins"] = [asdict(t) for t in twins]
    _save(args, rec)
    return rec


def _picked(screen_rec: dict[str, Any], top: int, extra: str | None) -> dict[str, float]:
    """arm -> lr: the BASE arm and the `top` best others of a screen, by val, at their best lr."""
    bests = {arm: min(runs, key=lambda x: x["val"]) for arm, runs in screen_rec["arms"].items()}
    others = sorted((a for a in bests if a != BASE), key=lambda a: bests[a]["val"])[:top]
    if extra:
        others += [a for a in extra.split(",") if a in bests and a not in others]
    return {a: bests[a]["lr"] for a in [BASE, *others] if a in bests}


def gains(rec: dict[str, Any], key: str) -> dict[str, list[float]]:
    """arm -> body gain per seed: its twin's test at the arm's step count minus the arm's test."""
    twin_at = {t["seed"]: {int(k): v for k, v in t["at"].items()} for t in rec.get("twins", [])}
    out: dict[str, list[float]] = {}
    for r in rec.get(key, []):
        if r["seed"] in twin_at and r["steps"] in twin_at[r["seed"]]:
            out.setdefault(r["arm"], []).append(twin_at[r["seed"]][r["steps"]] - r["test"])
    return out


def final_table(rec: dict[str, Any]) -> str:
    fp, wall = gains(rec, "equal_evals"), gains(rec, "equal_time")
    ref = np.mean(fp.get(BASE, [np.nan]))
    lines = [
        md_head(
            [
                "arm",
                "lr",
                f"gain at {rec['evals']} passes",
                f"x {BASE}",
                "gain at equal time",
                f"x {BASE}",
                "test (mean)",
                "ms/step",
            ]
        )
    ]
    for arm, lr in rec["arms"].items():
        runs = [r for r in rec["equal_evals"] if r["arm"] == arm]
        g_fp, g_t = fp.get(arm, []), wall.get(arm, []) if arm != BASE else fp.get(arm, [])
        lines.append(
            md_row(
                [
                    arm,
                    f"{lr:g}",
                    _spread(g_fp),
                    f"{np.mean(g_fp) / ref:.2f}" if g_fp else "",
                    _spread(g_t),
                    f"{np.mean(g_t) / ref:.2f}" if g_t else "",
                    f"{np.mean([r['test'] for r in runs]):.4f}",
                    f"{1e3 * np.mean([r['seconds'] / r['steps'] for r in runs]):.1f}",
                ]
            )
        )
    return "\n".join(lines)


def _spread(xs: list[float]) -> str:
    if not xs:
        return ""
    return f"{np.mean(xs):.4f} ± {np.std(xs):.4f}" if len(xs) > 1 else f"{xs[0]:.4f}"


def plot(rec: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, x in ((axes[0], "equal_evals", "evals"), (axes[1], "equal_time", "seconds")):
        runs = rec.get(key, []) + (
            [r for r in rec.get("equal_evals", []) if r["arm"] == BASE] if key == "equal_time" else []
        )
        runs += [t for t in rec.get("twins", [])] if x == "evals" else []
        for r in runs:
            pts = [p for p in r["curve"] if "test" in p]
            xs = [p["steps"] * 3 if r["arm"] == TWIN else p[x] for p in pts]
            label = f"{r['arm']} s{r['seed']}" + (" (3 passes a step)" if r["arm"] == TWIN else "")
            ax.plot(xs, [p["test"] for p in pts], label=label, lw=1, ls=":" if r["arm"] == TWIN else "-")
        ax.set_xlabel("forward passes" if x == "evals" else "seconds (one core)")
        ax.set_ylabel("test nats/byte")
        ax.legend(fontsize=6)
    fig.suptitle(f"body learning, {rec['kind']} expert")
    savefig(fig, path, 110)


def cost(args: argparse.Namespace) -> str:
    """Each arm's time per step and per forward pass on one core, with the loop and with the population
    evaluator (where the arm runs on it: not with split rows or the probes' decoder gradient)."""
    d = data()
    lines = [
        md_head(["arm", "passes/step", "loop ms/step", "loop ms/pass", "population ms/step", "population ms/pass"])
    ]
    for arm in args.arms.split(","):
        cfg = arm_config(arm, args.kind, 0)
        per, cells = evals_per_step(cfg.spsa), []
        for kind in (Evaluator.LOOP, Evaluator.POPULATION):
            ev = evaluator_for(cfg, "cpu", threads=1, parallel=1, evaluator=kind)
            if evaluator_kind(ev) is not kind:
                cells += ["n/a", "n/a"]
                continue
            ms = _time_steps(cfg, ev, d["train"], args.cost_steps)
            cells += [f"{ms:.1f}", f"{ms / per:.2f}"]
        lines.append(md_row([arm, str(per), *cells]))
    return "\n".join(lines)


def _time_steps(cfg: Config, ev, train: np.ndarray, n: int) -> float:
    """ms a step over `n` steps, after 5 of warm-up, in one training call as a worker runs them (the
    population's resident runner included)."""
    state = State(params.init(cfg.model, cfg.seed))
    spsa_train(state, train, cfg, ev, steps=5)
    return 1e3 * spsa_train(state, train, cfg, ev, steps=n).seconds / n


def _save(args: argparse.Namespace, rec: dict[str, Any]) -> None:
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(rec, indent=1))
        tmp.replace(args.json)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.body", description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=("screen", "final", "cost"))
    p.add_argument("--arms", default=None, help="screen: the arms (default: all); final: arms to add to --top")
    p.add_argument("--kind", choices=tuple(KINDS), default="lstm")
    p.add_argument("--evals", type=int, default=None, help="forward passes per arm (screen 9000, final 36000)")
    p.add_argument("--seeds", default=None, help="comma-separated (screen: its first; final default 0,1)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--from", dest="source", help="final: the screens' JSON (comma-separated: their arms together)")
    p.add_argument("--top", type=int, default=3)
    p.add_argument("--json", help="write the record here (after every arm)")
    p.add_argument("--plot", help="final: the curves' plot")
    p.add_argument("--cost-steps", type=int, default=40, help="cost: steps timed per arm and evaluator")
    args = p.parse_args(argv)
    if args.stage == "cost":
        args.arms = args.arms or ",".join(ARMS)
        print(cost(args))
        return
    if args.stage == "screen":
        args.arms = args.arms or ",".join(ARMS)
        args.evals, args.seeds = args.evals or 9000, args.seeds or "0"
        print(screen_table(screen(args)))
        return
    if not args.source:
        p.error("final needs --from SCREEN.json")
    args.evals, args.seeds = args.evals or 36000, args.seeds or "0,1"
    rec = final(args)
    print(final_table(rec))
    if args.plot:
        plot(rec, Path(args.plot))


if __name__ == "__main__":
    main()
