"""Compute share of federated rounds on a slow link, in weights mode and in log mode.

    sudo .venv/bin/python -m bench.slow_link [--sizes 124K,1M] [--modes weights,log] [--rounds 3]
                                             [--round-seconds 60] [--mbit 1] [--experts 2]
                                             [--deadline-slack 600]

For each expert size and reply mode, a real federation on simulated boxes (tests/helpers/netboxes.py:
network namespaces, a veth link limited with tc htb): the coordinator in one namespace, one worker in another
behind `--mbit` Mbit/s, `--experts` experts (all on that worker). A reply mode (weights, log, auto) runs
with `spsa.decoder = "spsa"` (no dense decoder) and the flags' round timing; mode `default` runs the shipped
settings (the delta-rule decoder, reply = auto, 60 s rounds, the default deadlines), setting only the model
size, experts, rounds and min_nodes. Prints, per round, the round's wall time, the worker's compute
seconds, the compute share counted by when the training happened (a round's span runs from its plan to
the next one's, the last one's to its commit: soma_edge.wire.compute_share), the same share as far as the
round's commit knew (the round line's: without what the next round's results trained inside its span),
and the bytes down and up; then the mean share of the rounds after the first. Needs root.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, coordinator_cmd, platform_line, worker_cmd
from soma_edge.processes.launch import free_port
from soma_edge.rundir import metrics
from soma_edge.rundir.layout import RunDir
from soma_edge.rundir.metrics import RoundLine
from soma_edge.wire import compute_share
from tests.helpers import netboxes

SIZES = {"124K": (32, 128), "1M": (64, 448), "8M": (128, 1280)}


def _config(size: str, mode: str, args) -> str:
    """The run's config: with mode "default", the shipped settings but for the model size, experts,
    rounds and min_nodes; else a reply mode with `spsa.decoder = "spsa"` and the flags' round timing."""
    embed, hidden = SIZES[size]
    head = f"[model]\nembed = {embed}\nhidden = {hidden}\n"
    fed = f"[federation]\nexperts = {args.experts}\nrounds = {args.rounds}\nmin_nodes = 1\n"
    if mode == "default":
        return head + fed
    return (
        head
        + '[spsa]\ndecoder = "spsa"\n'
        + fed
        + (
            f"round_seconds = {args.round_seconds}\ndeadline_factor = 1.5\n"
            f'deadline_slack = {args.deadline_slack}\nreply = "{mode}"\n'
        )
    )


def one(size: str, mode: str, args, work: Path) -> list[RoundLine]:
    cfg = work / f"{size}-{mode}.toml"
    cfg.write_text(_config(size, mode, args))
    run, env, port = work / f"run-{size}-{mode}", dict(os.environ), free_port()  # the corpus is in the usual cache
    boxes = netboxes.Boxes()
    try:
        coord = boxes.add("coord")
        slow = boxes.add("slow", link_to=coord, mbit=args.mbit)
        start = boxes.popen(
            coord,
            coordinator_cmd(run, cfg, port),
            work / f"{size}-{mode}.log",
            env=env,
            cwd=ROOT,
        )
        boxes.popen(
            slow,
            worker_cmd(f"{slow.peer}:{port}", "slow", work / f"cache-{size}-{mode}"),
            work / f"{size}-{mode}-w.log",
            env=env,
            cwd=ROOT,
        )
        code = start.wait(args.rounds * (args.round_seconds * 1.5 + args.deadline_slack + 300) + 300)
        if code != 0:
            raise SystemExit(f"{size} {mode}: start exited {code}; see {work / f'{size}-{mode}.log'}")
    finally:
        boxes.close()
    return metrics.round_lines(metrics.read_lines(RunDir(run)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="124K,1M")
    ap.add_argument(
        "--modes",
        default="weights,log",
        help="reply modes, or default (the shipped settings: only size, experts, rounds and min_nodes set)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--round-seconds", type=float, default=60.0)
    ap.add_argument("--mbit", type=float, default=1.0)
    ap.add_argument("--experts", type=int, default=2)
    ap.add_argument(
        "--deadline-slack",
        type=float,
        default=600.0,
        help="seconds past round_seconds x 1.5 a round waits; 8M weights take ~12 min up at 1 Mbit/s",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (network namespaces, veth, tc)")
    print(
        f"{platform_line()}; link {args.mbit:g} Mbit/s; "
        f"{args.rounds} rounds of {args.round_seconds:g} s; {args.experts} experts on the slow worker"
    )
    print(
        f"{'expert':>6} {'mode':>7} {'round':>5} {'wall s':>7} {'compute s':>9}"
        f" {'share':>6} {'at commit':>9} {'down B':>11} {'up B':>11}"
    )
    work = Path(tempfile.mkdtemp(prefix="soma-slow-link-"))
    for size in args.sizes.split(","):
        for mode in args.modes.split(","):
            t0 = time.time()
            rounds = one(size, mode, args, work)
            spans = compute_share.shares(rounds)
            for r in rounds:
                comp = sum((r.compute_seconds or {}).values())
                print(
                    f"{size:>6} {mode:>7} {r.round:>5} {r.round_seconds_total:>7.1f} {comp:>9.1f} "
                    f"{100 * spans.get(r.round, 0.0):>5.1f}% {100 * r.compute_share:>8.1f}% "
                    f"{r.bytes_down:>11,} {r.bytes_up:>11,}",
                    flush=True,
                )
            later = [spans.get(r.round, 0.0) for r in rounds[1:] or rounds]
            print(
                f"{size:>6} {mode:>7} rounds 2+: compute share {100 * sum(later) / len(later):.1f}% "
                f"({time.time() - t0:.0f} s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
