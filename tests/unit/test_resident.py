"""An expert resident on its device (soma_edge.engine.resident): weights, moments and batch as OrtValues bound
through IOBinding, the update run as the update graph. On the CPU EP its steps equal the Stepper's
population steps (host update, weights fed each call) bit for bit: the weights, the optimizer state, the
scalars the update log keeps, and the loss."""

from __future__ import annotations

import numpy as np
import pytest

from soma_edge.config import from_dict
from soma_edge.corpus.documents import batch_rng, sample_batch
from soma_edge.engine import resident
from soma_edge.engine.evaluator import evaluator_for
from soma_edge.expert import params, steps
from soma_edge.spsa import optim

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
        {"model": KINDS[kind], "data": {"batch": 6, "seq_len": 12}, "device": "cpu", "spsa": base | spsa_cfg}
    )


def _batches(cfg, t: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rngs = [batch_rng(cfg.seed, 0, t, a) for a in range(cfg.spsa.accumulate)]
    return [sample_batch(DATA, cfg.data.batch, cfg.data.seq_len, r) for r in rngs]


def _bits(a):
    return None if a is None else a.view(np.uint32).tolist()


@pytest.mark.parametrize("capture", [False, True], ids=["calls", "fixed-buffers"])
@pytest.mark.parametrize("setting", list(SPSA))
@pytest.mark.parametrize("kind", list(KINDS))
def test_resident_steps_equal_the_population_steps_bit_for_bit(kind, setting, capture):
    """Also with the fixed-address calls that CUDA graph capture needs (soma_edge.engine.capture: A/B weight sets,
    buffers refilled in place; uncaptured on the CPU EP), where the step qualifies."""
    cfg = _config(kind, SPSA[setting])
    evaluator = evaluator_for(cfg, threads=1)
    assert evaluator.population is not None
    host = optim.State(params.init(cfg.model, 3))
    on_device = optim.State(host.weights.copy())
    stepper = steps.stepper(cfg, 0)
    runner = resident.Resident(cfg, 0, evaluator.population, on_device, capture=capture)
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
    assert (runner.captured is not None) == (capture and cfg.spsa.accumulate == 1)
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
    runner = resident.Resident(cfg, 0, evaluator.population, optim.State(params.init(cfg.model, 3)))
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
    on_device = optim.State(params.init(cfg.model, 3))
    rep = train(on_device, DATA, cfg, evaluator, steps=3)
    assert len(calls) == 3 and on_device.step == 3
    monkeypatch.setattr(resident.update_graph, "supported", lambda s: "the host's update, for this test")
    on_host = optim.State(params.init(cfg.model, 3))
    again = train(on_host, DATA, cfg, evaluator, steps=3)
    assert len(calls) == 3  # the Stepper ran these
    assert _bits(on_device.weights) == _bits(on_host.weights) and _bits(on_device.opt.adam_v) == _bits(
        on_host.opt.adam_v
    )
    assert all(np.array_equal(a, b) for a, b in zip(rep.grads, again.grads)) and rep.loss == again.loss


def _run(cfg, population, state: optim.State, start: int, n: int, capture: bool) -> None:
    runner = resident.Resident(cfg, 0, population, state, capture=capture)
    for t in range(start, start + n):
        runner.step(_batches(cfg, t))
    runner.download()


def test_captured_buffers_serve_the_next_round_and_a_refusal_falls_back(monkeypatch, caplog):
    """The fixed buffers outlive a round (a captured graph keeps their addresses): a second round's state
    is loaded into them, and its steps equal plain calls bit for bit. A device that refuses capture (here
    the second round's first captured call raises) costs one warning line; the step runs uncaptured."""
    cfg = _config("soma", {})
    plain, fixed = evaluator_for(cfg, threads=1), evaluator_for(cfg, threads=1)
    want, got = optim.State(params.init(cfg.model, 5)), optim.State(params.init(cfg.model, 5))
    _run(cfg, plain.population, want, 0, 3, capture=False)
    _run(cfg, fixed.population, got, 0, 3, capture=True)
    kept = fixed.population.captured
    assert kept is not None and _bits(got.weights) == _bits(want.weights)
    _run(cfg, plain.population, want, 3, 3, capture=False)
    _run(cfg, fixed.population, got, 3, 3, capture=True)
    assert fixed.population.captured is kept and _bits(got.weights) == _bits(want.weights)
    assert _bits(got.opt.adam_m) == _bits(want.opt.adam_m) and got.step == want.step == 6

    def refused(*args):
        raise RuntimeError("CUDA failure 900: operation not permitted when stream is capturing")

    monkeypatch.setattr(kept, "evaluate", refused)
    with caplog.at_level("WARNING", logger="soma.resident"):
        _run(cfg, plain.population, want, 6, 2, capture=False)
        _run(cfg, fixed.population, got, 6, 2, capture=True)
    assert _bits(got.weights) == _bits(want.weights) and got.step == 8
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "capture failed" in said[0] and fixed.population.captured is None
    _run(cfg, fixed.population, got, 8, 1, capture=True)  # the next round does not try again
    assert fixed.population.captured is None and len(caplog.records) == 1


def test_capture_asks_the_cuda_ep_for_cuda_graphs_and_nothing_else(monkeypatch):
    """make_session(cuda_graph=True) adds enable_cuda_graph to the CUDA EP's options (the Plan's, use_tf32
    kept) and leaves other providers as they are."""
    from soma_edge.engine import runtime

    seen = {}

    class Session:
        def __init__(self, data, sess_options, providers, enable_fallback):
            seen["providers"] = providers

        def get_providers(self):
            return [p if isinstance(p, str) else p[0] for p in seen["providers"]]

    cuda = runtime.Plan([(runtime.CUDA, runtime.cuda_options(1))], strict=True)
    monkeypatch.setattr(runtime, "plan", lambda device: cuda)
    monkeypatch.setattr(runtime.load_ort(), "InferenceSession", Session)
    graph = resident.update_graph.build_update(
        _config("lstm", {}).model, _config("lstm", {}).spsa, 3, ["embed"], "bits", False
    )
    runtime.make_session(graph, "cuda:1", cuda_graph=True)
    assert seen["providers"] == [(runtime.CUDA, {"device_id": 1, "use_tf32": 0, "enable_cuda_graph": "1"})]
    runtime.make_session(graph, "cuda:1")
    assert seen["providers"] == [(runtime.CUDA, {"device_id": 1, "use_tf32": 0})]
    monkeypatch.setattr(runtime, "plan", lambda device: runtime.Plan([runtime.CPU], strict=False))
    runtime.make_session(graph, "cpu", cuda_graph=True)
    assert seen["providers"] == [(runtime.CPU, {})]


def test_capture_whose_sessions_cannot_be_made_falls_back_at_once(monkeypatch, caplog):
    """A device that refuses the captured sessions themselves (enable_cuda_graph at session creation) costs
    the same one warning line, and the round trains uncaptured from its first step."""
    cfg = _config("lstm", {})
    plain, fixed = evaluator_for(cfg, threads=1), evaluator_for(cfg, threads=1)

    def refused(*args):
        raise RuntimeError("this session cannot use the CUDA Graph feature")

    monkeypatch.setattr(resident.capture_mod, "Captured", refused)
    want, got = optim.State(params.init(cfg.model, 4)), optim.State(params.init(cfg.model, 4))
    with caplog.at_level("WARNING", logger="soma.resident"):
        _run(cfg, plain.population, want, 0, 3, capture=False)
        _run(cfg, fixed.population, got, 0, 3, capture=True)
    assert _bits(got.weights) == _bits(want.weights) and got.step == want.step == 3
    assert len(caplog.records) == 1 and fixed.population.capture_refused


def test_a_fixed_buffer_takes_only_its_dtype_and_shape():
    """update_inplace checks only the element count: a batch of another dtype would be copied as bytes into
    the int64 buffer. The refill refuses it, naming the buffer."""
    cfg = _config("lstm", {})
    ev = evaluator_for(cfg, threads=1)
    runner = resident.Resident(cfg, 0, ev.population, optim.State(params.init(cfg.model, 3)), capture=True)
    runner.step(_batches(cfg, 0))
    x, y = _batches(cfg, 1)[0]
    with pytest.raises(ValueError, match=r"x: int32\[6, 12\], the fixed buffer is int64\[6, 12\]"):
        runner.captured.evaluate(
            ev.population.noise_of(runner.stepper.probes(1, range(3), runner.body)), 1e-3, x.astype(np.int32), y
        )
