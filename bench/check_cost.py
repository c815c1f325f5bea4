"""What checking an update log costs the coordinator, per log step, on one of its check threads.

    python -m bench.check_cost                  # --sizes 124K,L --noises rademacher,rank1 --ks 1,8,64
    python -m bench.check_cost --json           # ... and one JSON line with every cell
    python -m bench.check_cost --replay-only    # the replay column alone (a minute, where the audits take ten)

A log reply is checked in two parts (coordinator.replay, coordinator.checks): the **replay** of every step
(g_j z_j summed over every direction from its key, a cache-sized block of weights at a time without
building any z whole (soma_edge.spsa.noise.add_rademacher, add_rank1), then the optimizer's update), and,
with federation.audit_steps > 0, the **audit**: each sampled step's 2K losses recomputed by forward passes
at the replayed weights, and, where the decoder learns by the delta rule, the decoder rebuilt along every
step, which with spsa.decoder_from = "probes" (the default) takes that step's 2K probes as well. So a
round of S log steps with s audited costs S x replay + s x audit, plus S x audit again for a delta-rule
decoder with its gradient from the probes (S x one clean forward with decoder_from = "clean").

Each cell times those parts on one thread, as one of check_threads' threads checks one reply: the replay
with numpy as the coordinator runs it, the forward passes on the coordinator's audit evaluator (CPU EP,
one intra-op thread, the loop). The config is the shipped default but for the model (the bench's sizes),
spsa.directions = K, spsa.noise and, since split rows need data.batch to be a multiple of K, data.batch =
max(16, K). `steps/s` is the replay alone: the log steps a check thread can keep up with without audits;
`budget steps/s` the most a single worker may step while its logs' replays stay within the coordinator's
budget (coordinator.check_budget: CHECK_SHARE of the round on check_threads' default threads).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace

import numpy as np

from bench.sizes import SIZES, rate
from coordinator import check_budget
from soma_edge.config import Config, DataConfig, Evaluator, Noise, check_threads, validate
from soma_edge.engine.evaluator import evaluator_for
from soma_edge.expert import params
from soma_edge.expert import steps as expert_steps
from soma_edge.spsa.log import UpdateLog
from soma_edge.spsa.optim import State, schedule


@dataclass
class Cell:
    size: str
    params: int
    noise: str
    k: int
    batch: int
    replay_ms: float  # one log step's replay
    audit_ms: float  # one audited step's 2K forward passes (and, for a delta-rule decoder, its gradient)
    clean_ms: float  # one clean forward with the decoder gradient: decoder_from = "clean"'s rebuild of a step

    @property
    def steps_per_s(self) -> float:
        return 1e3 / self.replay_ms

    @property
    def budget_steps_per_s(self) -> float:
        """A worker's step rate whose logs one round's replays keep within the check budget."""
        return self.steps_per_s * check_budget.CHECK_SHARE * check_threads(Config())


def config(size: str, noise: str, k: int) -> Config:
    cfg = Config(model=SIZES[size], data=DataConfig(batch=max(DataConfig.batch, k)))
    cfg.spsa = replace(cfg.spsa, directions=k, noise=Noise(noise))
    return validate(cfg)


def measure(size: str, noise: str, k: int, steps: int, data: np.ndarray, replay_only: bool = False) -> Cell:
    cfg = config(size, noise, k)
    w = params.init(cfg.model, cfg.seed)
    body = params.layout(cfg.model).body
    grads = np.random.default_rng(0).standard_normal((steps, k)).astype(np.float32)
    log = UpdateLog(start=0, grads=grads, lr_scale=1.0, decoder=w[body:].copy())
    warm = replace(log, grads=grads[:1])  # the first replay allocates what the others reuse
    expert_steps.replay(cfg, State(w.copy(), step=0), warm, 0)
    t0 = time.perf_counter()
    expert_steps.replay(cfg, State(w.copy(), step=0), log, 0)
    replay_ms = (time.perf_counter() - t0) * 1e3 / steps
    if replay_only:
        return Cell(size, params.count(cfg.model), noise, k, cfg.data.batch, replay_ms, float("nan"), float("nan"))
    # The coordinator's audit evaluator (coordinator.checks): CPU, one thread, no spinning, the loop.
    ev = evaluator_for(cfg, "cpu", threads=1, spin=False, parallel=1, evaluator=Evaluator.LOOP)
    stepper = expert_steps.stepper(cfg, 0)
    _, eps = schedule(cfg.spsa, 0, 1.0)
    objs = expert_steps.objectives(data, cfg, ev, 0, 0)
    try:
        audit_ms = 1e3 / rate(lambda: stepper.evaluate(w, objs, 0, body, eps, True), 0.05)
    finally:
        stepper.close()
    x, y = expert_steps.batches(data, cfg, 0, 0)[0]
    clean_ms = 1e3 / rate(lambda: ev.clean(w, x, y), 0.05)
    return Cell(size, params.count(cfg.model), noise, k, cfg.data.batch, replay_ms, audit_ms, clean_ms)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="124K,L", help=f"comma-separated, of {','.join(SIZES)}")
    ap.add_argument("--noises", default="rademacher,rank1", help="comma-separated spsa.noise kinds")
    ap.add_argument("--ks", default="1,8,64", help="comma-separated spsa.directions")
    ap.add_argument("--steps", type=int, default=8, help="log steps replayed per cell (after one to warm up)")
    ap.add_argument("--json", action="store_true", help="end with one JSON line of every cell")
    ap.add_argument("--replay-only", action="store_true", help="time the replay alone (audit and clean: nan)")
    args = ap.parse_args(argv)
    data = np.frombuffer(np.random.default_rng(1).bytes(1 << 20), dtype=np.uint8)
    print(
        f"{'size':>5} {'params':>10} {'noise':>10} {'K':>3} {'batch':>5} {'replay ms':>10} {'steps/s':>8} "
        f"{'budget steps/s':>14} {'audit ms':>9} {'clean ms':>9}"
    )
    cells = []
    for size in args.sizes.split(","):
        for noise in args.noises.split(","):
            for k in (int(x) for x in args.ks.split(",")):
                c = measure(size, noise, k, args.steps, data, args.replay_only)
                cells.append(c)
                print(
                    f"{c.size:>5} {c.params:>10,} {c.noise:>10} {c.k:>3} {c.batch:>5} {c.replay_ms:>10.2f} "
                    f"{c.steps_per_s:>8.1f} {c.budget_steps_per_s:>14.1f} {c.audit_ms:>9.1f} {c.clean_ms:>9.2f}",
                    flush=True,
                )
    if args.json:
        extra = lambda c: {"steps_per_s": c.steps_per_s, "budget_steps_per_s": c.budget_steps_per_s}  # noqa: E731
        print(json.dumps({"cells": [{**asdict(c), **extra(c)} for c in cells]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
