"""Routed top-k mixture of experts over a byte stream: the held-out loss of the whole model.

Two evaluation protocols (`PROTOCOLS`):
- "stream" (`evaluate`): the stream is cut into windows of `seq_len` predictions, each scored from a fresh
  LSTM state, exactly as the experts were trained, and every byte after the first is scored. Window i is
  routed on the bytes of window i-1 (window 0 on the router's prior), so the router never sees the bytes it
  helps predict.
- "paper" (`evaluate_paper`, the SOMA paper's): the stream is cut into consecutive 1,025-byte windows; each
  is routed on its own first 256 bytes, the experts run from a reset state over the whole window, and only
  its last 768 targets are scored (a tail shorter than a window is not scored).
The chosen experts are mixed in probability space, p(y) = sum_e w_e p_e(y), with w = softmax(-d^2/T) over
the top-k, or 1/k with `uniform` (the paper's mixture, over the top min(4, N)). Reductions are float64.

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


PROTOCOLS = ("stream", "paper")
PAPER_WINDOW, PAPER_PREFIX, PAPER_SCORED = 1025, 256, 768  # bytes per window, routed on, targets scored


class RouterLike(Protocol):
    n_experts: int

    def route_windows(
        self, data: np.ndarray, seq_len: int, top_k: int, temperature: float
    ) -> tuple[np.ndarray, np.ndarray]: ...

    def distances(self, contexts: Sequence[bytes | np.ndarray | None]) -> np.ndarray: ...

    def route(self, distances: np.ndarray | None, top_k: int, temperature: float) -> tuple[np.ndarray, np.ndarray]: ...


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
    positions: np.ndarray | None = None  # int64[bytes]: which predictions were scored (j predicts data[j+1]),
    # for protocols that score a subset; None means all of them, in order


def count_windows(n_bytes: int, seq_len: int) -> int:
    """Windows needed to score n_bytes: one prediction per byte after the first, seq_len per window."""
    if seq_len < 1:
        raise ConfigError(f"seq_len must be >= 1, got {seq_len}")
    if n_bytes < 2:
        raise CorpusError(f"need at least 2 bytes to score anything, got {n_bytes}")
    return -(-(n_bytes - 1) // seq_len)


def windows(data: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut a byte stream into (x, y, lengths): x, y int64[W, seq_len], y = x shifted by one byte.

    Every byte after the first is a target exactly once. The last window may be short; it is padded with
    zeros at the end, which cannot change the earlier positions of a left-to-right LSTM. `lengths` says how
    many positions of each window are real.
    """
    data = np.asarray(data, dtype=np.uint8)
    n = data.size - 1  # predictions
    w = count_windows(data.size, seq_len)
    x = np.zeros(w * seq_len, dtype=np.int64)
    y = np.zeros(w * seq_len, dtype=np.int64)
    x[:n], y[:n] = data[:-1], data[1:]
    lengths = np.full(w, seq_len, dtype=np.int64)
    lengths[-1] = n - (w - 1) * seq_len
    return x.reshape(w, seq_len), y.reshape(w, seq_len), lengths


