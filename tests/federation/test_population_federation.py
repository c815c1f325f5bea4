"""A federation whose worker evaluates its steps with the population evaluator (spsa.evaluator =
"population") and replies with update logs: the coordinator replays them, audits their scalars with the
loop, and accepts them; each version's metrics line names the evaluator that made it."""

from __future__ import annotations

from soma_edge.engine import population


def test_population_worker_log_replies_are_audited_and_accepted(run, tmp_path, monkeypatch):
    from coordinator import replay
    from coordinator.loop import Coordinator
    from tests.helpers.fakegrid import FakeGrid, equal_rates, set_fed

    equal_rates(monkeypatch)
    audited = []
    real_audit = replay.audit

    def audit(cfg, base, log, expert, data, evaluator, steps):
        audited.append(len(steps))
        return real_audit(cfg, base, log, expert, data, evaluator, steps)

    monkeypatch.setattr(replay, "audit", audit)
    calls = []
    real = population.PopulationEvaluator.noise_of  # the host's noise for a population call, either path

    def counted(self, *args, **kwargs):
        calls.append(self.k)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(population.PopulationEvaluator, "noise_of", counted)  # the worker runs in this process
    cfg = run.load_config()
    cfg.spsa.evaluator = "population"
    run.save_config(cfg)
    set_fed(run, rounds=2, reply="log", audit_steps=4)
    state = Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main()
    lines = [m for m in run.read_metrics() if m["type"] == "expert"]
    assert calls and set(calls) == {cfg.spsa.directions}  # the steps went through the population graph
    assert lines and all(m["accepted"] and m["weights_bytes_up"] == 0 and m["log_bytes_up"] for m in lines), lines
    assert all(m["evaluator"] == "population" for m in lines)  # each version records how it was made
    rejected = [x for m in run.read_metrics() if m["type"] == "round" for x in m["rejected"]]
    assert not rejected
    assert len(audited) == len(lines) and all(n > 0 for n in audited)  # each log's scalars were recomputed
    assert state.round == 2 and {m["round"] for m in lines} == {1, 2}
    assert all(x.version >= 2 for x in state.experts.values())  # each expert advanced in both rounds
