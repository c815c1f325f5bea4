"""Loss at equal compute budget: SOMA (N experts, federated) vs monolithic SPSA vs backprop (Adam).

    .venv/bin/python -m bench.equal_budget --minutes 5 [--corpus debian] [--params 120000] [--ns 2,4,8]
        [--plot docs/img/equal_budget.png] [--json]

Every arm has the same total parameter count M (an expert has ~M/N parameters, embedding 16, hidden size
chosen to fit, as in bench/variance.py) and the same compute budget F in forward FLOPs:
- `--minutes` becomes F once, at the start: this machine's measured SPSA forward throughput on the
  monolithic shape (evaluations/s, both cores) times the analytic FLOPs of one forward pass, times the
  minutes. Load from other processes afterwards changes wall time, never what an arm gets.
- An SPSA step costs 2K forward passes of its expert, plus one clean forward with the delta-rule decoder
  (`soma_edge.config.evals_per_step`); a backprop step costs 3x its forward pass.
- SOMA with N experts: each expert gets F/N, i.e. `federation.max_steps` SPSA steps, and trains through
  the real federation (`soma-coord start` with an embedded SuperLink and local workers). Its score is the
  routed top-2 mixture (soma_edge.corpus.mixture, the router fitted by `soma-coord prepare`).
- Monolithic SPSA: the same path with N = 1 (one expert of M parameters, one local worker).
- Adam: bench/torch_ref.py's TorchExpert of the monolithic shape, first-order: the backprop reference.
Each arm's learning rate comes from a short sweep (a fraction of the arm's steps, one expert, scored on its
cluster's val split). All arms are scored on the same test bytes: held-out nats/byte; curves of that loss
against FLOPs (on an evenly spread sample of the test split) come from the run's per-round checkpoints.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import tomli_w

from bench.common import (
    ROOT,
    TOP_K,
    expert_shape,
    forward_flops,
    machine,
    md_head,
    md_row,
    mixture_loss,
    ort_logprobs,
    prepared_run,
    protocol_scores,
    pyplot,
    savefig,
    say,
    shard_stream,
)
from bench.equal_budget_backprop import adam_train, run_adam_arm, torch_eval_loss
from soma_edge.config import Config, ModelConfig, evals_per_step
from soma_edge.corpus import documents, sources
from soma_edge.corpus import router as routing
from soma_edge.engine.evaluator import evaluator_for, mean_loss
from soma_edge.engine.runtime import cpu_count
from soma_edge.expert import params
from soma_edge.rundir.layout import RunDir
from soma_edge.rundir.metrics import expert_lines, read_lines, round_lines
from soma_edge.spsa.optim import State
from worker.trainer import train as spsa_train

SWEEP_VAL_WINDOWS = 64
Federate = Callable[[Path], None]  # runs the federation on a prepared, configured run directory


def default_corpus() -> str:
    """`debian` when its cache is complete (built by `soma-coord prepare debian` as root), else `default`."""
    return "debian" if (sources.cache_dir() / "debian" / "manifest.json").exists() else "default"


def base_config(m: ModelConfig, n: int, lr: float, steps: int, corpus_name: str, seed: int) -> Config:
    cfg = Config()
    cfg.model, cfg.seed, cfg.device = m, seed, "cpu"
    cfg.spsa.lr, cfg.spsa.total_steps = lr, steps  # cosine over the arm's whole budget
    cfg.spsa.warmup_steps = min(cfg.spsa.warmup_steps, max(steps // 10, 0))
    cfg.federation.experts, cfg.federation.corpus = n, corpus_name
    cfg.federation.max_steps = steps
    return cfg


# --- data and scoring --------------------------------------------------------------------------------


def test_bytes(corpus_name: str, limit: int) -> np.ndarray:
    docs = documents.by_split(sources.load_documents(corpus_name))["test"]
    data = documents.to_stream(docs)
    return data[:limit] if limit else data


def spread_sample(data: np.ndarray, size: int, pieces: int = 16) -> np.ndarray:
    """`pieces` contiguous slices evenly spaced over `data`, `size` bytes in all (the test stream is in
    corpus order, domain after domain, so a prefix would be one domain)."""
    if size <= 0 or size >= data.size:
        return data
    step, piece = data.size // pieces, size // pieces
    return np.concatenate([data[i * step : i * step + piece] for i in range(pieces)])


def prepared(work: Path, corpus_name: str, n: int, seed: int) -> RunDir:
    """A prepared directory per N (router + shards), reused across reruns; arms copy it."""
    return prepared_run(work / "prepared" / f"n{n}", corpus_name, n, seed)


def sweep_val(rd: RunDir) -> np.ndarray:
    """Expert 0's val split; all experts' when its cluster has almost no held-out text (tiny corpora)."""
    val = shard_stream(rd, 0, "val")
    if val.size <= 4 * Config().data.seq_len:
        n = int(rd.read_prepare().experts)
        val = np.concatenate([shard_stream(rd, e, "val") for e in range(n)])
    return val


# --- learning-rate sweeps (short, one expert, in-process) --------------------------------------------


def sweep_spsa(
    rd: RunDir, m: ModelConfig, n: int, lrs: list[float], steps: int, corpus_name: str, seed: int
) -> dict[float, float]:
    """Val nats/byte of expert 0 after `steps` SPSA steps (cosine over them) at each lr."""
    train, val = shard_stream(rd, 0, "train"), sweep_val(rd)
    x, y = documents.eval_windows(val, Config().data.seq_len, SWEEP_VAL_WINDOWS)
    ev = evaluator_for(base_config(m, n, lrs[0], steps, corpus_name, seed), "cpu")
    out = {}
    for lr in lrs:
        cfg = base_config(m, n, lr, steps, corpus_name, seed)
        state = State(params.init(m, seed))
        spsa_train(state, train, cfg, ev, expert=0, steps=steps)
        out[lr] = float(mean_loss(ev, state.weights, x, y))
        say(f"  sweep N={n} lr={lr:g}: val {out[lr]:.4f} nats/byte after {steps} steps")
    return out


def sweep_adam(
    rd: RunDir, m: ModelConfig, lrs: list[float], steps: int, batch: int, seq: int, seed: int
) -> dict[float, float]:
    train, val = shard_stream(rd, 0, "train"), sweep_val(rd)
    x, y = documents.eval_windows(val, seq, SWEEP_VAL_WINDOWS)
    out = {}
    for lr in lrs:
        model = adam_train(m, train, lr, steps, batch, seq, seed)
        out[lr] = torch_eval_loss(model, x, y)
        say(f"  sweep adam lr={lr:g}: val {out[lr]:.4f} nats/byte after {steps} steps")
    return out


# --- arms --------------------------------------------------------------------------------------------


def soma_coord_start(run: Path) -> None:
    """The real federation: `soma-coord start` (embedded SuperLink, local workers) on a configured run."""
    exe = Path(sys.executable).parent / "soma-coord"
    cmd = [str(exe), "start", "--run", str(run), "--config", str(run / "bench.toml"), "--port", "0"]
    with open(run / "start.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if rc != 0:
        tail = (run / "start.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"soma-coord start failed (exit {rc}) on {run}:\n{tail}")


def run_spsa_arm(
    work: Path,
    prep: RunDir,
    cfg: Config,
    federate: Federate,
    curve_data: np.ndarray,
    test_data: np.ndarray,
    round_seconds: float,
    name: str,
) -> dict[str, Any]:
    n, m, seq = cfg.federation.experts, cfg.model, cfg.data.seq_len
    run = work / "runs" / name
    if run.exists():
        shutil.rmtree(run)
    shutil.copytree(prep.root, run)
    fed = cfg.federation
    fed.rounds = 100_000  # max_steps ends the run
    fed.round_seconds = round_seconds
    fed.local_workers = fed.min_nodes = min(n, 2)
    fed.join_grace = 0.0  # round 1 waits for min_nodes, which are all the workers there are: no one else comes
    fed.keep_versions = 100_000  # every version stays: the curve is scored from them afterwards
    fed.val_windows = 16  # the coordinator's own per-round val loss: keep it cheap
    (run / "bench.toml").write_text(tomli_w.dumps(cfg.to_dict()))
    t0 = time.perf_counter()
    federate(run)
    wall = time.perf_counter() - t0

    rd = RunDir(run)
    state = rd.read_state()
    f1 = forward_flops(m, cfg.data.batch, seq)
    lines = read_lines(rd)
    rounds = sorted({x.round for x in round_lines(lines)})
    router = routing.load(rd.router)
    points, evals, compute = [], 0, 0.0
    versions = {e: 0 for e in range(n)}
    fns = {e: ort_logprobs(m, rd.load_expert(rd.expert_rel(e, 0))["weights"]) for e in range(n)}
    points.append({"round": 0, "forward_evals": 0, "flops": 0.0, "loss": mixture_loss(router, fns, curve_data, seq)})
    for r in rounds:
        for x in (x for x in expert_lines(lines) if x.round == r):
            evals += int(x.forward_evals)
            compute += float(x.seconds)
            if x.version != versions[x.expert]:
                versions[x.expert] = x.version
                w = rd.load_expert(rd.expert_rel(x.expert, x.version))["weights"]
                fns[x.expert] = ort_logprobs(m, w)
        points.append(
            {
                "round": r,
                "forward_evals": evals,
                "flops": evals * f1,
                "loss": mixture_loss(router, fns, curve_data, seq),
            }
        )
    final = {e: ort_logprobs(m, rd.load_expert(state.expert(e).path)["weights"]) for e in range(n)}
    steps = [int(state.expert(e).step) for e in range(n)]
    return {
        "arm": name,
        "kind": "soma" if n > 1 else "monolithic-spsa",
        "experts": n,
        "shape": m.__dict__,
        "params_per_expert": params.count(m),
        "params_total": n * params.count(m),
        "lr": cfg.spsa.lr,
        "directions": cfg.spsa.directions,
        "steps_per_expert": steps,
        "forward_evals": evals,
        "flops": evals * f1,
        **protocol_scores(router, final, test_data, seq).arm_fields(),
        "top_k": min(TOP_K, n),
        "wall_seconds": wall,
        "compute_seconds": compute,
        "rounds": len(rounds),
        "curve": points,
    }


# --- budget ------------------------------------------------------------------------------------------


def measure_rate(prep: RunDir, m: ModelConfig, seconds: float, seed: int) -> float:
    """Forward evaluations/s of SPSA training on the monolithic shape, both cores (what a lone worker does)."""
    cfg = base_config(m, 1, 5e-3, 0, "default", seed)
    ev = evaluator_for(cfg, "cpu")
    data = shard_stream(prep, 0, "train")
    spsa_train(State(params.init(m, seed)), data, cfg, ev, steps=2)  # warm the session up
    rep = spsa_train(State(params.init(m, seed)), data, cfg, ev, seconds=seconds)
    return rep.evals_per_s


# --- output ------------------------------------------------------------------------------------------


def table(out: dict[str, Any]) -> str:
    monos = [a for a in out["arms"] if a["kind"] == "monolithic-spsa"]
    mono = min(monos, key=lambda a: a["test_nats_per_byte"]) if monos else None
    lines = [
        md_head(
            [
                "arm",
                "N",
                "params",
                "lr",
                "steps/expert",
                "forward evals",
                "FLOPs / budget",
                "test nats/byte",
                "vs mono SPSA",
                "paper protocol",
                "stream, paper's bytes",
                "wall s",
            ]
        )
    ]
    for a in out["arms"]:
        rel = f"{(a['test_nats_per_byte'] / mono['test_nats_per_byte'] - 1) * 100:+.1f}%" if mono else "n/a"
        paper = [f"{a[k]:.4f}" if a.get(k) is not None else "-" for k in ("test_paper", "test_stream_paper_bytes")]
        lines.append(
            md_row(
                [
                    a["arm"],
                    str(a["experts"]),
                    f"{a['params_total']:,}",
                    f"{a['lr']:g}",
                    f"{a['steps_per_expert'][0]:,}",
                    f"{a['forward_evals']:,}",
                    f"{a['flops'] / out['budget_flops']:.3f}",
                    f"{a['test_nats_per_byte']:.4f}",
                    rel,
                    *paper,
                    f"{a['wall_seconds']:.0f}",
                ]
            )
        )
    return "\n".join(lines)


def plot(out: dict[str, Any], path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.8))
    for a in out["arms"]:
        xs = [p["flops"] / 1e12 for p in a["curve"]]
        ys = [p["loss"] for p in a["curve"]]
        style = "--" if a["kind"] == "backprop-reference" else "-"
        label = {
            "soma": f"SOMA N={a['experts']}",
            "monolithic-spsa": "monolithic SPSA (N=1)",
            "backprop-reference": "Adam (backprop reference)",
        }[a["kind"]]
        extra = a["arm"] not in ("mono-spsa", "adam") and not a["arm"].startswith("soma-n") or "-lr" in a["arm"]
        ax.plot(
            xs,
            ys,
            style,
            marker="o",
            ms=2 if extra else 3,
            lw=0.9 if extra else 1.8,
            alpha=0.75 if extra else 1,
            label=f"{label}, lr {a['lr']:g}" + (" (extra lr)" if extra else ""),
        )
    if out.get("unigram_nats_per_byte"):
        ax.axhline(out["unigram_nats_per_byte"], color="grey", lw=0.8, ls=":", label="unigram entropy")
    ax.axvline(out["budget_flops"] / 1e12, color="black", lw=0.8, ls=":")
    ax.set_xlabel("training compute (forward TFLOPs; backprop step = 3 forwards)")
    ax.set_ylabel("held-out nats/byte (test sample)")
    ax.set_title(f"Equal budget, {out['params_target']:,} params total, corpus {out['corpus']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    savefig(fig, Path(path), dpi=110)
    plt.close(fig)


# --- main --------------------------------------------------------------------------------------------


def floats(s: str) -> list[float]:
    return [float(v) for v in s.split(",") if v]


def main(argv: list[str] | None = None, federate: Federate = soma_coord_start) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--minutes", type=float, default=5.0, help="per-arm budget: minutes of monolithic SPSA on this machine"
    )
    ap.add_argument("--corpus", default=None, help="debian (if built), default, or a text file/folder")
    ap.add_argument("--params", type=int, default=120_000, help="total parameter count M of every arm")
    ap.add_argument("--ns", default="2,4,8", help="SOMA expert counts")
    ap.add_argument("--lrs", default="2.5e-3,5e-3,1e-2,2e-2", help="SPSA lr sweep grid")
    ap.add_argument("--adam-lrs", default="1e-3,3e-3,1e-2", help="Adam lr sweep grid")
    ap.add_argument("--sweep-frac", type=float, default=0.1, help="sweep runs this fraction of an arm's steps")
    ap.add_argument("--no-adam", action="store_true")
    ap.add_argument("--no-mono", action="store_true", help="skip the monolithic SPSA arm (extra SOMA arms)")
    ap.add_argument("--round-seconds", type=float, default=60.0)
    ap.add_argument("--rate-seconds", type=float, default=10.0, help="how long to measure the forward throughput")
    ap.add_argument("--test-bytes", type=int, default=0, help="score at most this many test bytes (0 = all)")
    ap.add_argument("--curve-bytes", type=int, default=131072, help="test-sample bytes scored at every round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default="runs/equal_budget", help="run directories and partial results")
    ap.add_argument("--plot", default=None, help="write a PNG plot here")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument(
        "--budget-tflops",
        type=float,
        default=None,
        help="use this budget instead of measuring one (to add arms to an earlier run at its budget)",
    )
    ap.add_argument("--lr", default="", help="pinned lrs that skip the sweep, e.g. n1=0.01,adam=0.003")
    ap.add_argument("--tag", default="", help="suffix for arm names (extra arms of an earlier run)")
    ap.add_argument(
        "--from-json",
        default=None,
        help="comma-separated results.json files: merge their arms, print the table and plot; trains nothing",
    )
    args = ap.parse_args(argv)
    if args.from_json:
        return report(merge([Path(p) for p in args.from_json.split(",") if p]), args)

    t0 = time.perf_counter()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    corpus_name = args.corpus or default_corpus()
    ns = [int(v) for v in args.ns.split(",") if v]
    B, T = Config().data.batch, Config().data.seq_len
    K = Config().spsa.directions
    shapes = {n: expert_shape(args.params, n) for n in [1, *ns]}
    preps = {n: prepared(work, corpus_name, n, args.seed) for n in [1, *ns]}
    test_data = test_bytes(corpus_name, args.test_bytes)
    curve_data = spread_sample(test_data, args.curve_bytes)
    train_all = documents.to_stream(documents.by_split(sources.load_documents(corpus_name))["train"])
    unigram = documents.unigram_entropy(train_all, test_data)
    say(
        f"corpus {corpus_name}: {test_data.size:,} test bytes (curve sample {curve_data.size:,}); unigram {unigram:.4f}"
    )

    # The budget, fixed once: forward FLOPs = minutes x measured rate on the monolithic shape.
    f_mono = forward_flops(shapes[1], B, T)
    if args.budget_tflops:
        rate, budget = None, args.budget_tflops * 1e12
    else:
        rate = measure_rate(preps[1], shapes[1], args.rate_seconds, args.seed)
        budget = args.minutes * 60 * rate * f_mono
    per_step = evals_per_step(Config().spsa)  # 2K probes, plus the delta rule's clean forward
    steps = {n: max(1, int(budget / (n * per_step * forward_flops(shapes[n], B, T)))) for n in [1, *ns]}
    adam_steps = max(1, int(budget / (3 * f_mono)))
    how = "given" if rate is None else f"{args.minutes:g} min x {rate:.1f} forward evals/s x {f_mono / 1e9:.3f} GFLOP"
    say(f"budget: {how} = {budget / 1e12:.2f} TFLOPs; SPSA steps per expert {steps}, Adam steps {adam_steps}")

    out: dict[str, Any] = {
        "machine": machine(),
        "corpus": corpus_name,
        "params_target": args.params,
        "minutes": args.minutes,
        "forward_evals_per_s": rate,
        "forward_flops_mono": f_mono,
        "budget_flops": budget,
        "batch": B,
        "seq_len": T,
        "directions": K,
        "test_bytes": int(test_data.size),
        "curve_bytes": int(curve_data.size),
        "unigram_nats_per_byte": unigram,
        "sweep": {},
        "arms": [],
    }
    partial = work / "results.json"

    def save() -> None:
        out["seconds"] = time.perf_counter() - t0
        partial.write_text(json.dumps(out, indent=1))

    lrs, adam_lrs = floats(args.lrs), floats(args.adam_lrs)
    chosen: dict[str, float] = {k: float(v) for k, v in (kv.split("=") for kv in args.lr.split(",") if kv)}
    spsa_ns = ns if args.no_mono else [1, *ns]
    for n in spsa_ns:
        if f"n{n}" in chosen:
            continue
        s = max(10, int(args.sweep_frac * steps[n]))
        res = sweep_spsa(preps[n], shapes[n], n, lrs, s, corpus_name, args.seed)
        chosen[f"n{n}"] = min(res, key=res.get)
        out["sweep"][f"n{n}"] = {"steps": s, "val_nats_per_byte": {f"{k:g}": v for k, v in res.items()}}
        save()
    if not args.no_adam:
        import torch  # optional (the bench extra): only the Adam arm needs it

        torch.set_num_threads(cpu_count())
    if not args.no_adam and "adam" not in chosen:
        s = max(10, int(args.sweep_frac * adam_steps))
        res = sweep_adam(preps[1], shapes[1], adam_lrs, s, B, T, args.seed)
        chosen["adam"] = min(res, key=res.get)
        out["sweep"]["adam"] = {"steps": s, "val_nats_per_byte": {f"{k:g}": v for k, v in res.items()}}
    out["lr"] = {k: v for k, v in chosen.items()}
    say(f"chosen lr: {out['lr']}")
    save()

    for n in spsa_ns:
        name = ("mono-spsa" if n == 1 else f"soma-n{n}") + args.tag
        cfg = base_config(shapes[n], n, chosen[f"n{n}"], steps[n], corpus_name, args.seed)
        arm = run_spsa_arm(work, preps[n], cfg, federate, curve_data, test_data, args.round_seconds, name)
        out["arms"].append(arm)
        say(
            f"{name}: test {arm['test_nats_per_byte']:.4f} nats/byte, {arm['flops'] / budget:.3f} of the budget, "
            f"wall {arm['wall_seconds']:.0f} s"
        )
        save()
    if not args.no_adam:
        arm = run_adam_arm(preps[1], shapes[1], chosen["adam"], adam_steps, B, T, args.seed, curve_data, test_data)
        arm["arm"] += args.tag
        out["arms"].append(arm)
        say(f"adam: test {arm['test_nats_per_byte']:.4f} nats/byte, wall {arm['wall_seconds']:.0f} s")
        save()

    save()
    return report(out, args)


def merge(paths: list[Path]) -> dict[str, Any]:
    """The first run's header with the arms of all of them (which must share its budget and corpus)."""
    runs = [json.loads(p.read_text()) for p in paths]
    out = runs[0]
    for r in runs[1:]:
        if abs(r["budget_flops"] - out["budget_flops"]) > 1e-6 * out["budget_flops"] or r["corpus"] != out["corpus"]:
            raise SystemExit(f"error: {r['corpus']} at {r['budget_flops']:.4g} FLOPs is not the first run's budget")
        out["arms"] = out["arms"] + r["arms"]
        out["seconds"] = out.get("seconds", 0) + r.get("seconds", 0)
        out.setdefault("extra_runs", []).append(
            {"sweep": r.get("sweep"), "lr": r.get("lr"), "seconds": r.get("seconds")}
        )
    return out


def report(out: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Table (or JSON) and plot. The best SOMA arm of each N is compared with the best monolithic SPSA arm."""
    monos = [a for a in out["arms"] if a["kind"] == "monolithic-spsa"]
    if monos:
        mono = min(monos, key=lambda a: a["test_nats_per_byte"])
        best: dict[str, float] = {}
        for a in out["arms"]:
            if a["kind"] == "soma":
                k = str(a["experts"])
                best[k] = min(best.get(k, math.inf), a["test_nats_per_byte"])
        out["soma_vs_mono"] = {k: 1 - v / mono["test_nats_per_byte"] for k, v in best.items()}
    if args.plot:
        plot(out, args.plot)
    if args.json:
        print(json.dumps(out))
    else:
        print(table(out))
        print(
            f"SOMA improvement over the best monolithic SPSA arm (1 - soma/mono): {out.get('soma_vs_mono')}; "
            f"total {out.get('seconds', 0):.0f} s"
        )
    return out


if __name__ == "__main__":
    main()
