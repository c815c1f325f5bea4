"""The capability probe times real SPSA steps (noise, evaluations, update), in the scheduler's unit."""

from __future__ import annotations

import time

import numpy as np
import pytest

from soma_edge.config import Evaluator, evals_per_step, from_dict
from soma_edge.engine.evaluator import evaluator_kind
from soma_edge.expert import params
from soma_edge.spsa import optim, stepper
from worker import probe
from worker.cache import Cache
from worker.trainer import train

CFG = from_dict({"model": {"embed": 8, "hidden": 16}, "data": {"batch": 4, "seq_len": 16}, "device": "cpu"})
# One direction a step on all rows with a clean forward: each slowed part then runs once a step, in line.
K1 = from_dict(
    {**CFG.to_dict(), "spsa": {**CFG.to_dict()["spsa"], "directions": 1, "split_rows": False, "decoder_from": "clean"}}
)
# s added to each call of the slowed part: far above a step of this model (well under 1 ms), so that even a
# box loaded enough to run it at ~500 evals/s (as under 4 test processes on 2 cores) tells the two apart.
SLOW = 0.05


def _evaluator():
    return probe.make_evaluator(K1, "cpu", threads=1, spin=False, parallel=1)


def _slowed(fn):
    def slow(*args, **kwargs):
        time.sleep(SLOW)
        return fn(*args, **kwargs)

    return slow


@pytest.mark.parametrize("part", ["noise", "apply_update"])  # the direction's noise; the update of the weights
def test_the_probe_counts_the_noise_and_the_update(monkeypatch, part):
    """Slowing either part by SLOW per step must slow the probe to about evals_per_step / SLOW (one
    direction per step: the noise is drawn once per step, the update made once). A probe of bare losses
    would not notice, and one that reported steps/s would be evals_per_step times too low."""
    evaluator = _evaluator()
    fast = probe.measure(evaluator, K1, seconds=0.2)
    per = evals_per_step(K1.spsa)
    assert K1.spsa.directions * K1.spsa.accumulate == 1 and per == 3  # K = 1 with the delta rule's clean forward
    assert fast > 4 * per / SLOW  # so the slowed rate below is told apart
    monkeypatch.setattr(stepper, part, _slowed(getattr(stepper, part)))  # as the Stepper looks them up
    slow = probe.measure(evaluator, K1, seconds=0.5)  # ~10 slowed steps
    assert 0.5 * per / SLOW < slow <= per / SLOW, (fast, slow)


def test_the_probe_is_cached_per_spsa_config(tmp_path, monkeypatch):
    """A second query with the same config reads the cache; another step config (here K) is probed again,
    since a step's cost depends on it."""
    cache = Cache(tmp_path)
    calls = []
    real = probe.measure
    monkeypatch.setattr(probe, "measure", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = probe.capabilities(CFG, cache, "cpu", 1, False, 1, seconds=0.05)
    again = probe.capabilities(CFG, cache, "cpu", 1, False, 1, seconds=0.05)
    assert not first["probe_cached"] and again["probe_cached"] and len(calls) == 1
    assert again["evals_per_s"] == first["evals_per_s"] > 0
    other = from_dict({**CFG.to_dict(), "spsa": {**CFG.to_dict()["spsa"], "directions": 2}})
    assert not probe.capabilities(other, cache, "cpu", 1, False, 1, seconds=0.05)["probe_cached"]
    assert len(calls) == 2


def test_auto_on_the_cpu_is_the_loop_without_measuring_the_population(tmp_path, monkeypatch):
    """On the CPU EP `auto` is one fixed choice (the loop), so CPU runs stay deterministic: one probe."""
    calls = []
    real = probe.measure
    monkeypatch.setattr(probe, "measure", lambda ev, *a, **k: calls.append(ev.population) or real(ev, *a, **k))
    caps = probe.capabilities(CFG, Cache(tmp_path), "cpu", 1, False, 1, seconds=0.05)
    assert caps["evaluator"] == "loop" and list(caps["evaluator_rates"]) == ["loop"] and calls == [None]
    assert probe.chosen(caps) is Evaluator.LOOP


@pytest.mark.parametrize("faster", [Evaluator.LOOP, Evaluator.POPULATION])
def test_auto_on_an_accelerator_measures_both_once_and_trains_with_the_faster(tmp_path, monkeypatch, faster):
    """Where `auto` is measured (an accelerator; faked here on the CPU EP), the probe times both evaluators
    once per expert shape, caches the faster, and the worker trains with it and names it in its report."""
    monkeypatch.setattr(probe, "measures_auto", lambda choice, providers: True)
    rates = {Evaluator.LOOP: 100.0, Evaluator.POPULATION: 300.0}
    if faster is Evaluator.LOOP:
        rates = {Evaluator.LOOP: 300.0, Evaluator.POPULATION: 100.0}
    timed = []

    def fake(ev, cfg, seconds=0.0):
        timed.append(evaluator_kind(ev))
        return rates[timed[-1]]

    monkeypatch.setattr(probe, "measure", fake)
    cache = Cache(tmp_path)
    caps = probe.capabilities(CFG, cache, "cpu", 1, False, 1, seconds=0.05)
    assert len(timed) == 2 and set(timed) == set(rates)
    assert caps["evaluator"] == faster.value and caps["evals_per_s"] == 300.0
    assert caps["evaluator_rates"] == {e.value: r for e, r in rates.items()}
    again = probe.capabilities(CFG, cache, "cpu", 1, False, 1, seconds=0.05)
    assert again["probe_cached"] and len(timed) == 2 and probe.chosen(again) is faster
    evaluator = probe.make_evaluator(CFG, "cpu", 1, False, 1, probe.chosen(again))
    assert evaluator_kind(evaluator) is faster
    data = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    report = train(optim.State(params.init(CFG.model, 0)), data, CFG, evaluator, steps=1)
    assert report.evaluator is faster
    timed.clear()  # `soma-worker train` chooses the same way, without a cache (probe.fastest)
    evaluator, measured = probe.fastest(CFG, "cpu", 1, False, 1, seconds=0.05)
    assert evaluator_kind(evaluator) is faster and measured == rates and len(timed) == 2


def test_a_cached_probe_without_an_evaluator_is_measured_again(tmp_path, monkeypatch):
    """A probe cached by a version that did not record the evaluator cannot say which one to train with."""
    cache = Cache(tmp_path)
    first = probe.capabilities(CFG, cache, "cpu", 1, False, 1, seconds=0.05)
    key = probe._key(CFG, "cpu", 1, False, 1, probe.AUTO)
    cache.put_json(key, {k: v for k, v in first.items() if k not in ("evaluator", "probe_cached")})
    assert not probe.capabilities(CFG, cache, "cpu", 1, False, 1, seconds=0.05)["probe_cached"]
