"""A slow worker never ends a run (issue 24): round 1's deadline prices its transfers at a slow link until
the link is measured, and a node still sending a late reply is busy, not gone: the next round waits for it
and takes its reply, and `wait_seconds` fails a run only when no live node is left working.

On the fake grid with a fake clock: the coordinator's waits cost no wall time, only the real training does.
"""

from __future__ import annotations

import pytest

from coordinator import scheduler
from coordinator.late import BUSY_FACTOR
from coordinator.ledger import Bases
from coordinator.loop import Coordinator
from coordinator.planning import Planner
from coordinator.scheduler import UNMEASURED_LINK as SHIPPED_LINK  # read before conftest's in_process_link
from soma_edge.errors import SomaError
from soma_edge.rundir import seed as seed_mod
from soma_edge.wire import protocol
from tests.helpers.fakegrid import FakeGrid, set_fed

WAIT = 2.0  # federation.wait_seconds, fake seconds


class Clock:
    """A clock that sleeping moves, and each reading by a millisecond (a round's span is never 0): the
    loop's polls and waits take no wall time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1e-3
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        assert self.now < 1e5, "the coordinator waits without end"


def slow_first_round(grid: FakeGrid, clock: Clock, monkeypatch, node: int, extra: float) -> list[float]:
    """Node `node` answers nothing (its SuperNode works one message at a time) until `extra` fake seconds
    after round 1's deadline: its round-1 train reply is still going up its slow link. Returns the rounds'
    deadlines as planned, in the order planned."""
    deadlines: list[float] = []
    real_deadline, real_pull = Planner.deadline, grid.pull_messages

    def deadline(self, r, plan, by_node):
        deadlines.append(real_deadline(self, r, plan, by_node))
        return deadlines[-1]

    def pull(ids):
        trained = any(m.metadata.message_type == protocol.TRAIN and m.metadata.dst_node_id == node for m in grid.sent)
        if trained and clock() < deadlines[0] + extra:
            ids = [mid for mid in ids if mid not in grid.pending or grid.pending[mid].metadata.dst_node_id != node]
        return real_pull(ids)

    monkeypatch.setattr(Planner, "deadline", deadline)
    grid.pull_messages = pull
    return deadlines


def test_a_late_reply_from_the_only_worker_is_waited_for_not_fatal(run, tmp_path, monkeypatch):
    """The ~1M trial of issue 24: the only worker's round-1 reply comes after the deadline and after
    `wait_seconds` more. Round 2 finds no free worker but one still working, waits for it, takes its late
    reply, and the run completes."""
    set_fed(run, rounds=2, min_nodes=1, wait_seconds=WAIT)
    clock, grid = Clock(), FakeGrid(tmp_path / "nodes", ["a"])
    # Its reply comes 2 s after the wait without it would have failed the run (round 2 starts at round 1's deadline).
    deadlines = slow_first_round(grid, clock, monkeypatch, 1000, extra=WAIT + 2.0)
    state = Coordinator(grid, run, clock=clock, sleep=clock.sleep).main()
    assert state.round == 2 and len(deadlines) == 2
    lines = [m for m in run.read_metrics() if m["type"] == "expert"]
    r1 = [m for m in lines if m["round"] == 1]
    assert len(r1) == 4 and all(not m["accepted"] and "deadline" in m["reason"] for m in r1)
    late = [m for m in lines if m.get("late")]
    assert sorted(m["expert"] for m in late) == [0, 1, 2, 3] and all(m["accepted"] and m["round"] == 2 for m in late)
    assert all(x.version == 2 for x in state.experts.values())  # the late version, then round 2's on top
    text = (run.logs / "coordinator.log").read_text()
    assert "no free worker: waiting for a (sent" in text and "still on the last round's request" in text


def test_a_worker_that_leaves_while_late_fails_the_run_after_wait_seconds(run, tmp_path, monkeypatch):
    """The only worker is late, then its SuperNode leaves: nothing live is working, so the wait fails the run
    after `wait_seconds` with the one line it always had."""
    set_fed(run, rounds=2, min_nodes=1, wait_seconds=WAIT)
    clock, grid = Clock(), FakeGrid(tmp_path / "nodes", ["a"])
    deadlines = slow_first_round(grid, clock, monkeypatch, 1000, extra=1e9)
    real_ids = grid.get_node_ids

    def ids():
        if deadlines and clock() > deadlines[0] + 1.0:  # it leaves 1 s into round 2's wait
            grid.gone.add(1000)
        return real_ids()

    grid.get_node_ids = ids
    with pytest.raises(SomaError, match=f"no worker joined within {WAIT:.0f} s"):
        Coordinator(grid, run, clock=clock, sleep=clock.sleep).main()
    assert clock() < deadlines[0] + 1.0 + WAIT + 2.0  # it did not wait longer than wait_seconds once a was gone
    text = (run.logs / "coordinator.log").read_text()
    assert "no free worker: waiting for a" in text  # it was waited for while it lived
    assert run.read_status()["phase"] == "failed"


def test_a_live_worker_that_never_answers_is_waited_for_only_so_long(run, tmp_path, monkeypatch):
    """A worker whose SuperNode stays live but never answers (hung) is waited for BUSY_FACTOR times its
    round's allowance, then `wait_seconds`: the run fails, it does not wait forever."""
    set_fed(run, rounds=2, min_nodes=1, wait_seconds=WAIT)
    clock, grid = Clock(), FakeGrid(tmp_path / "nodes", ["a"])
    deadlines = slow_first_round(grid, clock, monkeypatch, 1000, extra=1e9)
    with pytest.raises(SomaError, match="no worker joined within"):
        Coordinator(grid, run, clock=clock, sleep=clock.sleep).main()
    text = (run.logs / "coordinator.log").read_text()
    assert "is live but has not answered its last round's request" in text
    assert clock() > deadlines[0] + WAIT  # it waited past wait_seconds while the worker might still be working
    assert clock() < deadlines[0] + BUSY_FACTOR * (deadlines[0] - 1000.0) + WAIT + 5.0


