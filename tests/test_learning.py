"""SPSA on ORT really learns: held-out nats/byte falls clearly below the unigram entropy."""

from soma_edge import corpus, params
from soma_edge.config import Config, ModelConfig
from soma_edge.runtime import LossEvaluator, mean_loss
from soma_edge.spsa import State
from worker.trainer import train

MARGIN = 0.15  # nats/byte below the unigram entropy: a bigram-aware model, not a byte histogram


def test_spsa_learns_below_unigram_on_test_split(default_docs):
    cfg = Config(model=ModelConfig(embed=32, hidden=128, layers=1), device="cpu")
    assert 100_000 <= params.count(cfg.model) <= 300_000
    train_data = corpus.to_stream(default_docs["train"])
    test_data = corpus.to_stream(default_docs["test"])
    x, y = corpus.eval_windows(test_data, cfg.data.seq_len, max_windows=256)
    unigram = corpus.unigram_entropy(train_data, test_data)  # fitted on train, scored on test

    evaluator = LossEvaluator(cfg.model, cfg.device, cfg.threads, parallel=cfg.parallel)
    state = State(params.init(cfg.model, cfg.seed))
    before = mean_loss(evaluator, state.weights, x, y)
    # Honest threshold: the untrained model is far above it, and a unigram model scores `unigram` itself.
    assert before > unigram + 1.0
    report = train(state, train_data, cfg, evaluator, steps=1000)
    after = mean_loss(evaluator, state.weights, x, y)
    print(f"unigram {unigram:.3f}  before {before:.3f}  after {after:.3f}  ({report.steps_per_s:.1f} steps/s)")
    assert after < unigram - MARGIN, (before, after, unigram)
