"""Which parts of the SOMA recipe make one expert learn: cumulative arms on one cluster of a corpus.

    .venv/bin/python -m bench.recipe [--seconds 90] [--evals 0] [--cluster 0] [--corpus default]
        [--jobs 1] [--arms today,+delta,...] [--bptt-lrs 3e-3,1e-2,3e-2 | --no-bptt]
        [--plot docs/img/recipe.png] [--json]

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

plus `bptt`, the reference for `default`: torch backprop through time with Adam from `default`'s config
and its initial weights (the same flat vector, bit for bit: input gain 4 included), on `default`'s
minibatches (step s draws what SPSA step s draws), under table 1's limits (`--seconds`, one thread). Its
Adam lr is swept (`--bptt-lrs`, each lr a full run under those limits) and the val split picks the row,
never the test split; the row is named `bptt (lr X)` and the JSON gives every swept run. With `--jobs 2`
the sweep's runs share the cores with the arms, two at a time, like any arm.

Table 1 holds wall time equal (`--seconds` of training, the periodic val checks not counted); table 2
holds forward passes equal (`--evals`, default: what `today` did in table 1; a delta-rule step counts
2K + 1). Every row gives test nats/byte on the cluster's test split and the share of backprop's gain over
a byte unigram (fitted on the cluster's train split) that the arm captures: (unigram - arm) /
(unigram - bptt), with table 1's reference in both tables. The plateau rule looks at the val split every
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
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    ARM_NAMES,
    Data,
    Result,
    arm_config,
    arm_init,
    cluster_data,
    map_jobs,
    md_head,
    md_row,
    pyplot,
    run_spsa,
    savefig,
    say,
)
from bench.recipe_seed import run_seed_table, seed_table
from soma_edge.config import Config
from soma_edge.expert import steps

BPTT_FOR = "default"  # the arm the BPTT reference shares its config, initial weights and batches with
BPTT_LRS = (3e-3, 1e-2, 3e-2)  # Adam lrs the reference sweeps (1e-2 was its one lr before the sweep)


def bptt_model(seed: int = 0) -> tuple[Config, Any]:
    """(config, torch model) of the BPTT reference: `BPTT_FOR`'s config, loaded with that arm's initial
    weights (the same flat vector, so the same input gain and every other init rule, bit for bit)."""
    from bench.torch_ref import reference  # torch: optional (the bench extra), only the reference needs it

    cfg = arm_config(BPTT_FOR, seed)
    return cfg, reference(cfg.model, arm_init(cfg))


def run_bptt(
    data: Data, seconds: float | None, steps_cap: int | None, check_steps: int, lr: float, seed: int = 0
) -> Result:
    """Torch BPTT with Adam at `lr` from `BPTT_FOR`'s initial weights, on that arm's minibatches (step s draws
    the batches SPSA step s draws), until `seconds` of training or `steps_cap` steps."""
    import torch  # optional, as above

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    cfg, model = bptt_model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)

    def score(xy: tuple[np.ndarray, np.ndarray]) -> float:
        with torch.no_grad():
            return float(model(torch.from_numpy(xy[0]), torch.from_numpy(xy[1])))

    res = Result(name="bptt", test=0.0, steps=0, evals=0, seconds=0.0, lr=lr)
    while (seconds is None or res.seconds < seconds) and (steps_cap is None or res.steps < steps_cap):
        t0 = time.perf_counter()
        for _ in range(check_steps):
            opt.zero_grad()
            parts = steps.batches(data.train, cfg, 0, res.steps)
            for x, y in parts:  # `accumulate` batches: their mean loss, as SPSA averages them
                (model(torch.from_numpy(x), torch.from_numpy(y)) / len(parts)).backward()
            opt.step()
            res.steps += 1
            res.evals += len(parts)
            if (seconds is not None and res.seconds + time.perf_counter() - t0 >= seconds) or res.steps == steps_cap:
                break
        res.seconds += time.perf_counter() - t0
        res.val = score(data.val)
        res.curve.append((res.seconds, res.val))
    res.test = score(data.test)
    return res


def pick_by_val(sweep: list[Result]) -> Result:
    """The sweep's run with the lowest val nats/byte (the test split never chooses); NaN (diverged) loses."""
    return min(sweep, key=lambda r: r.val if np.isfinite(r.val) else float("inf"))


def _job(args: tuple) -> Result:
    kind, name, data, seconds, evals, check, lr = args
    os.environ["OMP_NUM_THREADS"] = "1"
    if kind == "bptt":
        return run_bptt(data, seconds, evals, check, lr)
    return run_spsa(name, arm_config(name), data, seconds, evals, check)


