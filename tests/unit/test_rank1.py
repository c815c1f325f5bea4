"""Rank-1 Rademacher probes (`spsa.noise = "rank1"`): each weight matrix a·bᵀ, each vector full signs, from
m + n signs per matrix of the key's stream; unbiased; replayed bit for bit; refused with density < 1."""

import functools
import subprocess
import sys

import numpy as np
import pytest

from soma_edge import config
from soma_edge.config import Config, ModelConfig, SPSAConfig
from soma_edge.errors import ConfigError
from soma_edge.expert import params, steps
from soma_edge.spsa import log as update_log
from soma_edge.spsa.noise import Rank1, body_shapes, matrix_shape, noise, rank1_factors, rank1_probe, rank1_signs
from soma_edge.spsa.optim import State
from soma_edge.spsa.stepper import Objective, Stepper

# A toy body: an ONNX-style [1, m, n] matrix, a bias, a plain matrix, a [1, 1, n] vector, a [m, 1, n] matrix.
SHAPES = ((1, 6, 5), (6,), (4, 3), (1, 1, 7), (5, 1, 4))
MATRICES = {0: (6, 5), 2: (4, 3), 4: (5, 4)}
M = 30 + 6 + 12 + 7 + 20


def _split(z: np.ndarray, shapes) -> list[np.ndarray]:
    sizes = [int(np.prod(s)) for s in shapes]
    return np.split(z, np.cumsum(sizes)[:-1])


def test_matrices_and_vectors_of_both_layouts():
    lstm = params.layout(ModelConfig(embed=8, hidden=16, layers=2))
    got = {n: matrix_shape(s) for n, s in zip(lstm.names, lstm.shapes)}
    assert got["lstm0.W"] == (64, 8) and got["lstm1.W"] == (64, 16) and got["lstm0.R"] == (64, 16)
    assert got["head.W"] == (16, 256) and got["embed"] == (256, 8)
    assert got["lstm0.B"] is None and got["head.b"] is None
    soma = params.layout(ModelConfig(kind="soma", embed=8, hidden=8))
    got = {n: matrix_shape(s) for n, s in zip(soma.names, soma.shapes)}
    assert got["block0.mlp.W1"] == (8, 32) and got["block0.mlp.W2"] == (32, 8) and got["E"] == (256, 8)
    assert got["block0.ln1.g"] is None and got["ln_f.g"] is None
    assert matrix_shape((1, 7)) is None and matrix_shape((2, 3, 4)) is None  # 1-D after squeezing; 3-D
    assert body_shapes(lstm.shapes, lstm.body) == lstm.shapes[:-2]  # the decoder's two tensors are left out
    with pytest.raises(ValueError, match="tensor boundary"):
        body_shapes(lstm.shapes, lstm.body - 1)


def test_each_matrix_probe_is_an_outer_product_of_signs():
    factors = rank1_factors(3, 1, 7, 2, SHAPES)
    z = rank1_probe(3, 1, 7, 2, SHAPES)
    assert z.dtype == np.float32 and z.shape == (M,)
    assert np.all(np.abs(z) == 1)
    for i, (part, f) in enumerate(zip(_split(z, SHAPES), factors)):
        if i in MATRICES:
            m, n = MATRICES[i]
            assert isinstance(f, Rank1) and f.a.shape == (m,) and f.b.shape == (n,)
            assert f.a.dtype == f.b.dtype == np.float32
            mat = part.reshape(m, n)
            assert np.linalg.matrix_rank(mat) == 1
            assert np.array_equal(mat, np.outer(f.a, f.b))
            assert np.array_equal(part.reshape(SHAPES[i]).reshape(m, n), mat)  # the tensor's own C order
        else:
            assert isinstance(f, np.ndarray) and f.dtype == np.float32
            assert np.array_equal(part, f) and np.all(np.abs(f) == 1)
    lstm = params.layout(ModelConfig(embed=8, hidden=16))  # a real body: every matrix rank 1, B full signs
    zb = rank1_probe(0, 0, 0, 0, lstm.shapes)
    for name, view in lstm.views(zb).items():
        mn = matrix_shape(view.shape)
        if mn:
            assert np.linalg.matrix_rank(view.reshape(mn)) == 1, name
        else:
            assert abs(float(view.mean())) < 0.2 and len(np.unique(view)) == 2, name  # not a·bᵀ of a vector


class _CountingPhilox(np.random.Philox):
    """Philox that counts the 64-bit words drawn from it."""

    words = 0

    def random_raw(self, size=None, output=True):
        _CountingPhilox.words += 1 if size is None else int(np.prod(size))
        return super().random_raw(size, output)


