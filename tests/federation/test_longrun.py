"""Long runs: strikes judged per round, a refusal that costs its expert alone, finished experts.

The rule tests run the strike table alone over many rounds (64 experts a node, as at N = 256 on 4 workers);
the runs use the fake grid's real ClientApps.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from coordinator import finish, guard
from coordinator.loop import Coordinator
from coordinator.start import reopen_finished
from soma_edge.config import FederationConfig
from soma_edge.rundir.metrics import Rejection
from soma_edge.rundir.state import ExpertRecord
from soma_edge.wire import protocol
from tests.helpers.fakegrid import FakeGrid, claim_log, equal_rates, set_fed
from worker import task as task_mod

MAX = FederationConfig().max_strikes  # the shipped limit
# Rounds for the runs about what is refused, struck, finished or kept, not about how far the experts train:
# each node trains for round_seconds, and at the fake grid's 0.2 s a round of two nodes took 0.4 s. The
# honest versions must still pass the guard: 0.1 s plans 38 steps an expert (75 at 0.2 s). (The run whose
# strike must be forgiven keeps 0.2 s: forgiving takes a version that clearly raises its bar.)
SHORT_ROUND = 0.1


def _season(pattern: list[tuple[int, int, int, int]]) -> list[int]:
    """A node's strike count after each round of (refused, of them far, accepted, raised) verdicts, at the
    shipped limit; it stops at the round that excludes it."""
    strikes: dict = {}
    counts = []
    for r, (refused, far, accepted, raised) in enumerate(pattern, 1):
        rejected = [Rejection(expert=e, node="n", reason="worse") for e in range(refused)]
        guard.judge_round(strikes, "key:n", "n", guard.Tally(rejected, far, accepted, raised), r)
        counts.append(guard.count(strikes, "key:n"))
        if guard.excluded(strikes, "key:n", MAX):
            break
    return counts


def test_an_honest_node_of_64_experts_with_refusals_is_never_excluded():
    """Some of its 64 experts refused in most rounds (3 in one round: 3 strikes at once under a per-refusal
    rule), the others raising their bars: a near miss alone is no strike, and a clean round takes one off."""
    honest = [(3, 0, 61, 20), (1, 0, 63, 12), (0, 0, 64, 9), (2, 1, 62, 8), (1, 0, 63, 5), (1, 0, 63, 4)] * 4
    counts = _season(honest)
    assert len(counts) == len(honest) and max(counts) < MAX and counts[:2] == [1, 0]


def test_liars_are_excluded_however_much_honest_work_they_do():
    # 3 poisoned a round beside 60 honest versions that raise their bars: struck every round, never forgiven
    assert _season([(3, 3, 60, 60)] * 10) == [1, 2, 3]
    # one poisoned a round is enough: a lie that harms is refused far from the bar
    assert _season([(1, 1, 63, 63)] * 10) == [1, 2, 3]
    # two near misses a round are no near miss
    assert _season([(2, 0, 63, 63)] * 10) == [1, 2, 3]
    # most of its versions poisoned: a strike each, out in its first round
    assert _season([(40, 40, 24, 24)] * 10) == [40]
    # ... and only refusals, even one near miss: the same
    assert _season([(3, 0, 0, 0)] * 10) == [3] and _season([(1, 0, 0, 0)] * 4) == [1, 2, 3]


def test_a_round_with_refusals_takes_one_strike_and_keeps_its_other_results(run, tmp_path, monkeypatch, caplog):
    """One node trains all 4 experts; 2 of its round-1 versions are poisoned. Judged one by one, those were
    2 strikes (out, at max_strikes = 2) and its later results dropped; judged together, one strike for the
    round, its 2 good versions accepted, and the strike forgiven by the clean rounds after it."""
    equal_rates(monkeypatch)
    set_fed(run, rounds=3, min_nodes=1, max_strikes=2, reply="weights", val_windows=16)

    def tamper(nid, body):
        if body["round"] == 1:
            for res in body["results"]:
                if res["expert"] in (0, 1):
                    res["weights"] = np.ascontiguousarray(res["weights"] * 10)
                    res["sha256"] = protocol.weights_sha256(res["weights"])
        return body

    grid = FakeGrid(tmp_path / "nodes", ["a"], tamper=tamper)
    with caplog.at_level(logging.INFO, logger="soma.coord"):
        state = Coordinator(grid, run).main()
    r1 = next(m for m in run.read_metrics() if m["type"] == "round" and m["round"] == 1)
    assert sorted(x["expert"] for x in r1["rejected"]) == [0, 1] and all(x["strike"] == 1 for x in r1["rejected"])
    assert r1["accepted"] == 2 and r1["excluded"] == []
    assert "2 of its 4 versions refused by the guard (experts [0, 1]), one strike for the round" in caplog.text
    assert state.round == 3 and state.strikes["node:1000"]["count"] == 0  # forgiven by a clean round


def test_the_worker_cache_keeps_the_base_across_refusals_at_keep_versions_1(tmp_path):
    from worker.cache import Cache

    c = Cache(tmp_path / "c", keep_versions=1)

    def put(v, fill):
        w = np.full(16, fill, dtype=np.float32)
        sha = protocol.weights_sha256(w)
        c.put_weights(sha, expert=0, version=v, step=v, weights=w, opt=None, run_id="r")
        return sha

    base = put(3, 3.0)
    c.pin("r", 0, [base, None])  # the task trains from v3
    refused = put(4, 4.0)  # its result, cached before the guard judges it
    c.pin("r", 0, [base, None, refused])
    assert set(c.weights()) == {base, refused}
    c.pin("r", 0, [base])  # refused: the next task trains from v3 again
    again = put(4, 4.5)  # the retrained v4 pushes the refused one out, never the base
    assert set(c.weights()) == {base, again}
    # planned ahead of the checks: the task trains from the claimed v4, and the accepted v3 stays under it
    c.pin("r", 0, [again, base])
    put(5, 5.0)
    assert {base, again} <= set(c.weights())
    c.pin("r", 0, [again])  # v4 accepted: v3 may go
    put(5, 5.5)
    assert base not in c.weights() and again in c.weights()


def test_a_refused_claim_at_keep_versions_1_costs_no_cache_miss(run, tmp_path, monkeypatch, caplog):
    """Round 2's version of expert 0 is refused after round 3 went out from it (pipelined): round 3's result
    is dropped, and round 4 trains expert 0 from the version the node kept, with no miss and no resend."""
    equal_rates(monkeypatch)
    set_fed(run, rounds=5, keep_versions=1, reply="weights", val_windows=16, max_strikes=0, round_seconds=SHORT_ROUND)
    missing: list = []
    calls = {"n": 0}
    honest = task_mod.train_loop

    def lying(state, data, cfg, evaluator, *, expert=0, **kw):  # the node caches what it sends, lie and all
        rep = honest(state, data, cfg, evaluator, expert=expert, **kw)
        calls["n"] += expert == 0
        if expert == 0 and calls["n"] == 2:
            state.weights[:] = state.weights * 10
        return rep

    def record(nid, body):
        missing.extend(body["missing"]["weights"])
        return body

    monkeypatch.setattr(task_mod, "train_loop", lying)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"], tamper=record)
    with caplog.at_level(logging.INFO, logger="soma.coord"):
        Coordinator(grid, run).main()
    lines = [m for m in run.read_metrics() if m["type"] == "expert" and m["expert"] == 0]
    by_round = {m["round"]: m for m in lines}
    assert not by_round[2]["accepted"] and "which was refused" in by_round[3]["reason"]
    # rounds 4 and 5 train it from the kept version: accepted, or (honest noise) refused by the guard
    assert all(by_round[r]["accepted"] or by_round[r]["reason"].startswith("rejected:") for r in (4, 5))
    assert missing == [] and "cache miss" not in caplog.text


def test_finish_rules_count_verdicts():
    fed = FederationConfig(finish_patience=3, finish_min_delta=0.01, finish_refusals=2)
    x = ExpertRecord(version=0, sha256="0" * 64, path=None, mark=3.0)
    assert finish.after_accept(x, 2.95, fed) is None and x.mark == 2.95 and x.stale == 0  # a gain
    assert finish.after_accept(x, 2.945, fed) is None and x.stale == 1  # under min_delta: no gain
    assert finish.after_refusal(x, fed) is None and x.refusals == 1
    assert finish.after_accept(x, 2.90, fed) is None and (x.stale, x.refusals) == (0, 0)  # a gain resets both
    assert finish.after_refusal(x, fed) is None
    assert finish.after_refusal(x, fed).startswith("refusals: 2 versions refused")
    y = ExpertRecord(version=0, sha256="0" * 64, path=None, mark=2.0)
    for _ in range(2):
        assert finish.after_accept(y, 2.1, fed) is None
    assert finish.rule_of(finish.after_accept(y, 1.995, fed)) == finish.PATIENCE
    off = FederationConfig(finish_patience=0, finish_refusals=0)
    z = ExpertRecord(version=0, sha256="0" * 64, path=None, mark=2.0)
    assert all(finish.after_accept(z, 2.5, off) is None and finish.after_refusal(z, off) is None for _ in range(50))
    assert finish.reopen(y) and y.finished is None and (y.stale, y.refusals) == (0, 0) and not finish.reopen(y)


def test_a_run_whose_experts_all_finish_ends_with_its_line_and_reopens(run, tmp_path, monkeypatch, caplog):
    """No version can gain 10 nats/byte: every expert finishes by patience after its first version, the run
    ends before its next round, and --reopen's edit trains them again on resume."""
    equal_rates(monkeypatch)
    set_fed(run, rounds=4, finish_patience=1, finish_min_delta=10.0, round_seconds=SHORT_ROUND)
    with caplog.at_level(logging.INFO, logger="soma.coord"):
        state = Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main()
    assert state.round < 4 and all(state.expert(e).finished.startswith("patience: 1 versions") for e in range(4))
    assert "run over after round" in caplog.text and "every expert is finished" in caplog.text
    assert run.read_status()["phase"] == "done"
    finished = {e for m in run.read_metrics() if m["type"] == "round" for e in m.get("finished", {})}
    assert finished == {"0", "1", "2", "3"}
    # export takes each one's best version, which the run kept
    assert all((run.root / state.expert(e).best.path).exists() for e in range(4))
    # resumed as it is, it ends at once; reopened, it trains again
    ended = state.round
    assert Coordinator(FakeGrid(tmp_path / "n2", ["a", "b"]), run).main().round == ended
    assert reopen_finished(run) == [0, 1, 2, 3]
    set_fed(run, finish_patience=0)
    state = Coordinator(FakeGrid(tmp_path / "n3", ["a", "b"]), run).main()
    assert state.round == 4 and all(state.expert(e).finished is None for e in range(4))


