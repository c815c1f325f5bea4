import numpy as np
import pytest

from soma_edge.config import SPSAConfig
from soma_edge.spsa import State, Stepper, noise, schedule


def test_noise_is_regenerated_from_its_key():
    a = noise(7, 1, 100, 3, 1001)
    assert np.array_equal(a, noise(7, 1, 100, 3, 1001))
    assert a.dtype == np.float32 and a.shape == (1001,)
    assert set(np.unique(a)) == {-1.0, 1.0}
    for other in [(8, 1, 100, 3), (7, 2, 100, 3), (7, 1, 101, 3), (7, 1, 100, 4)]:
        assert not np.array_equal(a, noise(*other, 1001)), other
    assert abs(noise(0, 0, 0, 0, 100_000).mean()) < 0.02  # balanced signs


def test_gaussian_noise():
    g = noise(1, 0, 0, 0, 100_000, "gaussian")
    assert g.dtype == np.float32
    assert abs(g.std() - 1) < 0.02 and abs(g.mean()) < 0.02
    assert np.array_equal(g, noise(1, 0, 0, 0, 100_000, "gaussian"))


def test_noise_key_out_of_range():
    with pytest.raises(ValueError):
        noise(2**32, 0, 0, 0, 10)


def test_schedule_warmup_cosine_and_tied_eps():
    cfg = SPSAConfig(lr=1e-2, warmup_steps=10, total_steps=110, lr_min_frac=0.1, eps=1e-3)
    lrs = [schedule(cfg, t)[0] for t in range(120)]
    assert lrs[0] == pytest.approx(1e-3)
    assert lrs[9] == pytest.approx(1e-2)
    assert lrs[10] == pytest.approx(1e-2)
    assert lrs[60] == pytest.approx(1e-2 * (0.1 + 0.9 * 0.5))
    assert lrs[115] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert schedule(cfg, 50)[1] == 1e-3
    tied = SPSAConfig(lr=1e-2, warmup_steps=1000, tie_eps_to_lr=True, eps_min=1e-4)
    assert schedule(tied, 0)[1] == pytest.approx(1e-4)  # warmup never makes eps zero
    assert schedule(tied, 999)[1] == pytest.approx(1e-2)


def _quadratic(target):
    return lambda w: float(np.sum((w.astype(np.float64) - target) ** 2))


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
@pytest.mark.parametrize("normalize,momentum", [(True, 0.0), (False, 0.0), (True, 0.5)])
def test_spsa_descends_a_quadratic(kind, normalize, momentum):
    rng = np.random.default_rng(0)
    target = rng.standard_normal(200)
    lr = 0.02 if normalize else 0.005
    cfg = SPSAConfig(directions=4, eps=1e-2, lr=lr, warmup_steps=0, noise=kind, normalize=normalize, momentum=momentum)
    state = State(np.zeros(200, dtype=np.float32))
    f = _quadratic(target)
    start = f(state.weights)
    stepper = Stepper(cfg, seed=1)
    for _ in range(300):
        stepper.step(state, f)
    stepper.close()
    assert state.step == 300
    assert f(state.weights) < 0.3 * start


def test_step_estimates_the_gradient():
    """K=1 Rademacher: g_1 is the directional derivative of the loss along z_1."""
    cfg = SPSAConfig(directions=3, eps=1e-3, warmup_steps=0)
    target = np.linspace(-1, 1, 50)
    state = State(np.zeros(50, dtype=np.float32))
    result = Stepper(cfg, seed=3, expert=2).step(state, _quadratic(target))
    grad = 2 * (0 - target)
    for k in range(3):
        z = noise(3, 2, 0, k, 50).astype(np.float64)
        assert result.grads[k] == pytest.approx(grad @ z, rel=1e-3, abs=1e-3)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_replay_is_bit_identical(momentum):
    cfg = SPSAConfig(directions=5, momentum=momentum, warmup_steps=3, total_steps=20)
    w0 = np.random.default_rng(4).standard_normal(300).astype(np.float32)
    target = np.random.default_rng(5).standard_normal(300)
    live, replayed = State(w0.copy()), State(w0.copy())
    stepper = Stepper(cfg, seed=11, expert=1)
    scalars = [stepper.step(live, _quadratic(target)).grads for _ in range(10)]
    for g in scalars:
        stepper.replay(replayed, g)
    assert replayed.step == live.step == 10
    assert np.array_equal(replayed.weights, live.weights)
    assert not np.array_equal(live.weights, w0)
    with pytest.raises(ValueError):
        stepper.replay(replayed, scalars[0][:2])
