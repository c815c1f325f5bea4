"""`soma-worker`: serve as a federation worker, or train one expert locally."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import typer

from soma_edge import checkpoint, corpus, params
from soma_edge import config as config_mod
from soma_edge.cli import entry, make_app
from soma_edge.runtime import LossEvaluator, mean_loss
from soma_edge.spsa import State
from worker.trainer import train as train_loop

app = make_app("soma-edge worker: forward-only SPSA training of LSTM experts on ONNX Runtime.")


@app.callback()
def _root() -> None:
    """soma-edge worker."""


@app.command("train")
def train_cmd(
    config: Optional[Path] = typer.Option(None, help="TOML config ([model], [spsa], [data], seed, device, threads)."),
    steps: int = typer.Option(200, min=1, help="SPSA steps to run."),
    seed: Optional[int] = typer.Option(None, help="Override the config's seed."),
    device: Optional[str] = typer.Option(None, help="auto | cpu | cuda[:i] | an ORT execution provider."),
    threads: Optional[int] = typer.Option(None, help="ORT intra-op threads (0 = ORT decides)."),
    out: Optional[Path] = typer.Option(None, help="Write the trained weights here (checksummed msgpack)."),
    eval_windows: int = typer.Option(128, min=1, help="Held-out windows for the before/after loss."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a summary."),
) -> None:
    """Train one expert on the default corpus on this box, and report held-out nats/byte before and after."""
    cfg = config_mod.load(config) if config else config_mod.Config()
    if seed is not None:
        cfg.seed = seed
    if device is not None:
        cfg.device = device
    if threads is not None:
        cfg.threads = threads
    config_mod.validate(cfg)

    splits = corpus.by_split(corpus.default_documents())
    train_data, test_data = corpus.to_stream(splits["train"]), corpus.to_stream(splits["test"])
    xt, yt = corpus.eval_windows(test_data, cfg.data.seq_len, eval_windows)
    evaluator = LossEvaluator(cfg.model, cfg.device, cfg.threads, parallel=cfg.parallel)
    state = State(params.init(cfg.model, cfg.seed))
    before = mean_loss(evaluator, state.weights, xt, yt)
    report = train_loop(state, train_data, cfg, evaluator, steps=steps)
    after = mean_loss(evaluator, state.weights, xt, yt)
    if out is not None:
        checkpoint.save(out, {"config": cfg.to_dict(), "step": state.step, "weights": state.weights}, "expert")
    summary = {
        "params": int(state.weights.size),
        "steps": report.steps,
        "seconds": round(report.seconds, 3),
        "steps_per_s": round(report.steps_per_s, 3),
        "forward_evals_per_s": round(report.evals_per_s, 1),
        "providers": evaluator.providers,
        "test_nats_per_byte_before": before,
        "test_nats_per_byte_after": after,
        "unigram_nats_per_byte": corpus.unigram_entropy(train_data, test_data),
        "weights_sha256": _sha256(state.weights),
    }
    if as_json:
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            print(f"{k:>28}: {v}")


def _sha256(a: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(a.tobytes()).hexdigest()


main = entry(app, "soma-worker")

if __name__ == "__main__":
    main()