def test_an_expert_refused_again_and_again_finishes_and_leaves_the_plans(run, tmp_path, monkeypatch):
    equal_rates(monkeypatch)
    set_fed(run, rounds=6, reply="weights", val_windows=16, max_strikes=0, finish_refusals=2, round_seconds=SHORT_ROUND)

    def tamper(nid, body):
        for res in body["results"]:
            if res["expert"] == 0:
                res["weights"] = np.ascontiguousarray(res["weights"] * 10)
                res["sha256"] = protocol.weights_sha256(res["weights"])
        return body

    grid = FakeGrid(tmp_path / "nodes", ["a", "b"], tamper=tamper)
    state = Coordinator(grid, run).main()
    assert finish.rule_of(state.expert(0).finished) == finish.REFUSALS and state.round == 6
    done_in = next(m["round"] for m in run.read_metrics() if m["type"] == "round" and "0" in m.get("finished", {}))
    asked = [
        protocol.unpack(m.content, protocol.KIND_TRAIN) for m in grid.sent if m.metadata.message_type == protocol.TRAIN
    ]
    # a round planned before its last refusal was judged may still carry it; none after that
    assert not [b["round"] for b in asked if b["round"] > done_in + 1 and 0 in [t["expert"] for t in b["tasks"]]]
    assert all(state.expert(e).finished is None and state.expert(e).version >= 3 for e in (1, 2, 3))


