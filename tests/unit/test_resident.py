"""An expert resident on its device (soma_edge.resident): weights, moments and batch as OrtValues bound
through IOBinding, the update run as the update graph. On the CPU EP its steps equal the Stepper's
population steps (host update, weights fed each call) bit for bit: the weights, the optimizer state, the
scalars the update log keeps, and the loss."""

from __future__ import annotations

import numpy as np
import pytest

from soma_edge import params, resident, spsa, steps
from soma_edge.config import from_dict
from soma_edge.corpus import batch_rng, sample_batch
from soma_edge.runtime import evaluator_for

DATA = np.frombuffer(b"".join(bytes([i % 97 + 32]) * (i % 7 + 1) for i in range(4000)), dtype=np.uint8)
KINDS = {"lstm": {"embed": 8, "hidden": 16}, "soma": {"kind": "soma", "embed": 8, "hidden": 8}}
SPSA = {  # beyond the defaults (adam, the delta-rule decoder, sparse Rademacher probes)
    "default": {},
    "decoder-spsa": {"decoder": "spsa"},
    "frozen-sgd-momentum": {"decoder": "frozen", "update": "sgd", "momentum": 0.9, "weight_decay": 0.01},
    "gaussian-accumulate": {"noise": "gaussian", "density": 1.0, "accumulate": 2},
    "rank1": {"noise": "rank1", "density": 1.0},
}
STEPS = 4


def _config(kind: str, spsa_cfg: dict):
    base = {"directions": 3, "warmup_steps": 2, "evaluator": "population"}
    return from_dict(
        {"model": KINDS[kind], "data": {"batch": 2, "seq_len": 12}, "device": "cpu", "spsa": base | spsa_cfg}
    )


def _batches(cfg, t: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rngs = [batch_rng(cfg.seed, 0, t, a) for a in range(cfg.spsa.accumulate)]
    return [sample_batch(DATA, cfg.data.batch, cfg.data.seq_len, r) for r in rngs]


def _bits(a):
    return None if a is None else a.view(np.uint32).tolist()


@pytest.mark.parametrize("setting", list(SPSA))
@pytest.mark.parametrize("kind", list(KINDS))
def test_resident_steps_equal_the_population_steps_bit_for_bit(kind, setting):
    cfg = _config(kind, SPSA[setting])
    evaluator = evaluator_for(cfg, threads=1)
    assert evaluator.population is not None
    host = spsa.State(params.init(cfg.model, 3))
    on_device = spsa.State(host.weights.copy())
    stepper = steps.stepper(cfg, 0)
    runner = resident.Resident(cfg, 0, evaluator.population, on_device)
    assert runner.verified()
    try:
        for t in range(STEPS):
            want = stepper.step(host, steps.objectives(DATA, cfg, evaluator, 0, t))
            got = runner.step(_batches(cfg, t), decoder_grad=True)
            assert np.array_equal(got.grads, want.grads) and got.loss == want.loss, t
            assert (got.lr, got.eps) == (want.lr, want.eps)
            assert _bits(got.decoder_grad) == _bits(want.decoder_grad)
    finally:
        stepper.close()
    runner.download()
    assert _bits(on_device.weights) == _bits(host.weights)
    assert not np.array_equal(host.weights, params.init(cfg.model, 3))  # it did train
    for part in ("adam_m", "adam_v", "momentum"):
        assert _bits(getattr(on_device.opt, part)) == _bits(getattr(host.opt, part)), part
    assert (on_device.step, on_device.opt.adam_t) == (host.step, host.opt.adam_t) == (STEPS, host.opt.adam_t)


def test_a_device_whose_update_bits_differ_fails_the_check(monkeypatch):
    """`verified` compares one device update with the host's: an update graph that rounds differently (here
    one whose lr is fed a hair larger) is caught, and the worker keeps the host update."""
    cfg = _config("lstm", {})
    evaluator = evaluator_for(cfg, threads=1)
    runner = resident.Resident(cfg, 0, evaluator.population, spsa.State(params.init(cfg.model, 3)))
    real = resident.update_graph.scalars

    def off(*args):
        out = real(*args)
        out["lr"] = np.array(np.nextafter(out["lr"], np.float32(1)))
        return out

    monkeypatch.setattr(resident.update_graph, "scalars", off)
    monkeypatch.setattr(resident, "_VERIFIED", {})
    assert not runner.verified()


def test_the_worker_trains_resident_when_it_evaluates_by_population(monkeypatch):
    """worker.trainer.train takes the resident path with the population evaluator, and falls back to the
    host update (the Stepper) where the update graph cannot serve: the same weights and log either way."""
    from worker.trainer import train

    cfg = _config("lstm", {})
    evaluator = evaluator_for(cfg, threads=1)
    calls = []
    real = resident.Resident.step
    monkeypatch.setattr(resident.Resident, "step", lambda self, *a: calls.append(1) or real(self, *a))
    on_device = spsa.State(params.init(cfg.model, 3))
    rep = train(on_device, DATA, cfg, evaluator, steps=3)
    assert len(calls) == 3 and on_device.step == 3
    monkeypatch.setattr(resident.update_graph, "supported", lambda s: "the host's update, for this test")
    on_host = spsa.State(params.init(cfg.model, 3))
    again = train(on_host, DATA, cfg, evaluator, steps=3)
    assert len(calls) == 3  # the Stepper ran these
    assert _bits(on_device.weights) == _bits(on_host.weights) and _bits(on_device.opt.adam_v) == _bits(
        on_host.opt.adam_v
    )
    assert all(np.array_equal(a, b) for a, b in zip(rep.grads, again.grads)) and rep.loss == again.loss
