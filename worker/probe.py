"""What a worker can do: providers, memory, and its measured throughput at the run's model and config.

The throughput is timed on whole SPSA steps of the run's config, as the worker trains them (noise, the 2K
probes' losses, the delta rule's clean forward, the update), not on bare losses: on a GPU the losses are
cheap and the host's noise and update are not, so a bare loss overstates the step rate. It is reported in
the unit the scheduler plans in and a worker's round reports: forward evaluations/s, each step counted
as `config.evals_per_step` of them.

Measured once per (model, SPSA config, batch, device, threads, versions) and cached on disk, because the
ClientApp process that answers the capability query lives for one message only. With spsa.evaluator =
"auto" on an accelerator, both evaluators are timed and the faster one is cached with the rate: the worker
then trains with it (`chosen`) and names it in every result, so each version records how it was made.
The probes the worker trains with (worker.device_recipe: the run's, or measured for its device) are chosen
first, cached with the rate, and the rate is of those probes' steps.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

import numpy as np

from soma_edge import __version__, devices
from soma_edge.config import Config, Evaluator, evals_per_step
from soma_edge.engine import runtime
from soma_edge.engine.evaluator import LossEvaluator, evaluator_for, evaluator_kind, measures_auto
from soma_edge.expert import params
from soma_edge.spsa.optim import State
from soma_edge.spsa.recipe import NODE_FIELDS, Choice
from worker import device_recipe
from worker.cache import Cache
from worker.trainer import train

PROBE_SECONDS = 1.5
AUTO = Choice("auto")  # the worker's recipe unless --recipe says otherwise (worker.device_recipe)
# A train request's config, which is this node's recipe already (the coordinator applied its probes).
AS_SENT = Choice("run")


def host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def cuda_memory_bytes() -> int | None:
    """Total memory of GPU 0 (devices.gpus), None when there is none."""
    found = devices.gpus()
    return found[0].memory_bytes if found else None


def make_evaluator(
    cfg: Config, device: str, threads: int, spin: bool, parallel: int = 0, evaluator: Evaluator | None = None
) -> LossEvaluator:
    """The worker's evaluator (`evaluator`: the measured choice for spsa.evaluator = "auto", see
    `chosen`). Workers sharing a box pass parallel=1 and threads=cores/workers, so that together they use
    each core once; a worker alone lets ORT and SPSA choose (0 = auto)."""
    return evaluator_for(cfg, device, threads, spin, parallel, evaluator)


def fastest(
    cfg: Config, device: str, threads: int, spin: bool, parallel: int = 0, seconds: float = PROBE_SECONDS
) -> tuple[LossEvaluator, dict[Evaluator, float]]:
    """The evaluator this worker trains `cfg` with, and the evals/s measured: the config's choice, or, with
    spsa.evaluator = "auto" on an accelerator, whichever of the loop and the population measured faster
    (a tie goes to the population)."""
    evaluator = make_evaluator(cfg, device, threads, spin, parallel)
    rates = {evaluator_kind(evaluator): measure(evaluator, cfg, seconds)}
    if measures_auto(cfg.spsa.evaluator, evaluator.providers):
        kind = Evaluator.LOOP if evaluator_kind(evaluator) is Evaluator.POPULATION else Evaluator.POPULATION
        other = make_evaluator(cfg, device, threads, spin, parallel, kind)
        rates[kind] = measure(other, cfg, seconds)
        if (rates[kind], kind is Evaluator.POPULATION) > (rates[evaluator_kind(evaluator)], kind is Evaluator.LOOP):
            evaluator = other
    return evaluator, rates


def chosen(caps: dict[str, Any]) -> Evaluator | None:
    """The evaluator a capability record says this worker trains with (None: the config's own choice)."""
    try:
        return Evaluator(caps.get("evaluator"))
    except ValueError:
        return None


def _key(cfg: Config, device: str, threads: int, spin: bool, parallel: int, recipe: Choice) -> str:
    import onnxruntime  # for its version only; loaded (heavy) by the evaluator anyway, not at import

    what = {
        "soma": __version__,
        "ort": onnxruntime.__version__,
        "model": cfg.to_dict()["model"],
        "spsa": cfg.to_dict()["spsa"],  # K, accumulate, decoder, noise, density, update: a step's cost
        "batch": cfg.data.batch,
        "seq_len": cfg.data.seq_len,
        "device": device,
        "threads": threads,
        "spin": spin,
        "parallel": parallel,
        "recipe": str(recipe),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]


def steps_per_s(cfg: Config, device: str, threads: int, spin: bool, parallel: int, seconds: float) -> float:
    """Whole steps/s of `cfg` on this device's one-call evaluator where it has one and the config does not
    ask for the loop (a candidate of device_recipe.choose, timed for a third of the probe's time)."""
    one_call = runtime.plan(device).names[0] != devices.CPU and cfg.spsa.evaluator != Evaluator.LOOP
    ev = make_evaluator(cfg, device, threads, spin, parallel, Evaluator.POPULATION if one_call else None)
    return measure(ev, cfg, seconds / 3) / evals_per_step(cfg.spsa)


def measure(evaluator: LossEvaluator, cfg: Config, seconds: float = PROBE_SECONDS) -> float:
    """Forward evaluations/s of `evaluator` as SPSA steps of `cfg` spend them: steps/s of the worker's own
    training loop on a random byte stream, times the forward passes one step counts."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=max(1 << 16, 4 * cfg.data.batch * (cfg.data.seq_len + 1)), dtype=np.uint8)
    state = State(params.init(cfg.model, 0))
    train(state, data, cfg, evaluator, steps=1)  # warm-up: the first runs allocate
    return train(state, data, cfg, evaluator, seconds=seconds).evals_per_s


def capabilities(
    cfg: Config,
    cache: Cache,
    device: str,
    threads: int,
    spin: bool,
    parallel: int = 0,
    seconds: float = PROBE_SECONDS,
    recipe: Choice = AUTO,
) -> dict[str, Any]:
    """Measured (or cached) throughput plus static facts about this box, and the probes it trains with
    (`probes`, a spsa.recipe.Probes record; `recipe_line`, how they were chosen)."""
    key = _key(cfg, device, threads, spin, parallel, recipe)
    hit = cache.get_json(key)
    probes_ok = isinstance(hit, dict) and isinstance(hit.get("probes"), dict) and set(hit["probes"]) == set(NODE_FIELDS)
    if probes_ok and isinstance(hit.get("evals_per_s"), (int, float)) and chosen(hit) is not None:
        return {**hit, "probe_cached": True}
    t0 = time.perf_counter()
    probes, table = device_recipe.probes_for(
        recipe, cfg, runtime.plan(device).names, lambda c: steps_per_s(c, device, threads, spin, parallel, seconds)
    )
    evaluator, rates = fastest(probes.apply(cfg), device, threads, spin, parallel, seconds)
    best = evaluator_kind(evaluator)
    on_cuda = evaluator.providers[0] == devices.CUDA
    out = {
        "probes": probes.to_record(),
        "recipe_line": device_recipe.summary(probes, table),
        "evals_per_s": rates[best],
        "evaluator": best.value,
        "evaluator_rates": {e.value: r for e, r in rates.items()},
        "providers": list(evaluator.providers),
        "device": device,
        "threads": evaluator.threads,
        "parallel": evaluator.parallel,
        "device_memory": cuda_memory_bytes() if on_cuda else host_memory_bytes(),
        "probe_seconds": time.perf_counter() - t0,
    }
    cache.put_json(key, out)
    # The train requests carry the recipe chosen here: they find this measurement, not a fresh one.
    cache.put_json(_key(probes.apply(cfg), device, threads, spin, parallel, AS_SENT), out)
    return {**out, "probe_cached": False}
