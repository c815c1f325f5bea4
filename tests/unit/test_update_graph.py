"""The SPSA update as an ONNX graph (soma_edge.expert.update_graph), on the CPU EP with the runtime's session options
(ORT_ENABLE_ALL): over four consecutive steps (warmup and cosine lr, changing bias corrections), its new
weights, Adam moments and momentum equal the numpy update's (Stepper.replay -> spsa.optim.apply_update) bit for bit, for
both model kinds, with Rademacher (dense and sparse), Gaussian and rank-1 noise fed exactly as the population
graph takes it; and `supported` refuses the rms update, which it cannot reproduce."""

import dataclasses

import numpy as np
import pytest

from soma_edge.config import ModelConfig, Noise, SPSAConfig
from soma_edge.engine.population import factor_feeds, graph_noise, noise_feeds
from soma_edge.engine.runtime import make_session
from soma_edge.expert import params
from soma_edge.expert.population_graph import Noise as GraphNoise
from soma_edge.expert.update_graph import build_update, run_update, supported, update_feeds, update_inputs, write_back
from soma_edge.spsa import optim
from soma_edge.spsa import stepper as steppers

KINDS = [ModelConfig(embed=16, hidden=32, layers=1), ModelConfig(kind="soma", embed=16, hidden=16, layers=1)]
SEED, EXPERT, STEPS = 3, 2, 4
BASE = SPSAConfig(directions=3, lr=1e-2, warmup_steps=2, total_steps=5, lr_min_frac=0.2)
CONFIGS = {
    "default": BASE,
    "decoder_spsa": dataclasses.replace(BASE, decoder="spsa"),
    "sgd_momentum": dataclasses.replace(BASE, update="sgd", momentum=0.9),
    "weight_decay": dataclasses.replace(BASE, weight_decay=0.05),
    "sparse": dataclasses.replace(BASE, density=0.25),
    "dense_signs": dataclasses.replace(BASE, density=1.0, decoder="frozen"),
    "gaussian": dataclasses.replace(BASE, noise=Noise.GAUSSIAN),
    "rank1": dataclasses.replace(BASE, noise=Noise.RANK1, density=1.0),
    "accumulate": dataclasses.replace(BASE, directions=2, accumulate=3, weight_decay=0.01),
}


def _noise(
    stepper: steppers.Stepper, lay: params.Layout, perturbed, t: int, body: int, k: int
) -> dict[str, np.ndarray]:
    """The k directions of step t as the population graph's inputs, drawn by the Stepper itself."""
    probes = stepper.probes(t, range(k), body)
    if probes.factors is not None:
        return factor_feeds(lay, perturbed, probes.factors)
    if probes.bits is not None:  # Rademacher: the keyed bits (and sparse masks), expanded by the graph
        return {"bits": probes.bits} | ({} if probes.keep is None else {"keep": probes.keep})
    return noise_feeds(lay, perturbed, graph_noise(stepper.cfg), probes.z)


def _grads(rng: np.random.Generator, k: int, t: int) -> np.ndarray:
    """Projected gradients as a step records them (float64, used as float32), of mixed signs and scales; at
    odd steps the first is an exact zero (L+ == L-: g z is ±0 on every weight)."""
    g = rng.standard_normal(k) * 10.0 ** rng.integers(-3, 2, k)
    g[0] = g[0] if t % 2 == 0 else 0.0
    return g


def _decoder_grads(rng: np.random.Generator, lay: params.Layout, a: int) -> tuple[list[dict], np.ndarray]:
    """A step's delta-rule gradients: per minibatch as the population graph returns them ({"grad.<name>"}), and
    their mean as the Stepper takes it (spsa.optim.mean_decoder_grad over the flat decoder)."""
    shapes = dict(zip(lay.names, lay.shapes))
    per = [{f"grad.{n}": rng.standard_normal(shapes[n]).astype(np.float32) for n in lay.decoder} for _ in range(a)]
    flat = optim.mean_decoder_grad([np.concatenate([d[f"grad.{n}"].ravel() for n in lay.decoder]) for d in per])
    return per, flat


def _assert_state_equal(got: optim.State, want: optim.State, where: str) -> None:
    assert got.step == want.step and got.opt.adam_t == want.opt.adam_t, where
    assert np.array_equal(got.weights.view(np.uint32), want.weights.view(np.uint32)), f"{where}: weights differ"
    for name in ("adam_m", "adam_v", "momentum"):
        a, b = getattr(got.opt, name), getattr(want.opt, name)
        assert (a is None) == (b is None), f"{where}: {name}"
        if a is not None:
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{where}: {name} differs"


@pytest.mark.parametrize("model", KINDS, ids=lambda m: m.kind)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_update_graph_equals_numpy_bit_for_bit(model, name):
    cfg = CONFIGS[name]
    assert supported(cfg) is None
    lay = params.layout(model)
    k = cfg.directions * cfg.accumulate
    stepper = steppers.Stepper(cfg, seed=SEED, expert=EXPERT, body=lay.body, dense=lay.dense(), shapes=lay.shapes)
    body, delta = stepper.split(lay.size)
    perturbed = [n for n, o in zip(lay.names, lay.offsets) if o < body]
    graph = build_update(model, cfg, k, perturbed, graph_noise(cfg), delta)
    session = make_session(graph, "cpu", threads=1)
    w = params.init(model, 1)
    w[::97] = 0.0  # zero weights: where a signed zero would show
    host = optim.State(w.copy(), step=0)
    dev = optim.State(w.copy(), step=0)
    rng = np.random.default_rng(len(name))
    try:
        for t in range(STEPS):
            g = _grads(rng, k, t)
            dec, flat_dec = _decoder_grads(rng, lay, cfg.accumulate) if delta else ([], None)
            feeds = update_feeds(model, cfg, dev, g, _noise(stepper, lay, perturbed, t, body, k), dec)
            write_back(model, cfg, dev, run_update(session, feeds), delta)
            stepper.replay(host, g.astype(np.float32), decoder_grad=flat_dec)
            _assert_state_equal(dev, host, f"{name} step {t}")
            assert not np.array_equal(dev.weights, w)  # it did move
    finally:
        stepper.close()


def test_supported_refuses_rms_and_build_says_why():
    cfg = dataclasses.replace(BASE, update="rms")
    why = supported(cfg)
    assert why is not None and "rms" in why and "\n" not in why
    assert supported(BASE) is None and supported(CONFIGS["sgd_momentum"]) is None
    m = KINDS[0]
    with pytest.raises(ValueError, match="rms"):
        build_update(m, cfg, 3, ["embed"], GraphNoise.SIGNS, False)


def test_inputs_share_the_population_graphs_noise_and_refuse_a_wrong_k():
    from soma_edge.expert.population_graph import noise_inputs

    m = KINDS[1]
    lay = params.layout(m)
    body = [n for n in lay.names if n not in lay.decoder]
    names = {i.name: i for i in update_inputs(m, BASE, 3, body, GraphNoise.RANK1, True)}
    for i in noise_inputs(m, 3, body, GraphNoise.RANK1):
        assert names[i.name] == i
    assert "grad.0.E" in names and "mom.block0.lstm.W" not in names and "m.block0.lstm.W" in names
    with pytest.raises(ValueError, match="directions"):
        update_inputs(m, BASE, 2, body, GraphNoise.SIGNS, True)
