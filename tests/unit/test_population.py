"""The population graph (soma_edge.expert.population_graph) and evaluator (soma_edge.engine.population), on the CPU EP:
one call's 2K + 1 losses equal 2K + 1 looped LossEvaluator calls on w, w + eps z_j and w - eps z_j (z
materialized in numpy) to δ, for both kinds, K = 1 to 4, dense signs as keyed bits, sparse signs, Gaussian and
rank-1 noise; the clean
member's decoder gradients equal the "train" graph's; and the graph runs whole on CUDA, with no Loop, Scan
or LSTM node."""

import numpy as np
import pytest

from soma_edge.config import ModelConfig
from soma_edge.engine.evaluator import LossEvaluator
from soma_edge.engine.numerics import DELTA
from soma_edge.engine.population import PopulationEvaluator, direction, noise_feeds
from soma_edge.expert import cuda_kernels as cuda_ops
from soma_edge.expert import params
from soma_edge.expert.population_graph import Noise, build_population, noise_inputs, perturbed_size
from soma_edge.spsa import noise as keyed

KINDS = [ModelConfig(embed=8, hidden=16, layers=2), ModelConfig(kind="soma", embed=16, hidden=16, layers=2)]
# A short window (the tests are not about its length): each test opens a population session, unrolled over T
# steps, and ORT opens one of 16 steps in ~0.15 s, of 6 in ~0.04 s. 6 is no other dimension here (B, the split
# test's 4 rows, K, embed, hidden), so a graph that mixed up two axes cannot pass by their sizes alone.
B, T, EPS = 2, 6, 1e-2
SEED, EXPERT, STEP = 7, 3, 11


def _id(m: ModelConfig) -> str:
    return m.kind


@pytest.fixture(scope="module", params=KINDS, ids=_id)
def expert(request):
    """(model, clean weights, batch, the looped reference evaluator with its "train" session)."""
    m = request.param
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, size=(2, B, T), dtype=np.int64)
    return m, params.init(m, 1), x, y, LossEvaluator(m, "cpu", threads=1, parallel=1, decoder_grad=True)


def _body(m: ModelConfig) -> tuple[str, ...]:
    lay = params.layout(m)
    return lay.names[: lay.names.index(lay.decoder[0])]


def _noise(m: ModelConfig, k: int, perturbed, noise: Noise) -> dict[str, np.ndarray]:
    """K directions as the graph's inputs: the host's keyed noise (dense Rademacher as its bits, sparse
    Rademacher, density 1/2, or Gaussian cut from the flat vector), or rank-1 factors of random signs."""
    lay = params.layout(m)
    if noise is Noise.RANK1:
        rng = np.random.default_rng(k)
        return {i.name: rng.choice(np.array([-1, 1], np.int8), i.shape) for i in noise_inputs(m, k, perturbed, noise)}
    if noise in (Noise.BITS, Noise.SPARSE_BITS):
        n = perturbed_size(m, perturbed)
        feeds = {"bits": np.stack([keyed.noise_bits(SEED, EXPERT, STEP, j, n) for j in range(k)])}
        masks = [keyed.probe_mask(SEED, EXPERT, STEP, j, n, 0.5) for j in range(k)]
        if noise is Noise.SPARSE_BITS:
            feeds["keep"] = np.stack([np.packbits(mask) for mask in masks])
        for j in range(k):  # the bits stand for the host's z over the perturbed tensors, zero past them
            z = keyed.noise(SEED, EXPERT, STEP, j, n) * (masks[j] if noise is Noise.SPARSE_BITS else 1)
            want = np.concatenate([z, np.zeros(lay.size - n, np.float32)])
            assert np.array_equal(direction(lay, feeds, j, n).view(np.uint32), want.view(np.uint32))  # -0.0 too
        return feeds
    kind = "gaussian" if noise is Noise.GAUSSIAN else "rademacher"
    z = np.stack([keyed.noise(SEED, EXPERT, STEP, j, lay.size, kind) for j in range(k)])
    if noise is Noise.SIGNS:
        z *= np.stack([keyed.probe_mask(SEED, EXPERT, STEP, j, lay.size, 0.5) for j in range(k)])
    feeds = noise_feeds(lay, perturbed, noise, z)
    for j in range(k):  # what crosses is the host's noise, bit for bit, on the perturbed tensors
        zj = direction(lay, feeds, j)
        for n, s, o in zip(lay.names, lay.shapes, lay.offsets):
            want = z[j, o : o + int(np.prod(s))] if n in perturbed else 0.0
            np.testing.assert_array_equal(zj[o : o + int(np.prod(s))], want)
    return feeds


