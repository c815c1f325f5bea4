"""Every ORT graph mode equals the torch reference on the same weights, for both model kinds."""

import numpy as np
import pytest

from soma_edge.config import ModelConfig
from soma_edge.engine.evaluator import LossEvaluator
from soma_edge.expert import params

torch = pytest.importorskip("torch")

from bench.torch_ref import TorchExpert, torch_loss  # noqa: E402 - after importorskip: it imports torch

SHAPES = [ModelConfig(embed=16, hidden=24, layers=1), ModelConfig(embed=8, hidden=20, layers=2)]
SOMA = [
    ModelConfig(kind="soma", embed=16, hidden=16, layers=1),
    ModelConfig(kind="soma", embed=12, hidden=12, layers=2),
]
BOTH = SHAPES + SOMA


def _id(m: ModelConfig) -> str:
    return f"{m.kind}-E{m.embed}H{m.hidden}L{m.layers}"


def _wide_weights(m: ModelConfig, seed: int) -> np.ndarray:
    # std 0.5 on every tensor, biases included: a gate-order or transpose mistake changes the loss a lot.
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(params.count(m)) * 0.5).astype(np.float32)


def _batch(seed: int, b: int = 3, t: int = 17):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(b, t + 1))  # every byte value is fair game
    data[0, :4] = [0, 255, 0, 255]
    return data[:, :-1].astype(np.int64), data[:, 1:].astype(np.int64)


@pytest.mark.parametrize("m", BOTH, ids=_id)
def test_ort_loss_matches_torch(m):
    ev = LossEvaluator(m, device="cpu", threads=1)
    w = _wide_weights(m, 1)
    x, y = _batch(2)
    ort_loss, ref = ev.loss(w, x, y), torch_loss(m, w, x, y)
    assert abs(ort_loss - ref) <= 1e-5, (ort_loss, ref)
    # Far from uniform (log 256 = 5.545): the weights really shape the output.
    assert abs(ref - np.log(256)) > 0.1

    # A perturbed weight set through the same session.
    w2 = w + 0.3 * np.random.default_rng(3).standard_normal(w.size).astype(np.float32)
    ort2, ref2 = ev.loss(w2, x, y), torch_loss(m, w2, x, y)
    assert abs(ort2 - ref2) <= 1e-5, (ort2, ref2)
    assert abs(ort2 - ort_loss) > 1e-3


def test_gate_order_matters():
    """Guard the guard: swapping two gate blocks in the torch copy must break parity."""
    m = SHAPES[0]
    w = _wide_weights(m, 4)
    x, y = _batch(5)
    model = TorchExpert(m).load_flat(w)
    H = m.hidden
    with torch.no_grad():
        wi = model.lstm.weight_ih_l0
        wi.copy_(torch.cat([wi[H : 2 * H], wi[:H], wi[2 * H :]]))
        bad = float(model(torch.from_numpy(x), torch.from_numpy(y)))
    good = LossEvaluator(m, device="cpu", threads=1).loss(w, x, y)
    assert abs(bad - good) > 1e-3


@pytest.mark.parametrize("m", [SHAPES[1], SOMA[1]], ids=_id)
def test_flat_grad_roundtrip(m):
    """The torch gradient maps back into the flat layout: a finite difference along it agrees."""
    from bench.torch_ref import reference

    w = _wide_weights(m, 6) * 0.5
    x, y = _batch(7)
    model = reference(m, w)
    loss = model(torch.from_numpy(x), torch.from_numpy(y))
    loss.backward()
    g = model.flat_grad()
    ev = LossEvaluator(m, device="cpu", threads=1)
    d = g / np.linalg.norm(g)
    h = 1e-2
    fd = (ev.loss(w + h * d, x, y) - ev.loss(w - h * d, x, y)) / (2 * h)
    assert abs(fd - np.linalg.norm(g)) / np.linalg.norm(g) < 0.05


@pytest.mark.parametrize("m", BOTH, ids=_id)
def test_delta_rule_equals_autograd_through_the_decoder(m):
    """The train graph's decoder gradient is torch autograd's gradient w.r.t. the head alone (h detached)."""
    from bench.torch_ref import decoder_path_grad

    ev = LossEvaluator(m, device="cpu", threads=1, decoder_grad=True)
    w = _wide_weights(m, 4)
    x, y = _batch(5, b=4, t=23)
    loss, g = ev.clean(w, x, y)
    ref_loss, ref = decoder_path_grad(m, w, x, y)
    assert g.dtype == np.float32 and g.shape == (params.count(m) - params.layout(m).body,)
    assert abs(loss - ref_loss) <= 1e-5
    diff = np.abs(g.astype(np.float64) - ref)
    assert diff.max() <= 1e-5, diff.max()
    assert np.linalg.norm(diff) / np.linalg.norm(ref) <= 1e-5
    assert np.linalg.norm(ref) > 1e-2  # a real gradient, not zeros on both sides


@pytest.mark.parametrize("m", BOTH, ids=_id)
def test_logprobs_and_stream_graphs_match_torch(m):
    """The deploy graphs (weights as initializers): log-probs, and streaming from a non-zero state."""
    from bench.torch_ref import stream_logits
    from soma_edge.engine.runtime import make_session
    from soma_edge.expert.graph import build

    w = _wide_weights(m, 8)
    x, _ = _batch(9)
    ref, _ = stream_logits(m, w, x)
    ref_lp = ref - np.log(np.exp(ref.astype(np.float64)).sum(-1, keepdims=True))
    (lp,) = make_session(build(m, "logprobs", w), "cpu", 1).run(None, {"x": x})
    assert np.abs(lp - ref_lp).max() <= 1e-5

    rng = np.random.default_rng(10)
    state = [rng.standard_normal((1, x.shape[0], m.hidden)).astype(np.float32) * 0.5 for _ in range(2 * m.layers)]
    names = [f"{s}{layer}" for layer in range(m.layers) for s in ("h", "c")]
    logits, *after = make_session(build(m, "stream", w), "cpu", 1).run(None, {"x": x, **dict(zip(names, state))})
    ref_logits, ref_after = stream_logits(m, w, x, state)
    assert np.abs(logits - ref_logits).max() <= 1e-5
    for a, b in zip(after, ref_after, strict=True):
        assert np.abs(a - b).max() <= 1e-5
    # the state matters: from zeros the logits differ
    zero, _ = stream_logits(m, w, x)
    assert np.abs(zero - ref_logits).max() > 1e-3


def test_tied_delta_rule_is_the_decoder_path_only():
    """Guard the guard: the tied kind's full gradient w.r.t. E (both roles) differs from the delta rule."""
    from bench.torch_ref import decoder_path_grad, reference

    m = SOMA[1]
    w = _wide_weights(m, 11)
    x, y = _batch(12)
    model = reference(m, w)
    model(torch.from_numpy(x), torch.from_numpy(y)).backward()
    full = model.E.grad.numpy().reshape(-1)
    _, path = decoder_path_grad(m, w, x, y)
    assert np.linalg.norm(full - path) > 1e-3 * np.linalg.norm(path)
