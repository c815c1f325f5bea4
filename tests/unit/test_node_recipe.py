"""A node's recipe: the run's with its own probes (soma_edge.spsa.recipe.Probes), chosen by `--recipe`
(worker.device_recipe) and, on an accelerator, measured; and an expert that moves between two recipes keeps
its weights and Adam moments, and no step of the new one overshoots."""

from __future__ import annotations

import numpy as np
import pytest

from soma_edge.config import Config, from_dict
from soma_edge.engine.evaluator import mean_loss
from soma_edge.expert import params
from soma_edge.spsa import recipe as recipe_mod
from soma_edge.spsa.optim import State
from soma_edge.spsa.recipe import Choice, Probes, Recipe
from worker import device_recipe, probe
from worker.cache import Cache
from worker.trainer import train

TINY = from_dict({"model": {"embed": 8, "hidden": 16}, "data": {"batch": 4, "seq_len": 16}, "device": "cpu"})
DATA = np.frombuffer(b"".join(bytes([i % 89 + 33]) * (i % 5 + 1) for i in range(6000)), dtype=np.uint8)


def test_probes_replace_only_their_four_settings_and_read_back():
    p = Probes(16, False, "rank1", 1.0)
    cfg = p.apply(Config())
    assert (cfg.spsa.directions, cfg.spsa.split_rows, cfg.spsa.noise, cfg.spsa.density) == (16, False, "rank1", 1.0)
    diff = Recipe.of(Config()).differences(Recipe.of(cfg))
    assert [d.split(":")[0] for d in diff] == ["spsa.directions", "spsa.split_rows", "spsa.noise"]
    assert Probes.from_record(p.to_record(), Config()) == p == Probes.of(cfg)
    assert Recipe.of(cfg).apply(Config()) == cfg  # a log's recipe gives back its node's config
    assert p.describe() == "K=16 rank1 directions on the whole batch each"


@pytest.mark.parametrize(
    "rec, says",
    [
        (None, "not a probes record"),
        ({"directions": 4, "split_rows": False, "noise": "rademacher"}, "not a probes record"),
        ({"directions": "4", "split_rows": False, "noise": "rademacher", "density": 1.0}, "must be an int"),
        ({"directions": 4, "split_rows": 1, "noise": "rademacher", "density": 1.0}, "must be an int, a bool"),
        ({"directions": 4, "split_rows": False, "noise": "uniform", "density": 1.0}, "noise one of"),
        ({"directions": 4, "split_rows": False, "noise": "rank1", "density": 0.5}, "rank1' needs spsa.density"),
        ({"directions": 3, "split_rows": True, "noise": "rademacher", "density": 1.0}, "multiple of spsa.directions"),
        ({"directions": 0, "split_rows": False, "noise": "rademacher", "density": 1.0}, "a node may take 1 to 256"),
        ({"directions": 512, "split_rows": False, "noise": "rademacher", "density": 1.0}, "512 directions, where"),
    ],
)
def test_a_bad_probes_record_is_one_clear_error(rec, says):
    with pytest.raises(ValueError, match="probes") as got:
        Probes.from_record(rec, Config())
    assert says in str(got.value) and "\n" not in str(got.value)


@pytest.mark.parametrize(
    "text, want", [("auto", Choice("auto")), ("run", Choice("run")), ("device:64", Choice("device", 64))]
)
def test_recipe_option_parses(text, want):
    assert recipe_mod.parse(text) == want and str(want) == text


@pytest.mark.parametrize("text", ["gpu", "device:", "device:0", "device:x", "run:4", "auto:8", "device:257"])
def test_recipe_option_refuses_what_it_does_not_take(text):
    with pytest.raises(ValueError, match="expected auto, run, device or device:K"):
        recipe_mod.parse(text)


