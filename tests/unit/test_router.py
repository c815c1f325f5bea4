"""The router: featurizer, balanced k-means, scoring, routing on preceding bytes only, storage."""

import subprocess
import sys

import msgpack
import numpy as np
import pytest

from soma_edge import codec
from soma_edge.corpus import features
from soma_edge.corpus import router as routing
from soma_edge.errors import CodecError, ConfigError
from tests.helpers.corpus import FOUR_DOMAINS


@pytest.fixture(scope="module")
def fitted(four_domain_docs):
    """A router with 8 clusters over 4 experts, fitted on the train split of the 4-domain sample."""
    docs = four_domain_docs
    train = [i for i, d in enumerate(docs) if d.split == "train"]
    router, labels = routing.fit([d.text for d in docs], 4, n_clusters=8, seed=0, fit_on=train)
    return docs, router, labels


def test_fit_shapes_balance_and_size(fitted):
    docs, router, labels = fitted
    assert router.n_experts == 4 and router.n_clusters == 8 and router.dim == features.DIM
    assert sorted(set(router.cluster_expert.tolist())) == [0, 1, 2, 3]  # every expert has a cluster
    sizes = np.bincount(labels, weights=[len(d.text) for d in docs], minlength=8)
    assert sizes.max() <= 2 * sizes.mean() and sizes.min() > 0
    assert abs(router.prior.sum() - 1) < 1e-9 and np.all(router.prior > 0)
    expert_bytes = np.bincount(router.cluster_expert, weights=sizes, minlength=4)
    np.testing.assert_allclose(router.prior, expert_bytes / expert_bytes.sum())
    assert len(router.to_bytes()) < 4 * 1024 * 1024  # "within a few MB"
    assert router.temperature > 0


def test_distance_is_min_over_an_experts_clusters(fitted):
    _, router, _ = fitted
    ctx = [b"To be, or not to be, that is the question", b"def f(x):\n    return x + 1\n", b"x" * 300]
    feats = router.features(ctx)
    np.testing.assert_allclose(np.linalg.norm(feats, axis=1), 1.0, rtol=1e-5)
    by_cluster = ((feats[:, None, :] - router.centroids[None, :, :]) ** 2).sum(-1)  # computed directly
    want = np.stack([by_cluster[:, router.cluster_expert == e].min(axis=1) for e in range(4)], axis=1)
    np.testing.assert_allclose(router.distances(ctx), want, atol=1e-5)


def test_features_of_a_batch_equal_features_one_by_one(fitted):
    """n-grams never cross from one text into the next: batching cannot change a text's features."""
    docs, router, _ = fitted
    texts = [docs[0].text[:500], b"", docs[-1].text[:77], b"a", docs[5].text[:3000]]
    batch = router.features(texts)
    alone = np.concatenate([router.features([t]) for t in texts])
    np.testing.assert_array_equal(batch, alone)
    assert not batch[1].any()  # no bytes, no features
    joined = router.features([texts[0] + texts[2]])[0]
    assert not np.allclose(joined, batch[0])


def test_routes_held_out_windows_to_their_domain(fitted):
    """The router is useful at inference: 256-byte contexts from held-out documents mostly pick the
    expert that trains on their domain (0.88 measured with 8 clusters over 4 experts; chance is 0.25)."""
    docs, router, labels = fitted
    majority = {}
    for dom in FOUR_DOMAINS:
        experts = [router.cluster_expert[k] for d, k in zip(docs, labels) if d.domain == dom]
        majority[dom] = np.bincount(experts, minlength=4).argmax()
    hits = total = 0
    for d in docs:
        if d.split == "train":
            continue
        experts, _ = router.route_windows(d.text, 256, 1, router.temperature)
        hits += int((experts[1:, 0] == majority[d.domain]).sum())
        total += experts.shape[0] - 1
    assert total > 100 and hits / total >= 0.75


def test_route_is_softmax_over_top_k(fitted):
    _, router, _ = fitted
    d = np.array([[0.9, 0.5, 0.7, 0.5], [0.1, 0.4, 0.3, 0.2]])
    experts, weights = router.route(d, 2, 0.1)
    np.testing.assert_array_equal(experts, [[1, 3], [0, 3]])  # the tie 0.5/0.5 goes to the lower id
    for row in range(2):
        z = np.exp(-d[row, experts[row]] / 0.1)
        np.testing.assert_allclose(weights[row], z / z.sum())
    experts, weights = router.route(d, 1, 0.1)
    np.testing.assert_array_equal(experts[:, 0], [1, 0])
    np.testing.assert_array_equal(weights, 1.0)
    experts, weights = router.route(d, 4, 1e9)  # very hot: all experts, near uniform
    np.testing.assert_allclose(weights, 0.25, atol=1e-6)


def test_no_context_uses_the_prior(fitted):
    _, router, _ = fitted
    order = np.argsort(-router.prior, kind="stable")
    experts, weights = router.route(None, 2, 0.1)
    np.testing.assert_array_equal(experts, [order[:2]])
    np.testing.assert_allclose(weights, [router.prior[order[:2]] / router.prior[order[:2]].sum()])
    d = router.distances([None, b"", b"some text"])
    assert np.isnan(d[0]).all() and np.isnan(d[1]).all() and np.isfinite(d[2]).all()
    experts, _ = router.route(d, 2, 0.1)
    np.testing.assert_array_equal(experts[0], order[:2])


