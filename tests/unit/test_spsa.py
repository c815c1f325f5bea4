import numpy as np
import pytest

from soma_edge.config import SPSAConfig
from soma_edge.spsa import optim
from soma_edge.spsa import stepper as stepper_mod
from soma_edge.spsa.noise import (
    add_rademacher,
    add_rank1,
    body_shapes,
    noise,
    noise_bits,
    probe_mask,
    rank1_factors,
    rank1_probe,
)
from soma_edge.spsa.optim import OptState, State, plateau, schedule
from soma_edge.spsa.stepper import Objective, Stepper

# The Stepper's mechanics on bare loss functions, which have no rows to split: every direction on the whole
# minibatch and the delta rule from a clean forward (split rows: tests/unit/test_split_rows.py).
ALL_ROWS = {"split_rows": False, "decoder_from": "clean"}


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


@pytest.mark.parametrize("block", [1, 3, 5, 1 << 16])  # 5: the last of 126 bytes' blocks is short
def test_directions_summed_in_blocks_are_the_one_by_one_sum_bit_for_bit(block):
    """add_rademacher / add_rank1 (the update's and the replay's Σ c_j z_j) against acc += float32(c) z_j one
    direction at a time, across block edges, a body that is no whole number of bytes, masks and c = 0."""
    n, k = 1003, 6
    coefs = np.array([0.37, -1.5e-3, 0.0, 2.5, -7.0, 1e-30])
    bits = np.stack([noise_bits(4, 1, 9, j, n) for j in range(k)])
    masks = [probe_mask(4, 1, 9, j, n, 0.5) for j in range(k)]
    for packed in (None, np.stack([np.packbits(m) for m in masks])):
        want, got = np.full(n, 0.1, np.float32), np.full(n, 0.1, np.float32)
        for j, c in enumerate(coefs):
            want += np.float32(c) * (noise(4, 1, 9, j, n) * (1 if packed is None else masks[j]))
        add_rademacher(got, coefs, bits, packed, block=block)
        assert got.tobytes() == want.tobytes()

    shapes = body_shapes([(1, 12, 7), (12,), (5, 1, 9), (3,)], 84 + 12 + 45 + 3)
    size = sum(int(np.prod(s)) for s in shapes)
    want, got = np.full(size, -0.2, np.float32), np.full(size, -0.2, np.float32)
    for j, c in enumerate(coefs):
        want += np.float32(c) * rank1_probe(4, 1, 9, j, shapes)
    add_rank1(got, coefs, [rank1_factors(4, 1, 9, j, shapes) for j in range(k)], block=block)  # 1: a row a block
    assert got.tobytes() == want.tobytes()


UPDATES = {
    "adam": {},
    "adam+wd": dict(weight_decay=1e-2),
    "sgd": dict(update="sgd"),
    "sgd+momentum+wd": dict(update="sgd", momentum=0.9, weight_decay=1e-2),
    "rms+momentum": dict(update="rms", momentum=0.5),  # one block whatever UPDATE_BLOCK: its norm is the body's
}


@pytest.mark.parametrize("recipe", list(UPDATES))
def test_the_update_in_blocks_is_the_whole_body_update_bit_for_bit(monkeypatch, recipe):
    cfg = SPSAConfig(warmup_steps=0, **UPDATES[recipe])
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal(1000).astype(np.float32)
    accs = [rng.standard_normal(900).astype(np.float32) for _ in range(3)]
    dec = rng.standard_normal(100).astype(np.float32)
    got = []
    for block in (1 << 17, 7):
        monkeypatch.setattr(optim, "UPDATE_BLOCK", block)
        state = State(w0.copy())
        for acc in accs:
            optim.apply_update(state, cfg, 900, acc, dec)
        got.append((state.weights.tobytes(), state.opt.adam_m.tobytes(), state.opt.adam_v.tobytes()))
    assert got[0] == got[1] and got[0][0] != w0.tobytes()


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
@pytest.mark.parametrize("update,momentum", [("rms", 0.0), ("sgd", 0.0), ("rms", 0.5), ("adam", 0.0)])
def test_spsa_descends_a_quadratic(kind, update, momentum):
    rng = np.random.default_rng(0)
    target = rng.standard_normal(200)
    lr = {"rms": 0.02, "sgd": 0.005, "adam": 0.02}[update]
    cfg = SPSAConfig(
        **ALL_ROWS, directions=4, eps=1e-2, lr=lr, warmup_steps=0, noise=kind, update=update, momentum=momentum
    )
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
    target = np.linspace(-1, 1, 50)
    grad = 2 * (0 - target)
    for density in (1.0, 0.5):
        cfg = SPSAConfig(**ALL_ROWS, directions=3, eps=1e-3, warmup_steps=0, density=density)
        result = Stepper(cfg, seed=3, expert=2).step(State(np.zeros(50, dtype=np.float32)), _quadratic(target))
        for k in range(3):
            z = noise(3, 2, 0, k, 50).astype(np.float64)
            if density < 1:
                z *= probe_mask(3, 2, 0, k, 50, density)
            assert result.grads[k] == pytest.approx(grad @ z, rel=1e-3, abs=1e-3)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_replay_is_bit_identical(momentum):
    cfg = SPSAConfig(**ALL_ROWS, directions=5, momentum=momentum, warmup_steps=3, total_steps=20)
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