def test_the_choice_is_the_knee_of_the_measured_directions_rate_then_the_faster_noise():
    """A device whose step costs the same up to K = 16 and doubles after: 16 is the knee (32 and 64 give no
    more directions/s); rank-1 is taken at 16 because it steps faster there."""
    cost = {4: 1.0, 8: 1.0, 16: 1.05, 32: 2.1, 64: 4.2}
    seen = []

    def rate(cfg):
        seen.append((cfg.spsa.directions, str(cfg.spsa.noise), cfg.spsa.split_rows, cfg.spsa.density))
        return (1.2 if cfg.spsa.noise == "rank1" else 1.0) * 100 / cost[cfg.spsa.directions]

    probes, table = device_recipe.choose(Config(), rate)
    assert probes == Probes(16, False, "rank1", 1.0)
    assert [s[0] for s in seen] == [4, 8, 16, 32, 64, 16] and {s[2:] for s in seen} == {(False, 1.0)}
    assert len(table) == 6 and "K=16 rank1" in device_recipe.summary(probes, table)
    # A CPU-like device, where a step costs in proportion to K, gets the smallest K; dense noise when rank-1 is slower.
    probes, _ = device_recipe.choose(Config(), lambda c: (0.9 if c.spsa.noise == "rank1" else 1.0) / c.spsa.directions)
    assert probes == Probes(4, False, "rademacher", 1.0)


def test_auto_measures_on_an_accelerator_only_and_device_k_is_not_measured():
    def never(cfg):
        raise AssertionError("measured")

    cpu, cuda = ["CPUExecutionProvider"], ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert device_recipe.probes_for(Choice("auto"), TINY, cpu, never) == (Probes.of(TINY), [])
    assert device_recipe.probes_for(Choice("run"), TINY, cuda, never) == (Probes.of(TINY), [])
    assert device_recipe.probes_for(Choice("device", 8), TINY, cuda, never) == (Probes(8, False, "rademacher", 1.0), [])
    assert device_recipe.measured(Choice("auto"), cuda) and device_recipe.measured(Choice("device"), cpu)


def test_capabilities_announce_the_probes_and_measure_them(tmp_path):
    """`--recipe device` measures the candidates on this device (here the CPU EP, on a tiny model), and the
    announced rate is of the chosen probes' steps; a train request's config, which already is that recipe,
    finds the same measurement in the cache."""
    cache = Cache(tmp_path)
    caps = probe.capabilities(TINY, cache, "cpu", 1, False, 1, 0.3, Choice("device"))
    chosen = Probes.from_record(caps["probes"], TINY)
    assert chosen.directions in device_recipe.CANDIDATES and not chosen.split_rows
    assert "measured steps/s by K: 4:" in caps["recipe_line"] and caps["evals_per_s"] > 0
    again = probe.capabilities(chosen.apply(TINY), cache, "cpu", 1, False, 1, 0.3, probe.AS_SENT)
    assert again["probe_cached"] and again["probes"] == caps["probes"]
    run = probe.capabilities(TINY, cache, "cpu", 1, False, 1, 0.3, Choice("auto"))  # the CPU keeps the run's
    assert run["probes"] == Probes.of(TINY).to_record() and run["recipe_line"] == Probes.of(TINY).describe()


@pytest.mark.parametrize("first, then", [("run", "device"), ("device", "run")], ids=["to-gpu-sized", "to-run"])
def test_an_expert_moved_to_another_recipe_keeps_its_moments_and_no_step_overshoots(first, then):
    """An expert trains 150 steps under one recipe, then 60 under the other, carrying its weights, step and
    optimizer state as a move between nodes does. Adam's moments are per weight, whatever K, so they carry
    over as they are; a step's size is lr · m̂/√v̂, which a change in the estimate's spread can push to about
    (1 - β1)/√(1 - β2) ≈ 3.2 lr at most. No body weight may move more than 10 lr in one step, and the
    held-out loss keeps falling on the new recipe."""
    recipes = {"run": TINY, "device": Probes(8, False, "rademacher", 1.0).apply(TINY)}
    held_out = DATA[-2000:]
    state = State(params.init(TINY.model, 0))
    ev = probe.make_evaluator(TINY, "cpu", 1, False, 1)
    train(state, DATA[:-2000], recipes[first], ev, steps=150)
    before = _loss(ev, state, held_out)
    body, lr = params.layout(TINY.model).body, TINY.spsa.lr
    worst = 0.0
    for _ in range(60):
        w = state.weights[:body].copy()
        train(state, DATA[:-2000], recipes[then], ev, steps=1)
        worst = max(worst, float(np.max(np.abs(state.weights[:body] - w))))
    assert 0 < worst <= 10 * lr, worst
    assert _loss(ev, state, held_out) < before


def _loss(ev, state, data) -> float:
    n = TINY.data.seq_len + 1
    windows = np.stack([data[i * n : (i + 1) * n] for i in range(len(data) // n)]).astype(np.int64)
    return mean_loss(ev, state.weights, windows[:, :-1], windows[:, 1:])
