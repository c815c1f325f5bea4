"""The capability probe times real SPSA steps (noise, evaluations, update), in the scheduler's unit."""

from __future__ import annotations

import time

import pytest

from soma_edge import spsa
from soma_edge.config import evals_per_step, from_dict
from worker import probe
from worker.cache import Cache

CFG = from_dict({"model": {"embed": 8, "hidden": 16}, "data": {"batch": 2, "seq_len": 16}, "device": "cpu"})
SLOW = 0.02  # s added to each call of the slowed part: far above a step of this model (well under 1 ms)


def _evaluator():
    return probe.make_evaluator(CFG, "cpu", threads=1, spin=False, parallel=1)


def _slowed(fn):
    def slow(*args, **kwargs):
        time.sleep(SLOW)
        return fn(*args, **kwargs)

    return slow


@pytest.mark.parametrize("part", ["noise", "_apply"])  # the direction's noise; the update of the weights
def test_the_probe_counts_the_noise_and_the_update(monkeypatch, part):
    """Slowing either part by SLOW per step must slow the probe to about evals_per_step / SLOW (one
    direction per step: the noise is drawn once per step, the update made once). A probe of bare losses
    would not notice, and one that reported steps/s would be evals_per_step times too low."""
    evaluator = _evaluator()
    fast = probe.measure(evaluator, CFG, seconds=0.2)
    per = evals_per_step(CFG.spsa)
    assert CFG.spsa.directions * CFG.spsa.accumulate == 1 and per == 3  # K = 1 with the delta rule's clean forward
    assert fast > 4 * per / SLOW  # so the slowed rate below is told apart
    monkeypatch.setattr(spsa, part, _slowed(getattr(spsa, part)))
    slow = probe.measure(evaluator, CFG, seconds=0.3)
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
    other = from_dict({**CFG.to_dict(), "spsa": {**CFG.to_dict()["spsa"], "directions": 4}})
    assert not probe.capabilities(other, cache, "cpu", 1, False, 1, seconds=0.05)["probe_cached"]
    assert len(calls) == 2
