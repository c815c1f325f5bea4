"""How an expert's weights move once SPSA has its estimate: the lr and eps schedule, the optimizer state that
travels with the weights, the update itself (unit-RMS, Adam or SGD, momentum, coupled weight decay, and the
delta rule's Adam step on the decoder), and the plateau rule.

`apply_update` is the one float32 arithmetic every step and every replay runs, element-wise and in a fixed
order (no BLAS), so a replay gives the worker's bits (soma_edge.expert.update_graph runs it node for node).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from soma_edge.config import SPSAConfig
from soma_edge.errors import CheckpointError

# Body weights one update pass takes at a time, so that its temporaries (a dozen element-wise passes) stay in
# a core's cache: at L (7.6M) on the 2-core EPYC box 23-27 ms a step at 2^17 against 55-58 ms whole (2^19: 68).
UPDATE_BLOCK = 1 << 17

# --- schedule ------------------------------------------------------------------------------------------


def _cosine(cfg: SPSAConfig, step: int) -> float:
    if cfg.total_steps <= cfg.warmup_steps or step < cfg.warmup_steps:
        return 1.0
    t = min(1.0, (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps))
    return cfg.lr_min_frac + (1 - cfg.lr_min_frac) * 0.5 * (1 + math.cos(math.pi * t))


def schedule(cfg: SPSAConfig, step: int, scale: float = 1.0) -> tuple[float, float]:
    """(body lr, eps) at `step`: linear warmup, then constant or cosine to lr*lr_min_frac over total_steps
    (if set), times `scale`, the plateau rule's factor, which scales eps too (halved together)."""
    warm = (step + 1) / cfg.warmup_steps if cfg.warmup_steps and step < cfg.warmup_steps else 1.0
    lr = cfg.lr * warm * _cosine(cfg, step) * scale
    eps = max(cfg.eps_min, lr) if cfg.tie_eps_to_lr else cfg.eps * scale
    return lr, eps


def decoder_lr(cfg: SPSAConfig, step: int, scale: float = 1.0) -> float:
    """The delta-rule decoder's Adam lr: no warmup (its gradient is exact), the same cosine and plateau."""
    return cfg.decoder_lr * _cosine(cfg, step) * scale


# --- optimizer state -----------------------------------------------------------------------------------


@dataclass
class OptState:
    """Everything besides the weights that an expert's next step depends on; it travels and checkpoints
    with the weights. Arrays cover the whole flat vector (the body's part for the body update, the
    decoder's part for the delta rule) and are created on first use."""

    momentum: np.ndarray | None = None
    adam_m: np.ndarray | None = None
    adam_v: np.ndarray | None = None
    adam_t: int = 0  # Adam updates behind the moments (bias correction), which need not equal the step
    lr_scale: float = 1.0  # the plateau rule's factor on lr and eps, constant within a federation round
    best_val: float | None = None  # plateau counters: the best val loss so far and the step it was seen
    best_step: int = 0

    def copy(self) -> "OptState":
        def arr(a):
            return None if a is None else a.copy()

        return OptState(
            momentum=arr(self.momentum),
            adam_m=arr(self.adam_m),
            adam_v=arr(self.adam_v),
            adam_t=self.adam_t,
            lr_scale=self.lr_scale,
            best_val=self.best_val,
            best_step=self.best_step,
        )

    def nbytes(self) -> int:
        """Bytes of its vectors (what the state adds to a message or checkpoint beyond the weights)."""
        return sum(a.nbytes for a in (self.momentum, self.adam_m, self.adam_v) if a is not None)

    def to_record(self) -> dict[str, Any]:
        return {
            "momentum": self.momentum,
            "adam_m": self.adam_m,
            "adam_v": self.adam_v,
            "adam_t": int(self.adam_t),
            "lr_scale": float(self.lr_scale),
            "best_val": self.best_val,
            "best_step": int(self.best_step),
        }

    @classmethod
    def from_record(cls, rec: Any, size: int, where: str = "optimizer state") -> "OptState":
        """Check a record against the weights it belongs to (float32[size], finite); CheckpointError if not."""
        if rec is None:
            return cls()
        if not isinstance(rec, dict):
            raise CheckpointError(f"{where}: not a map")
        unknown = set(rec) - {"momentum", "adam_m", "adam_v", "adam_t", "lr_scale", "best_val", "best_step"}
        if unknown:
            raise CheckpointError(f"{where}: unknown fields {sorted(unknown)}")
        arrays = {}
        for name in ("momentum", "adam_m", "adam_v"):
            a = rec.get(name)
            if a is not None and (
                not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != (size,) or not np.isfinite(a).all()
            ):
                got = f"{a.dtype}{list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
                raise CheckpointError(f"{where}: {name} is {got}, not a finite float32[{size}] like the weights")
            arrays[name] = None if a is None else np.array(a, dtype=np.float32)
        if (arrays["adam_m"] is None) != (arrays["adam_v"] is None) or (
            arrays["adam_v"] is not None and (arrays["adam_v"] < 0).any()
        ):
            raise CheckpointError(f"{where}: Adam moments are incomplete or negative")
        scale, best, best_step = rec.get("lr_scale", 1.0), rec.get("best_val"), rec.get("best_step", 0)
        adam_t = rec.get("adam_t", 0)
        if not is_step_count(adam_t) or (adam_t > 0) != (arrays["adam_m"] is not None):
            raise CheckpointError(f"{where}: adam_t {adam_t!r} does not fit the Adam moments")
        if not _finite_number(scale) or not 0 < scale <= 1:
            raise CheckpointError(f"{where}: lr_scale {scale!r} is not in (0, 1]")
        if best is not None and not _finite_number(best):
            raise CheckpointError(f"{where}: best_val {best!r} is not a finite number")
        if not is_step_count(best_step):
            raise CheckpointError(f"{where}: best_step {best_step!r} is not a step count")
        return cls(
            **arrays,
            adam_t=adam_t,
            lr_scale=float(scale),
            best_val=None if best is None else float(best),
            best_step=best_step,
        )


