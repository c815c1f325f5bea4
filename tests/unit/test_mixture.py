"""soma_edge.corpus.mixture: windows, routed top-k mixing, and that unselected experts never run.

The router here is a stand-in with a known rule, so that the expected mixture can be computed byte by byte
in a plain loop; tests/unit/test_export.py runs the same code with the real router and ORT experts.
"""

import numpy as np
import pytest

from soma_edge.corpus import mixture
from soma_edge.errors import ConfigError, CorpusError

N = 4


def _bigram_tables(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, 256, 256)) * 2.0
    return (z - np.log(np.exp(z).sum(-1, keepdims=True))).astype(np.float32)  # log p_e(next | current)


class CountingExpert:
    """A bigram 'expert' with the same interface as an ORT session: x[B,T] -> log-probs [B,T,256]."""

    def __init__(self, table: np.ndarray):
        self.table, self.calls, self.rows = table, 0, 0

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.calls += 1
        self.rows += x.shape[0]
        return self.table[x]


class RuleRouter:
    """Window i goes to experts chosen from the sum of window i-1's bytes; window 0 to the 'prior'."""

    def __init__(self, n: int, allowed: list[int] | None = None):
        self.n_experts, self.allowed = n, allowed or list(range(n))
        self.contexts: list[bytes] = []

    def route_windows(self, data, seq_len, top_k, temperature):
        w = -(-data.size // seq_len)
        experts, weights = [], []
        for i in range(w):
            ctx = bytes(data[(i - 1) * seq_len : i * seq_len]) if i else b""
            self.contexts.append(ctx)
            first = sum(ctx) % len(self.allowed)
            chosen = [self.allowed[(first + j) % len(self.allowed)] for j in range(top_k)]
            d = np.arange(top_k, dtype=np.float64) + (sum(ctx) % 7) / 7  # distances rising with rank
            p = np.exp(-(d**2) / temperature)
            experts.append(chosen)
            weights.append(p / p.sum())
        return np.array(experts), np.array(weights)


def _loop_reference(router, tables, data, T, k, temp, uniform=False):
    """Mixture log-prob of every byte after the first, one byte at a time."""
    experts, weights = router.route_windows(data[:-1], T, k, temp)
    out = []
    for j in range(data.size - 1):  # predict data[j+1] from data[j] (bigram), window j // T
        w = j // T
        p = 0.0
        for e, wt in zip(experts[w], weights[w]):
            p += (1.0 / k if uniform else wt) * np.exp(float(tables[e][data[j], data[j + 1]]))
        out.append(np.log(p))
    return np.array(out)


@pytest.mark.parametrize("n_bytes,T", [(2, 8), (9, 8), (17, 8), (100, 7), (64, 64)])
def test_windows_cover_every_byte_once(n_bytes, T):
    data = np.random.default_rng(n_bytes).integers(0, 256, n_bytes).astype(np.uint8)
    x, y, lengths = mixture.windows(data, T)
    assert x.shape == y.shape == (-(-(n_bytes - 1) // T), T)
    real = np.arange(T)[None, :] < lengths[:, None]
    np.testing.assert_array_equal(x[real], data[:-1])
    np.testing.assert_array_equal(y[real], data[1:])
    assert lengths.sum() == n_bytes - 1


def test_windows_reject_too_little_data():
    for bad in (b"", b"a"):
        with pytest.raises(CorpusError):
            mixture.windows(np.frombuffer(bad, np.uint8), 8)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("uniform", [False, True])
def test_routed_mixture_matches_byte_loop(k, uniform):
    tables = _bigram_tables(N)
    data = np.frombuffer(b"the quick brown fox jumps over the lazy dog; " * 7, dtype=np.uint8)
    T, temp = 8, 0.7
    fns = [CountingExpert(t) for t in tables]
    r = mixture.evaluate(RuleRouter(N), fns, data, T, k, temp, uniform=uniform, batch=3, keep_logprobs=True)
    ref = _loop_reference(RuleRouter(N), tables, data, T, k, temp, uniform)
    assert r.bytes == data.size - 1
    np.testing.assert_allclose(r.logprobs, ref, rtol=0, atol=1e-9)
    assert r.nats_per_byte == pytest.approx(-ref.mean(), abs=1e-12)
    np.testing.assert_allclose(r.weights.sum(1), 1.0)
    # per-expert view: each expert's own loss on exactly the windows it served
    x, y, lengths = mixture.windows(data, T)
    for e, nats in r.expert_nats.items():
        rows = np.nonzero((r.experts == e).any(1))[0]
        own = [float(tables[e][x[w, t], y[w, t]]) for w in rows for t in range(lengths[w])]
        assert nats == pytest.approx(-np.mean(own), abs=1e-9)
        assert r.expert_windows[e] == rows.size


def test_unselected_experts_never_run():
    tables = _bigram_tables(N)
    data = np.frombuffer(b"abcdefgh" * 40, dtype=np.uint8)
    fns = [CountingExpert(t) for t in tables]
    r = mixture.evaluate(RuleRouter(N, allowed=[1, 3]), fns, data, 8, 1, 1.0, batch=4)
    assert fns[0].calls == 0 and fns[2].calls == 0
    served = {e: int((r.experts == e).sum()) for e in (1, 3)}
    assert fns[1].rows == served[1] and fns[3].rows == served[3]  # each only on its own windows
    assert fns[1].calls == -(-served[1] // 4)  # in batches


def test_router_sees_only_preceding_windows():
    data = np.frombuffer(bytes(range(50)), dtype=np.uint8)
    router = RuleRouter(N)
    mixture.evaluate(router, [CountingExpert(t) for t in _bigram_tables(N)], data, 8, 2, 1.0)
    # window i (targets data[8i+1 .. 8i+8]) was routed on data[8(i-1) : 8i], i.e. strictly before its targets
    assert router.contexts[0] == b""
    for i, ctx in enumerate(router.contexts[1:], start=1):
        assert ctx == bytes(range(8 * (i - 1), 8 * i))


@pytest.mark.parametrize("k", [0, N + 1, -1])
def test_top_k_out_of_range(k):
    data = np.frombuffer(b"hello world", dtype=np.uint8)
    with pytest.raises(ConfigError, match="top-k"):
        mixture.evaluate(RuleRouter(N), [CountingExpert(t) for t in _bigram_tables(N)], data, 4, k, 1.0)


def test_blocks_change_nothing():
    """Scoring in blocks of windows (bounded memory) equals scoring all windows at once, across borders."""
    tables = _bigram_tables(N)
    data = np.frombuffer(bytes(range(256)) * 3 + b"tail", dtype=np.uint8)
    whole = mixture.evaluate(RuleRouter(N), [CountingExpert(t) for t in tables], data, 8, 2, 0.5, keep_logprobs=True)
    router = RuleRouter(N)
    parts = mixture.evaluate(router, [CountingExpert(t) for t in tables], data, 8, 2, 0.5, keep_logprobs=True, block=7)
    assert len(router.contexts) > whole.experts.shape[0]  # it really went block by block
    np.testing.assert_array_equal(parts.experts, whole.experts)
    np.testing.assert_array_equal(parts.weights, whole.weights)
    np.testing.assert_allclose(parts.logprobs, whole.logprobs, rtol=0, atol=1e-12)
    assert parts.nats_per_byte == pytest.approx(whole.nats_per_byte, abs=1e-12)
    assert parts.expert_windows == whole.expert_windows and parts.expert_bytes == whole.expert_bytes
    for e in whole.expert_nats:
        assert parts.expert_nats[e] == pytest.approx(whole.expert_nats[e], abs=1e-12)
