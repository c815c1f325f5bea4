"""The seed run: one shared expert trains first on every cluster's data, then starts every expert from
its weights with the decoder frozen (or still training, with seed_decoder = "delta"). A seed run cut off
part way resumes at the seed's step, and status and export say it is one.
"""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.loop import Coordinator
from soma_edge import checkpoint
from soma_edge import config as config_mod
from soma_edge.errors import CheckpointError
from soma_edge.rundir.layout import RunDir
from soma_edge.spsa.optim import OptState
from soma_edge.wire import protocol
from tests.helpers.fakegrid import FakeGrid, equal_rates, set_fed, train_tasks


def _seeded(rd: RunDir, **fed) -> None:
    cfg = rd.load_config()
    cfg.model.kind, cfg.model.embed, cfg.model.hidden = "soma", 8, 8  # the paper's expert, with its tied E
    for k, v in fed.items():
        setattr(cfg.federation, k, v)
    rd.save_config(config_mod.validate(cfg))


def _weights_of(rd: RunDir, rel: str) -> np.ndarray:
    return checkpoint.load(rd.root / rel, "expert")["weights"]


def test_seed_run_starts_every_expert_and_freezes_the_decoder(run, tmp_path, monkeypatch):
    from soma_edge.config import expert_steps
    from soma_edge.expert import params

    equal_rates(monkeypatch)
    # Time enough that the step budget, not a slow box's clock, ends each expert's round: 37 steps of 2
    # forwards each take 0.12 s at 600 evals/s, well within the 1.5 s each of two experts gets of 3 s.
    _seeded(run, seed_steps=12, rounds=3, max_steps=40, keep_versions=5, round_seconds=3.0)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    state = Coordinator(grid, run).main()
    cfg = run.load_config()
    seed = state.seed
    assert (state.phase, seed.expert, seed.step) == ("experts", 4, 12)
    tasks = train_tasks(grid)
    seed_tasks = [t for t in tasks if t["expert"] == 4]
    all_train = sorted(h for e in range(4) for h in run.read_prepare().shards(e, "train"))
    assert seed_tasks and all(sorted(t["shards"]) == all_train for t in seed_tasks)  # every cluster's data
    requests = [
        protocol.unpack(m.content, protocol.KIND_TRAIN) for m in grid.sent if m.metadata.message_type == protocol.TRAIN
    ]
    decoders = [r["config"]["spsa"]["decoder"] for r in requests]  # the seed's rule, then the experts' frozen E
    assert decoders == ["delta"] * len(seed_tasks) + ["frozen"] * (len(requests) - len(seed_tasks))

    sw = _weights_of(run, seed.path)
    body = params.layout(cfg.model).body
    for e in range(4):
        v0 = checkpoint.load(run.root / f"experts/{e}/v0.msgpack", "expert")
        assert v0["weights"].tobytes() == sw.tobytes() and v0["step"] == 0 and v0["opt"] is None  # bit for bit
        x = state.expert(e)
        # 12 seed steps of 2 forward passes paid by 4 experts at 2 per step: 37 of the 40 steps are left
        assert (x.version, x.step, expert_steps(cfg)) == (1, 37, 37)
        w = _weights_of(run, x.path)
        assert w[body:].tobytes() == sw[body:].tobytes()  # E frozen after the seed
        assert not np.array_equal(w[:body], sw[:body])  # while the body trained
        first = next(t for t in tasks if t["expert"] == e)
        fresh = OptState.from_record(first["opt"], sw.size)  # fresh optimizer state
        assert (first["step"], first["version"], fresh.adam_m, fresh.adam_t, fresh.best_val) == (0, 0, None, 0, None)
    rounds = [m for m in run.read_metrics() if m["type"] == "round"]
    assert [m["phase"] for m in rounds] == ["seed", "experts"] and rounds[0]["seed_done"]["step"] == 12
    assert rounds[0]["mixture_val_loss"] is None and np.isfinite(rounds[1]["mixture_val_loss"])


def test_seed_decoder_delta_keeps_training_the_decoder(run, tmp_path, monkeypatch):
    from soma_edge.expert import params

    equal_rates(monkeypatch)
    # Two rounds for the experts after the seed's: on a box loaded 3x over, a round's replies can all come
    # late (seen once), and one round of the experts' is all this test needs.
    _seeded(run, seed_steps=4, rounds=3)
    cfg = run.load_config()
    cfg.model.seed_decoder = "delta"
    run.save_config(config_mod.validate(cfg))
    state = Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main()
    body = params.layout(cfg.model).body
    sw = _weights_of(run, state.seed.path)
    for e in range(4):
        assert not np.array_equal(_weights_of(run, state.expert(e).path)[body:], sw[body:])


def test_interrupted_seed_run_resumes_where_it_was(run, tmp_path, monkeypatch):
    equal_rates(monkeypatch)
    # A round of 0.01 s plans at most 8 seed steps (1.5 * 0.01 s * 1000 evals/s / 2 a step): the seed's 40
    # cannot finish in it, on any box.
    seed_steps = 40
    _seeded(run, seed_steps=seed_steps, rounds=1, round_seconds=0.01)
    Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main()
    s1 = run.read_state()
    seed1 = s1.expert(4)
    assert s1.phase == "seed" and list(s1.experts) == ["4"] and 0 < seed1.step < seed_steps
    from rich.console import Console

    from coordinator.progress import experts_table, summary

    console = Console(record=True, width=160)
    console.print(experts_table(summary(run)))
    text = " ".join(console.export_text().split())  # the title wraps to the table's width
    assert "seed run" in text and "4 (seed)" in text  # status says so
    with pytest.raises(CheckpointError, match="seed run"):  # nothing to export yet, and it says why
        from export.bundle import write

        write(run.root, tmp_path / "deploy")
    # Debris of a crashed round 2, then a restart with more, longer rounds: rounds are timed, and a slow
    # box (87 seed steps/s, once) left the experts no round when the seed's steps filled every round. At
    # 0.4 s, rounds 2-4 carry >= 3 * 35 steps on such a box, over twice the < 40 left, and round 5 is the
    # experts'; a fast box finishes the seed in round 2, and each later round is 0.4 s a node.
    run.write_metrics(run.read_metrics() + [{"type": "round", "round": 2, "debris": True}])
    set_fed(run, rounds=5, round_seconds=0.4)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    state = Coordinator(grid, run).main()
    first = train_tasks(grid)[0]
    assert (first["expert"], first["step"], first["base_sha256"]) == (4, seed1.step, seed1.sha256)
    assert state.phase == "experts" and state.seed.step == seed_steps
    assert all(x.version >= 1 for x in state.experts.values())
    rounds = [m["round"] for m in run.read_metrics() if m["type"] == "round"]
    assert rounds == list(range(1, 6))
    # The experts the seed fanned out in this run advanced in it: no warning at the end says otherwise.
    assert run.read_status()["never_advanced"] == {}