def _finite_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_step_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**62


@dataclass
class State:
    """What an expert carries between steps: its weights, step counter and optimizer state."""

    weights: np.ndarray
    step: int = 0
    opt: OptState = field(default_factory=OptState)


def slower(cfg: SPSAConfig, scale: float) -> float:
    """The lr scale after one slow-down (a plateau, or a refused version): x plateau_factor, never below
    lr_floor."""
    return max(cfg.lr_floor / cfg.lr, scale * cfg.plateau_factor)


def plateau(cfg: SPSAConfig, opt: OptState, val: float, step: int) -> bool:
    """Record the expert's val loss at `step`; halve lr and eps (opt.lr_scale) when it has not improved by
    `plateau_min_delta` for `plateau_patience` steps, never below `lr_floor`. True when it decayed.

    The caller decides when to look (the coordinator at round boundaries), so the scale is constant
    between looks and a round's steps all use one lr."""
    if not cfg.plateau:
        return False
    if opt.best_val is None or val < opt.best_val - cfg.plateau_min_delta:
        opt.best_val, opt.best_step = float(val), step
        return False
    if step - opt.best_step < cfg.plateau_patience:
        return False
    new = slower(cfg, opt.lr_scale)
    opt.best_step = step  # patience counts afresh from the decay
    if new >= opt.lr_scale:
        return False
    opt.lr_scale = new
    return True


def _adam(g: np.ndarray, m: np.ndarray, v: np.ndarray, t: int, cfg: SPSAConfig) -> np.ndarray:
    """Bias-corrected Adam direction for gradient g at update t >= 1; updates the moments in place."""
    m *= np.float32(cfg.beta1)
    m += np.float32(1 - cfg.beta1) * g
    v *= np.float32(cfg.beta2)
    v += np.float32(1 - cfg.beta2) * (g * g)
    m_hat = m / np.float32(1 - cfg.beta1**t)
    v_hat = v / np.float32(1 - cfg.beta2**t)
    return m_hat / (np.sqrt(v_hat) + np.float32(cfg.adam_eps))


def adam_moments(opt: OptState, n: int) -> tuple[np.ndarray, np.ndarray]:
    if opt.adam_m is None or opt.adam_v is None:
        opt.adam_m, opt.adam_v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    return opt.adam_m, opt.adam_v


def apply_update(
    state: State, cfg: SPSAConfig, body: int, acc: np.ndarray, dec: np.ndarray | None, decoder_elsewhere: bool = False
) -> None:
    """w <- w - lr u(ĝ) on the body, and the decoder's Adam step on the delta-rule gradient (or, with
    `decoder_elsewhere`, none: a replay that sets the decoder from its log counts the Adam update only)."""
    t, opt, w = state.step, state.opt, state.weights
    lr, _ = schedule(cfg, t, opt.lr_scale)
    adam = cfg.update == "adam" or dec is not None or decoder_elsewhere
    n_adam = opt.adam_t + 1
    if cfg.update == "adam":
        adam_moments(opt, w.size)
    if cfg.momentum > 0 and cfg.update != "adam" and opt.momentum is None:
        opt.momentum = np.zeros_like(w)
    block = max(1, body) if cfg.update == "rms" else UPDATE_BLOCK  # rms scales by the whole update's norm
    for at in range(0, body, block):
        _body_step(opt, cfg, w, acc, slice(at, min(body, at + block)), float(lr), n_adam)
    if dec is not None:
        # No weight decay here: the decoder's exact gradient is tiny for rare bytes, so a coupled wd*w would
        # dominate it and Adam would shrink those weights at its full lr (measured: +0.1 nats/byte).
        m, v = adam_moments(opt, w.size)
        w[body:] -= np.float32(decoder_lr(cfg, t, opt.lr_scale)) * _adam(dec, m[body:], v[body:], n_adam, cfg)
    if adam:
        opt.adam_t = n_adam
    state.step += 1


def _body_step(
    opt: OptState, cfg: SPSAConfig, w: np.ndarray, acc: np.ndarray, sl: slice, lr: float, n_adam: int
) -> None:
    """The body's update on the weights `sl`: every operation is element-wise, so any split of the body
    gives the whole body's result bit for bit (rms excepted: it takes the whole body as one slice)."""
    update = acc[sl] / np.float32(cfg.directions * cfg.accumulate)
    if cfg.weight_decay > 0:
        update += np.float32(cfg.weight_decay) * w[sl]
    if cfg.update == "adam":
        update = _adam(update, opt.adam_m[sl], opt.adam_v[sl], n_adam, cfg)
    elif cfg.update == "rms":
        rms = np.sqrt(np.mean(np.square(update, dtype=np.float64)))
        if rms > 0:
            update *= np.float32(1.0 / rms)
    if opt.momentum is not None and cfg.momentum > 0 and cfg.update != "adam":
        buf = opt.momentum[sl]
        buf *= np.float32(cfg.momentum)
        buf += update
        update = buf
    w[sl] -= np.float32(lr) * update


def mean_decoder_grad(grads: list[np.ndarray]) -> np.ndarray:
    """The delta rule's gradient of a step: the mean over its minibatches, in batch order."""
    out = np.array(grads[0], dtype=np.float32)
    for g in grads[1:]:
        out += g
    if len(grads) > 1:
        out /= np.float32(len(grads))
    return out
