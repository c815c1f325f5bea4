"""spsa.evaluator = "population": the Stepper takes a minibatch's clean forward and 2K probes from one ORT
call, fed spsa's own noise for each key bit for bit, and sums g_j z_j as the loop does. Its scalars pass the
coordinator's audit (recomputed by the loop, within g_tolerance), its logs replay to its weights bit for bit,
and training with each evaluator is deterministic across processes."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator import replay as audit_mod
from soma_edge import checkpoint
from soma_edge.config import Evaluator, from_dict
from soma_edge.engine import population
from soma_edge.engine.evaluator import choose_evaluator, evaluator_for
from soma_edge.errors import ConfigError
from soma_edge.expert import params, steps
from soma_edge.spsa import log as update_log
from soma_edge.spsa import noise as keyed
from soma_edge.spsa import optim
from soma_edge.spsa import stepper as steppers

DATA = np.frombuffer(b"".join(bytes([i % 97 + 32]) * (i % 7 + 1) for i in range(4000)), dtype=np.uint8)
NOISES = {  # spsa settings: every noise form the population graph is fed
    "rademacher-sparse": {"noise": "rademacher", "density": 0.5},
    "rademacher-dense": {"noise": "rademacher", "density": 1.0},
    "gaussian": {"noise": "gaussian", "density": 1.0},
    "rank1": {"noise": "rank1", "density": 1.0},
}
KINDS = {"lstm": {"embed": 8, "hidden": 16}, "soma": {"kind": "soma", "embed": 8, "hidden": 8}}
STEPS = 6


def _config(kind: str, noise: str, evaluator: str = "population", decoder: str = "delta"):
    return from_dict(
        {
            "model": KINDS[kind],
            "data": {"batch": 6, "seq_len": 12},
            "device": "cpu",
            "spsa": {"directions": 3, "accumulate": 2, "warmup_steps": 2, "decoder": decoder, "evaluator": evaluator}
            | NOISES[noise],
        }
    )


def _expected_z(cfg, stepper: steppers.Stepper, t: int, j: int, body: int) -> np.ndarray:
    """Direction j of step t from spsa's public noise functions (what the loop perturbs with)."""
    s = cfg.spsa
    if s.noise == "rank1":
        return keyed.rank1_probe(cfg.seed, 0, t, j, keyed.body_shapes(stepper.shapes, body))
    z = keyed.noise(cfg.seed, 0, t, j, body, s.noise)
    if s.density < 1:
        keep = keyed.probe_mask(cfg.seed, 0, t, j, body, s.density)
        if stepper.dense is not None:  # the soma kind's norm gains, which sparse probes always touch
            keep |= stepper.dense[:body]
        z *= keep
    return z


