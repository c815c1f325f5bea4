"""Update logs: a round of one expert's steps as the scalars that rebuild it (`record_log`), checked on
arrival (`UpdateLog.from_record`) and replayed from the version the round started at (`replay`), bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import numpy as np

from soma_edge.config import SPSAConfig
from soma_edge.errors import CheckpointError
from soma_edge.spsa import quant
from soma_edge.spsa.optim import State, adam_moments, is_step_count
from soma_edge.spsa.recipe import Recipe
from soma_edge.spsa.stepper import Stepper


@dataclass
class UpdateLog:
    """A round of one expert's steps as the scalars that rebuild it: with the noise keys (the run's seed,
    the expert, the step), `replay` turns the version it started from into the version it ended at, bit
    for bit. A delta-rule decoder's update is dense, so it comes along: as its change since the round's
    start in int8 codes (`decoder_codes`, `decoder_scales`: soma_edge.spsa.quant, which the worker adopted), or
    as its final float32 weights (`decoder`: federation.log_decoder = "float32"). Its Adam moments
    (`decoder_m`, `decoder_v`) come along only where the coordinator audits logs (federation.audit_steps > 0:
    the audit rebuilds the decoder's steps from them) and in logs before protocol 4; otherwise they stay on
    the worker, which keeps the exact ones, and a replay keeps the base version's. `recipe` is the settings
    its steps ran with (soma_edge.spsa.recipe; None in logs before protocol 5: the run's own)."""

    start: int  # the step of the first update
    grads: np.ndarray  # float32[steps, A*K]: each step's projected gradients (float32 is what the update uses)
    lr_scale: float  # the plateau factor on lr and eps in force for the round
    decoder: np.ndarray | None = None  # float32[n - body]: the delta-rule decoder at the end of the round
    decoder_m: np.ndarray | None = None  # ... and its Adam moments, where the coordinator audits
    decoder_v: np.ndarray | None = None
    decoder_codes: np.ndarray | None = None  # int8[n - body]: the decoder's change, coded (soma_edge.spsa.quant)
    decoder_scales: np.ndarray | None = None  # float32[blocks]: ... and its scales
    recipe: Recipe | None = None

    KEYS: ClassVar = ("start", "grads", "lr_scale", "decoder", "decoder_m", "decoder_v")  # every record's
    CODED_KEYS: ClassVar = ("decoder_codes", "decoder_scales")  # ... and a coded decoder's (protocol 4)
    RECIPE_KEY: ClassVar = "recipe"  # ... and, from protocol 5, its recipe

    @property
    def steps(self) -> int:
        return int(self.grads.shape[0])

    def coded(self) -> quant.Coded | None:
        return None if self.decoder_codes is None else quant.Coded(self.decoder_codes, self.decoder_scales)

    def nbytes(self) -> dict[str, int]:
        """Bytes of the body's part (the scalars) and of the decoder's (dense weights and moments, or codes)."""
        parts = (self.decoder, self.decoder_m, self.decoder_v, self.decoder_codes, self.decoder_scales)
        return {"body": int(self.grads.nbytes), "decoder": int(sum(a.nbytes for a in parts if a is not None))}

    def to_record(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.KEYS}
        if self.decoder_codes is not None:
            out.update({k: getattr(self, k) for k in self.CODED_KEYS})
        if self.recipe is not None:
            out[self.RECIPE_KEY] = self.recipe.to_record()
        return out

    @classmethod
    def from_record(cls, rec: Any, where: str = "update log") -> "UpdateLog":
        """Type-check a record (`replay` checks that it fits the state and config); CheckpointError if not."""
        if not isinstance(rec, dict) or set(rec) - {cls.RECIPE_KEY} not in (
            set(cls.KEYS),
            set(cls.KEYS) | set(cls.CODED_KEYS),
        ):
            raise CheckpointError(f"{where}: not an update log record")
        try:
            recipe = None if rec.get(cls.RECIPE_KEY) is None else Recipe.from_record(rec[cls.RECIPE_KEY])
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from None
        g, scale = rec["grads"], rec["lr_scale"]
        if not is_step_count(rec["start"]):
            raise CheckpointError(f"{where}: start {rec['start']!r} is not a step")
        if not isinstance(g, np.ndarray) or g.dtype != np.float32 or g.ndim != 2:
            raise CheckpointError(f"{where}: scalars are not a float32 [steps, directions] array")
        if not isinstance(scale, float) or not (0 < scale <= 1):
            raise CheckpointError(f"{where}: lr scale {scale!r} is not in (0, 1]")
        if not all(_vector(rec[k], np.float32) for k in ("decoder", "decoder_m", "decoder_v")):
            raise CheckpointError(f"{where}: the decoder's weights and moments must be float32 vectors")
        if (rec["decoder_m"] is None) != (rec["decoder_v"] is None):
            raise CheckpointError(f"{where}: the decoder's Adam moments come both, or neither")
        codes, scales = rec.get("decoder_codes"), rec.get("decoder_scales")
        if not (_vector(codes, np.int8) and _vector(scales, np.float32)) or (codes is None) != (scales is None):
            raise CheckpointError(f"{where}: the decoder's codes must be an int8 vector with float32 scales")
        if codes is not None and rec["decoder"] is not None:
            raise CheckpointError(f"{where}: a decoder comes as its codes or as its weights, not both")
        return cls(
            int(rec["start"]), g, scale, rec["decoder"], rec["decoder_m"], rec["decoder_v"], codes, scales, recipe
        )


def _vector(a: Any, dtype: type) -> bool:
    """None, or a 1-D array of `dtype`."""
    return a is None or (isinstance(a, np.ndarray) and a.dtype == dtype and a.ndim == 1)


def code_decoder(state: State, body: int, base: np.ndarray) -> quant.Coded:
    """Code the delta-rule decoder's change since `base` (its weights when the round started) and adopt
    the coded change: the state's decoder becomes base + decode(codes), what the coordinator rebuilds."""
    coded, adopted = quant.adopt(base, state.weights[body:])
    state.weights[body:] = adopted
    return coded


def record_log(
    start: int,
    lr_scale: float,
    grads: Sequence[np.ndarray],
    state: State | None = None,
    body: int = 0,
    coded: quant.Coded | None = None,
    moments: bool = False,
    recipe: Recipe | None = None,
) -> UpdateLog:
    """The log of the steps whose StepResult.grads are `grads`, run with `recipe`; with `state` (after them)
    and `body` < its size, the delta-rule decoder too: its `coded` change (code_decoder), or else its float32
    weights, and with `moments` its Adam moments."""
    g = np.array(grads, dtype=np.float32).reshape(len(grads), -1) if len(grads) else np.zeros((0, 0), np.float32)
    out = UpdateLog(start=int(start), grads=g, lr_scale=float(lr_scale), recipe=recipe)
    if state is not None and 0 < body < state.weights.size:
        if coded is not None:
            out.decoder_codes, out.decoder_scales = coded
        else:
            out.decoder = state.weights[body:].copy()
        if moments:
            m, v = adam_moments(state.opt, state.weights.size)
            out.decoder_m, out.decoder_v = m[body:].copy(), v[body:].copy()
    return out


def replay(
    cfg: SPSAConfig,
    state: State,
    log: UpdateLog,
    *,
    seed: int,
    expert: int,
    body: int = 0,
    dense: np.ndarray | None = None,
    shapes: tuple[tuple[int, ...], ...] = (),
) -> State:
    """The state after `log`'s steps from `state` (which is left as it was): the same float32 arithmetic
    in the same order as training, so the weights and optimizer state match the worker's bit for bit.
    ValueError when the log does not fit the state or the config."""
    n = state.weights.size
    dec_n = n - body if 0 < body < n else 0
    delta = cfg.decoder == "delta" and dec_n > 0
    if log.start != state.step:
        raise ValueError(f"the log starts at step {log.start}, the version is at step {state.step}")
    if log.grads.ndim != 2 or (log.steps and log.grads.shape[1] != cfg.directions * cfg.accumulate):
        raise ValueError(
            f"the log holds scalars of shape {list(log.grads.shape)}, each step needs {cfg.directions * cfg.accumulate}"
        )
    if not np.isfinite(log.grads).all():
        raise ValueError("the log holds non-finite scalars")
    out = State(state.weights.copy(), step=state.step, opt=state.opt.copy())
    out.opt.lr_scale = float(log.lr_scale)
    decoder = _logged_decoder(log, state.weights[body:], dec_n) if delta and log.steps else None
    stepper = Stepper(cfg, seed=seed, expert=expert, parallel=1, body=body, dense=dense, shapes=shapes)
    try:
        for g in log.grads:
            stepper.replay(out, g, body_only=delta)
    finally:
        stepper.close()
    if decoder is not None:
        out.weights[body:] = decoder
        m, v = adam_moments(out.opt, n)  # the decoder's Adam counted its steps: its moments exist, if only as zeros
        if log.decoder_m is not None:  # else the base's stay: the worker holds the exact ones
            m[body:], v[body:] = log.decoder_m, log.decoder_v
    return out


def _logged_decoder(log: UpdateLog, base: np.ndarray, n: int) -> np.ndarray:
    """The decoder a delta-rule log ends at, from its codes (and the base's decoder) or its weights;
    ValueError where the log's decoder part does not fit."""
    moments = (log.decoder_m, log.decoder_v)
    if log.decoder_m is not None and not all(a.shape == (n,) and np.isfinite(a).all() for a in moments):
        raise ValueError(f"a delta-rule log's decoder moments must be finite float32[{n}]")
    if log.decoder_v is not None and (log.decoder_v < 0).any():
        raise ValueError("the decoder's Adam second moment is negative")
    if log.decoder_codes is not None:
        return base + quant.decode(log.coded(), n)
    if not (isinstance(log.decoder, np.ndarray) and log.decoder.shape == (n,) and np.isfinite(log.decoder).all()):
        raise ValueError(f"a delta-rule log needs its decoder: int8 codes, or finite float32[{n}] weights")
    return log.decoder