def _check_population(expert, k: int, perturbed, noise: Noise) -> None:
    m, w, x, y, ref = expert
    lay = params.layout(m)
    feeds = _noise(m, k, perturbed, noise)
    if noise is Noise.SIGNS:  # sparse: some weights of every probe untouched
        assert all((f == 0).any() and (f != 0).any() for f in feeds.values())
    if noise is Noise.SPARSE_BITS:
        assert all((direction(lay, feeds, j, perturbed_size(m, perturbed)) == 0).any() for j in range(k))
    pop = PopulationEvaluator(m, k, perturbed, noise, T, decoder_grad=True, device="cpu", threads=1)
    got = pop.evaluate(w, feeds, EPS, x, y)

    loss, grad = ref.clean(w, x, y)
    assert abs(got.loss - loss) <= DELTA * loss
    assert got.decoder_grad.dtype == np.float32 and got.decoder_grad.shape == (lay.size - lay.body,)
    np.testing.assert_allclose(got.decoder_grad, grad, rtol=0, atol=1e-6)
    assert got.lp.shape == got.lm.shape == (k,)
    for j in range(k):
        z = direction(lay, feeds, j, perturbed_size(m, perturbed))
        lp, lm = ref.loss(w + np.float32(EPS) * z, x, y), ref.loss(w - np.float32(EPS) * z, x, y)
        assert abs(got.lp[j] - lp) <= DELTA * lp, (j, got.lp[j], lp)
        assert abs(got.lm[j] - lm) <= DELTA * lm, (j, got.lm[j], lm)
        # each member sees its own probe: a graph that dropped or mixed up the noise would be caught here
        assert abs(lp - lm) > 10 * DELTA * loss


@pytest.mark.parametrize("noise", list(Noise), ids=lambda n: n.value)
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_population_losses_equal_the_loop(expert, noise, k):
    _check_population(expert, k, _body(expert[0]), noise)


@pytest.mark.parametrize("noise", list(Noise), ids=lambda n: n.value)
def test_population_perturbing_every_tensor(expert, noise):
    """decoder = "spsa" perturbs the decoder too: the tied E in both its roles (embedding and head), or
    the head's matrix and bias."""
    _check_population(expert, 2, params.layout(expert[0]).names, noise)


@pytest.mark.parametrize("m", KINDS, ids=_id)
@pytest.mark.parametrize("noise", list(Noise), ids=lambda n: n.value)
def test_population_graph_runs_whole_on_cuda_and_unrolls(m, noise):
    for perturbed in (_body(m), params.layout(m).names):
        model = build_population(m, 3, perturbed, noise, decoder_grad=True, seq_len=T)
        assert cuda_ops.nodes_without_cuda_kernel(model) == []
        ops = {n.op_type for n in model.graph.node}
        assert not ops & {"Loop", "Scan", "LSTM", "If"}
        assert {"MatMul", "Sigmoid", "Tanh"} <= ops


