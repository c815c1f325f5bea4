"""The speculating trainer (worker.speculation): a worker goes on training while its reply is in flight,
and the next round's ClientApp takes the steps it ran. With the fake Grid (tests/helpers/fakegrid.py):
real ClientApp, real trainer processes, real ORT training."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from coordinator.loop import Coordinator
from soma_edge import codec
from soma_edge.config import Config
from tests.helpers.fakegrid import FakeGrid, equal_rates, set_fed, step_budgets_bind
from worker import speculation
from worker.trainer import TrainReport

NODES = ["a", "b", "c", "d"]  # the run's 4 experts, one on each node
# Each expert takes its step budget (`step_budgets_bind`), and 0.05 s rounds make it 38 steps (18 with two on a
# node: 1000 evals/s claimed, 2 a step, times HEADROOM): enough to train ahead and claim, at a quarter of 0.2 s's.
ROUND_SECONDS = 0.05


def _no_trainer_left(root: Path, within: float = 20.0) -> bool:
    until = time.monotonic() + within
    while time.monotonic() < until:
        if not any(speculation.running(p) for p in root.iterdir() if p.is_dir()):
            return True
        time.sleep(0.1)
    return False


def _with_and_without(
    run, tmp_path, monkeypatch, rounds: int, request=None, nodes=NODES, per_round: int = 4, **fed
) -> tuple[dict, dict, list[bool]]:
    """The experts' final hashes with speculation on and off, from one prepared run on `nodes`, and whether
    each claim got the trainer's results. Each expert takes exactly its step budget (`step_budgets_bind`);
    `request(body)`, where given, edits every train request's body; `fed`: more federation settings, under
    which `per_round` experts advance each round."""
    equal_rates(monkeypatch)
    set_fed(run, rounds=rounds, min_nodes=len(nodes), deadline_slack=60.0, round_seconds=ROUND_SECONDS, **fed)
    cfg = run.load_config()
    cfg.spsa.plateau = False  # the lr scale stays, so every round's key is the one its trainer ran
    run.save_config(cfg)
    claims: list[bool] = []
    real_claim = speculation.claim

    def counted(*args, **kwargs):
        res = real_claim(*args, **kwargs)
        claims.append(res is not None)
        return res

    monkeypatch.setattr(speculation, "claim", counted)
    ends = {}
    for speculate in (1, 0):
        rd = type(run)(tmp_path / f"copy-{speculate}")
        shutil.copytree(run.root, rd.root)
        grid = FakeGrid(tmp_path / f"nodes-{speculate}", nodes)
        for node in grid.nodes.values():
            node["speculate"] = speculate
        step_budgets_bind(grid, request)
        state = Coordinator(grid, rd).main()
        ends[speculate] = {e: x.sha256 for e, x in state.experts.items()}
        assert all(m["accepted"] == per_round for m in rd.read_metrics() if m["type"] == "round")
    return ends[1], ends[0], claims


@pytest.mark.parametrize("nodes", [NODES, ["a", "b"]], ids=["one-expert-each", "two-experts-each"])
def test_speculated_rounds_end_bit_for_bit_where_fresh_ones_do(run, tmp_path, monkeypatch, nodes):
    """From round 2 on, every round is trained by the trainer the round before started (claims), whether a
    node holds one expert or several; the experts end bit for bit where workers without speculation end,
    and the run's end stops every trainer. The last round's requests name no experts next round (nothing is
    trained ahead of a round never sent), and no other round's do."""
    named = []

    def seen(body):
        named.append((body["round"], body.get("next_experts")))
        return body

    on, off, claims = _with_and_without(run, tmp_path, monkeypatch, rounds=4, request=seen, nodes=nodes)
    assert on == off
    assert {r for r, nxt in named if nxt == []} == {4} and all(nxt is None for r, nxt in named if r < 4), named
    # Round 1 brings version 0's optimizer state (no claim asked); rounds 2, 3 and 4 of every node are claimed.
    assert claims == [True] * 3 * len(nodes), claims
    assert _no_trainer_left(tmp_path / "nodes-1")


