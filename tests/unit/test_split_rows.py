"""Directions on their own rows (`spsa.split_rows`) and shaped differences (`spsa.shaping`): the estimate stays
unbiased with the second moment its analysis gives; each direction's probes see only its rows; a run's log
replays bit for bit and passes the coordinator's audit under every shaping; the bench's frozen twin never
moves the body."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator import replay as audit_mod
from soma_edge import codec, config
from soma_edge.config import SPSAConfig, evals_per_step
from soma_edge.engine.evaluator import evaluator_for
from soma_edge.errors import ConfigError, ValidationError
from soma_edge.expert import params, steps
from soma_edge.spsa import log as update_log
from soma_edge.spsa import shaping
from soma_edge.spsa.optim import State
from soma_edge.spsa.recipe import Recipe
from soma_edge.spsa.stepper import Objective, Stepper
from worker.trainer import train

M, ROWS = 48, 16
SHAPES = ((6, 5), (8,), (2, 5))  # 30 + 8 + 10 = M: two matrices (rank-1 probes) and a vector


def _rows_objective(seed: int) -> tuple[Objective, np.ndarray]:
    """Linear per-row losses v_r . w: a direction's central difference is exactly (mean of its rows' v) . z,
    at w = 0 (the probes are exactly ±eps z). Returns the objective and the rows' gradients v [ROWS, M]."""
    v = np.random.default_rng(seed).standard_normal((ROWS, M))

    def part(w, i, n):
        rows = v[i * ROWS // n : (i + 1) * ROWS // n]
        return float(rows.mean(axis=0) @ w.astype(np.float64))

    return Objective(loss=lambda w: part(w, 0, 1), part=part), v


@pytest.mark.parametrize("noise", ["rademacher", "rank1"])
def test_split_rows_estimate_is_unbiased_with_the_second_moment_of_its_analysis(noise):
    """With K directions on ROWS / K rows each, direction j measures g_j . z_j, g_j its rows' gradient, so
    ĝ = (1/K) Σ (g_j . z_j) z_j has mean (1/K) Σ g_j = the batch's gradient, and (Rademacher or rank-1 signs:
    |z|² = M, E[z zᵀ] = I) E|ĝ|² = (M Σ_j |g_j|² + Σ_{i≠j} g_i . g_j) / K². Checked over 3,000 keyed steps
    of the real Stepper (SGD at lr 1 from w = 0, so the step is -ĝ)."""
    K, T = 4, 3000
    cfg = SPSAConfig(
        directions=K, split_rows=True, noise=noise, density=1.0, update="sgd", lr=1.0, warmup_steps=0, decoder="frozen"
    )
    obj, v = _rows_objective(1)
    g_parts = v.reshape(K, ROWS // K, M).mean(axis=1)
    grad = v.mean(axis=0)
    stepper = Stepper(cfg, seed=5, shapes=SHAPES)
    est = np.empty((T, M))
    for t in range(T):
        state = State(np.zeros(M, np.float32), step=t)
        stepper.step(state, obj)
        est[t] = -state.weights
    stepper.close()
    se = est.std(axis=0) / np.sqrt(T)
    assert np.all(np.abs(est.mean(axis=0) - grad) < 4.5 * se), np.max(np.abs(est.mean(axis=0) - grad) / se)
    gram = g_parts @ g_parts.T
    want = (M * np.trace(gram) + gram.sum() - np.trace(gram)) / K**2
    got = np.mean(np.sum(est**2, axis=1))
    assert abs(got / want - 1) < 0.05, (got, want)


def test_each_direction_probes_only_its_own_rows():
    """Direction j of a step calls `part(w, j % K, K)` twice (w ± eps z_j), never the whole minibatch's
    loss, and a step costs the forward passes of one direction (2 probes of batch / K rows each, per K)."""
    calls = []
    obj, _ = _rows_objective(2)

    def part(w, i, n):
        calls.append((i, n))
        return obj.part(w, i, n)

    cfg = SPSAConfig(directions=4, split_rows=True, density=1.0, decoder="frozen")
    stepper = Stepper(cfg, seed=0)
    stepper.step(State(np.zeros(M, np.float32)), Objective(loss=lambda w: pytest.fail("whole batch"), part=part))
    stepper.close()
    assert sorted(calls) == sorted([(i, 4) for i in range(4)] * 2)
    clean = {"decoder_from": "clean"}
    assert evals_per_step(cfg) == 2 and evals_per_step(SPSAConfig(directions=4, split_rows=True, **clean)) == 3
    assert evals_per_step(SPSAConfig(directions=4, split_rows=False, **clean)) == 9
    assert evals_per_step(SPSAConfig()) == 2  # the default: 4 directions on their own rows, the head from them


def test_shapings_weigh_the_step_as_documented():
    g = np.array([0.3, -2.0, 0.3, 5.0, -0.1])
    assert shaping.shape("none", g) is not None and np.array_equal(shaping.shape("none", g), g)
    assert np.array_equal(shaping.shape("sign", g), np.sign(g))
    z = shaping.shape("zscore", g)
    assert abs(z.mean()) < 1e-12 and abs(z.std() - 1) < 1e-12 and np.argmax(z) == 3
    r = shaping.shape("rank", g)
    assert np.array_equal(r, np.array([0.0, -0.5, 0.25, 0.5, -0.25]))  # equal scalars rank in index order
    assert np.array_equal(shaping.shape("zscore", np.ones(3)), np.zeros(3))  # no spread: no step
    assert config.SHAPINGS == shaping.KINDS
    with pytest.raises(ValueError, match="at least 2"):
        shaping.shape("rank", g[:1])


def test_a_shaping_that_needs_two_scalars_is_refused_at_one_direction():
    cfg = config.from_dict({"spsa": {"directions": 2, "shaping": "rank"}})
    assert cfg.spsa.shaping == "rank"
    with pytest.raises(ConfigError, match="spsa.shaping = 'zscore' needs at least 2 directions"):
        config.from_dict({"spsa": {"shaping": "zscore", "directions": 1}})


DATA = np.frombuffer(b"".join(bytes([i % 89 + 33]) * (i % 5 + 1) for i in range(5000)), dtype=np.uint8)


def _run_config(shape: str, noise: str = "rademacher", decoder_from: str = "clean", split: bool = True):
    return config.from_dict(
        {
            "model": {"embed": 8, "hidden": 16},
            "data": {"batch": 4, "seq_len": 16},
            "device": "cpu",
            "spsa": {
                "directions": 4,
                "split_rows": split,
                "density": 1.0,
                "noise": noise,
                "shaping": shape,
                "warmup_steps": 2,
                "decoder_from": decoder_from,
            },
        }
    )


RUNS = {  # shaping, noise, decoder_from, split_rows
    "none": ("none", "rademacher", "clean", True),
    "zscore": ("zscore", "rademacher", "clean", True),
    "sign": ("sign", "rademacher", "clean", True),
    "rank-rank1": ("rank", "rank1", "clean", True),
    "probes-decoder": ("none", "rademacher", "probes", True),
    "probes-decoder-shared-rows": ("sign", "rank1", "probes", False),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_a_new_recipe_replays_bit_for_bit_and_passes_the_audit(run):
    cfg = _run_config(*RUNS[run])
    ev = evaluator_for(cfg, threads=1, parallel=2)
    assert ev.population is None  # split rows run on the loop
    start = State(params.init(cfg.model, 0))
    live = State(start.weights.copy())
    rep = train(live, DATA, cfg, ev, expert=1, steps=6, keep_decoder_grads=True)
    sent = update_log.record_log(0, 1.0, rep.grads, live, steps.log_body(cfg), recipe=Recipe.of(cfg))
    log = update_log.UpdateLog.from_record(codec.decode(codec.encode(sent.to_record(), "log"), "log"))
    assert log.recipe == Recipe.of(cfg) and log.recipe.rows == (1 if cfg.spsa.split_rows else 4)
    assert steps.replay(cfg, start, log, 1).weights.tobytes() == live.weights.tobytes()
    audit_mod.audit(cfg, start, log, 1, DATA, ev, list(range(6)))
    other = _run_config(*RUNS[run])
    other.spsa.split_rows = not other.spsa.split_rows  # the same scalars on other rows: refused, not misread
    with pytest.raises(ValueError, match=f"spsa.split_rows: {cfg.spsa.split_rows} vs {other.spsa.split_rows}"):
        steps.replay(other, start, log, 1)
    bad = update_log.record_log(0, 1.0, [g.copy() for g in rep.grads], live, steps.log_body(cfg))
    bad.grads[3][2] *= 1.5
    with pytest.raises(ValidationError, match=r"log step 3\), direction 2"):
        audit_mod.audit(cfg, start, bad, 1, DATA, ev, [3])


def test_the_frozen_twin_moves_the_decoder_only():
    """The bench's twin (Stepper.freeze_body): no probe is evaluated, the body keeps its bits, the decoder
    takes the same delta-rule step as in a run whose body learns (its first step, from the same weights)."""
    cfg = _run_config("none")
    ev = evaluator_for(cfg, threads=1, parallel=1)
    body = params.layout(cfg.model).body
    w0 = params.init(cfg.model, 0)
    twin, arm = State(w0.copy()), State(w0.copy())
    objs = steps.objectives(DATA, cfg, ev, 0, 0)
    frozen = steps.stepper(cfg, 0)
    frozen.freeze_body = True
    no_probes = [Objective(loss=None, part=None, clean=o.clean) for o in objs]
    r = frozen.step(twin, no_probes)
    learning = steps.stepper(cfg, 0)
    learning.step(arm, objs)
    frozen.close()
    learning.close()
    assert twin.weights[:body].tobytes() == w0[:body].tobytes() and not np.any(r.grads)
    assert twin.weights[body:].tobytes() == arm.weights[body:].tobytes() != w0[body:].tobytes()
    assert twin.step == 1 and twin.opt.adam_t == 1


def test_the_probes_decoder_gradient_is_the_clean_one_to_second_order_and_costs_no_pass():
    """decoder_from = "probes": the mean of the decoder gradients at w ± eps z_j over the step's directions
    (each on its rows), which is the clean forward's gradient at w up to O(eps²); a step costs 2 passes."""
    cfg = _run_config("none", decoder_from="probes")
    ev = evaluator_for(cfg, threads=1, parallel=1)
    w = params.init(cfg.model, 0)
    objs = steps.objectives(DATA, cfg, ev, 0, 0)
    stepper = steps.stepper(cfg, 0)
    body = params.layout(cfg.model).body
    sums = stepper.evaluate(w, objs, 0, body, 1e-3, True)
    stepper.close()
    ((loss, probes),) = sums.cleans
    clean_loss, clean = objs[0].clean(w)
    assert np.linalg.norm(probes - clean) < 1e-3 * np.linalg.norm(clean)
    assert abs(loss - clean_loss) < 1e-3 and evals_per_step(cfg.spsa) == 2


@pytest.mark.parametrize("split", [False, True], ids=["shared-rows", "split-rows"])
def test_the_population_evaluator_takes_the_probes_decoder_gradient_and_passes_the_audit(split):
    """decoder_from = "probes" on the population graph, each direction on the whole batch or on its own rows:
    its losses and decoder gradient (the mean over the probes' rows) are the loop's to float rounding, and its
    run's log passes the loop's audit and replays bit for bit."""
    cfg = _run_config("none", decoder_from="probes", split=split)
    cfg.spsa.evaluator = "population"
    pop = evaluator_for(cfg, threads=1, parallel=1)
    loop = evaluator_for(cfg, threads=1, parallel=1, evaluator="loop")
    assert pop.population is not None and loop.population is None
    clean = _run_config("none", decoder_from="clean", split=split)  # a split graph's clean member reads a slice:
    assert (evaluator_for(clean, threads=1, evaluator="population").population is None) == split  # the loop
    w, body = params.init(cfg.model, 0), params.layout(cfg.model).body
    stepper = steps.stepper(cfg, 0)
    via_pop = stepper._population(w, steps.objectives(DATA, cfg, pop, 0, 0), 0, body, 1e-3, True)
    via_loop = stepper.evaluate(w, steps.objectives(DATA, cfg, loop, 0, 0), 0, body, 1e-3, True)
    stepper.close()
    assert np.allclose(via_pop.pairs, via_loop.pairs, rtol=1e-5)
    (_, dec_pop), (_, dec_loop) = via_pop.cleans[0], via_loop.cleans[0]
    assert np.allclose(dec_pop, dec_loop, rtol=1e-4, atol=1e-7)
    start, live = State(w.copy()), State(w.copy())
    rep = train(live, DATA, cfg, pop, steps=4, keep_decoder_grads=True)
    log = update_log.record_log(0, 1.0, rep.grads, live, steps.log_body(cfg), recipe=Recipe.of(cfg))
    assert steps.replay(cfg, start, log, 0).weights.tobytes() == live.weights.tobytes()
    audit_mod.audit(cfg, start, log, 0, DATA, loop, [0, 3])