def run_table(
    names: list[str], data: Data, seconds: float | None, evals: int | None, check: int, jobs: int, lrs: list[float]
) -> tuple[list[Result], list[Result]]:
    """(the arms' rows, the reference's chosen run last when `lrs`; every run of the reference's lr sweep)."""
    work = [("spsa", n, data, seconds, evals, check, None) for n in names]
    work += [("bptt", "bptt", data, seconds, None, max(10, check // 4), lr) for lr in lrs]
    out = map_jobs(_job, work, jobs)
    rows, sweep = out[: len(names)], out[len(names) :]
    for r in out:
        nats = f"test {r.test:.4f}, val {r.val:.4f} nats/byte"
        say(f"  {label(r)}: {nats}, {r.steps} steps, {r.evals} forward passes, {r.seconds:.0f} s")
    if sweep:
        best = pick_by_val(sweep)
        rows.append(best)
        if len(sweep) > 1 and best.lr in (min(lrs), max(lrs)):
            say(f"  bptt: the best lr {best.lr:g} is at the edge of the sweep; widen --bptt-lrs")
    return rows, sweep


def label(r: Result) -> str:
    return f"{r.name} (lr {r.lr:g})" if r.lr is not None else r.name


def sweep_note(sweep: list[Result], best: Result) -> str:
    runs = ", ".join(f"lr {r.lr:g}: {r.val:.3f}" for r in sweep)
    return (
        f"bptt: torch backprop through time from `{BPTT_FOR}`'s config and initial weights, on its batches, under"
        f" the same limits; Adam lr swept ({runs} val nats/byte), lr {best.lr:g} chosen by the val split"
    )


def captured(unigram: float, arm: float, ref: float) -> float:
    return (unigram - arm) / (unigram - ref) if unigram != ref else float("nan")


def table(title: str, rows: list[Result], unigram: float, ref: float) -> str:
    lines = [title, "", md_head(["arm", "test nats/byte", "captured", "steps", "forward passes", "train s"])]
    for r in rows:
        lines.append(
            md_row(
                [
                    label(r),
                    f"{r.test:.3f}",
                    f"{captured(unigram, r.test, ref):.2f}",
                    str(r.steps),
                    str(r.evals),
                    f"{r.seconds:.0f}",
                ]
            )
        )
    lines.append(md_row(["byte unigram (cluster train split)", f"{unigram:.3f}", "0", "", "", ""]))
    return "\n".join(lines)


def plot(rows: list[Result], unigram: float, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in rows:
        if r.curve:
            t, v = zip(*r.curve)
            ax.plot(t, v, label=f"{label(r)} ({r.test:.2f})", lw=2 if r.name == "bptt" else 1.4)
    ax.axhline(unigram, color="grey", ls=":", label=f"byte unigram ({unigram:.2f})")
    ax.set_xlabel("training seconds (one thread)")
    ax.set_ylabel("val nats/byte (cluster val split)")
    ax.set_title("One expert, E32/H128, cumulative recipe arms (test score in legend)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    savefig(fig, path, dpi=110)


def parse(argv: list[str] | None) -> argparse.Namespace:
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
    ap.add_argument(
        "--bptt-lrs",
        default=",".join(f"{lr:g}" for lr in BPTT_LRS),
        help="the BPTT reference's Adam lrs, comma-separated; each gets table 1's limits, the val split picks one",
    )
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    a.names = [n.strip() for n in a.arms.split(",") if n.strip()]
    unknown = [n for n in a.names if n not in ARM_NAMES]
    if unknown:
        ap.error(f"unknown arms {unknown} (known: {', '.join(ARM_NAMES)})")
    try:
        a.lrs = [] if a.no_bptt else [float(v) for v in a.bptt_lrs.split(",") if v.strip()]
    except ValueError:
        ap.error(f"--bptt-lrs must be comma-separated numbers, got {a.bptt_lrs!r}")
    if not a.no_bptt and (not a.lrs or min(a.lrs) <= 0):
        ap.error(f"--bptt-lrs needs at least one lr > 0 (or --no-bptt), got {a.bptt_lrs!r}")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    data = cluster_data(a.corpus, a.cluster, a.work)
    say(f"cluster {a.cluster} of {a.corpus}: {data.train.size} train bytes, unigram {data.unigram:.4f} nats/byte")
    t1, sweep = run_table(a.names, data, a.seconds, None, a.check_steps, a.jobs, a.lrs)
    ref = t1[-1].test if sweep else float("nan")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}; "
        f"corpus {a.corpus}, cluster {a.cluster}; jobs {a.jobs}\n"
    )
    print(table(f"Table 1: equal wall time ({a.seconds:g} s of training on one thread)", t1, data.unigram, ref))
    if sweep:
        print("\n" + sweep_note(sweep, t1[-1]))
    if a.evals >= 0:
        evals = a.evals or next((r.evals for r in t1 if r.name == "today"), 0)
        if evals > 0:
            t2, _ = run_table(a.names, data, None, evals, a.check_steps, a.jobs, [])
            print()
            title = f"Table 2: equal forward passes ({evals} each; a delta-rule step counts 2K + 1)"
            print(table(title, t2, data.unigram, ref))
    t3 = None
    if a.seed_evals > 0:
        picked = [n.strip() for n in a.seed_arms.split(",") if n.strip()] or None
        t3 = run_seed_table(a.corpus, a.work, a.seed_evals, a.seed_share, a.check_steps, a.jobs, picked)
        print()
        print(seed_table(t3, a.seed_evals, a.seed_share))
    if a.plot:
        plot(t1, data.unigram, a.plot)
        say(f"plot: {a.plot}")
    if a.json:
        print(json.dumps(json_out(t1, sweep, data.unigram, ref, t3)))
    return 0


def json_out(t1: list[Result], sweep: list[Result], unigram: float, ref: float, t3: list | None) -> dict[str, Any]:
    """Table 1's arms (the reference's row adds its lr and val), the reference's sweep, table 3's rows."""

    def arm(r: Result) -> dict[str, Any]:
        out = {"name": r.name, "test_nats_per_byte": r.test, "captured": captured(unigram, r.test, ref)}
        return out if r.lr is None else {**out, "lr": r.lr, "val_nats_per_byte": r.val, "init": BPTT_FOR}

    out: dict[str, Any] = {"arms": [arm(r) for r in t1]}
    if sweep:
        out["bptt_sweep"] = [
            {"lr": r.lr, "val_nats_per_byte": r.val, "test_nats_per_byte": r.test, "steps": r.steps} for r in sweep
        ]
    if t3 is not None:
        out["seed_table"] = [vars(r) for r in t3]
    return out


if __name__ == "__main__":
    raise SystemExit(main())