def test_the_trainer_trains_the_experts_the_request_names_for_the_next_round(run, tmp_path, monkeypatch):
    """Experts in turn (min_expert_seconds = round_seconds: 2 of the 4 a round, one on each node): rounds
    alternate {0, 1} and {2, 3}. Each request names the node's expert of the next round, from the version
    the node made two rounds before, and the trainer trains that one, not the one it just sent: every round
    from round 3 on is claimed (rounds 1 and 2 bring version 0's optimizer state), bit for bit."""
    on, off, claims = _with_and_without(
        run, tmp_path, monkeypatch, rounds=5, nodes=["a", "b"], per_round=2, min_expert_seconds=ROUND_SECONDS
    )
    assert on == off
    assert claims == [True] * 3 * 2, claims
    assert _no_trainer_left(tmp_path / "nodes-1")


def test_a_round_of_another_key_stops_the_trainer_and_trains_fresh(run, tmp_path, monkeypatch):
    """When the next request differs from what the trainer ran (here: its config, in a key the worker
    does not train by), the ClientApp refuses the speculation, trains from the request's base itself,
    and the experts still end where workers without speculation end."""

    def new_config(body):
        fed = {**body["config"]["federation"], "round_seconds": 1.0 + body["round"]}
        return {**body, "config": {**body["config"], "federation": fed}}

    on, off, claims = _with_and_without(run, tmp_path, monkeypatch, rounds=3, request=new_config)
    assert on == off
    assert claims and not any(claims)
    assert _no_trainer_left(tmp_path / "nodes-1")


def test_a_task_of_another_key_starts_again_and_the_others_keep_their_steps(run, tmp_path, monkeypatch):
    """Round 3 caps expert 0 at 1 step, below what the trainer ran ahead of the request (its node's first
    expert, trained first; a node's rate measured lower does this, and a refused version or another lr scale
    is the same case): that expert starts again from the version the task names, in the cache, and the
    node's other expert keeps the steps it ran ahead. Every round is still claimed, and the experts end bit
    for bit where workers without speculation end."""

    def capped(body):
        if body["round"] != 3:
            return body
        return {**body, "tasks": [{**t, "steps": 1} if t["expert"] == 0 else t for t in body["tasks"]]}

    on, off, claims = _with_and_without(run, tmp_path, monkeypatch, rounds=4, request=capped, nodes=["a", "b"])
    assert on == off
    assert claims == [True] * 3 * 2, claims
    assert _no_trainer_left(tmp_path / "nodes-1")


def _key(**kw) -> speculation.Key:
    base = dict(node=1, run_id="r", expert=0, version=2, base_sha256="a" * 64, step=10, lr_scale=1.0)
    return speculation.Key(**{**base, "shards": ("b" * 64,), "reply_dtype": "float32", "config": "c" * 64, **kw})


def test_a_claim_on_no_live_trainer_trains_here_and_stops_it(tmp_path):
    """A state left by a trainer that died (its lock is free), or a trainer of another key: the claim gives
    the round back to the ClientApp at once, and no trainer is wanted any more."""
    folder = tmp_path / speculation.FOLDER
    folder.mkdir()
    (folder / "current.json").write_text(json.dumps({"id": "x", "pid": os.getpid()}))
    (folder / "state.json").write_text(json.dumps({"id": "x", "pid": os.getpid(), "keys": [_key().record()]}))
    t0 = time.monotonic()
    assert speculation.claim(tmp_path, [_key()], [{"steps": 5}], 1.0) is None
    assert time.monotonic() - t0 < 2.0
    assert json.loads((folder / "current.json").read_text()) == {}
    assert speculation.claim(tmp_path / "none", [_key()], [{"steps": 5}], 1.0) is None


def test_a_trainer_that_is_not_wanted_or_cannot_read_its_spec_exits(tmp_path):
    """A trainer whose spec is not the one current.json names (the run moved on while it started) exits
    without training; a corrupt spec gets one warning line and exit status 2."""
    folder = tmp_path / speculation.FOLDER
    folder.mkdir()
    (folder / "current.json").write_text(json.dumps({"id": "other", "pid": 1}))
    spec = folder / "spec-x.msgpack"
    spec.write_bytes(codec.encode({"id": "x"}, speculation.SPEC_KIND))
    assert speculation.main([str(spec)]) == 0
    assert not spec.exists() and not (folder / "state.json").exists()
    spec.write_bytes(b"\x00not msgpack")
    proc = subprocess.run([sys.executable, "-m", "worker.speculation", str(spec)], capture_output=True, text=True)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "the speculating trainer did not start" in err[0], proc.stderr