def check_protocol(protocol: str) -> None:
    if protocol not in PROTOCOLS:
        raise ConfigError(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")


def check_top_k(top_k: int, n_experts: int) -> None:
    if not 1 <= top_k <= n_experts:
        raise ConfigError(f"top-k must be between 1 and the number of experts ({n_experts}), got {top_k}")


def route(
    router: RouterLike,
    data: np.ndarray,
    seq_len: int,
    top_k: int,
    temperature: float,
    uniform: bool = False,
    windows_range: tuple[int, int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(experts int64[W, k], weights float64[W, k]) for the windows of `windows(data, seq_len)`.

    The router sees the input stream x = data[:-1] cut into the same windows, and routes window i on
    window i-1. `windows_range` (lo, hi) routes only windows lo..hi-1 (the router then featurizes only
    hi - lo contexts). `uniform` replaces the weights by 1/k (a diagnostic: with k = N the plain average).
    """
    check_top_k(top_k, router.n_experts)
    x_stream = np.asarray(data, dtype=np.uint8)[:-1]
    total = -(-x_stream.size // seq_len)
    lo, hi = windows_range or (0, total)
    first = max(lo - 1, 0)  # window lo is routed on window lo - 1: hand that one to the router too
    experts, weights = router.route_windows(x_stream[first * seq_len : hi * seq_len], seq_len, top_k, temperature)
    experts = np.asarray(experts, dtype=np.int64)[lo - first :]
    weights = np.asarray(weights, dtype=np.float64)[lo - first :]
    if experts.shape != (hi - lo, top_k) or weights.shape != experts.shape:
        raise ValueError(
            f"router returned experts {experts.shape} and weights {weights.shape} for {hi - lo} windows, top-k {top_k}"
        )
    if uniform:
        weights = np.full(experts.shape, 1.0 / top_k)
    return experts, weights


def _logsumexp(a: np.ndarray, axis: int) -> np.ndarray:
    m = np.max(a, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    return np.squeeze(m, axis) + np.log(np.sum(np.exp(a - m), axis=axis))


class _Stats:
    """Per-expert totals over the windows it was selected for."""

    def __init__(self) -> None:
        self.windows: dict[int, int] = {}
        self.weight: dict[int, float] = {}
        self.bytes: dict[int, int] = {}
        self.nats: dict[int, float] = {}

    def add(self, e: int, windows: int, weight: float, n_bytes: int, nats: float) -> None:
        for d, v in ((self.windows, windows), (self.weight, weight), (self.bytes, n_bytes), (self.nats, nats)):
            d[e] = d.get(e, 0) + v


def _mix(
    experts: Mapping[int, LogProbFn] | Sequence[LogProbFn],
    x: np.ndarray,
    y: np.ndarray,
    chosen: np.ndarray,
    weights: np.ndarray,
    scored: np.ndarray,
    batch: int,
    stats: _Stats,
) -> np.ndarray:
    """float64 mixture log-probs of y[scored] (row-major), running each chosen expert only on its windows."""
    seq_len = x.shape[1]
    own = np.zeros(chosen.shape + (seq_len,), dtype=np.float64)  # log p_e(y) of each chosen expert
    for e in np.unique(chosen).tolist():
        rows, slots = np.nonzero(chosen == e)
        fn = experts[e]
        for i in range(0, rows.size, batch):
            r, s = rows[i : i + batch], slots[i : i + batch]
            out = fn(x[r])
            if out.shape != (r.size, seq_len, 256):
                raise ValueError(
                    f"expert {e} returned log-probs of shape {out.shape}, expected {(r.size, seq_len, 256)}"
                )
            own[r, s] = np.take_along_axis(out, y[r][..., None], axis=-1)[..., 0]
        mask = scored[rows]
        stats.add(e, rows.size, weights[rows, slots].sum(), mask.sum(), -own[rows, slots][mask].sum())
    with np.errstate(divide="ignore"):  # a weight of exactly 0 contributes nothing: log 0 = -inf
        logw = np.log(weights)
    return _logsumexp(logw[:, :, None] + own, axis=1)[scored]


def _result(
    nll: float,
    scored: int,
    experts: list[np.ndarray],
    weights: list[np.ndarray],
    stats: _Stats,
    logprobs: list[np.ndarray] | None,
    positions: np.ndarray | None = None,
) -> MixtureResult:
    return MixtureResult(
        nats_per_byte=float(nll / scored),
        bytes=scored,
        experts=np.concatenate(experts),
        weights=np.concatenate(weights),
        expert_windows={e: int(v) for e, v in stats.windows.items()},
        expert_weight={e: float(v) for e, v in stats.weight.items()},
        expert_bytes={e: int(v) for e, v in stats.bytes.items()},
        expert_nats={e: float(stats.nats[e] / stats.bytes[e]) for e in stats.bytes},
        logprobs=np.concatenate(logprobs) if logprobs is not None else None,
        positions=positions,
    )


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
    block: int = 4096,
) -> MixtureResult:
    """Mixture nats/byte of `data` under routed top-k experts, the "stream" protocol (module docstring).

    Windows are routed and scored `block` at a time, so memory stays bounded for any length of data.
    """
    data = np.asarray(data, dtype=np.uint8)
    check_top_k(top_k, router.n_experts)
    n_windows = count_windows(data.size, seq_len)
    nll, stats = 0.0, _Stats()
    parts_e, parts_w, parts_lp = [], [], []
    for lo in range(0, n_windows, block):
        hi = min(lo + block, n_windows)
        x, y, lengths = windows(data[lo * seq_len : hi * seq_len + 1], seq_len)
        chosen, weights = route(router, data, seq_len, top_k, temperature, uniform, (lo, hi))
        real = np.arange(seq_len)[None, :] < lengths[:, None]  # [w, T]
        mix = _mix(experts, x, y, chosen, weights, real, batch, stats)
        nll -= mix.sum()
        parts_e.append(chosen)
        parts_w.append(weights)
        if keep_logprobs:
            parts_lp.append(mix)
    return _result(nll, data.size - 1, parts_e, parts_w, stats, parts_lp if keep_logprobs else None)


def paper_positions(n_bytes: int) -> np.ndarray:
    """int64: the predictions the paper protocol scores in a stream of n_bytes (j predicts data[j+1])."""
    starts = np.arange(n_bytes // PAPER_WINDOW, dtype=np.int64) * PAPER_WINDOW
    first = PAPER_WINDOW - 1 - PAPER_SCORED  # prediction 256 of the window's 1,024
    return (starts[:, None] + first + np.arange(PAPER_SCORED)[None, :]).reshape(-1)


def evaluate_paper(
    router: RouterLike,
    experts: Mapping[int, LogProbFn] | Sequence[LogProbFn],
    data: np.ndarray,
    top_k: int,
    temperature: float = 1.0,
    uniform: bool = True,
    batch: int = 16,
    keep_logprobs: bool = False,
    block: int = 256,
) -> MixtureResult:
    """Mixture nats/byte of `data` under the paper's protocol (module docstring); uniform by default."""
    data = np.asarray(data, dtype=np.uint8)
    check_top_k(top_k, router.n_experts)
    n_windows = data.size // PAPER_WINDOW
    if n_windows == 0:
        raise CorpusError(f"the paper protocol scores {PAPER_WINDOW}-byte windows; got only {data.size} bytes")
    scored = np.arange(PAPER_WINDOW - 1) >= PAPER_WINDOW - 1 - PAPER_SCORED
    nll, stats = 0.0, _Stats()
    parts_e, parts_w, parts_lp = [], [], []
    for lo in range(0, n_windows, block):
        hi = min(lo + block, n_windows)
        win = data[lo * PAPER_WINDOW : hi * PAPER_WINDOW].reshape(hi - lo, PAPER_WINDOW).astype(np.int64)
        # The router reads each window's first 256 bytes only; the scored targets start 257 bytes in.
        chosen, weights = router.route(
            router.distances(list(win[:, :PAPER_PREFIX].astype(np.uint8))), top_k, temperature
        )
        chosen = np.asarray(chosen, dtype=np.int64)
        weights = np.full(chosen.shape, 1.0 / top_k) if uniform else np.asarray(weights, dtype=np.float64)
        mask = np.broadcast_to(scored, (hi - lo, PAPER_WINDOW - 1))
        mix = _mix(experts, win[:, :-1], win[:, 1:], chosen, weights, mask, batch, stats)
        nll -= mix.sum()
        parts_e.append(chosen)
        parts_w.append(weights)
        if keep_logprobs:
            parts_lp.append(mix)
    return _result(
        nll,
        n_windows * PAPER_SCORED,
        parts_e,
        parts_w,
        stats,
        parts_lp if keep_logprobs else None,
        paper_positions(data.size),
    )
