"""The guard at its default rule, measured: how often it refuses honest work, and what it refuses of harm.

    .venv/bin/python -m bench.guard [--rounds 25] [--steps 800] [--seeds 0,1] [--shapes demo,eb8]
        [--attack-every 5] [--jobs 2] [--json]

An honest trajectory trains one expert with the shipped recipe on one cluster of the demo's split (`soma-coord
prepare default --experts 4`), `--steps` SPSA steps a round, and after each round the coordinator's own
guard judges the new version exactly as in a run: `coordinator.evaluation` scores it on the expert's
`federation.val_windows` val windows, `coordinator.guard.judge` compares it with the bar at the default
`guard_tolerance` and `guard_sigmas`; a refused version is dropped and the expert retrains from the kept
one at the plateau factor's lr (`Ledger.slow_down`), the plateau rule runs at each round boundary. Each
judgement is one honest decision. The rule before this one (refuse when the val loss exceeds the best so
far by more than 0.05) is judged on the same decisions, for comparison.

Every `--attack-every` rounds, two lies are made from the version just accepted and judged against the
same bar: `reverse` walks back along the round's own honest update (damage shaped like honest noise),
`noise` adds a random direction; each is scaled by bisection until its *true* val loss, on every window of
the cluster's val split (not only the guard's), is 0.05 above the bar's. The guard should refuse both.

Shapes: `demo` (the demo's expert, E32/H128, 124K parameters) and `eb8` (bench/equal_budget.py's N = 8
expert of a 120K-parameter budget, ~15K parameters, the smallest and noisiest it trains).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench.common import arm_config, expert_shape, machine, map_jobs, md_head, md_row, prepared, say, shard_stream
from coordinator import guard
from coordinator.evaluation import Evaluation
from soma_edge.config import Config
from soma_edge.corpus import documents
from soma_edge.engine.evaluator import evaluator_for, mean_loss
from soma_edge.expert import params
from soma_edge.spsa.optim import State, plateau, slower
from worker.trainer import train as spsa_train

WORK = Path("/tmp/soma-bench")
OLD_TOLERANCE = 0.05  # the rule before: val <= best so far + 0.05
HARM = 0.05  # the attacks raise the true val loss by this much over the bar's


@dataclass
class Decision:
    round: int
    val: float
    diff: float  # mean over windows of (version - bar)
    margin: float
    refused: bool
    raises_bar: bool
    old_refused: bool  # by the rule before


@dataclass
class Trajectory:
    shape: str
    cluster: int
    seed: int
    decisions: list[Decision] = field(default_factory=list)
    attacks: dict[str, list[bool]] = field(default_factory=lambda: {"reverse": [], "noise": []})  # refused?
    seconds: float = 0.0


def shape_config(shape: str, seed: int) -> Config:
    cfg = arm_config("default", seed)
    if shape == "eb8":
        cfg.model = expert_shape(120_000, 8)
    return cfg


def true_val(rd, cluster: int, cfg: Config):
    """Every window of the cluster's val split: the loss the attacks are scaled against."""
    return documents.eval_windows(shard_stream(rd, cluster, "val"), cfg.data.seq_len, None)


def bisect_harm(score, make, target: float, iters: int = 14) -> np.ndarray:
    """The weights `make(a)` whose true val loss `score` is `target`, for a in (0, hi)."""
    lo, hi = 0.0, 1.0
    while score(make(hi)) < target and hi < 1e6:
        hi *= 2
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if score(make(mid)) < target else (lo, mid)
    return make(hi)


