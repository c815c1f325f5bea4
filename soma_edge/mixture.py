"""Routed top-k mixture of experts over a byte stream: the held-out loss of the whole model.

The stream is cut into windows of `seq_len` predictions, each scored from a fresh LSTM state, exactly as the
experts were trained. Window i is routed on the bytes of window i-1 (window 0 on the router's prior), so the
router never sees the bytes it helps predict. The chosen experts are mixed in probability space,
p(y) = sum_e w_e p_e(y), with w = softmax(-d^2/T) over the top-k (DESIGN.md §1).

Only experts selected for some window are run, and each only on its windows: that is where routed inference
gains its throughput. Export's eval and the coordinator's per-round routed val loss both call `evaluate`;
they differ only in where the per-expert log-prob functions come from (deploy ONNX vs training weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

from soma_edge.errors import ConfigError, CorpusError

# fn(x int64[B, T]) -> float32[B, T, 256] log-probs of the next byte at every position.
LogProbFn = Callable[[np.ndarray], np.ndarray]


class RouterLike(Protocol):
    n_experts: int

    def route_windows(
        self, data: np.ndarray, seq_len: int, top_k: int, temperature: float
    ) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass
class MixtureResult:
    nats_per_byte: float
    bytes: int  # bytes scored: every byte after the first
    experts: np.ndarray  # int64[W, k]: the experts chosen for each window
    weights: np.ndarray  # float64[W, k]: their mixture weights (rows sum to 1)
    expert_windows: dict[int, int] = field(default_factory=dict)  # windows each expert was selected for
    expert_weight: dict[int, float] = field(default_factory=dict)  # its total weight, in windows
    expert_nats: dict[int, float] = field(default_factory=dict)  # its own nats/byte on those windows
    expert_bytes: dict[int, int] = field(default_factory=dict)
    logprobs: np.ndarray | None = None  # float64[bytes]: mixture log-prob of each scored byte, if asked


def windows(data: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut a byte stream into (x, y, lengths): x, y int64[W, seq_len], y = x shifted by one byte.

    Every byte after the first is a target exactly once. The last window may be short; it is padded with
    zeros at the end, which cannot change the earlier positions of a left-to-right LSTM. `lengths` says how
    many positions of each window are real.
    """
    if seq_len < 1:
        raise ConfigError(f"seq_len must be >= 1, got {seq_len}")
    data = np.asarray(data, dtype=np.uint8)
    n = data.size - 1  # predictions
    if n < 1:
        raise CorpusError(f"need at least 2 bytes to score anything, got {data.size}")
    w = -(-n // seq_len)
    x = np.zeros(w * seq_len, dtype=np.int64)
    y = np.zeros(w * seq_len, dtype=np.int64)
    x[:n], y[:n] = data[:-1], data[1:]
    lengths = np.full(w, seq_len, dtype=np.int64)
    lengths[-1] = n - (w - 1) * seq_len
    return x.reshape(w, seq_len), y.reshape(w, seq_len), lengths


def check_top_k(top_k: int, n_experts: int) -> None:
    if not 1 <= top_k <= n_experts:
        raise ConfigError(f"top-k must be between 1 and the number of experts ({n_experts}), got {top_k}")


def route(
    router: RouterLike, data: np.ndarray, seq_len: int, top_k: int, temperature: float, uniform: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(experts int64[W, k], weights float64[W, k]) for the windows of `windows(data, seq_len)`.

    The router sees the input stream x = data[:-1] cut into the same windows, and routes window i on
    window i-1. `uniform` replaces the weights by 1/k (a diagnostic: with k = N it is the plain average).
    """
    check_top_k(top_k, router.n_experts)
    x_stream = np.asarray(data, dtype=np.uint8)[:-1]
    experts, weights = router.route_windows(x_stream, seq_len, top_k, temperature)
    experts = np.asarray(experts, dtype=np.int64)
    weights = np.asarray(weights, dtype=np.float64)
    n_windows = -(-x_stream.size // seq_len)
    if experts.shape != (n_windows, top_k) or weights.shape != experts.shape:
        raise ValueError(
            f"router returned experts {experts.shape} and weights {weights.shape} for {n_windows} windows, top-k {top_k}"
        )
    if uniform:
        weights = np.full(experts.shape, 1.0 / top_k)
    return experts, weights


def _logsumexp(a: np.ndarray, axis: int) -> np.ndarray:
    m = np.max(a, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    return np.squeeze(m, axis) + np.log(np.sum(np.exp(a - m), axis=axis))


def evaluate(
    router: RouterLike,
    experts: Mapping[int, LogProbFn] | Sequence[LogProbFn],
    data: np.ndarray,
    seq_len: int,
    top_k: int,
    temperature: float,
    uniform: bool = False,
    batch: int = 64,
    keep_logprobs: bool = False,
) -> MixtureResult:
    """Mixture nats/byte of `data` under routed top-k experts; see the module docstring."""
    x, y, lengths = windows(data, seq_len)
    chosen, weights = route(router, data, seq_len, top_k, temperature, uniform)
    n_windows, k = chosen.shape
    real = np.arange(seq_len)[None, :] < lengths[:, None]  # [W, T]
    own = np.zeros((n_windows, k, seq_len), dtype=np.float64)  # log p_e(y) of each chosen expert
    for e in np.unique(chosen).tolist():
        rows, slots = np.nonzero(chosen == e)
        fn = experts[e]
        for i in range(0, rows.size, batch):
            r, s = rows[i : i + batch], slots[i : i + batch]
            out = fn(x[r])
            if out.shape != (r.size, seq_len, 256):
                raise ValueError(f"expert {e} returned log-probs of shape {out.shape}, expected {(r.size, seq_len, 256)}")
            own[r, s] = np.take_along_axis(out, y[r][..., None], axis=-1)[..., 0]
    with np.errstate(divide="ignore"):  # a weight of exactly 0 contributes nothing: log 0 = -inf
        logw = np.log(weights)
    mix = _logsumexp(logw[:, :, None] + own, axis=1)  # [W, T]
    scored = int(real.sum())
    result = MixtureResult(
        nats_per_byte=float(-mix[real].sum() / scored),
        bytes=scored,
        experts=chosen,
        weights=weights,
        logprobs=mix[real] if keep_logprobs else None,  # row-major order = stream order
    )
    for e in np.unique(chosen).tolist():
        rows, slots = np.nonzero(chosen == e)
        mask = real[rows]
        result.expert_windows[e] = int(rows.size)
        result.expert_weight[e] = float(weights[rows, slots].sum())
        result.expert_bytes[e] = int(mask.sum())
        result.expert_nats[e] = float(-own[rows, slots][mask].sum() / mask.sum())
    return result
