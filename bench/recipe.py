"""Which parts of the SOMA recipe make one expert learn: cumulative arms on one cluster of a corpus.

    .venv/bin/python bench/recipe.py [--seconds 90] [--evals 0] [--cluster 0] [--corpus default]
        [--jobs 1] [--arms today,+delta,...] [--plot docs/img/recipe.png] [--json]

One cluster of `soma-coord prepare CORPUS --experts 4` (the demo's split), one expert (E32/H128 LSTM, the
demo's shape), one ORT thread. The arms are cumulative:

    today     all weights by SPSA, unit-RMS update, lr 1e-2, K = 8 (the recipe before the delta rule)
    +delta    the head by the exact decoder-path delta rule (its own Adam), SPSA on the body only
    +adam     Adam moments on the body's SPSA estimate (lr 1e-3)
    +sparse   sparse Rademacher probes (density 1/2)
    +wd+plat  coupled weight decay 1e-4 and the plateau rule (lr and eps halved together)
    default   the shipped defaults: the above with K = 1 (and patience 1,000), and model.input_gain 4

and, on top of `default` (not cumulative), the paper's expert (`model.kind = "soma"`):

    soma      d = 32, D = 2 residual blocks, tied E by the delta rule (the paper's shape, 41K parameters)
    soma-d64  the same at d = 64 (147K parameters, the demo expert's size)

plus `bptt`, the reference: the same model trained by torch backprop through time with Adam, on the same
batches, under the same limits (one thread). Table 1 holds wall time equal (`--seconds` of training, the
periodic val checks not counted); table 2 holds forward passes equal (`--evals`, default: what `today`
did in table 1; a delta-rule step counts 2K + 1). Every row gives test nats/byte on the cluster's test
split and the share of backprop's gain over a byte unigram (fitted on the cluster's train split) that the
arm captures: (unigram - arm) / (unigram - bptt). The plateau rule looks at the val split every
`--check-steps` steps, as the coordinator does at round boundaries. `--jobs 2` runs two arms at a time,
one per core: compare ratios from one run only.

Table 3 (`--seed-evals`, 0 to skip) is what one cluster cannot show: N = 4 experts, one per cluster, at
equal forward passes per expert, the seed's included (`federation.seed_steps` semantics: the seed's
passes are paid out of the experts' steps), scored as the routed mixture on every cluster's test split
under both evaluation protocols (the stream protocol's top-2 routed mixture, as `make demo` reports it,
and the paper's top-4 uniform one on its scored bytes, with the stream protocol on those same bytes).
The seed trains on every cluster's train split for `--seed-share` of the total passes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from soma_edge import corpus, params  # noqa: E402
from soma_edge.config import Config, ModelConfig  # noqa: E402
from soma_edge.runtime import evaluator_for, mean_loss  # noqa: E402
from soma_edge.spsa import State, evals_per_step, plateau  # noqa: E402
from worker.trainer import train as spsa_train  # noqa: E402

MODEL = ModelConfig(embed=32, hidden=128, layers=1, input_gain=1.0)
N_CLUSTERS = 4  # the demo's split
TEST_WINDOWS = 256
VAL_WINDOWS = 32

# Cumulative arms: each adds its settings to all those above it. The last, `default`, is what
# soma-edge ships: the config's own defaults (fewer directions, a lower body lr, a stronger input drive).
ARMS: list[tuple[str, dict[str, Any]]] = [
    (
        "today",
        {
            "decoder": "spsa",
            "update": "rms",
            "lr": 1e-2,
            "directions": 8,
            "density": 1.0,
            "weight_decay": 0.0,
            "plateau": False,
            "model.input_gain": 1.0,
        },
    ),
    ("+delta", {"decoder": "delta", "decoder_lr": 3e-2}),
    ("+adam", {"update": "adam", "lr": 1e-3}),
    ("+sparse", {"density": 0.5}),
    ("+wd+plat", {"weight_decay": 1e-4, "plateau": True, "plateau_patience": 300}),
    ("default", {}),  # filled in by arm_config: Config()'s [spsa] and model.input_gain
]
# On top of `default`, not cumulative: the paper's expert.
SOMA_ARMS: dict[str, dict[str, Any]] = {
    "soma": {"kind": "soma", "embed": 32, "hidden": 32, "layers": 2},
    "soma-d64": {"kind": "soma", "embed": 64, "hidden": 64, "layers": 2},
}
ARM_NAMES = [n for n, _ in ARMS] + list(SOMA_ARMS)


def say(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


@dataclass
class Data:
    train: np.ndarray
    val: tuple[np.ndarray, np.ndarray]
    test: tuple[np.ndarray, np.ndarray]
    unigram: float


@dataclass
class Result:
    name: str
    test: float
    steps: int
    evals: int
    seconds: float
    curve: list[tuple[float, float]] = field(default_factory=list)  # (train seconds, val nats/byte)
    weights: np.ndarray | None = None  # the trained weights (SPSA arms)


def prepared(corpus_name: str, work: Path, seed: int = 0):
    """The demo's split of `corpus_name` (prepared once under `work`), as a RunDir."""
    from coordinator.prepare import prepare
    from soma_edge.rundir import RunDir

    d = work / f"prepared-{corpus_name}-n{N_CLUSTERS}-s{seed}"
    if not (d / "prepare.json").exists():
        prepare(corpus_name, N_CLUSTERS, d, seed=seed, progress=False)
    return RunDir(d)


