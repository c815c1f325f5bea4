"""The backprop reference of bench/equal_budget.py: one monolithic expert trained by torch Adam on the same
shards, batches and initialization as the SPSA arms, scored by the same routed protocol. torch is optional
(the bench extra): only this arm imports it."""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import numpy as np

from bench.common import forward_flops, mixture_loss, ort_logprobs, protocol_scores, shard_stream
from soma_edge.config import ModelConfig
from soma_edge.corpus import documents
from soma_edge.corpus import router as routing
from soma_edge.expert import params
from soma_edge.rundir.layout import RunDir


def lr_at(step: int, total: int, lr: float, warmup: int, min_frac: float = 0.1) -> float:
    """Warmup then cosine to lr * min_frac: the SPSA schedule (soma_edge.spsa.optim.schedule), for Adam."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(total - warmup, 1))
    return lr * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def adam_train(
    m: ModelConfig,
    data: np.ndarray,
    lr: float,
    steps: int,
    batch: int,
    seq: int,
    seed: int,
    on_step: Callable[[int, Any], None] | None = None,
):
    import torch  # optional (the bench extra): only the Adam arm needs it

    from bench.torch_ref import TorchExpert  # torch, as above

    torch.manual_seed(seed)
    model = TorchExpert(m).load_flat(params.init(m, seed))  # the same initialization as the SPSA monolith
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    warmup = min(20, steps // 10)
    for s in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(s, steps, lr, warmup)
        x, y = documents.sample_batch(data, batch, seq, documents.batch_rng(seed, 0, s))
        opt.zero_grad()
        model(torch.from_numpy(x), torch.from_numpy(y)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if on_step:
            on_step(s + 1, model)
    return model


def torch_eval_loss(model, x: np.ndarray, y: np.ndarray, batch: int = 64) -> float:
    import torch  # optional (the bench extra): only the Adam arm needs it

    total = 0.0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            total += (
                float(model(torch.from_numpy(x[i : i + batch]), torch.from_numpy(y[i : i + batch])))
                * x[i : i + batch].size
            )
    return total / x.size


def torch_logprobs(model) -> Callable[[np.ndarray], np.ndarray]:
    import torch  # optional (the bench extra): only the Adam arm needs it

    def fn(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            h, _ = model.lstm(model.embed(torch.from_numpy(x)))
            return torch.log_softmax(model.head(h), dim=-1).numpy()

    return fn


def run_adam_arm(
    prep: RunDir,
    m: ModelConfig,
    lr: float,
    steps: int,
    batch: int,
    seq: int,
    seed: int,
    curve_data: np.ndarray,
    test_data: np.ndarray,
    points_n: int = 10,
) -> dict[str, Any]:
    router = routing.load(prep.router)  # one expert: the mixture is the model itself
    train = shard_stream(prep, 0, "train")
    f3 = 3 * forward_flops(m, batch, seq)
    every = max(1, steps // points_n)
    points, eval_s = [], 0.0
    t_init = params.init(m, seed)
    points.append(
        {
            "step": 0,
            "forward_evals": 0,
            "flops": 0.0,
            "loss": mixture_loss(router, {0: ort_logprobs(m, t_init)}, curve_data, seq),
        }
    )

    def on_step(s: int, model) -> None:
        nonlocal eval_s
        if s % every == 0 or s == steps:
            t = time.perf_counter()
            points.append(
                {
                    "step": s,
                    "forward_evals": 3 * s,
                    "flops": s * f3,
                    "loss": mixture_loss(router, {0: torch_logprobs(model)}, curve_data, seq),
                }
            )
            eval_s += time.perf_counter() - t

    t0 = time.perf_counter()
    model = adam_train(m, train, lr, steps, batch, seq, seed, on_step)
    wall = time.perf_counter() - t0 - eval_s
    return {
        "arm": "adam",
        "kind": "backprop-reference",
        "experts": 1,
        "shape": m.__dict__,
        "params_per_expert": params.count(m),
        "params_total": params.count(m),
        "lr": lr,
        "directions": None,
        "steps_per_expert": [steps],
        "forward_evals": 3 * steps,
        "flops": steps * f3,
        **protocol_scores(router, {0: torch_logprobs(model)}, test_data, seq).arm_fields(),
        "top_k": 1,
        "wall_seconds": wall,
        "compute_seconds": wall,
        "rounds": None,
        "curve": points,
    }