# --- the recipe: delta-rule decoder, Adam, sparse probes, weight decay, accumulation, plateau ----------

BODY, DEC = 120, 40  # a toy "expert": the last DEC weights play the decoder


def _toy(seed: int):
    """A quadratic objective whose clean forward also returns the exact gradient of its decoder part."""
    target = np.random.default_rng(seed).standard_normal(BODY + DEC)

    def loss(w):
        return float(np.sum((w.astype(np.float64) - target) ** 2))

    def clean(w):
        return loss(w), (2 * (w[BODY:].astype(np.float64) - target[BODY:])).astype(np.float32)

    return loss, clean


RECIPES = {
    "adam": dict(update="adam", lr=1e-2),
    "adam+sparse+wd": dict(update="adam", lr=1e-2, density=0.5, weight_decay=1e-3),
    "rms+momentum+sparse": dict(update="rms", momentum=0.9, density=0.25),
    "sgd+gaussian+wd": dict(update="sgd", lr=1e-3, noise="gaussian", weight_decay=1e-2),
    "adam+accumulate": dict(update="adam", accumulate=3),
}


@pytest.mark.parametrize("decoder", ["delta", "spsa", "frozen"])
@pytest.mark.parametrize("recipe", list(RECIPES), ids=list(RECIPES))
def test_replay_is_bit_identical_for_every_option(monkeypatch, recipe, decoder):
    monkeypatch.setattr(stepper_mod, "REPLAY_GROUP", 3)  # the replay draws 4 or 12 directions 3 at a time
    cfg = SPSAConfig(**ALL_ROWS, directions=4, warmup_steps=2, decoder=decoder, **RECIPES[recipe])
    loss, clean = _toy(1)
    w0 = np.random.default_rng(2).standard_normal(BODY + DEC).astype(np.float32)
    live, replayed = State(w0.copy()), State(w0.copy())
    live.opt.lr_scale = replayed.opt.lr_scale = 0.5
    stepper = Stepper(cfg, seed=9, expert=3, body=BODY)
    objs = [Objective(loss, clean)] * cfg.accumulate
    results = [stepper.step(live, objs) for _ in range(12)]
    for r in results:
        assert r.grads.shape == (4 * cfg.accumulate,)
        stepper.replay(replayed, r.grads, r.decoder_grad)
    stepper.close()
    assert replayed.weights.tobytes() == live.weights.tobytes()
    for name in ("momentum", "adam_m", "adam_v"):
        a, b = getattr(live.opt, name), getattr(replayed.opt, name)
        assert (a is None and b is None) or a.tobytes() == b.tobytes(), name
    decoder_moved = not np.array_equal(live.weights[BODY:], w0[BODY:])
    assert decoder_moved == (decoder != "frozen")
    assert not np.array_equal(live.weights[:BODY], w0[:BODY])
    assert loss(live.weights) < loss(w0)


def test_delta_decoder_is_never_perturbed_and_takes_adam_steps():
    seen = []
    loss, clean = _toy(3)

    def spy(w):
        seen.append(w.copy())
        return loss(w)

    w0 = np.zeros(BODY + DEC, dtype=np.float32)
    cfg = SPSAConfig(**ALL_ROWS, directions=3, decoder="delta", decoder_lr=0.1, warmup_steps=0)
    state = State(w0.copy())
    r = Stepper(cfg, seed=0, body=BODY).step(state, Objective(spy, clean))
    assert len(seen) == 6 and all(np.array_equal(p[BODY:], w0[BODY:]) for p in seen)
    assert all(not np.array_equal(p[:BODY], w0[:BODY]) for p in seen)
    # First Adam step (bias-corrected) moves each decoder weight by lr against the sign of its gradient.
    g = r.decoder_grad
    assert np.allclose(state.weights[BODY:], -0.1 * np.sign(g), atol=1e-6)
    assert r.loss == loss(w0)  # the clean loss, not the probes' mean
    with pytest.raises(ValueError, match="clean forward"):
        Stepper(cfg, seed=0, body=BODY).step(State(w0.copy()), spy)