def cluster_data(corpus_name: str, cluster: int, work: Path, seed: int = 0) -> Data:
    from bench.equal_budget import shard_stream

    rd = prepared(corpus_name, work, seed)
    seq = Config().data.seq_len

    def stream(split: str) -> np.ndarray:
        data = shard_stream(rd, cluster, split)
        if data.size <= 4 * seq:  # a tiny corpus: the split of every cluster
            say(f"cluster {cluster} has {data.size} {split} bytes: using the {split} split of all clusters")
            data = np.concatenate([shard_stream(rd, e, split) for e in range(N_CLUSTERS)])
        return data

    train, val, test = stream("train"), stream("val"), stream("test")
    return Data(
        train=train,
        val=corpus.eval_windows(val, seq, VAL_WINDOWS),
        test=corpus.eval_windows(test, seq, TEST_WINDOWS),
        unigram=corpus.unigram_entropy(train, test),
    )


def arm_config(name: str, seed: int = 0) -> Config:
    cfg = Config(model=MODEL, seed=seed, device="cpu", threads=1, parallel=1)
    if name in SOMA_ARMS:
        cfg.model = ModelConfig(**SOMA_ARMS[name])
        return cfg
    if name == "default":
        cfg.model = ModelConfig(embed=MODEL.embed, hidden=MODEL.hidden, layers=MODEL.layers)
        return cfg
    upto = [n for n, _ in ARMS].index(name)
    for _, overrides in ARMS[: upto + 1]:
        for k, v in overrides.items():
            if k.startswith("model."):
                cfg.model = ModelConfig(**{**cfg.model.__dict__, k.removeprefix("model."): v})
            else:
                setattr(cfg.spsa, k, v)
    return cfg