def test_route_windows_sees_only_the_previous_window(fitted):
    docs, router, _ = fitted
    T = 64
    data = b"".join(d.text[:200] for d in docs[::40])[: 5 * T + 10]  # 6 windows, the last one short
    experts, weights = router.route_windows(data, T, 2, 0.05)
    assert experts.shape == (6, 2) and weights.shape == (6, 2)
    prior_e, prior_w = router.route(None, 2, 0.05)
    np.testing.assert_array_equal(experts[0], prior_e[0])
    np.testing.assert_allclose(weights[0], prior_w[0])
    for i in range(1, 6):
        want_e, want_w = router.route(router.distances([data[(i - 1) * T : i * T]]), 2, 0.05)
        np.testing.assert_array_equal(experts[i], want_e[0])
        np.testing.assert_allclose(weights[i], want_w[0], rtol=1e-6)
    # Rewriting window 3's own bytes changes the routing of window 4, never of window 3.
    other = bytearray(data)
    other[3 * T : 4 * T] = (b"def g(): return None\n" * 4)[:T]
    e2, w2 = router.route_windows(np.frombuffer(bytes(other), dtype=np.uint8), T, 2, 0.05)
    np.testing.assert_array_equal(e2[:4], experts[:4])
    np.testing.assert_allclose(w2[:4], weights[:4])
    assert not (np.array_equal(e2[4], experts[4]) and np.allclose(w2[4], weights[4]))


def test_bad_route_arguments(fitted):
    _, router, _ = fitted
    with pytest.raises(ConfigError, match="top-k"):
        router.route(None, 0, 0.1)
    with pytest.raises(ConfigError, match="top-k"):
        router.route(None, 5, 0.1)
    with pytest.raises(ConfigError, match="temperature"):
        router.route(None, 1, 0.0)
    with pytest.raises(ConfigError, match="shape"):
        router.route(np.zeros((2, 3)), 1, 0.1)
    with pytest.raises(ConfigError, match="seq_len"):
        router.route_windows(b"abc", 0, 1, 0.1)


def test_roundtrip_and_bounded_decode(fitted, tmp_path):
    _, router, _ = fitted
    data = router.to_bytes()
    back = routing.Router.from_bytes(data)
    assert back.to_bytes() == data
    ctx = [b"Of Man's first disobedience", b"import os\n"]
    np.testing.assert_array_equal(back.distances(ctx), router.distances(ctx))
    (tmp_path / "router.msgpack").write_bytes(data)
    assert routing.load(tmp_path / "router.msgpack").to_bytes() == data

    with pytest.raises(CodecError, match="exceeds"):
        routing.Router.from_bytes(data, max_bytes=1000)
    with pytest.raises(CodecError, match="expected a router"):
        routing.Router.from_bytes(codec.encode({}, "expert"))
    with pytest.raises(CodecError):
        routing.Router.from_bytes(data[: len(data) // 2])
    body = codec.decode(data, "router")
    for field, value, match in [
        ("featurizer", "something-else", "featurizer"),
        ("idf", np.ones(10, np.float32), "idf"),
        ("cluster_expert", np.zeros(8, np.int64), "no cluster"),
        ("prior", np.array([1.0, 0, 0, 0.5]), "prior"),
        ("centroids", np.full((8, 2048), np.nan, np.float32), "non-finite"),
    ]:
        with pytest.raises(CodecError, match=match):
            routing.Router.from_bytes(codec.encode({**body, field: value}, "router"))
    bad = dict(body)
    del bad["temperature"]
    with pytest.raises(CodecError, match="field"):
        routing.Router.from_bytes(codec.encode(bad, "router"))
    with pytest.raises(CodecError):
        routing.Router.from_bytes(msgpack.packb({"schema": 1, "kind": "router", "body": [1, 2]}))


def test_fit_is_deterministic_and_seeded(fitted):
    docs, router, labels = fitted
    small = docs[::3]
    a, la = routing.fit([d.text for d in small], 3, seed=5)
    b, lb = routing.fit([d.text for d in small], 3, seed=5)
    assert a.to_bytes() == b.to_bytes() and np.array_equal(la, lb)


def test_fit_refuses_impossible_requests():
    texts = [b"alpha beta", b"gamma delta", b"epsilon"]
    with pytest.raises(ConfigError, match="experts"):
        routing.fit(texts, 0)
    with pytest.raises(ConfigError, match="clusters"):
        routing.fit(texts, 3, n_clusters=2)
    with pytest.raises(ConfigError, match="documents"):
        routing.fit(texts, 4)
    with pytest.raises(ConfigError, match="power of two"):
        routing.fit(texts, 2, dim=1000)


def test_router_module_needs_no_training_code():
    """export/ uses the router with numpy and msgpack only."""
    code = (
        "import sys\n"
        "for m in ('torch', 'flwr', 'onnx', 'onnxruntime'): sys.modules[m] = None\n"
        "import soma_edge.corpus.router\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