def test_sparse_probes_touch_a_density_share_and_keep_gains_dense():
    n = 200_000
    for q in (0.5, 0.1):
        m = probe_mask(5, 1, 7, 2, n, q)
        assert m.dtype == bool and abs(m.mean() - q) < 0.01
        assert np.array_equal(m, probe_mask(5, 1, 7, 2, n, q))
        assert not np.array_equal(m, probe_mask(5, 1, 7, 3, n, q))
    dense = np.zeros(BODY, dtype=bool)
    dense[:10] = True  # "norm gains"
    st = Stepper(SPSAConfig(directions=1, density=0.5), seed=1, body=BODY, dense=dense)
    z = st._z(0, 0, BODY)
    assert np.all(np.abs(z[:10]) == 1) and 0.3 < np.mean(z[10:] == 0) < 0.7
    assert set(np.unique(np.abs(z))) == {0.0, 1.0}  # no rescaling
    st.close()


def test_accumulation_uses_fresh_directions_per_batch():
    loss, clean = _toy(4)
    cfg = SPSAConfig(**ALL_ROWS, directions=2, accumulate=3, decoder="spsa", warmup_steps=0)
    calls = []
    objs = [Objective(lambda w, a=a: calls.append(a) or loss(w)) for a in range(3)]
    r = Stepper(cfg, seed=2).step(State(np.zeros(BODY + DEC, np.float32)), objs)
    assert sorted(calls) == [0] * 4 + [1] * 4 + [2] * 4  # each batch: its own K directions, 2 probes each
    assert len(set(r.grads.round(6))) == 6
    with pytest.raises(ValueError, match="accumulate"):
        Stepper(cfg, seed=2).step(State(np.zeros(BODY + DEC, np.float32)), objs[:1])


def test_plateau_halves_lr_and_eps_together_down_to_the_floor():
    cfg = SPSAConfig(lr=1e-3, eps=1e-3, plateau=True, plateau_patience=100, lr_floor=2e-4)
    opt = OptState()
    assert not plateau(cfg, opt, 2.0, 100) and opt.best_val == 2.0
    assert not plateau(cfg, opt, 1.9, 150) and opt.best_step == 150
    assert not plateau(cfg, opt, 1.9 - 1e-9, 240)  # below min_delta: no improvement, but patience not spent
    assert plateau(cfg, opt, 1.95, 250) and opt.lr_scale == 0.5
    assert schedule(cfg, 1000, opt.lr_scale) == pytest.approx((5e-4, 5e-4))
    assert not plateau(cfg, opt, 1.95, 300)  # patience counts afresh from the decay
    assert plateau(cfg, opt, 1.95, 350) and opt.lr_scale == 0.25
    assert plateau(cfg, opt, 1.95, 450) and opt.lr_scale == pytest.approx(0.2)  # the floor: lr 2e-4
    assert not plateau(cfg, opt, 1.95, 550) and opt.lr_scale == pytest.approx(0.2)
    assert not plateau(SPSAConfig(), OptState(), 9.0, 10**6)  # off by default


def test_optimizer_state_record_round_trips_and_refuses_mismatches():
    from soma_edge.errors import CheckpointError

    opt = OptState(
        adam_m=np.ones(5, np.float32),
        adam_v=np.full(5, 2, np.float32),
        adam_t=7,
        lr_scale=0.25,
        best_val=1.5,
        best_step=40,
    )
    back = OptState.from_record(opt.to_record(), 5)
    assert back.lr_scale == 0.25 and back.best_val == 1.5 and back.best_step == 40 and back.adam_t == 7
    assert back.adam_v.tobytes() == opt.adam_v.tobytes() and back.momentum is None
    assert OptState.from_record(None, 5) == OptState()
    for bad in [
        {**opt.to_record(), "adam_m": np.ones(6, np.float32)},
        {**opt.to_record(), "adam_m": np.ones(5)},
        {**opt.to_record(), "best_step": -1},
        {**opt.to_record(), "lr_scale": 0.0},
        [1, 2],
        {**opt.to_record(), "adam_t": 0},
        {**OptState().to_record(), "adam_t": 2},
    ]:
        with pytest.raises(CheckpointError):
            OptState.from_record(bad, 5)


def test_adam_bias_correction_counts_its_own_updates_not_the_step():
    """A version resumed at step 5000 with fresh moments takes a first Adam step of size lr, not 3x lr."""
    loss, _ = _toy(6)
    cfg = SPSAConfig(**ALL_ROWS, directions=2, update="adam", lr=1e-2, warmup_steps=0, decoder="spsa", density=1.0)
    w0 = np.zeros(BODY + DEC, np.float32)
    late = State(w0.copy(), step=5000)
    Stepper(cfg, seed=0).step(late, loss)
    assert late.opt.adam_t == 1
    assert np.allclose(np.abs(late.weights), 1e-2, rtol=1e-3)  # |m_hat / sqrt(v_hat)| = 1 on the first update