def test_rank1_inputs_are_factors_for_matrices_and_signs_for_vectors():
    m = KINDS[0]
    got = {i.name: (np.dtype(i.dtype), i.shape) for i in noise_inputs(m, 3, _body(m), Noise.RANK1)}
    H, E = m.hidden, m.embed
    assert got["a.embed"] == (np.int8, (3, 256)) and got["b.embed"] == (np.int8, (3, E))
    assert got["a.lstm0.W"] == (np.int8, (3, 4 * H)) and got["b.lstm0.W"] == (np.int8, (3, E))
    assert got["a.lstm1.R"] == (np.int8, (3, 4 * H)) and got["b.lstm1.R"] == (np.int8, (3, H))
    assert got["z.lstm0.B"] == (np.int8, (3, 1, 8 * H))  # a vector: full signs
    assert len(got) == 2 * 5 + 2  # embed and four W/R matrices as factors, two biases as signs


def test_evaluator_refuses_noise_of_the_wrong_form():
    m = KINDS[0]
    pop = PopulationEvaluator(m, 1, _body(m), Noise.SIGNS, T, device="cpu", threads=1)
    w, x = params.init(m, 1), np.zeros((B, T), dtype=np.int64)
    feeds = {i.name: np.zeros(i.shape, np.int8) for i in pop.inputs}
    assert pop.evaluate(w, feeds, EPS, x, x).decoder_grad is None
    with pytest.raises(ValueError, match="expected int8"):
        pop.evaluate(w, {**feeds, "z.embed": feeds["z.embed"].astype(np.float32)}, EPS, x, x)
    with pytest.raises(ValueError, match="noise inputs"):
        pop.evaluate(w, {"z.embed": feeds["z.embed"]}, EPS, x, x)
    with pytest.raises(ValueError, match="unknown"):
        build_population(m, 1, ["nope"], Noise.SIGNS, decoder_grad=False, seq_len=T)


@pytest.mark.parametrize("noise", list(Noise), ids=lambda n: n.value)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_split_population_gives_each_direction_its_own_rows(expert, noise, k):
    """spsa.split_rows on the graph: direction j's members see only rows j B/K .. (j + 1) B/K (their losses
    equal the loop's on those rows alone, and differ from the whole batch's), and the decoder gradient is
    the mean of the 2K probes' own, as the loop's decoder_from = "probes" sums it."""
    m, w, _, _, ref = expert
    rows = 4
    x, y = np.random.default_rng(k).integers(0, 256, size=(2, rows, T), dtype=np.int64)
    perturbed, lay = _body(m), params.layout(m)
    feeds = _noise(m, k, perturbed, noise)
    pop = PopulationEvaluator(
        m, k, perturbed, noise, T, decoder_grad=True, device="cpu", threads=1, decoder_from="probes", split=True
    )
    got = pop.evaluate(w, feeds, EPS, x, y)
    n, grads = perturbed_size(m, perturbed), []
    for j in range(k):
        own = slice(j * rows // k, (j + 1) * rows // k)
        z = np.float32(EPS) * direction(lay, feeds, j, n)
        (lp, gp), (lm, gm) = ref.clean(w + z, x[own], y[own]), ref.clean(w - z, x[own], y[own])
        assert abs(got.lp[j] - lp) <= DELTA * lp and abs(got.lm[j] - lm) <= DELTA * lm, (j, got.lp[j], lp)
        grads += [gp, gm]
        if k > 1:  # the whole batch's loss is another number: a graph that ignored the split is caught here
            assert abs(ref.loss(w + z, x, y) - lp) > 10 * DELTA * lp
    np.testing.assert_allclose(got.decoder_grad, np.mean(grads, axis=0), rtol=0, atol=1e-6)


def test_split_population_refuses_the_clean_decoder_gradient_and_runs_whole_on_cuda():
    m = KINDS[1]
    with pytest.raises(ValueError, match="clean member sees one slice"):
        build_population(m, 2, _body(m), Noise.BITS, decoder_grad=True, seq_len=T, split=True)
    for noise in Noise:
        model = build_population(m, 4, _body(m), noise, True, T, decoder_from="probes", split=True)
        assert cuda_ops.nodes_without_cuda_kernel(model) == []