def test_epochs_are_the_steps_bytes_over_the_train_text(run, tmp_path, monkeypatch):
    equal_rates(monkeypatch)
    set_fed(run, round_seconds=SHORT_ROUND)
    Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main()
    prep, cfg = run.read_prepare(), run.load_config()
    sizes = prep.shard_sizes()
    for m in run.read_metrics():
        if m["type"] == "expert" and m["accepted"]:
            text = sum(sizes[h] for h in prep.shards(m["expert"], "train"))
            assert m["epochs"] == pytest.approx(m["step"] * cfg.data.batch * cfg.data.seq_len / text)


def test_a_log_liar_with_made_up_scalars_is_excluded_at_the_defaults(run, tmp_path, monkeypatch):
    """Node b makes up its logs: the body's scalars turned uphill, the decoder's coded change at random;
    it claims the hash its made-up log replays to, so the replay matches. With no audit (the
    default), the guard's refusals strike it out at the shipped rule, and a's work stands. (Made-up body
    scalars alone do no harm the guard could see at this size: the exact head learns on regardless.)"""
    from soma_edge.spsa import log as update_log

    equal_rates(monkeypatch)
    # guard, strikes and audit at their defaults
    set_fed(run, rounds=4, reply="log", val_windows=16, round_seconds=SHORT_ROUND)
    box: list = []

    def lie(nid, body):
        coord = box[0]
        for res in body["results"] if nid == 1001 else []:
            log = update_log.UpdateLog.from_record(res["log"])
            log.grads[:] = -50 * log.grads
            # the decoder's change (int8-coded, as shipped) made up too: +-6 on every weight, whatever the steps
            rng = np.random.default_rng(res["expert"])
            log.decoder_codes = rng.choice(np.array([-127, 127], np.int8), log.decoder_codes.size)
            log.decoder_scales = np.full_like(log.decoder_scales, 0.05)
            claim_log(coord, res, log)
        return body

    coord = Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"], tamper=lie), run)
    box.append(coord)
    state = coord.main()
    metrics = run.read_metrics()
    assert state.strikes["node:1001"]["count"] >= MAX and "node:1000" not in state.strikes
    assert [m["round"] for m in metrics if m["type"] == "round" and m["excluded"] == ["b"]]
    assert not [m for m in metrics if m["type"] == "expert" and m["node"] == "b" and m["accepted"]]
    assert all(m["accepted"] for m in metrics if m["type"] == "expert" and m["node"] == "a")