def trajectory(job: tuple[str, int, int, int, int, int]) -> Trajectory:
    shape, cluster, seed, rounds, steps, attack_every = job
    t0, cfg = time.perf_counter(), shape_config(shape, seed)
    rd = prepared("default", WORK, 0)
    ev = Evaluation(rd, cfg, rd.read_prepare())
    train = shard_stream(rd, cluster, "train")
    tx, ty = true_val(rd, cluster, cfg)
    trainer = evaluator_for(cfg, "cpu", threads=1, parallel=1)
    state = State(params.init(cfg.model, cfg.seed))
    bar, bar_w = guard.bar_of(0, ev.window_losses(cluster, state.weights)), state.weights.copy()
    best, out = bar.val_loss, Trajectory(shape, cluster, seed)
    fed, rng = cfg.federation, np.random.default_rng(seed)
    for r in range(1, rounds + 1):
        kept = copy.deepcopy(state)
        spsa_train(state, train, cfg, trainer, expert=cluster, steps=steps)
        windows = ev.window_losses(cluster, state.weights)
        v = guard.judge(windows, bar, fed.guard_tolerance, fed.guard_sigmas)
        val = float(np.mean(windows))
        d = Decision(
            r, val, val - bar.val_loss, v.margin, v.refused is not None, v.raises_bar, val > best + OLD_TOLERANCE
        )
        out.decisions.append(d)
        if d.refused:
            state = kept
            state.opt.lr_scale = slower(cfg.spsa, state.opt.lr_scale)
            continue
        best = min(best, val)
        if v.raises_bar:
            bar, bar_w = guard.bar_of(r, windows), state.weights.copy()
        plateau(cfg.spsa, state.opt, val, state.step)
        if r % attack_every == 0:
            score = lambda w: mean_loss(trainer, w, tx, ty)  # noqa: E731 - the true val loss, for the bisection
            attack(out, ev, cluster, cfg, bar, score(bar_w) + HARM, kept.weights, state.weights, score, rng)
    out.seconds = time.perf_counter() - t0
    say(f"  {shape} cluster {cluster} seed {seed}: {len(out.decisions)} decisions in {out.seconds:.0f} s")
    return out


def attack(out, ev, cluster, cfg, bar, target, before, after, score, rng) -> None:
    """Two lies from the version just accepted (`after`, trained from `before`), each scaled to the true val
    loss `target` (the bar's + HARM), judged against the bar."""
    fed, step = cfg.federation, after - before
    direction = rng.standard_normal(after.size).astype(np.float32) * float(np.std(after))
    lies = {
        "reverse": bisect_harm(score, lambda a: (after - a * step).astype(np.float32), target),
        "noise": bisect_harm(score, lambda a: (after + a * 1e-3 * direction).astype(np.float32), target),
    }
    for name, w in lies.items():
        v = guard.judge(ev.window_losses(cluster, w), bar, fed.guard_tolerance, fed.guard_sigmas)
        out.attacks[name].append(v.refused is not None)


def table(trajs: list[Trajectory]) -> str:
    rows = [
        md_head(
            [
                "shape",
                "runs",
                "decisions",
                "honest refusals",
                "by the old rule (best + 0.05)",
                "bar raised",
                "margin (median)",
                "reverse lies refused",
                "noise lies refused",
            ]
        )
    ]
    for shape in sorted({t.shape for t in trajs}):
        ts = [t for t in trajs if t.shape == shape]
        ds = [d for t in ts for d in t.decisions]
        rev = [x for t in ts for x in t.attacks["reverse"]]
        noi = [x for t in ts for x in t.attacks["noise"]]
        rows.append(
            md_row(
                [
                    shape,
                    str(len(ts)),
                    str(len(ds)),
                    f"{sum(d.refused for d in ds)} ({100 * np.mean([d.refused for d in ds]):.1f}%)",
                    str(sum(d.old_refused for d in ds)),
                    str(sum(d.raises_bar for d in ds)),
                    f"{np.median([d.margin for d in ds]):.4f}",
                    f"{sum(rev)}/{len(rev)}",
                    f"{sum(noi)}/{len(noi)}",
                ]
            )
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--clusters", default="0,1,2,3")
    ap.add_argument("--shapes", default="demo,eb8")
    ap.add_argument("--attack-every", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    seeds, clusters = [int(s) for s in a.seeds.split(",")], [int(c) for c in a.clusters.split(",")]
    jobs = [
        (shape, c, s, a.rounds, a.steps, a.attack_every)
        for shape in a.shapes.split(",")
        for s in seeds
        for c in clusters
    ]
    say(f"{machine()}; {len(jobs)} trajectories of {a.rounds} rounds x {a.steps} steps, {a.jobs} at a time")
    trajs = map_jobs(trajectory, jobs, a.jobs)
    fed = Config().federation
    print(
        f"\nThe guard at guard_tolerance = {fed.guard_tolerance:g}, guard_sigmas = {fed.guard_sigmas:g}, "
        f"{fed.val_windows} val windows; lies at +{HARM} true val loss\n"
    )
    print(table(trajs))
    if a.json:
        print(json.dumps({"trajectories": [asdict(t) for t in trajs]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
