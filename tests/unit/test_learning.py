"""SPSA on ORT really learns, and the recipe's default learns far more than the recipe before it."""

import numpy as np
import pytest

from soma_edge import corpus, params
from soma_edge.config import Config, ModelConfig, SPSAConfig
from soma_edge.runtime import evaluator_for, mean_loss
from soma_edge.spsa import State
from worker.trainer import train

STEPS = 300
GAIN = 0.15  # nats/byte the default must beat the old recipe by on held-out text


def _today() -> tuple[SPSAConfig, float]:
    """The recipe before the delta rule (the old defaults): every weight by SPSA, unit-RMS update, K = 8,
    dense probes, no plateau rule, torch's input-weight init; and its input gain."""
    return SPSAConfig(decoder="spsa", update="rms", lr=5e-3, directions=8, density=1.0, plateau=False), 1.0


@pytest.fixture(scope="module")
def data(default_docs):
    seq = Config().data.seq_len
    train_data = corpus.to_stream(default_docs["train"])
    test_data = corpus.to_stream(default_docs["test"])
    return (
        train_data,
        corpus.eval_windows(test_data, seq, max_windows=256),
        corpus.unigram_entropy(train_data, test_data),
    )


def _run(spsa: SPSAConfig, data, input_gain: float = ModelConfig().input_gain) -> tuple[float, float]:
    train_data, (x, y), _ = data
    cfg = Config(model=ModelConfig(embed=32, hidden=128, layers=1, input_gain=input_gain), spsa=spsa, device="cpu")
    assert 100_000 <= params.count(cfg.model) <= 300_000
    evaluator = evaluator_for(cfg)
    state = State(params.init(cfg.model, cfg.seed))
    before = mean_loss(evaluator, state.weights, x, y)
    train(state, train_data, cfg, evaluator, steps=STEPS)
    return before, mean_loss(evaluator, state.weights, x, y)


def test_default_recipe_beats_the_old_one_on_the_test_split(data):
    unigram = data[2]
    spsa, gain = _today()
    before, old = _run(spsa, data, gain)
    before_new, new = _run(SPSAConfig(), data)
    print(
        f"unigram {unigram:.3f}  init {before:.3f}/{before_new:.3f}  old recipe {old:.3f}  default {new:.3f} "
        f"after {STEPS} steps"
    )
    assert min(before, before_new) > unigram + 1.0  # both start far above a byte histogram
    assert new < old - GAIN, (old, new)
    assert new < unigram - GAIN  # a model of context, not a byte histogram


def test_frozen_decoder_stays_put_and_learns_less(data):
    """decoder = "frozen" never moves the head (the random init), and without it the body alone is stuck."""
    train_data, (x, y), unigram = data
    cfg = Config(model=ModelConfig(embed=16, hidden=32), device="cpu")
    cfg.spsa.decoder = "frozen"
    ev = evaluator_for(cfg)
    state = State(params.init(cfg.model, 0))
    body = params.layout(cfg.model).body
    head0 = state.weights[body:].copy()
    train(state, train_data, cfg, ev, steps=20)
    assert np.array_equal(state.weights[body:], head0)
    assert not np.array_equal(state.weights[:body], params.init(cfg.model, 0)[:body])
    assert mean_loss(ev, state.weights, x[:32], y[:32]) > unigram