def test_a_claim_of_an_expert_refused_last_time_is_judged_before_the_next_round_is_planned(run, tmp_path, monkeypatch):
    """Expert 0's versions of rounds 2 and 4 are lies. Round 3, planned ahead of round 2's checks, trains
    from the refused version and is lost (the price of pipelining); round 4's claim is then suspect and is
    judged before round 5 is planned, so round 5 trains from the kept version and is not lost."""
    equal_rates(monkeypatch)
    set_fed(run, rounds=5, reply="weights", val_windows=16, max_strikes=0, round_seconds=SHORT_ROUND)
    calls = {"n": 0}
    honest = task_mod.train_loop

    def lying(state, data, cfg, evaluator, *, expert=0, **kw):
        rep = honest(state, data, cfg, evaluator, expert=expert, **kw)
        calls["n"] += expert == 0
        if expert == 0 and calls["n"] in (2, 4):
            state.weights[:] = state.weights * 10
        return rep

    monkeypatch.setattr(task_mod, "train_loop", lying)
    Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main()
    by_round = {m["round"]: m for m in run.read_metrics() if m["type"] == "expert" and m["expert"] == 0}
    assert not by_round[2]["accepted"] and "which was refused" in by_round[3]["reason"]
    assert not by_round[4]["accepted"] and by_round[4]["reason"].startswith("rejected:")
    assert by_round[5]["accepted"] or by_round[5]["reason"].startswith("rejected:"), by_round[5]


@pytest.mark.parametrize("audit", [0, 8])
def test_a_log_of_the_wrong_width_is_one_strike_and_the_run_goes_on(run, tmp_path, monkeypatch, audit):
    """Node b's logs carry one scalar too many a step (its round 1) or one too few (round 2): refused at
    arrival with one line and a strike each, the audit and the replay never see them, and the run ends."""
    from soma_edge.spsa import log as update_log

    equal_rates(monkeypatch)
    set_fed(run, rounds=3, reply="log", audit_steps=audit, val_windows=16, round_seconds=SHORT_ROUND)

    def widen(nid, body):
        for res in body["results"] if nid == 1001 and body["round"] <= 2 else []:
            log = update_log.UpdateLog.from_record(res["log"])
            g = log.grads
            log.grads = np.ascontiguousarray(np.concatenate([g, g[:, :1]], 1) if body["round"] == 1 else g[:, :1])
            res["log"] = log.to_record()
        return body

    state = Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"], tamper=widen), run).main()
    rejected = [x for m in run.read_metrics() if m["type"] == "round" for x in m["rejected"]]
    assert rejected and all(x["node"] == "b" and "scalars a step" in x["reason"] for x in rejected)
    assert {x["reason"].split("holds ")[1].split(" ")[0] for x in rejected} <= {"3", "1"}
    assert state.round == 3 and state.strikes["node:1001"]["count"] == len(rejected)
