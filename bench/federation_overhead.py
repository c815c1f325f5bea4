"""Where a federated round's wall time goes, and how many bytes it moves per expert.

For each round of a run (from its metrics.jsonl): the round's wall time (plan -> commit), each node's
seconds of SPSA compute, the compute share (mean over nodes of compute / wall), and the bytes moved per
expert: weights down (coordinator -> worker), shard bytes down, weights up. Steady state = every round
after the first (the first pays for capability probes, shard and version-0 transfers).

    python -m bench.federation_overhead --run runs/demo          # analyse an existing run
    python -m bench.federation_overhead --fresh --rounds 4 --round-seconds 55   # run the demo setting first
    python -m bench.federation_overhead --log-bytes [--seconds 60]  # log replies against weights replies

`--log-bytes` trains the ~124K, ~1M and ~8M experts for one round of `--seconds` each on this box (the
worker's own loop, ORT CPU EP), with a decoder that SPSA perturbs with the body and with the delta-rule
decoder, and prints the upstream bytes of that round's reply in weights mode (float32 weights and the
Adam moments, as sent) and in log mode (the update log, body scalars and dense decoder parts apart),
both encoded exactly as a reply carries them, with the coordinator's replay time and whether the
replay equals the trained weights bit for bit. Issue 12's target: >= 100x fewer bytes up at 1M and 8M
without a dense decoder.

Targets (issue 4): compute >= 90% of wall time in steady state; zero weight bytes to a worker whose
assignment did not change.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from soma_edge import codec
from soma_edge.config import Config, ModelConfig
from soma_edge.corpus import documents, sources
from soma_edge.engine.evaluator import evaluator_for
from soma_edge.expert import params, steps
from soma_edge.rundir import metrics
from soma_edge.rundir.layout import RunDir
from soma_edge.spsa import log, optim
from soma_edge.wire import protocol
from worker.trainer import train


def load(run: Path) -> list[metrics.Line]:
    return metrics.read_lines(RunDir(run))


def table(run: Path) -> dict:
    lines_all = load(run)
    rounds = metrics.round_lines(lines_all)
    experts = metrics.expert_lines(lines_all)
    print(f"run: {run}")
    print(
        f"{'round':>5} {'wall s':>7} {'compute s/node':>15} {'share':>6} {'moved':>6} "
        f"{'w down/exp':>11} {'shards down/exp':>16} {'w up/exp':>9} {'sticky w down':>14}"
    )
    rows = []
    for r in rounds:
        lines = [m for m in experts if m.round == r.round]
        n = max(len(lines), 1)
        comp = r.compute_seconds or {}
        per_node = sum(comp.values()) / max(len(r.nodes or [1]), 1)
        moved = set(r.moved or [])
        sticky_down = sum(m.weights_bytes_down for m in lines if m.expert not in moved)
        row = {
            "round": r.round,
            "wall": r.round_seconds_total,
            "compute_per_node": per_node,
            "share": r.compute_share,
            "moved": len(moved),
            "w_down": sum(m.weights_bytes_down for m in lines) / n,
            "s_down": sum(m.shard_bytes_down for m in lines) / n,
            "w_up": sum(m.weights_bytes_up for m in lines) / n,
            "sticky_down": sticky_down,
        }
        rows.append(row)
        print(
            f"{row['round']:>5} {row['wall']:>7.1f} {row['compute_per_node']:>15.1f} {100 * row['share']:>5.1f}% "
            f"{row['moved']:>6} {row['w_down']:>11.0f} {row['s_down']:>16.0f}"
            f" {row['w_up']:>9.0f} {row['sticky_down']:>14}"
        )
    steady = rows[1:] or rows
    share = sum(r["share"] for r in steady) / max(len(steady), 1)
    wall = sum(r["wall"] for r in steady) / max(len(steady), 1)
    summary = {
        "steady_rounds": len(steady),
        "steady_compute_share": share,
        "steady_wall_s": wall,
        "steady_overhead_s": wall * (1 - share),
        "sticky_weight_bytes_down": sum(r["sticky_down"] for r in steady),
        "steady_weight_bytes_up_per_expert": sum(r["w_up"] for r in steady) / max(len(steady), 1),
    }
    print(
        f"steady state (rounds {', '.join(str(r['round']) for r in steady)}): compute {100 * share:.1f}% of "
        f"{wall:.1f} s rounds, {summary['steady_overhead_s']:.1f} s/round in Flower round trips, process start, "
        f"transfers and checkpoints; weight bytes sent for unchanged assignments: {summary['sticky_weight_bytes_down']}"
    )
    return summary


def fresh(rounds: int, round_seconds: float, experts: int, workers: int) -> Path:
    run = Path(tempfile.mkdtemp(prefix="soma-fed-bench-")) / "run"
    cmd = [
        sys.executable,
        "-m",
        "coordinator",
        "start",
        "--run",
        str(run),
        "--local-workers",
        str(workers),
        "--experts",
        str(experts),
        "--rounds",
        str(rounds),
        "--round-seconds",
        str(round_seconds),
        "--port",
        "0",
    ]
    t0 = time.time()
    subprocess.run(cmd, check=True)
    print(f"federation finished in {time.time() - t0:.0f} s")
    return run


SIZES = {"124K": (32, 128), "1M": (64, 448), "8M": (128, 1280)}  # (embed, hidden) of a one-layer lstm expert


def log_bytes(seconds: float) -> list[dict]:
    data = documents.to_stream(documents.by_split(sources.default_documents())["train"])
    print(
        f"{'expert':>6} {'params':>9} {'decoder':>7} {'steps':>6} {'weights up B':>13} {'log up B':>10} "
        f"{'log body B':>10} {'log dec B':>10} {'ratio':>9} {'replay s':>8} {'bit-identical':>13}"
    )
    rows = []
    for name, (embed, hidden) in SIZES.items():
        for decoder in ("spsa", "delta"):
            cfg = Config(model=ModelConfig(embed=embed, hidden=hidden))
            cfg.spsa.decoder = decoder
            lay = params.layout(cfg.model)
            start = optim.State(params.init(cfg.model, cfg.seed))
            state = optim.State(start.weights.copy())
            rep = train(state, data, cfg, evaluator_for(cfg, "cpu"), steps=None, seconds=seconds)
            ulog = log.record_log(0, 1.0, rep.grads, state, steps.log_body(cfg))
            common = {
                "expert": 0,
                "base_sha256": "0" * 64,
                "version": 1,
                "step": state.step,
                "steps": rep.steps,
                "forward_evals": rep.forward_evals,
                "seconds": rep.seconds,
                "train_loss": rep.loss,
                "sha256": protocol.weights_sha256(state.weights),
            }
            as_weights = len(codec.encode({**common, "weights": state.weights, "opt": state.opt.to_record()}, "r"))
            as_log = len(codec.encode({**common, "weights": None, "opt": None, "log": ulog.to_record()}, "r"))
            t0 = time.perf_counter()
            got = steps.replay(cfg, start, ulog, 0)
            replay_s = time.perf_counter() - t0
            same = got.weights.tobytes() == state.weights.tobytes()
            parts = ulog.nbytes()
            row = {
                "expert": name,
                "params": lay.size,
                "decoder": decoder,
                "steps": rep.steps,
                "weights_up": as_weights,
                "log_up": as_log,
                "log_body": parts["body"],
                "log_decoder": parts["decoder"],
                "ratio": as_weights / as_log,
                "replay_s": replay_s,
                "bit_identical": same,
            }
            rows.append(row)
            print(
                f"{name:>6} {lay.size:>9} {decoder:>7} {rep.steps:>6} {as_weights:>13,} {as_log:>10,} "
                f"{parts['body']:>10,} {parts['decoder']:>10,} {row['ratio']:>8.0f}x {replay_s:>8.1f} "
                f"{'yes' if same else 'NO':>13}",
                flush=True,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", type=Path, help="analyse this run directory")
    ap.add_argument("--fresh", action="store_true", help="run the demo setting first (embedded, local workers)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--round-seconds", type=float, default=55.0)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="also print the summary as one JSON object")
    ap.add_argument("--log-bytes", action="store_true", help="log replies against weights replies, per expert size")
    ap.add_argument("--seconds", type=float, default=60.0, help="--log-bytes: the round's compute per size")
    args = ap.parse_args()
    if args.log_bytes:
        rows = log_bytes(args.seconds)
        if args.json:
            print(json.dumps(rows))
        return
    if not args.run and not args.fresh:
        ap.error("give --run DIR or --fresh")
    run = fresh(args.rounds, args.round_seconds, args.experts, args.workers) if args.fresh else args.run
    summary = table(run)
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