def test_only_m_plus_n_signs_per_matrix_are_drawn(monkeypatch):
    signs = rank1_signs(SHAPES)
    assert signs == (6 + 5) + 6 + (4 + 3) + 7 + (5 + 4)
    flat = np.concatenate(
        [np.concatenate([f.a, f.b]) if isinstance(f, Rank1) else f for f in rank1_factors(5, 2, 9, 4, SHAPES)]
    )
    assert np.array_equal(flat, noise(5, 2, 9, 4, signs))  # the first `signs` signs of the key's stream, in order
    lay = params.layout(ModelConfig(embed=32, hidden=128))
    monkeypatch.setattr(np.random, "Philox", _CountingPhilox)
    rank1_factors(0, 0, 0, 0, lay.shapes)
    want = rank1_signs(lay.shapes)
    assert _CountingPhilox.words == -(-want // 64)  # 64 signs per word, nothing more
    assert want == 3136 and lay.size == 124_160  # the demo expert: 3,136 signs for 124K weights


@functools.cache
def _probes(n: int) -> np.ndarray:
    """n rank-1 directions of the toy body, float64 [n, M] (drawn once for the statistical tests), each written
    straight into its row: at n = 40,000 the draws are the tests' cost, and a stack of n arrays adds ~10 %."""
    zs = np.empty((n, M), np.float32)
    for k in range(n):
        rank1_probe(11, 3, 5, k, SHAPES, out=zs[k])
    return zs.astype(np.float64)


N = 40_000


def test_second_moment_is_the_identity():
    """E[z zᵀ] = I: E[a_i b_j a_k b_l] = δ_ik δ_jl. Each entry of the mean over N draws has standard
    deviation 1/√N = 0.005 (off the diagonal); 0.03 is 6 of those."""
    zs = _probes(N)
    second = zs.T @ zs / N
    assert np.all(np.diag(second) == 1)  # ‖z‖² = M exactly: every entry ±1
    assert np.abs(second - np.eye(M)).max() < 0.03


def test_estimates_average_to_the_true_gradient():
    """On f(w) = ½ wᵀAw + cᵀw the central difference is exactly gᵀz (up to rounding), so the mean of N
    estimates (gᵀz) z has E = E[z zᵀ] g = g and E‖ĝ - g‖² = (M - 1)‖g‖² / N (‖z‖² = M). At N = 40000 the
    relative error's RMS is √(74/40000) ≈ 0.043; the 0.13 bound is 3σ (Chebyshev: a random seed fails
    with probability ≤ 1/9). A probe with E[z zᵀ] ≠ I (say b reusing a's signs, so that z_ii = 1 always)
    is biased by O(1) of ‖g‖ on the matrices' entries and fails it."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((M, M))
    a, c, w = q @ q.T / M + np.eye(M), rng.standard_normal(M), rng.standard_normal(M)
    g, eps, zs = a @ w + c, 1e-3, _probes(N)

    def f(x):  # one loss per row of x (through a matmul: einsum's unoptimized loop takes ~0.3 s a call here)
        return 0.5 * np.sum((x @ a) * x, axis=1) + x @ c

    est = ((f(w + eps * zs) - f(w - eps * zs)) / (2 * eps)) @ zs / N
    rel = np.linalg.norm(est - g) / np.linalg.norm(g)
    assert rel < 0.13
    assert rel > 0.01  # ... and of the size the variance predicts: these are N independent probes


def _rank1_cfg(**kw) -> SPSAConfig:
    # all rows for every direction: a bare loss function has no rows to split (spsa.split_rows)
    return SPSAConfig(noise="rank1", density=1.0, directions=3, warmup_steps=2, split_rows=False, **kw)


def test_stepper_probes_are_the_materialized_outer_products():
    w0 = np.random.default_rng(1).standard_normal(M).astype(np.float32)
    seen = []

    def loss(w):
        seen.append(w.copy())
        return float(np.sum(w.astype(np.float64) ** 2))

    cfg = _rank1_cfg(eps=0.5)  # ε a power of two: w ± εz is exact enough to read z back
    stepper = Stepper(cfg, seed=4, expert=1, shapes=SHAPES)
    r = stepper.step(State(w0.copy()), loss)
    stepper.close()
    # The Stepper keeps two directions in flight on its threads, so their evaluations may interleave: match the
    # probes by value, not by the order they were seen.
    assert len(seen) == 6
    for k in range(3):
        z = rank1_probe(4, 1, 0, k, SHAPES)
        for want in (w0 + np.float32(0.5) * z, w0 + np.float32(-0.5) * z):
            assert sum(np.array_equal(got, want) for got in seen) == 1, k
        assert r.grads[k] == pytest.approx(2 * w0.astype(np.float64) @ z, rel=1e-4)


def test_stepper_needs_shapes_and_density_one():
    with pytest.raises(ValueError, match="shapes"):
        Stepper(_rank1_cfg(), seed=0)
    with pytest.raises(ValueError, match="density"):
        Stepper(SPSAConfig(noise="rank1", density=0.5), seed=0, shapes=SHAPES)


TOY = Config(model=ModelConfig(embed=4, hidden=6))


def _toy_objective(cfg: Config, seed: int) -> Objective:
    """A quadratic over the expert's flat vector; its clean forward gives the decoder's exact gradient."""
    lay = params.layout(cfg.model)
    target = np.random.default_rng(seed).standard_normal(lay.size)

    def loss(w):
        return float(np.sum((w.astype(np.float64) - target) ** 2))

    def clean(w):
        return loss(w), (2 * (w[lay.body :] - target[lay.body :])).astype(np.float32)

    # The toy's loss does not depend on rows: a direction's share of them (spsa.split_rows) is the whole.
    return Objective(loss, clean, part=lambda w, i, n: loss(w), part_clean=lambda w, i, n: clean(w))


@pytest.mark.parametrize("decoder", ["delta", "spsa", "frozen"])
@pytest.mark.parametrize("update", ["adam", "rms"])
def test_training_replays_bit_for_bit(decoder, update):
    """Steps taken with rank-1 probes, replayed from their scalars through spsa.log.replay and steps.replay
    (the coordinator's path), give the same bits; with decoder = spsa, head.W is a rank-1 body matrix."""
    cfg = config.from_dict(
        {
            "model": {"embed": 4, "hidden": 6},
            "spsa": {
                "noise": "rank1",
                "density": 1.0,
                "directions": 4,
                "update": update,
                "decoder": decoder,
                "warmup_steps": 2,
            },
        }
    )
    lay = params.layout(cfg.model)
    start = State(params.init(cfg.model, 0), step=4)
    live = State(start.weights.copy(), step=start.step, opt=start.opt.copy())
    stepper = steps.stepper(cfg, expert=2, parallel=2)
    obj = _toy_objective(cfg, 1)
    grads = [stepper.step(live, obj).grads for _ in range(8)]
    stepper.close()
    log = update_log.record_log(start.step, 1.0, grads, live, steps.log_body(cfg))
    via_steps = steps.replay(cfg, start, log, 2)
    via_spsa = update_log.replay(
        cfg.spsa, start, log, seed=cfg.seed, expert=2, body=lay.body, dense=lay.dense(), shapes=lay.shapes
    )
    assert not np.array_equal(live.weights[: lay.body], start.weights[: lay.body])
    for got in (via_steps, via_spsa):
        assert got.step == live.step == 12
        assert got.weights.tobytes() == live.weights.tobytes()
        if update == "adam":  # the body's: a delta-rule decoder's stay on the worker
            body = steps.log_body(cfg) or lay.size
            assert got.opt.adam_m[:body].tobytes() == live.opt.adam_m[:body].tobytes()
        assert got.opt.adam_t == live.opt.adam_t and (got.opt.adam_m is None) == (live.opt.adam_m is None)
    # The same scalars under full Rademacher probes are another update: the log needs rank-1's noise.
    other = config.from_dict({**cfg.to_dict(), "spsa": {**cfg.to_dict()["spsa"], "noise": "rademacher"}})
    assert steps.replay(other, start, log, 2).weights.tobytes() != live.weights.tobytes()


def test_fixed_seed_is_deterministic_and_each_key_differs():
    base = rank1_probe(7, 1, 100, 3, SHAPES)
    assert np.array_equal(base, rank1_probe(7, 1, 100, 3, SHAPES))
    for other in [(8, 1, 100, 3), (7, 2, 100, 3), (7, 1, 101, 3), (7, 1, 100, 4)]:
        assert not np.array_equal(base, rank1_probe(*other, SHAPES)), other
    runs = []
    for parallel in (1, 2, 1):
        stepper = steps.stepper(
            config.from_dict(
                {"model": {"embed": 4, "hidden": 6}, "spsa": {"noise": "rank1", "density": 1.0, "directions": 4}}
            ),
            expert=0,
            parallel=parallel,
        )
        state = State(params.init(TOY.model, 0))
        obj = _toy_objective(TOY, 3)
        for _ in range(5):
            stepper.step(state, obj)
        stepper.close()
        runs.append(state.weights.tobytes())
    assert runs[0] == runs[1] == runs[2]


def test_validation_refuses_rank1_with_sparse_probes():
    for density in (0.5, 0.999):
        with pytest.raises(ConfigError, match=r"spsa\.noise.*spsa\.density"):
            config.from_dict({"spsa": {"noise": "rank1", "density": density}})
    cfg = config.from_dict({"spsa": {"noise": "rank1", "density": 1.0}})
    assert cfg.spsa.noise == config.Noise.RANK1 and cfg.spsa.noise == "rank1"
    built = Config()
    built.spsa.noise, built.spsa.density = "rank1", 1.0  # set in code: validate makes it the enum
    assert config.validate(built).spsa.noise is config.Noise.RANK1
    built.spsa.density = 0.5
    with pytest.raises(ConfigError, match="spsa.density"):
        config.validate(built)


def test_cli_prints_one_error_line_for_rank1_with_density_below_one(tmp_path):
    path = tmp_path / "cfg.toml"
    path.write_text('[spsa]\nnoise = "rank1"\ndensity = 0.5\n')
    r = subprocess.run(
        [sys.executable, "-m", "worker.cli", "train", "--config", str(path), "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr
    assert "spsa.noise" in lines[0] and "spsa.density" in lines[0]
