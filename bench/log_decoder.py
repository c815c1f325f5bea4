"""What int8-coded decoder changes cost in learning: fixed-step runs of the demo expert, with and without.

    .venv/bin/python -m bench.log_decoder [--rounds 4] [--steps 1500] [--seeds 0,1] [--cluster 0]
                                          [--corpus default] [--jobs 2]

One cluster of the demo's split (as bench/recipe.py), the demo expert with the shipped recipe (delta-rule
decoder, Adam, sparse SPSA body, K = 1), one ORT thread. Each run trains `--rounds` rounds of `--steps` SPSA
steps, as a worker does between log replies:
- float32: the decoder stays as it trained (what a log with federation.log_decoder = "float32" carries);
- int8: at each round's end the worker adopts the decoder's change in int8 codes (spsa.log.code_decoder, what a
  worker sending an int8 log does), and trains on from there.
The two arms of a seed share the initialization, the batches and the noise. Prints the test split's
nats/byte after each round and, per seed, int8 minus float32 at the end (the issue's bound: within 0.01).
`--jobs 2` runs two runs at a time, one per core.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.common import Data, arm_config, cluster_data, map_jobs, platform_line
from soma_edge.engine.evaluator import evaluator_for, mean_loss
from soma_edge.expert import params, steps
from soma_edge.spsa.log import code_decoder
from soma_edge.spsa.optim import State
from worker.trainer import train

ARMS = ("float32", "int8")


def one(job: tuple[str, int, Data, int, int]) -> list[float]:
    """Test nats/byte after each round of one arm and seed."""
    arm, seed, data, rounds, n_steps = job
    cfg = arm_config("default", seed)
    ev = evaluator_for(cfg, "cpu", threads=1, parallel=1)
    state = State(params.init(cfg.model, cfg.seed))
    body = steps.log_body(cfg)
    out = []
    for _ in range(rounds):
        start = state.weights[body:].copy()
        train(state, data.train, cfg, ev, steps=n_steps)
        if arm == "int8":
            code_decoder(state, body, start)
        out.append(mean_loss(ev, state.weights, *data.test))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.log_decoder", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1500, help="SPSA steps per round")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--cluster", type=int, default=0)
    ap.add_argument("--corpus", default="default")
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",")]
    data = cluster_data(a.corpus, a.cluster, Path(tempfile.gettempdir()) / "soma-bench")
    print(f"{platform_line()}; demo expert, default recipe; {a.rounds} rounds x {a.steps} steps; seeds {seeds}")
    t0 = time.time()
    jobs = [(arm, seed, data, a.rounds, a.steps) for seed in seeds for arm in ARMS]
    curves = dict(zip([(arm, seed) for seed in seeds for arm in ARMS], map_jobs(one, jobs, a.jobs)))
    print("| seed | arm | " + " | ".join(f"round {r + 1}" for r in range(a.rounds)) + " |")
    print("|---|---|" + "---|" * a.rounds)
    for (arm, seed), curve in curves.items():
        print(f"| {seed} | {arm} | " + " | ".join(f"{x:.4f}" for x in curve) + " |")
    for seed in seeds:
        diff = curves[("int8", seed)][-1] - curves[("float32", seed)][-1]
        print(f"seed {seed}: int8 - float32 at the end = {diff:+.4f} nats/byte")
    print(f"({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
