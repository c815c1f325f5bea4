"""The budget for checking update logs in a run (coordinator.check_budget): logs timed as they are checked,
weights asked instead where a node's logs would overrun their share of the round, and, where logs are asked
all the same, one line that says so and `federation.audit_share` of them audited."""

from __future__ import annotations

import logging

from coordinator import check_budget, replay
from coordinator.loop import Coordinator
from tests.helpers.fakegrid import FakeGrid, equal_rates, set_fed


def _lines(run, kind: str) -> list[dict]:
    return [m for m in run.read_metrics() if m["type"] == kind]


def test_logs_over_their_check_budget_give_way_to_the_weights(run, tmp_path, monkeypatch):
    """Under reply = "auto" an unmeasured link asks for logs; once a node's logs are timed and would take
    more than their budget (here any time at all), the next rounds ask for its weights, which the link
    (priced, not yet measured) carries sooner."""
    equal_rates(monkeypatch)
    monkeypatch.setattr(check_budget, "CHECK_SHARE", 1e-9)
    set_fed(run, rounds=3, reply="auto")
    Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main()
    lines = _lines(run, "expert")
    assert lines and all(m["accepted"] for m in lines)
    by_round = {r: [m for m in lines if m["round"] == r] for r in (1, 2, 3)}
    assert all(m["weights_bytes_up"] == 0 and m["log_bytes_up"] for m in by_round[1]), by_round[1]
    assert all(m["weights_bytes_up"] > 0 and m.get("log_bytes_up") is None for m in by_round[3]), by_round[3]


def test_logs_asked_all_the_same_are_said_once_and_audited_at_the_share(run, tmp_path, monkeypatch, caplog):
    equal_rates(monkeypatch)
    monkeypatch.setattr(check_budget, "CHECK_SHARE", 1e-9)
    monkeypatch.setattr(replay, "audit_key", lambda: 7)  # which logs are audited: the same draw every time
    audited = []
    real_audit = replay.audit

    def audit(cfg, base, log, expert, data, evaluator, steps):
        audited.append(expert)
        return real_audit(cfg, base, log, expert, data, evaluator, steps)

    monkeypatch.setattr(replay, "audit", audit)
    set_fed(run, rounds=3, reply="log", audit_steps=2, audit_share=0.5)
    with caplog.at_level(logging.INFO, logger="soma.coord"):
        Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main()
    lines = _lines(run, "expert")
    assert len(lines) == 12 and all(m["accepted"] and m["weights_bytes_up"] == 0 for m in lines)
    want = sum(check_budget.audited(7, m["expert"], m["version"], 0.5) for m in lines)
    assert 0 < len(audited) == want < len(lines), (audited, want)
    said = [r.getMessage() for r in caplog.records if "over their budget" in r.getMessage()]
    assert sorted(s.split(":")[0] for s in said) == ["node a", "node b"], said  # once each, from round 2
    assert "a lower federation.audit_share audits fewer of its logs" in said[0]
