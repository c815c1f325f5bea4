"""The paper's expert on a small shard: does its tied E, trained by the delta rule, climb?

    .venv/bin/python -m bench.tied_decoder [--kb 7,35] [--seeds 0,1] [--steps 2000] [--json]

One expert trained with the worker's own loop (`worker.trainer.train`, one ORT thread), on a slice of
`--kb` KB of the default corpus's train text (what an expert holds at N = 256: 35 KB on average, 4.5 KB
at the smallest), held out on 64 windows of a slice 2 MB further on. The model is the preprint's kind
(`model.kind = "soma"`, d = 32, one block, no seed run: E [256, d] is the input embedding and the
decoder both, trained by the delta rule) at three head lrs, and the untied LSTM at the shipped 3e-2 as a
control. The state carries on between checks as it does between a worker's rounds.

Each row: train loss (the mean of the steps' clean losses over the last 250 steps, what a round reports)
and held-out loss at every 500 steps, and `climb`: the largest rise of that train loss above its lowest
so far, the mark of steps that go uphill.
"""

from __future__ import annotations

import argparse
import json
import time

from soma_edge import config as config_mod
from soma_edge.corpus import documents, sources
from soma_edge.engine.evaluator import evaluator_for, mean_loss
from soma_edge.expert import params
from soma_edge.spsa.optim import State
from worker.trainer import train as train_loop

ARMS = {  # name -> (model.kind, spsa.decoder_lr)
    "soma 3e-2": ("soma", 3e-2),
    "soma 1e-2": ("soma", 1e-2),
    "soma 3e-3": ("soma", 3e-3),
    "lstm 3e-2": ("lstm", 3e-2),
}
CHECK = 250  # steps per train-loss mean
OFFSET, HELD_OUT = 200_000, 2_000_000  # where the shard starts in the train stream, and the held-out slice


def config(kind: str, lr: float, seed: int) -> config_mod.Config:
    cfg = config_mod.Config(seed=seed, device="cpu", threads=1, parallel=1)
    cfg.model.kind, cfg.model.embed, cfg.model.hidden, cfg.model.layers = kind, 32, 32, 1
    cfg.spsa.decoder_lr = lr
    return config_mod.validate(cfg)


def run(stream, kind: str, lr: float, kb: float, seed: int, steps: int) -> dict:
    cfg = config(kind, lr, seed)
    shard = stream[OFFSET : OFFSET + int(kb * 1024)].copy()
    held = stream[OFFSET + HELD_OUT : OFFSET + HELD_OUT + 64 * (cfg.data.seq_len + 1)]
    xv, yv = documents.eval_windows(held, cfg.data.seq_len, 64)
    ev = evaluator_for(cfg)
    state = State(params.init(cfg.model, cfg.seed))
    curve, t0 = [], time.perf_counter()
    while state.step < steps:
        rep = train_loop(state, shard, cfg, ev, steps=CHECK)
        curve.append({"step": state.step, "train": rep.loss, "val": mean_loss(ev, state.weights, xv, yv)})
    low, climb = float("inf"), 0.0
    for c in curve:
        low = min(low, c["train"])
        climb = max(climb, c["train"] - low)
    return {"kb": kb, "seed": seed, "curve": curve, "climb": climb, "seconds": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kb", default="7,35")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    stream = documents.to_stream(documents.by_split(sources.default_documents())["train"])
    out = {}
    marks = list(range(500, a.steps + 1, 500))
    print(f"| arm | KB | seed | {' | '.join(f'train/held-out @{m}' for m in marks)} | climb |")
    print("|---|---|---|" + "---|" * len(marks) + "---|")
    for name, (kind, lr) in ARMS.items():
        for kb in map(float, a.kb.split(",")):
            for seed in map(int, a.seeds.split(",")):
                r = run(stream, kind, lr, kb, seed, a.steps)
                out.setdefault(name, []).append(r)
                at = {c["step"]: c for c in r["curve"]}
                cells = " | ".join(f"{at[m]['train']:.3f}/{at[m]['val']:.3f}" if m in at else "-" for m in marks)
                print(f"| {name} | {kb:g} | {seed} | {cells} | {r['climb']:.3f} |", flush=True)
    if a.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
