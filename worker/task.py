"""One expert's round on a worker: its base state, its training, and the result its task asked for.

The ClientApp runs a round here from start to end; the speculating trainer (`worker.speculation`) runs the
same steps in a process of its own and finishes the round here too, so a round it trained gives the reply
that the ClientApp would have built. Imports no flwr: the trainer starts without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from soma_edge.config import Config, LogDecoder
from soma_edge.expert import steps
from soma_edge.processes.logs import role_logger
from soma_edge.spsa import quant
from soma_edge.spsa.log import code_decoder, record_log
from soma_edge.spsa.optim import OptState, State
from soma_edge.spsa.recipe import Recipe
from soma_edge.wire import compute_share, protocol
from soma_edge.wire.protocol import ReplyMode
from worker.cache import Cache
from worker.trainer import TrainReport
from worker.trainer import train as train_loop

log = role_logger("soma.worker")


def base_state(t: protocol.Task, weights: Any, opt: Any) -> State:
    """The state a task trains from: its base weights and optimizer state (CheckpointError if they do not
    fit), at the task's step, with the coordinator's plateau decision for this round as the lr scale."""
    w = protocol.decode_weights(weights)
    state = State(w, step=t["step"], opt=OptState.from_record(opt, w.size, f"expert {t['expert']}: optimizer state"))
    state.opt.lr_scale = float(t["lr_scale"])
    return state


def decoder_base(cfg: Config, state: State) -> np.ndarray | None:
    """The delta-rule decoder as the round starts (None without one): a log in int8 codes carries its
    change since then."""
    body = steps.log_body(cfg)
    return state.weights[body:].copy() if 0 < body < state.weights.size else None


def _coded(t: protocol.Task, cfg: Config, state: State, base_decoder: np.ndarray | None) -> quant.Coded | None:
    """Where the reply's log carries the decoder's change in int8 codes (federation.log_decoder), code it
    and adopt the coded change into `state` (spsa.code_decoder); else None."""
    if base_decoder is None or t.get("reply", ReplyMode.WEIGHTS) == ReplyMode.WEIGHTS:
        return None
    if cfg.federation.log_decoder != LogDecoder.INT8:
        return None
    return code_decoder(state, steps.log_body(cfg), base_decoder)


def _as_sent(t: protocol.Task, state: State, reply_dtype: str) -> np.ndarray:
    # With the log alone, the coordinator stores its float32 replay: the hash is of the float32 weights.
    return state.weights if t.get("reply", ReplyMode.WEIGHTS) == ReplyMode.LOG else state.weights.astype(reply_dtype)


def finish(
    t: protocol.Task,
    cfg: Config,
    state: State,
    start: int,
    base_decoder: np.ndarray | None,
    rep: TrainReport,
    reply_dtype: str,
) -> dict[str, Any]:
    """The round's result in the form its task asked for: the new weights, its update log, or both.
    `state` is the trained state (a coded decoder change is adopted into it); `start` its step, and
    `base_decoder` its decoder, as the round began."""
    coded = _coded(t, cfg, state, base_decoder)
    out = _as_sent(t, state, reply_dtype)
    mode, sha = t.get("reply", ReplyMode.WEIGHTS), protocol.weights_sha256(out)
    log.info(
        "sent expert=%d version=%d sha256=%s steps=%d seconds=%.2f loss=%.4f",
        t["expert"],
        t["version"] + 1,
        sha,
        rep.steps,
        rep.seconds,
        rep.loss,
    )
    res = {
        "expert": t["expert"],
        "base_sha256": t["base_sha256"],
        "version": t["version"] + 1,
        "step": state.step,
        "steps": rep.steps,
        "forward_evals": rep.forward_evals,
        "seconds": rep.seconds,
        "train_loss": rep.loss,
        "evaluator": rep.evaluator.value,
        "trained": compute_share.record(rep.spans),
        "sha256": sha,
        "weights": out,
        "opt": state.opt.to_record(),
    }
    if mode in (ReplyMode.LOG, ReplyMode.BOTH):
        # The decoder's Adam moments go along only where the coordinator audits: it rebuilds the decoder's
        # steps from them. Otherwise the worker keeps them, and they stay off a weak link.
        moments = cfg.federation.audit_steps > 0
        ulog = record_log(
            start, state.opt.lr_scale, rep.grads, state, steps.log_body(cfg), coded, moments, Recipe.of(cfg)
        )
        res["log"] = ulog.to_record()
    return res


def keep(cache: Cache, res: dict[str, Any], run_id: str) -> None:
    """Cache a result's version with its optimizer state: the next round starts from it."""
    cache.put_weights(
        res["sha256"],
        expert=res["expert"],
        version=res["version"],
        step=res["step"],
        weights=res["weights"],
        opt=res["opt"],
        run_id=run_id,
    )


def as_reply(t: protocol.Task, res: dict[str, Any]) -> dict[str, Any]:
    """A result as it goes on the wire: a log reply leaves the weights and optimizer state at home."""
    return {**res, "weights": None, "opt": None} if t.get("reply", ReplyMode.WEIGHTS) == ReplyMode.LOG else res


def run(
    t: protocol.Task,
    cfg: Config,
    state: State,
    data: np.ndarray,
    evaluator,
    seconds: float,
    reply_dtype: str,
    cache: Cache,
    run_id: str,
) -> dict[str, Any]:
    """Train the task for up to `seconds` (and its step cap), cache the new version, and return the result
    as it is sent."""
    start, base_decoder = state.step, decoder_base(cfg, state)
    rep = train_loop(state, data, cfg, evaluator, expert=t["expert"], steps=t["steps"], seconds=seconds)
    res = finish(t, cfg, state, start, base_decoder, rep, reply_dtype)
    keep(cache, res, run_id)
    return as_reply(t, res)
