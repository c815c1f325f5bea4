"""Guarded updates: replies that pass every protocol check but would make an expert worse.

Node "b" of a fake grid (the real ClientApp, trained for real) lies about its results; node "a" is
honest. Each attack must be refused by the best-loss bound, strike b out, and leave every expert with
a version no worse than its best so far plus the tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

from coordinator import guard
from coordinator.loop import Coordinator
from soma_edge import checkpoint, protocol
from soma_edge.rundir import BestVersion
from tests.helpers.fakegrid import FakeGrid, equal_rates, hold_first_train_reply, set_fed

TOL = 0.3  # wide enough for the honest node's noise on TINY's 4 val windows


def _rehash(res: dict, w: np.ndarray) -> None:
    res["weights"] = np.ascontiguousarray(w, dtype=res["weights"].dtype)
    res["sha256"] = protocol.weights_sha256(res["weights"])


def _scale10(coord, res):
    _rehash(res, res["weights"] * 10)


def _random(coord, res):
    w = res["weights"]
    _rehash(res, np.random.default_rng(res["step"]).standard_normal(w.size) * float(w.std()))


def _drift(coord, res):
    """An attacker that knows the coordinator's val set: each reply is 0.9 tolerance worse than the version
    it was sent, found by bisection along a fixed direction, so each single step is within tolerance."""
    e = res["expert"]
    base = coord.loop.ledger.expert(e).val_loss
    w = res["weights"].astype(np.float32)
    d = np.random.default_rng(e).standard_normal(w.size).astype(np.float32)
    lo, hi = 0.0, 1.0
    while coord.loop.evaluation.val_loss(e, w + hi * d) < base + 0.9 * TOL:
        hi *= 2
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if coord.loop.evaluation.val_loss(e, w + mid * d) < base + 0.9 * TOL else (lo, mid)
    _rehash(res, w + lo * d)


def _poison(coord_box: list, attack):
    def tamper(nid, body):
        if nid == 1001:  # node "b"
            for res in body["results"]:
                attack(coord_box[0], res)
        return body

    return tamper


def _guarded_run(run, tmp_path, monkeypatch, attack, rounds: int):
    equal_rates(monkeypatch)
    # v0 stays readable; the attacks edit the weights a weights reply carries (a lying log is refused by
    # its replay before the guard: tests/federation/test_replay.py)
    set_fed(run, rounds=rounds, guard_tolerance=TOL, max_strikes=3, keep_versions=10, reply="weights")
    box: list = []
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"], tamper=_poison(box, attack))
    coord = Coordinator(grid, run)
    box.append(coord)
    state = coord.main()
    return state, run.read_metrics(), grid


def _train_rounds(grid: FakeGrid, node: int) -> list[int]:
    """The rounds of every training request sent to `node`."""
    return [
        protocol.unpack(m.content, protocol.KIND_TRAIN)["round"]
        for m in grid.sent
        if m.metadata.message_type == protocol.TRAIN and m.metadata.dst_node_id == node
    ]


def _accepted_within_bound(metrics: list[dict], v0: dict[int, float]) -> None:
    """Replaying the metrics: every accepted version was within tolerance of its expert's best so far."""
    best = dict(v0)
    for m in metrics:
        if m["type"] == "expert" and m["accepted"] and m["val_loss"] is not None:
            assert m["val_loss"] <= best[m["expert"]] + TOL + 1e-9, m
            best[m["expert"]] = min(best[m["expert"]], m["val_loss"])


@pytest.mark.parametrize(
    # 5 rounds: b's three strikes take two rounds, or three where a pipelined round finds b's cache without the
    # version it lied about (the round sent ahead of round 1's checks, on a busy box); then one more round shows
    # that no training goes to b after it is out.
    "attack,rounds",
    [(_scale10, 5), (_random, 5), (_drift, 7)],
    ids=["scale10", "random", "drift"],
)
def test_poisoned_replies_are_refused_and_the_node_struck_out(run, tmp_path, monkeypatch, attack, rounds):
    state, metrics, grid = _guarded_run(run, tmp_path, monkeypatch, attack, rounds)
    assert state.round == rounds
    v0 = {e: checkpoint.load(run.root / f"experts/{e}/v0.msgpack", "expert")["val_loss"] for e in range(4)}
    _accepted_within_bound(metrics, v0)
    rejected = [r for m in metrics if m["type"] == "round" for r in m["rejected"]]
    assert rejected and all(r["node"] == "b" and r.get("guard") for r in rejected), rejected
    assert all(r["next_lr_scale"] == r["lr_scale"] / 2 for r in rejected)  # retrained slower, not repeated
    # b is out after its third strike, for good: no training message goes to it after the one for the
    # round that was sent ahead of the checks that struck it out, and nothing it sent later counts.
    (who,) = [k for k in state.strikes]
    assert who == "node:1001" and state.strikes[who]["count"] >= 3
    out_round = next(m["round"] for m in metrics if m["type"] == "round" and m["excluded"] == ["b"])
    assert max(_train_rounds(grid, 1001)) == out_round + 1 < rounds
    assert not [
        m for m in metrics if m["type"] == "expert" and m["round"] > out_round and m["node"] == "b" and m["accepted"]
    ]
    last = [m for m in metrics if m["type"] == "expert" and m["round"] == rounds]
    assert all(m["node"] == "a" and m["accepted"] for m in last)
    # The honest node's work stands; every expert ends no worse than its best + tolerance, and its best
    # version (never pruned) is at least as good as version 0.
    for e in range(4):
        x = state.expert(e)
        best = x.best_or_current()
        assert best.val_loss <= v0[e] and x.val_loss <= best.val_loss + TOL
        body = checkpoint.load(run.root / best.path, "expert")
        assert protocol.weights_sha256(body["weights"]) == best.sha256 and body["val_loss"] == best.val_loss