@pytest.mark.parametrize("decoder", ["delta", "spsa"])
@pytest.mark.parametrize("noise", list(NOISES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_population_steps_pass_the_audit_and_replay_bit_for_bit(kind, noise, decoder):
    cfg = _config(kind, noise, decoder=decoder)
    ev = evaluator_for(cfg, threads=1, parallel=1)
    assert ev.population is not None
    lay = params.layout(cfg.model)
    start = optim.State(params.init(cfg.model, 0))
    state = optim.State(start.weights.copy())
    stepper = steps.stepper(cfg, 0)
    body, _ = stepper.split(lay.size)
    K = cfg.spsa.directions
    fed: list[tuple[int, np.ndarray]] = []  # (step, dense directions of each members call)
    grads = []
    try:
        for _ in range(STEPS):
            objs = steps.objectives(DATA, cfg, ev, 0, state.step)
            for o in objs:
                o.loss = o.clean = None  # the population path must not fall back to the loop's evaluations
                inner = o.members

                def members(w, probes, eps, inner=inner, t=state.step):
                    feeds = ev.population.noise_of(probes)  # bits, int8 signs, floats or factors
                    fed.append((t, np.stack([population.direction(lay, feeds, i, body) for i in range(K)])))
                    return inner(w, probes, eps)

                o.members = members
            grads.append(stepper.step(state, objs).grads)
    finally:
        stepper.close()
    # The graph was fed spsa's noise for each key, exactly: equal values (zeros where the sparse mask drops
    # a weight; int8 has no -0.0, which the loop's masked z may hold, and w + (±0 eps) is w either way).
    assert len(fed) == STEPS * cfg.spsa.accumulate
    for n, (t, dirs) in enumerate(fed):
        for i, d in enumerate(dirs):
            want = _expected_z(cfg, stepper, t, (n % cfg.spsa.accumulate) * K + i, body)
            assert np.array_equal(d[:body], want) and not d[body:].any()
    log = update_log.record_log(0, 1.0, grads, state, steps.log_body(cfg))
    got = steps.replay(cfg, start, log, 0)
    assert got.weights.tobytes() == state.weights.tobytes() and got.step == STEPS
    assert got.opt.to_record().keys() == state.opt.to_record().keys()
    body = steps.log_body(cfg) or lay.size  # a delta-rule decoder's moments stay on the worker
    for a, b in zip((got.opt.adam_m, got.opt.adam_v), (state.opt.adam_m, state.opt.adam_v)):
        assert (a is None and b is None) or a[:body].tobytes() == b[:body].tobytes()
    assert not np.array_equal(state.weights, start.weights)
    # The coordinator recomputes every step's losses with the loop and accepts each scalar within its
    # tolerance (and, for the delta rule, the decoder the log's steps lead to).
    loop_ev = evaluator_for(cfg, "cpu", threads=1, parallel=1, evaluator=Evaluator.LOOP)
    assert loop_ev.population is None
    audit_mod.audit(cfg, start, log, 0, DATA, loop_ev, list(range(STEPS)))


def test_population_scalars_are_the_loops_within_the_audit_tolerance():
    """One step from the same state: each g_j of the population evaluator is the loop's within
    g_tolerance of the loop's own losses, and the mean loss agrees."""
    cfg = _config("lstm", "rademacher-sparse", decoder="frozen")
    out = {}
    for choice in (Evaluator.LOOP, Evaluator.POPULATION):
        ev = evaluator_for(cfg, threads=1, parallel=1, evaluator=choice)
        stepper = steps.stepper(cfg, 0)
        state = optim.State(params.init(cfg.model, 0))
        try:
            out[choice] = stepper.step(state, steps.objectives(DATA, cfg, ev, 0, 0))
        finally:
            stepper.close()
    loop, pop = out[Evaluator.LOOP], out[Evaluator.POPULATION]
    assert pop.eps == loop.eps and len(pop.grads) == len(loop.grads) == 6
    # The step's loss is the mean of its L+ and L- (no clean forward), so |L+| + |L-| is about 2 loss.
    tol = [audit_mod.g_tolerance(loop.loss, loop.loss, loop.eps, g) for g in loop.grads]
    assert np.all(np.abs(pop.grads - loop.grads) <= tol), (pop.grads, loop.grads, tol)
    assert abs(pop.loss - loop.loss) <= 1e-5 * abs(loop.loss)


def test_auto_is_the_loop_on_the_cpu_and_the_population_on_an_accelerator():
    assert choose_evaluator("auto", ["CPUExecutionProvider"]) is Evaluator.LOOP
    assert choose_evaluator("auto", ["CUDAExecutionProvider", "CPUExecutionProvider"]) is Evaluator.POPULATION
    assert choose_evaluator("population", ["CPUExecutionProvider"]) is Evaluator.POPULATION
    assert choose_evaluator("loop", ["CUDAExecutionProvider"]) is Evaluator.LOOP
    cfg = _config("lstm", "rademacher-dense", evaluator="auto")
    assert cfg.spsa.evaluator is Evaluator.AUTO
    assert evaluator_for(cfg, "cpu", threads=1, parallel=1).population is None


def test_validation_refuses_a_bad_evaluator():
    with pytest.raises(ConfigError) as e:
        from_dict({"spsa": {"evaluator": "gpu"}})
    msg = str(e.value)
    assert "\n" not in msg and "spsa.evaluator" in msg and "'population'" in msg and "'gpu'" in msg
    assert from_dict({}).spsa.evaluator is Evaluator.AUTO


def _train_args(tmp_path, name: str, evaluator: str) -> list[str]:
    out, cfg = tmp_path / f"{name}.msgpack", tmp_path / f"{name}.toml"
    cfg.write_text(
        'device = "cpu"\nthreads = 1\nparallel = 1\n[model]\nembed = 8\nhidden = 16\n[data]\nbatch = 2\nseq_len = 16\n'
        f'[spsa]\ndirections = 2\nevaluator = "{evaluator}"\n'
    )
    return ["--config", str(cfg), "--steps", "8", "--out", str(out), "--eval-windows", "2", "--json"]


def _weights(tmp_path, name: str) -> np.ndarray:
    body = checkpoint.load(tmp_path / f"{name}.msgpack", "expert")
    assert body["step"] == 8
    return body["weights"]


def test_each_evaluator_is_deterministic_across_processes(tmp_path, train):
    """Each evaluator trains in a fresh process and in this test process: two processes, each with its own
    hash seed and history."""
    for e in ("loop", "population"):
        train(*_train_args(tmp_path, f"{e}0", e), fresh=True)
        train(*_train_args(tmp_path, f"{e}1", e))
    got = {e: [_weights(tmp_path, f"{e}{i}") for i in range(2)] for e in ("loop", "population")}
    for a, b in got.values():
        assert a.tobytes() == b.tobytes()
    # The population graph's losses differ from the LSTM op's by float rounding, which moves the weights'
    # low bits: evidence that the second process really trained through the population evaluator.
    assert got["loop"][0].tobytes() != got["population"][0].tobytes()