def run_spsa(
    name: str,
    cfg: Config,
    data: Data,
    seconds: float | None,
    evals: int | None,
    check_steps: int,
    state: State | None = None,
    expert: int = 0,
    steps: int | None = None,
) -> Result:
    """Train `state` (default: a fresh init) for `seconds`, `evals` forward passes or `steps` steps."""
    ev = evaluator_for(cfg, "cpu", threads=1, parallel=1)
    state = state if state is not None else State(params.init(cfg.model, cfg.seed))
    per = evals_per_step(cfg.spsa)
    budget_steps = steps if evals is None else max(1, evals // per)
    res = Result(name=name, test=0.0, steps=0, evals=0, seconds=0.0)
    while (seconds is None or res.seconds < seconds) and (budget_steps is None or res.steps < budget_steps):
        chunk = check_steps if budget_steps is None else min(check_steps, budget_steps - res.steps)
        left = None if seconds is None else seconds - res.seconds
        rep = spsa_train(state, data.train, cfg, ev, expert=expert, steps=chunk, seconds=left)
        res.steps, res.evals, res.seconds = (
            res.steps + rep.steps,
            res.evals + rep.forward_evals,
            res.seconds + rep.seconds,
        )
        val = mean_loss(ev, state.weights, *data.val)
        res.curve.append((res.seconds, val))
        if plateau(cfg.spsa, state.opt, val, state.step):
            say(f"  {name}: plateau at step {state.step}, lr scale now {state.opt.lr_scale:g}")
    res.test = mean_loss(ev, state.weights, *data.test)
    res.weights = state.weights
    return res


def run_bptt(
    data: Data, seconds: float | None, steps_cap: int | None, check_steps: int, lr: float = 1e-2, seed: int = 0
) -> Result:
    import torch

    from bench.torch_ref import TorchExpert

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    cfg = Config(model=MODEL, seed=seed)
    model = TorchExpert(MODEL).load_flat(params.init(MODEL, seed))  # today's initialization
    opt = torch.optim.Adam(model.parameters(), lr=lr)

    def score(xy: tuple[np.ndarray, np.ndarray]) -> float:
        with torch.no_grad():
            return float(model(torch.from_numpy(xy[0]), torch.from_numpy(xy[1])))

    res = Result(name="bptt", test=0.0, steps=0, evals=0, seconds=0.0)
    while (seconds is None or res.seconds < seconds) and (steps_cap is None or res.steps < steps_cap):
        t0 = time.perf_counter()
        for _ in range(check_steps):
            x, y = corpus.sample_batch(
                data.train, cfg.data.batch, cfg.data.seq_len, corpus.batch_rng(seed, 0, res.steps)
            )
            opt.zero_grad()
            model(torch.from_numpy(x), torch.from_numpy(y)).backward()
            opt.step()
            res.steps += 1
            res.evals += 1
            if (seconds is not None and res.seconds + time.perf_counter() - t0 >= seconds) or res.steps == steps_cap:
                break
        res.seconds += time.perf_counter() - t0
        res.curve.append((res.seconds, score(data.val)))
    res.test = score(data.test)
    return res


def _job(args: tuple) -> Result:
    kind, name, data, seconds, evals, check = args
    os.environ["OMP_NUM_THREADS"] = "1"
    if kind == "bptt":
        return run_bptt(data, seconds, evals, check)
    return run_spsa(name, arm_config(name), data, seconds, evals, check)


def _map(fn, work: list, jobs: int) -> list:
    if jobs <= 1:
        return [fn(w) for w in work]
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        return pool.map(fn, work, chunksize=1)


def run_table(
    names: list[str], data: Data, seconds: float | None, evals: int | None, check: int, jobs: int, bptt: bool
) -> list[Result]:
    work = [("spsa", n, data, seconds, evals, check) for n in names]
    if bptt:
        work.append(("bptt", "bptt", data, seconds, None, max(10, check // 4)))
    out = _map(_job, work, jobs)
    for r in out:
        say(f"  {r.name}: test {r.test:.4f} nats/byte, {r.steps} steps, {r.evals} forward passes, {r.seconds:.0f} s")
    return out


def captured(unigram: float, arm: float, ref: float) -> float:
    return (unigram - arm) / (unigram - ref) if unigram != ref else float("nan")


def table(title: str, rows: list[Result], unigram: float, ref: float) -> str:
    lines = [
        title,
        "",
        "| arm | test nats/byte | captured | steps | forward passes | train s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.test:.3f} | {captured(unigram, r.test, ref):.2f}"
            f" | {r.steps} | {r.evals} | {r.seconds:.0f} |"
        )
    lines.append(f"| byte unigram (cluster train split) | {unigram:.3f} | 0 | | | |")
    return "\n".join(lines)


def plot(rows: list[Result], unigram: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in rows:
        if r.curve:
            t, v = zip(*r.curve)
            ax.plot(t, v, label=f"{r.name} ({r.test:.2f})", lw=2 if r.name == "bptt" else 1.4)
    ax.axhline(unigram, color="grey", ls=":", label=f"byte unigram ({unigram:.2f})")
    ax.set_xlabel("training seconds (one thread)")
    ax.set_ylabel("val nats/byte (cluster val split)")
    ax.set_title("One expert, E32/H128, cumulative recipe arms (test score in legend)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=90.0, help="training seconds per arm in table 1")
    ap.add_argument(
        "--evals",
        type=int,
        default=0,
        help="forward passes per arm in table 2 (0: today's count from table 1; -1: skip)",
    )
    ap.add_argument("--cluster", type=int, default=0)
    ap.add_argument("--corpus", default="default")
    ap.add_argument("--arms", default=",".join(ARM_NAMES))
    ap.add_argument("--seed-evals", type=int, default=11000, help="table 3: forward passes per expert (0: skip)")
    ap.add_argument("--seed-share", type=float, default=0.25, help="table 3: the seed's share of all passes")
    ap.add_argument("--seed-arms", default="", help="table 3: comma-separated arm names (default: all)")
    ap.add_argument("--check-steps", type=int, default=50, help="steps between val checks (plateau rule, curves)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path("runs/bench-recipe"))
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--no-bptt", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    names = [n.strip() for n in a.arms.split(",") if n.strip()]
    unknown = [n for n in names if n not in ARM_NAMES]
    if unknown:
        ap.error(f"unknown arms {unknown} (known: {', '.join(ARM_NAMES)})")
    data = cluster_data(a.corpus, a.cluster, a.work)
    say(f"cluster {a.cluster} of {a.corpus}: {data.train.size} train bytes, unigram {data.unigram:.4f} nats/byte")
    t1 = run_table(names, data, a.seconds, None, a.check_steps, a.jobs, not a.no_bptt)
    ref = next((r.test for r in t1 if r.name == "bptt"), float("nan"))
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}; "
        f"corpus {a.corpus}, cluster {a.cluster}; jobs {a.jobs}\n"
    )
    print(table(f"Table 1: equal wall time ({a.seconds:g} s of training on one thread)", t1, data.unigram, ref))
    if a.evals >= 0:
        evals = a.evals or next((r.evals for r in t1 if r.name == "today"), 0)
        if evals > 0:
            t2 = run_table(names, data, None, evals, a.check_steps, a.jobs, False)
            print()
            print(
                table(
                    f"Table 2: equal forward passes ({evals} each; a delta-rule step counts 2K + 1)",
                    t2,
                    data.unigram,
                    ref,
                )
            )
    t3 = None
    if a.seed_evals > 0:
        from bench.recipe_seed import run_seed_table, seed_table

        picked = [n.strip() for n in a.seed_arms.split(",") if n.strip()] or None
        t3 = run_seed_table(a.corpus, a.work, a.seed_evals, a.seed_share, a.check_steps, a.jobs, picked)
        print()
        print(seed_table(t3, a.seed_evals, a.seed_share))
    if a.plot:
        plot(t1, data.unigram, a.plot)
        say(f"plot: {a.plot}")
    if a.json:
        out: dict[str, Any] = {
            "arms": [
                {"name": r.name, "test_nats_per_byte": r.test, "captured": captured(data.unigram, r.test, ref)}
                for r in t1
            ]
        }
        if t3 is not None:
            out["seed_table"] = [vars(r) for r in t3]
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