def test_a_late_poisoned_reply_strikes_and_excludes_its_node_in_the_round_that_settles_it(run, tmp_path, monkeypatch):
    """b's x10 reply to round 1 comes after its deadline; round 2 settles it: refused, b struck out, and
    round 2's metrics line says so (found when a slow CI box made the poisoned e2e worker miss round 1)."""
    equal_rates(monkeypatch)
    set_fed(run, rounds=2, deadline_slack=0.5, guard_tolerance=TOL, max_strikes=1, reply="weights")
    box: list = []
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"], tamper=_poison(box, _scale10))
    coord = Coordinator(grid, run)
    box.append(coord)
    hold_first_train_reply(grid, monkeypatch, 1001)
    coord.main()
    r2 = next(m for m in run.read_metrics() if m["type"] == "round" and m["round"] == 2)
    assert r2["rejected"] and all(x["node"] == "b" for x in r2["rejected"]) and r2["excluded"] == ["b"], r2


def test_strikes_persist_across_a_coordinator_restart(run, tmp_path, monkeypatch):
    """Strikes commit with the round: a node excluded before a restart is excluded after it (same identity)."""
    state, _, _ = _guarded_run(run, tmp_path, monkeypatch, _scale10, 2)
    assert state.strikes["node:1001"]["count"] >= 3
    set_fed(run, rounds=3)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])  # b is honest now, but its strikes stand
    state = Coordinator(grid, run).main()
    assert state.round == 3 and _train_rounds(grid, 1001) == []


def test_an_honest_overshoot_is_refused_then_retrained_slower_and_forgiven(run, tmp_path, monkeypatch):
    """One bad reply is a strike and halves lr; the next version that improves the best takes it off."""
    calls = {"n": 0}

    def once(coord, res):
        calls["n"] += 1
        if calls["n"] == 1:
            _scale10(coord, res)

    state, metrics, _ = _guarded_run(run, tmp_path, monkeypatch, once, 3)
    rejected = [r for m in metrics if m["type"] == "round" for r in m["rejected"]]
    assert len(rejected) == 1 and rejected[0]["strike"] == 1
    improved = [
        m
        for m in metrics
        if m["type"] == "expert" and m["accepted"] and m["node"] == "b" and m["best_version"] == m["version"]
    ]
    assert improved  # b did honest work that set a new best ...
    assert state.strikes["node:1001"]["count"] == 0  # ... so its strike was forgiven


def test_guard_verdict_bounds_by_the_best_not_the_current_version():
    best = BestVersion(version=2, sha256="0" * 64, path="experts/0/v2.msgpack", val_loss=3.0)
    assert guard.verdict(3.1, best, 0.1) is None
    assert "worse than the expert's best 3.0000 (v2)" in guard.verdict(3.1001, best, 0.1)
    strikes: dict = {}
    assert [guard.strike(strikes, "key:ab", "w", "x", r) for r in (1, 2)] == [1, 2]
    assert not guard.excluded(strikes, "key:ab", 3) and guard.excluded(strikes, "key:ab", 2)
    assert not guard.excluded(strikes, "key:ab", 0)  # 0: never exclude
    guard.forgive(strikes, "key:ab")
    guard.forgive(strikes, "key:cd")  # unknown: nothing to forgive
    assert strikes["key:ab"]["count"] == 1 and "key:cd" not in strikes


def test_export_takes_the_best_version_by_default_and_latest_on_request(run, tmp_path, monkeypatch):
    from export.bundle import write

    state, _, _ = _guarded_run(run, tmp_path, monkeypatch, _drift, 1)  # b's drifted versions are accepted ...
    best = {int(e): x.best_or_current().version for e, x in state.experts.items()}
    latest = {int(e): x.version for e, x in state.experts.items()}
    assert best != latest  # ... but are not the best: v0 stays the best of b's experts
    for version, want in (("best", best), ("latest", latest)):
        manifest = write(run.root, tmp_path / version, version=version)
        assert {e["id"]: e["version"] for e in manifest["experts"]} == want
        assert manifest["run"]["version"] == version


def test_export_refuses_an_unknown_version_choice(run, tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "export.cli",
            "onnx",
            str(run.root),
            "--out",
            str(tmp_path / "b"),
            "--version",
            "newest",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: --version must be one of best, latest, got 'newest'"
    ]
