"""The coordinator's val scores, window by window: what the guard compares."""

from __future__ import annotations

import numpy as np

from coordinator.evaluation import VAL_BATCH, Evaluation
from soma_edge.config import Config, ModelConfig
from soma_edge.engine.evaluator import LossEvaluator
from soma_edge.expert import params


def test_window_losses_are_each_windows_own_loss():
    cfg = Config(model=ModelConfig(embed=8, hidden=16))
    rng = np.random.default_rng(0)
    n = VAL_BATCH + 6  # two calls, the second one short
    x, y = rng.integers(0, 256, (n, 32)), rng.integers(0, 256, (n, 32))
    ev = Evaluation(None, cfg, None)  # no run directory: the windows are given
    ev.windows[0] = (x, y)
    w = params.init(cfg.model, 0)
    got = ev.window_losses(0, w)
    one = LossEvaluator(cfg.model, "cpu", 1, False)
    want = [one.loss(w, x[i : i + 1], y[i : i + 1]) for i in range(n)]
    assert got.shape == (n,) and np.allclose(got, want, rtol=0, atol=1e-5)
    assert ev.val_loss(0, w) == float(np.mean(got))
