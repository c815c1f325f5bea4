"""Same seed and config: bit-identical weights from two separate processes on the CPU EP."""

import subprocess
import sys

import numpy as np

from soma_edge import checkpoint, params
from soma_edge.config import ModelConfig


def _train(tmp_path, name: str, seed: int) -> np.ndarray:
    out = tmp_path / f"{name}.msgpack"
    cfg = tmp_path / "cfg.toml"
    cfg.write_text('device = "cpu"\n[model]\nembed = 16\nhidden = 48\n[data]\nbatch = 4\nseq_len = 32\n')
    r = subprocess.run(
        [sys.executable, "-m", "worker.cli", "train", "--config", str(cfg), "--steps", "20",
         "--seed", str(seed), "--out", str(out), "--eval-windows", "4", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    body = checkpoint.load(out, "expert")
    assert body["step"] == 20
    return body["weights"]


def test_same_seed_same_bits_other_seed_differs(tmp_path):
    a = _train(tmp_path, "a", 0)
    b = _train(tmp_path, "b", 0)
    c = _train(tmp_path, "c", 1)
    assert a.dtype == np.float32
    assert a.tobytes() == b.tobytes()
    init = params.init(ModelConfig(embed=16, hidden=48), 0)
    assert not np.array_equal(a, init)
    assert not np.array_equal(a, c)


def test_concurrency_does_not_change_the_bits():
    """parallel=1 and parallel=2 (two ORT runs at once) give the same weights: g_k z_k is summed in order k."""
    from soma_edge.config import SPSAConfig
    from soma_edge.runtime import LossEvaluator
    from soma_edge.spsa import State, Stepper

    m = ModelConfig(embed=8, hidden=24)
    x = np.random.default_rng(0).integers(0, 256, (4, 32)).astype(np.int64)
    out = []
    for parallel in (1, 2):
        ev = LossEvaluator(m, "cpu", threads=1, parallel=parallel)
        stepper = Stepper(SPSAConfig(directions=6), seed=5, parallel=ev.parallel)
        state = State(params.init(m, 0))
        for _ in range(5):
            stepper.step(state, lambda w: ev.loss(w, x, x))
        stepper.close()
        out.append(state.weights)
    assert out[0].tobytes() == out[1].tobytes()
