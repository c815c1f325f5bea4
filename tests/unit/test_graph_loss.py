"""The loss head that the CUDA EP runs whole (LogSoftmax, GatherElements, ReduceMean, Neg) equals the
SoftmaxCrossEntropyLoss head it replaced, in the loss and in every decoder gradient, for both model kinds."""

import numpy as np
import onnxruntime as ort
import pytest

from soma_edge.config import ModelConfig
from soma_edge.expert import graph, params
from tests.helpers.old_loss import with_softmax_cross_entropy

KINDS = [ModelConfig(embed=8, hidden=20, layers=2), ModelConfig(kind="soma", embed=12, hidden=12, layers=2)]
BATCHES = [(3, 17), (1, 5), (4, 33)]  # (B, T)


def _id(m: ModelConfig) -> str:
    return f"{m.kind}-E{m.embed}H{m.hidden}L{m.layers}"


def _run(model, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


def _feeds(m: ModelConfig, seed: int, b: int, t: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    # std 0.5 on every tensor: logits far from uniform, so a wrong row or sign changes the loss a lot
    w = (rng.standard_normal(params.count(m)) * 0.5).astype(np.float32)
    x, y = rng.integers(0, 256, size=(2, b, t), dtype=np.int64)
    return {"x": x, "y": y, **params.layout(m).views(w)}


@pytest.mark.parametrize("m", KINDS, ids=_id)
@pytest.mark.parametrize("mode", ["loss", "train"])
def test_new_loss_head_equals_softmax_cross_entropy(m, mode):
    new = graph.build(m, mode)
    assert "SoftmaxCrossEntropyLoss" not in {n.op_type for n in new.graph.node}
    old = with_softmax_cross_entropy(new)
    for seed, (b, t) in enumerate(BATCHES):
        feeds = _feeds(m, seed, b, t)
        got, want = _run(new, feeds), _run(old, feeds)
        assert (
            set(got)
            == set(want)
            == {"loss"} | ({f"grad.{n}" for n in params.layout(m).decoder} if mode == "train" else set())
        )
        assert 1.0 < want["loss"] < 30.0  # a real cross-entropy, not a constant both graphs agree on
        assert abs(float(got["loss"]) - float(want["loss"])) <= 1e-6
        for name in sorted(set(want) - {"loss"}):
            assert got[name].shape == want[name].shape
            np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("m", KINDS, ids=_id)
def test_new_loss_head_is_the_mean_cross_entropy(m):
    """Independent of either graph: -mean log softmax(logits)[y], with the logits from the logprobs head."""
    feeds = _feeds(m, 7, 2, 9)
    w = np.concatenate([feeds[n].ravel() for n in params.layout(m).names])
    (logprobs,) = _run(graph.build(m, "logprobs", w), {"x": feeds["x"]}).values()
    want = -np.take_along_axis(logprobs.astype(np.float64), feeds["y"][..., None], axis=-1).mean()
    assert float(_run(graph.build(m, "loss"), feeds)["loss"]) == pytest.approx(want, abs=2e-6)