def test_round_one_deadline_prices_transfers_at_a_slow_link_until_measured(run, tmp_path, monkeypatch):
    """A node with nothing cached and an unmeasured link: the deadline adds its version and shards coming
    down and its reply (weights and moments) going up at 1 Mbit/s. Measured fast: nothing added."""
    assert SHIPPED_LINK == 125_000.0  # 1 Mbit/s, the slowest link soma-edge is built for
    monkeypatch.setattr(scheduler, "UNMEASURED_LINK", SHIPPED_LINK)
    set_fed(run, rounds=1, min_nodes=1, wait_seconds=WAIT, reply="weights")  # the largest replies
    clock = Clock()
    coord = Coordinator(FakeGrid(tmp_path / "nodes", ["a"]), run, clock=clock, sleep=clock.sleep)
    coord.main()
    loop, fed = coord.loop, run.load_config().federation
    a = loop.fleet.nodes[1000]
    a.link, a.weights, a.shards = None, set(), set()  # as a node joining fresh
    plan, by_node = loop.planner.plan({1000: a}, Bases(loop.ledger, loop.fleet.nodes))
    assert by_node == {1000: [0, 1, 2, 3]} and fed.reply == "weights"
    sizes = loop.prep.shard_sizes()
    shards = sum(sizes[h] for e in range(4) for h in seed_mod.shards(loop.cfg, loop.prep, e, "train"))
    down, up = 4 * loop.ledger.version_bytes() + shards, 4 * loop.ledger.version_bytes()
    base = fed.round_seconds * fed.deadline_factor + fed.deadline_slack
    allowed = loop.planner.deadline(1, plan, by_node) - clock()
    assert allowed == pytest.approx(base + (down + up) / SHIPPED_LINK, abs=0.01)
    assert (down + up) / SHIPPED_LINK > 1.0  # the test's corpus makes it count
    a.link = 1e12  # measured, fast
    plan, by_node = loop.planner.plan({1000: a}, Bases(loop.ledger, loop.fleet.nodes))
    assert loop.planner.deadline(1, plan, by_node) - clock() == pytest.approx(base, abs=0.01)
