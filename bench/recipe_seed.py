"""Table 3 of bench/recipe.py: N = 4 experts with and without the paper's seed run, at equal forward passes.

Each arm trains one expert per cluster of the demo's split from the same budget of forward passes per
expert. A seeded arm first trains the seed (expert id N, on every cluster's train split) for `share` of
all the arm's passes; each expert then starts from the seed's weights with fresh optimizer state and
takes the steps `soma_edge.config.expert_steps` leaves it, exactly what `federation.seed_steps` does in a
run. The mixture is scored on every cluster's test split under both protocols (soma_edge.corpus.mixture).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    N_CLUSTERS,
    SOMA_ARMS,
    Data,
    arm_config,
    cluster_data,
    map_jobs,
    md_head,
    md_row,
    ort_logprobs,
    prepared,
    protocol_scores,
    run_spsa,
    say,
    shard_stream,
)
from soma_edge.config import Config, ModelConfig, evals_per_step, expert_config, expert_steps
from soma_edge.corpus.router import load as load_router
from soma_edge.expert import params
from soma_edge.rundir import seed as seed_mod
from soma_edge.spsa.optim import State

# (name, model overrides on the shipped default, seed decoder or None for no seed run)
SEED_ARMS: list[tuple[str, dict[str, Any], str | None]] = [
    ("lstm default", {}, None),
    ("soma", SOMA_ARMS["soma"], None),
    ("soma + seed (E frozen)", SOMA_ARMS["soma"], "frozen"),
    ("soma + seed (E by delta)", SOMA_ARMS["soma"], "delta"),
    ("lstm + seed (head frozen)", {}, "frozen"),
    ("lstm + seed (head by delta)", {}, "delta"),
]


@dataclass
class SeedRow:
    name: str
    params: int
    seed_steps: int
    expert_steps: int
    evals_per_expert: float  # every forward pass of the arm (the seed's included) / N
    stream: float  # stream protocol: top-2 routed mixture, every test byte
    paper: float  # paper protocol: top-4 uniform mixture on its scored bytes
    stream_on_paper_bytes: float  # the stream protocol on the paper's scored bytes
    seconds: float


def arm_cfg(model: dict[str, Any], seed_decoder: str | None, evals: int, share: float) -> Config:
    cfg = arm_config("default")
    if model:
        cfg.model = ModelConfig(**model)
    cfg.federation.experts = N_CLUSTERS
    if seed_decoder is not None:
        cfg.model.seed_decoder = seed_decoder
        cfg.federation.seed_steps = max(1, round(share * N_CLUSTERS * evals / evals_per_step(cfg.spsa)))
    cfg.federation.max_steps = evals // evals_per_step(expert_config(cfg).spsa)
    return cfg


def _expert_job(args: tuple) -> np.ndarray:
    name, cfg, data, steps, check, weights, expert = args
    state = State(params.init(cfg.model, cfg.seed) if weights is None else weights.copy())
    # The mixture is scored on its own (`score`): each expert's own test score would be unused work.
    res = run_spsa(name, cfg, data, None, None, check, state=state, expert=expert, steps=steps, score_test=False)
    return res.weights


def _seed_data(datas: list[Data]) -> Data:
    def cat(parts):
        return tuple(np.concatenate(p) for p in zip(*parts))

    return Data(
        train=np.concatenate([d.train for d in datas]),
        val=cat([d.val for d in datas]),
        test=cat([d.test for d in datas]),
        unigram=math.nan,
    )


def score(
    router, m: ModelConfig, weights: list[np.ndarray], tests: list[np.ndarray], seq: int
) -> tuple[float, float, float]:
    """(stream top-2, paper top-4 uniform, stream on the paper's bytes) nats/byte over the test splits."""
    fns = {e: ort_logprobs(m, w) for e, w in enumerate(weights)}
    sums, counts = np.zeros(3), np.zeros(3)
    for data in tests:
        s = protocol_scores(router, fns, data, seq)
        sums[0], counts[0] = sums[0] + s.stream * s.stream_bytes, counts[0] + s.stream_bytes
        if s.paper is not None:
            sums[1:] += np.array([s.paper, s.stream_on_paper]) * s.paper_bytes
            counts[1:] += s.paper_bytes
    return tuple(float(x) for x in sums / counts)  # type: ignore[return-value]


def run_seed_table(
    corpus_name: str, work: Path, evals: int, share: float, check: int, jobs: int, names: list[str] | None = None
) -> list[SeedRow]:
    rd = prepared(corpus_name, work)
    router = load_router(rd.router)
    datas = [cluster_data(corpus_name, c, work) for c in range(N_CLUSTERS)]
    tests = [t for t in (shard_stream(rd, c, "test") for c in range(N_CLUSTERS)) if t.size >= 2]
    rows = []
    for name, model, seed_decoder in SEED_ARMS:
        if names is not None and name not in names:
            continue
        cfg = arm_cfg(model, seed_decoder, evals, share)
        t0 = time.perf_counter()
        start, seed_steps = None, cfg.federation.seed_steps
        if seed_decoder is not None:
            say(f"  {name}: seed run, {seed_steps} steps on every cluster")
            start = _expert_job(
                (f"{name} seed", cfg, _seed_data(datas), seed_steps, check, None, seed_mod.seed_expert(cfg))
            )
        ecfg, steps = expert_config(cfg), expert_steps(cfg)
        work_items = [(f"{name} e{e}", ecfg, datas[e], steps, check, start, e) for e in range(N_CLUSTERS)]
        weights = map_jobs(_expert_job, work_items, jobs)
        total = seed_steps * evals_per_step(cfg.spsa) + N_CLUSTERS * steps * evals_per_step(ecfg.spsa)
        stream, paper, same = score(router, cfg.model, weights, tests, cfg.data.seq_len)
        rows.append(
            SeedRow(
                name,
                params.count(cfg.model),
                seed_steps,
                steps,
                total / N_CLUSTERS,
                stream,
                paper,
                same,
                time.perf_counter() - t0,
            )
        )
        say(
            f"  {name}: stream {stream:.4f}, paper {paper:.4f}"
            f" (stream on its bytes {same:.4f}), {rows[-1].seconds:.0f} s"
        )
    return rows


def seed_table(rows: list[SeedRow], evals: int, share: float) -> str:
    lines = [
        f"Table 3: N = {N_CLUSTERS} experts, {evals:,} forward passes per expert, the seed's included "
        f"(a seed takes {share:.0%} of them); routed mixture on every cluster's test split",
        "",
        md_head(
            [
                "arm",
                "params/expert",
                "seed steps",
                "steps/expert",
                "passes/expert",
                "stream top-2",
                "paper top-4 uniform",
                "stream on the paper's bytes",
                "wall s",
            ]
        ),
    ]
    for r in rows:
        lines.append(
            md_row(
                [
                    r.name,
                    f"{r.params:,}",
                    f"{r.seed_steps:,}",
                    f"{r.expert_steps:,}",
                    f"{r.evals_per_expert:,.0f}",
                    f"{r.stream:.4f}",
                    f"{r.paper:.4f}",
                    f"{r.stream_on_paper_bytes:.4f}",
                    f"{r.seconds:.0f}",
                ]
            )
        )
    return "\n".join(lines)