def _fake_trainer(folder: Path, then: str) -> subprocess.Popen:
    """A process that holds the trainer's lock and says it trains round `_key()`; once claimed, it runs
    `then` (Python, with `claim`: the claim's record, and `folder`)."""
    script = (
        "import fcntl, json, pathlib, sys, time\n"
        "folder = pathlib.Path(sys.argv[1]); f = open(folder / 'lock', 'a+'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        "print(1, flush=True)\n"
        "while not (folder / 'claim.json').exists(): time.sleep(0.02)\n"
        "claim = json.loads((folder / 'claim.json').read_text()); (folder / 'claim.json').unlink()\n"
        + then
        + "\ntime.sleep(60)\n"
    )
    trainer = subprocess.Popen([sys.executable, "-c", script, str(folder)], stdout=subprocess.PIPE)
    assert trainer.stdout.readline().strip() == b"1"
    (folder / "current.json").write_text(json.dumps({"id": "x", "pid": trainer.pid}))
    (folder / "state.json").write_text(json.dumps({"id": "x", "pid": trainer.pid, "keys": [_key().record()]}))
    return trainer


def test_a_trainer_whose_answer_does_not_read_gives_the_round_back(tmp_path):
    """A corrupt answer, or the result of another round: the claim gives the round back at once, in one
    line, and no trainer is wanted any more."""
    folder = tmp_path / speculation.FOLDER
    folder.mkdir()
    for then in (
        "(folder / f\"result-{claim['nonce']}.msgpack\").write_bytes(b'\\x00garbage')",
        "import numpy; from soma_edge import codec\n"
        "body = codec.encode({'results': [{'expert': 9, 'base_sha256': 'f' * 64}]}, 'speculated_result')\n"
        "(folder / f\"result-{claim['nonce']}.msgpack\").write_bytes(body)",
    ):
        trainer = _fake_trainer(folder, then)
        try:
            t0 = time.monotonic()
            assert speculation.claim(tmp_path, [_key()], [{"steps": 5}], 30.0) is None
            assert time.monotonic() - t0 < 5.0
            assert json.loads((folder / "current.json").read_text()) == {}
        finally:
            trainer.kill()
            trainer.wait()


def test_a_trainer_killed_mid_round_gives_the_round_back(tmp_path):
    """The ClientApp has claimed the round, and the trainer dies (kill -9) before its result: the claim
    gives the round back within a second or two, and the ClientApp trains it."""
    folder = tmp_path / speculation.FOLDER
    folder.mkdir()
    trainer = _fake_trainer(folder, "pass")
    try:
        killer = threading.Timer(1.0, trainer.kill)
        killer.start()
        t0 = time.monotonic()
        assert speculation.claim(tmp_path, [_key()], [{"steps": 5}], 30.0) is None
        assert 0.9 < time.monotonic() - t0 < 5.0
        assert not (folder / "claim.json").exists()  # the claim was made, and taken
    finally:
        trainer.kill()
        trainer.wait()


def test_a_clientapp_whose_superexec_is_gone_starts_no_trainer(tmp_path, monkeypatch):
    """A ClientApp that finishes its round after its worker was stopped (its SuperExec gone, the process
    handed to another parent) starts no trainer: none would be claimed, and one would watch the wrong parent
    and outlive the worker (seen after a kill -9 of `soma-coord start`)."""
    monkeypatch.setattr(speculation.os, "getppid", lambda: 1)
    res = {"version": 3, "sha256": "d" * 64, "step": 12}
    t = {"expert": 0, "version": 2, "base_sha256": "a" * 64, "step": 10, "steps": 5}
    speculation.spawn(tmp_path, [(_key(), t, res)], {}, 1.0, {})
    folder = tmp_path / speculation.FOLDER
    assert not list(folder.glob("spec-*")) and not speculation.running(tmp_path)


