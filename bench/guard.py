"""The guard at its default rule, measured: how often it refuses honest work, and what it refuses of harm.

    .venv/bin/python -m bench.guard [--rounds 25] [--steps 800] [--seeds 0,1] [--shapes demo,eb8]
        [--windows 1,2,4,8,64] [--attack-every 5] [--jobs 2] [--json]

A job trains the experts of the demo's split (`soma-coord prepare default --experts 4`, `--clusters` of
them) side by side with the shipped recipe, `--steps` SPSA steps a round, and after each round the
coordinator's own guard judges each new version exactly as in a run: `coordinator.evaluation` scores it on
the expert's val windows, `coordinator.guard.judge` compares it with the bar at the default
`guard_tolerance` and `guard_sigmas`, with the spread pooled over the job's other experts (`guard.pool`)
where the windows are too few to estimate their own (spreads the driving count measured). The largest
`--windows` count (64, the shipped `federation.val_windows`) drives the run: a version it refuses is
dropped and the expert retrains from the kept one at the plateau factor's lr (`Ledger.slow_down`); the
plateau rule runs at each round boundary.
Each smaller count (1, 2, 4, 8: prepare's guarantee is 8) judges the same versions against its own bar,
raised by its own verdicts, as a coordinator that had only that many windows would. Each judgement is one
honest decision. The rule before this one (refuse when the val loss exceeds the best so far by more than
0.05) is judged on the driving decisions, for comparison.

Every `--attack-every` rounds, two lies are made from the version just accepted and judged at every count
against that count's bar: `reverse` walks back along the round's own honest update (damage shaped like
honest noise), `noise` adds a random direction; each is scaled by bisection until its *true* val loss, on
every window of the cluster's val split (not only the guard's), is 0.05 above the 64-window bar's. The
guard should refuse both.

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
from typing import Any

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
    cluster: int
    windows: int  # val windows the guard judged on
    val: float
    diff: float  # mean over windows of (version - bar)
    margin: float
    refused: bool
    raises_bar: bool
    old_refused: bool  # by the rule before (driving decisions only)


@dataclass
class Trajectory:
    shape: str
    seed: int
    decisions: list[Decision] = field(default_factory=list)
    # per kind of lie, (val windows, refused?) for each count that judged it
    attacks: dict[str, list[tuple[int, bool]]] = field(default_factory=lambda: {"reverse": [], "noise": []})
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


class Guards:
    """The guard at each window count: its evaluation and, per cluster, its bar; and each cluster's last spread
    accepted by the driving (largest) count, which every count pools from."""

    def __init__(self, rd, cfg: Config, counts: list[int]) -> None:
        self.counts, self.fed = counts, cfg.federation
        self.evs = {n: Evaluation(rd, _with_windows(cfg, n), rd.read_prepare()) for n in counts}
        self.bars: dict[int, dict[int, Any]] = {n: {} for n in counts}
        self.spreads: dict[int, guard.Spread] = {}

    def start(self, c: int, w: np.ndarray) -> None:
        for n in self.counts:
            self.bars[n][c] = guard.bar_of(0, self.evs[n].window_losses(c, w))

    def verdict(self, n: int, c: int, w: np.ndarray) -> tuple[np.ndarray, guard.Verdict | None]:
        """None: one window, and no other expert accepted yet to pool a spread from (cannot be judged)."""
        windows = self.evs[n].window_losses(c, w)
        # The other experts' spreads as the driving count measured them: in a run of many experts they come
        # from experts with 8 or more windows, and the per-window spread does not depend on how many there are.
        pooled = guard.pool([sp for x, sp in sorted(self.spreads.items()) if x != c])
        if n < 2 and pooled is None:
            return windows, None
        return windows, guard.judge(windows, self.bars[n][c], self.fed.guard_tolerance, self.fed.guard_sigmas, pooled)

    def judge(self, r: int, c: int, w: np.ndarray, best: float) -> list[Decision]:
        """Every count's decision on version `w` of cluster c; accepted ones move that count's spread and bar."""
        out = []
        for n in self.counts:
            windows, v = self.verdict(n, c, w)
            if v is None:
                continue
            bar, val = self.bars[n][c], float(np.mean(windows))
            out.append(
                Decision(
                    r,
                    c,
                    n,
                    val,
                    val - bar.val_loss,
                    v.margin,
                    v.refused is not None,
                    v.raises_bar,
                    val > best + OLD_TOLERANCE,
                )
            )
            if v.refused is None:
                sp = guard.spread_of(windows, bar)
                if sp is not None and n == self.counts[-1]:
                    self.spreads[c] = sp
                if v.raises_bar:
                    self.bars[n][c] = guard.bar_of(r, windows)
        return out


def _with_windows(cfg: Config, n: int) -> Config:
    out = copy.deepcopy(cfg)
    out.federation.val_windows = n
    return out


@dataclass
class Expert:
    cluster: int
    state: State
    train: np.ndarray
    true_val: tuple[np.ndarray, np.ndarray]
    bar_w: np.ndarray
    best: float


def trajectory(job: tuple[str, int, int, int, int, tuple[int, ...], tuple[int, ...]]) -> Trajectory:
    shape, seed, rounds, steps, attack_every, clusters, counts = job
    t0, cfg = time.perf_counter(), shape_config(shape, seed)
    rd = prepared("default", WORK, 0)
    guards, drive = Guards(rd, cfg, sorted(counts)), max(counts)
    trainer = evaluator_for(cfg, "cpu", threads=1, parallel=1)
    experts, out, rng = [], Trajectory(shape, seed), np.random.default_rng(seed)
    for c in clusters:
        state = State(params.init(cfg.model, cfg.seed))
        guards.start(c, state.weights)
        x = Expert(c, state, shard_stream(rd, c, "train"), true_val(rd, c, cfg), state.weights.copy(), 0.0)
        x.best = guards.bars[drive][c].val_loss
        experts.append(x)
    for r in range(1, rounds + 1):
        for x in experts:
            kept = copy.deepcopy(x.state)
            spsa_train(x.state, x.train, cfg, trainer, expert=x.cluster, steps=steps)
            decisions = guards.judge(r, x.cluster, x.state.weights, x.best)
            out.decisions += decisions
            d = next(d for d in decisions if d.windows == drive)
            if d.refused:
                x.state = kept
                x.state.opt.lr_scale = slower(cfg.spsa, x.state.opt.lr_scale)
                continue
            x.best = min(x.best, d.val)
            if d.raises_bar:
                x.bar_w = x.state.weights.copy()
            plateau(cfg.spsa, x.state.opt, d.val, x.state.step)
            if r % attack_every == 0:
                attack(out, guards, x, trainer, kept.weights, rng)
    out.seconds = time.perf_counter() - t0
    say(f"  {shape} seed {seed}: {len(out.decisions)} decisions in {out.seconds:.0f} s")
    return out


def attack(out: Trajectory, guards: Guards, x: Expert, trainer, before: np.ndarray, rng) -> None:
    """Two lies from the version just accepted (trained from `before`), each scaled to the true val loss of
    the driving bar's version + HARM, judged at every count against that count's bar."""
    after = x.state.weights
    step = after - before
    tx, ty = x.true_val

    def score(w):
        return mean_loss(trainer, w, tx, ty)

    target = score(x.bar_w) + HARM
    direction = rng.standard_normal(after.size).astype(np.float32) * float(np.std(after))
    lies = {
        "reverse": bisect_harm(score, lambda a: (after - a * step).astype(np.float32), target),
        "noise": bisect_harm(score, lambda a: (after + a * 1e-3 * direction).astype(np.float32), target),
    }
    for name, w in lies.items():
        for n in guards.counts:
            v = guards.verdict(n, x.cluster, w)[1]
            if v is not None:
                out.attacks[name].append((n, v.refused is not None))


def table(trajs: list[Trajectory]) -> str:
    heads = ["shape", "val windows", "honest decisions", "honest refusals", "designed (0.13%)", "bar raised"]
    heads += ["margin (median)", "reverse lies refused", "noise lies refused"]
    rows = [md_head(heads)]
    for shape in sorted({t.shape for t in trajs}):
        ts = [t for t in trajs if t.shape == shape]
        for n in sorted({d.windows for t in ts for d in t.decisions}):
            ds = [d for t in ts for d in t.decisions if d.windows == n]
            rev = [ok for t in ts for k, ok in t.attacks["reverse"] if k == n]
            noi = [ok for t in ts for k, ok in t.attacks["noise"] if k == n]
            refused = sum(d.refused for d in ds)
            rows.append(
                md_row(
                    [
                        shape,
                        str(n),
                        str(len(ds)),
                        f"{refused} ({100 * refused / max(len(ds), 1):.1f}%)",
                        f"{0.00135 * len(ds):.2f}",
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
    ap.add_argument("--windows", default="1,2,4,8,64", help="val window counts to judge at (the largest drives)")
    ap.add_argument("--attack-every", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    seeds, clusters = [int(s) for s in a.seeds.split(",")], [int(c) for c in a.clusters.split(",")]
    counts = tuple(sorted(int(n) for n in a.windows.split(",")))
    jobs = [
        (shape, s, a.rounds, a.steps, a.attack_every, tuple(clusters), counts)
        for shape in a.shapes.split(",")
        for s in seeds
    ]
    say(
        f"{machine()}; {len(jobs)} jobs of {len(clusters)} experts, {a.rounds} rounds x {a.steps} steps, "
        f"judged at {counts} val windows, {a.jobs} at a time"
    )
    trajs = map_jobs(trajectory, jobs, a.jobs)
    fed = Config().federation
    print(
        f"\nThe guard at guard_tolerance = {fed.guard_tolerance:g}, guard_sigmas = {fed.guard_sigmas:g}, "
        f"spread pooled under {guard.POOL_BELOW} windows; lies at +{HARM} true val loss\n"
    )
    print(table(trajs))
    if a.json:
        print(json.dumps({"trajectories": [asdict(t) for t in trajs]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