def test_a_request_s_next_experts_are_read_only_when_well_formed():
    task = {"expert": 3, "version": 2, "base_sha256": "a" * 64, "step": 40, "steps": 20, "lr_scale": 1.0}
    task["shards"] = ["b" * 64]
    assert speculation.following({}) is None  # none named: the same experts next round
    assert speculation.following({"next_experts": [3, 1], "next_tasks": [task]}) == ([3, 1], [task])
    for bad in (
        {"next_experts": "3"},
        {"next_experts": [3], "next_tasks": [{**task, "step": "40"}]},
        {"next_experts": [3], "next_tasks": [{**task, "weights": [1.0]}]},  # a base of its own: not trained ahead
        {"next_experts": [3], "next_tasks": {"expert": 3}},
    ):
        assert speculation.following(bad) is None, bad


def test_the_trainer_goes_on_with_the_named_experts_in_their_order():
    """After a round of experts 0 and 2: next round names 5, 2 (and a task for 5, from the node's version);
    0 is dropped, and a task for an expert the list does not name is ignored."""
    task = {"expert": 5, "version": 3, "base_sha256": "d" * 64, "step": 30, "steps": 20, "lr_scale": 1.0}
    task["shards"] = ["e" * 64]
    stray = {**task, "expert": 7}
    keys = [_key(expert=0), _key(expert=2)]
    named = speculation._named(keys, ([5, 2], [task, stray]))
    assert [(k.expert, t) for k, t in named] == [(5, task), (2, None)]
    assert named[0][0] == speculation.key_for(keys[0], task)


def _claimed_seconds(tmp_path: Path, monkeypatch, claim_extra: dict) -> tuple[float, bool]:
    """A trainer of one expert with a budget of 0.3 s trains it ahead (a fake loop: each call runs the
    seconds it is given at once), then takes a claim of budget 0.3 s; (the seconds its result reports,
    whether it goes on to another round)."""

    def loop(state, data, cfg, evaluator, *, expert, steps, seconds, stop):
        return TrainReport(steps=1, seconds=seconds, loss=1.0, forward_evals=3)

    def finish(t, cfg, state, start, base_decoder, rep, dtype):
        return {
            "expert": t["expert"],
            "version": 3,
            "sha256": "d" * 64,
            "step": 12,
            "seconds": rep.seconds,
            "weights": None,
            "opt": None,
        }

    fake = SimpleNamespace(
        train_loop=loop,
        finish=finish,
        as_reply=lambda t, r: r,
        keep=lambda *a: None,
        base_state=lambda *a: None,
        decoder_base=lambda *a: None,
    )
    monkeypatch.setattr(speculation, "task", fake)
    folder = tmp_path / speculation.FOLDER
    folder.mkdir(parents=True)
    (folder / "current.json").write_text(json.dumps({"id": "x", "pid": os.getpid()}))
    t = {"expert": 0, "version": 2, "base_sha256": "a" * 64, "step": 10, "steps": 100}
    spec = {"budget": 0.3, "watch": os.getpid(), "id": "x"}
    trainer = speculation.Trainer(
        folder, spec, Config(), None, [speculation.Job(_key(), t, SimpleNamespace(step=10), None)], None
    )
    claim = {"nonce": "n", "keys": [_key().record()], "tasks": [t], "budget": 0.3, **claim_extra}
    later = threading.Timer(0.3, lambda: (folder / "claim.json").write_text(json.dumps(claim)))
    later.start()
    goes_on = trainer._round()
    later.join()
    got = codec.decode((folder / "result-n.msgpack").read_bytes(), speculation.RESULT_KIND)
    return got["results"][0]["seconds"], goes_on


def test_a_claim_naming_no_next_experts_counts_its_budget_from_the_request(tmp_path, monkeypatch):
    """The run's last round (the request names no experts next round): the seconds a trainer ran ahead of
    the request come on top of its budget, so a node that trained ahead does not finish first and wait
    for the others, and the trainer stops after it. Any other round: the budget counts them."""
    assert _claimed_seconds(tmp_path / "mid", monkeypatch, {}) == (pytest.approx(0.3), True)
    assert _claimed_seconds(tmp_path / "last", monkeypatch, {"next_experts": [], "next_tasks": []}) == (
        pytest.approx(0.6),
        False,
    )
