"""The scheduler, link timing and heartbeat advice: how experts are split over nodes by their rates,
how a link's speed is measured and priced into a round's deadline, and why the advised heartbeat holds
steady while pieces come back one by one. Mostly pure functions; the few that need a run use the fake Grid.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from flwr.app import RecordDict

from coordinator import heartbeat as heartbeat_mod
from coordinator import scheduler
from coordinator.dispatch import log_bytes
from coordinator.loop import Coordinator
from tests.helpers.fakegrid import FakeGrid, set_fed


def test_scheduler_quotas_follow_throughput_and_stay_sticky():
    assert scheduler.quotas(4, {1: 100.0, 2: 100.0}) == {1: 2, 2: 2}
    assert scheduler.quotas(4, {1: 300.0, 2: 100.0}) == {1: 3, 2: 1}
    assert scheduler.quotas(8, {1: 100.0}) == {1: 8}
    prev = {0: 2, 1: 2, 2: 1, 3: 1}
    a = scheduler.assign([0, 1, 2, 3], {1: 100.0, 2: 100.0}, prev)
    assert a == prev  # nothing moves when quotas allow it
    # node 2 dies: all four go to node 1; only its two experts move
    p = scheduler.plan([0, 1, 2, 3], {1: 100.0}, prev, 10.0, {1: 16})  # 16 forward passes per step (K = 8)
    assert p.assignment == {0: 1, 1: 1, 2: 1, 3: 1} and p.moved == [0, 1]
    assert scheduler.steps_for(100.0, 4, 10.0, 16) == 15 and p.steps[0] == math.ceil(scheduler.HEADROOM * 15)
    assert scheduler.steps_for(100.0, 4, 10.0, 17) == 14  # a delta-rule step adds its clean forward
    # a faster node joins beside an idle one: it takes two, node 1 keeps one, and node 2 is not left idle
    rates = {1: 100.0, 2: 100.0, 3: 400.0}
    p = scheduler.plan([0, 1, 2, 3], rates, {e: 1 for e in range(4)}, 10.0, dict.fromkeys(rates, 16))
    assert sorted(p.assignment.values()) == [1, 2, 3, 3] and p.assignment[0] == 1 and p.moved == [1, 2, 3]
    assert p.makespan <= 10.0 + 1e-9


def test_scheduler_leaves_no_live_node_idle_unless_it_is_far_slower():
    """Every node computes for round_seconds anyway, so a node without an expert wastes its round. Probe
    rates measured while other workers start differ up to 3x: the bare makespan rule then put all three
    experts on the fastest node (340 / 3 > 104) and the others idled. Proportional fairness gives each node
    one; only a node so slow that its expert would train far slower than the experts it relieves stays idle."""
    assert scheduler.quotas(3, {1: 340.0, 2: 104.0, 3: 93.0}) == {1: 1, 2: 1, 3: 1}
    assert scheduler.quotas(2, {1: 300.0, 2: 100.0}) == {1: 1, 2: 1}
    assert scheduler.quotas(2, {1: 1000.0, 2: 1.0}) == {1: 2, 2: 0}  # no expert starves at 1/500 the speed
    # last round's split with an idle node does not stand against one that employs it
    assert scheduler.quotas(3, {1: 340.0, 2: 104.0, 3: 93.0}, keep={1: 3}) == {1: 1, 2: 1, 3: 1}
    # nor does a split two nodes of equal speed share unequally, once the gap is real
    assert scheduler.quotas(4, {1: 100.0, 2: 100.0}, keep={1: 3, 2: 1}) == {1: 2, 2: 2}


def test_scheduler_does_not_move_experts_for_a_small_change_in_rates():
    """Three experts on two nodes of nearly equal speed: a 0.0001% faster node would take two of them by
    the bare makespan rule, moving an expert and its cache every time the measured rates cross."""
    prev = {0: 1, 1: 1, 2: 2}
    rates = {1: 1000.0, 2: 1000.001}
    assert scheduler.quotas(3, rates) == {1: 1, 2: 2}  # the bare rule
    p = scheduler.plan([0, 1, 2], rates, prev, 10.0, dict.fromkeys(rates, 2))
    assert p.assignment == prev and p.moved == []
    # A real difference still moves work: node 2 three times as fast takes two.
    p = scheduler.plan([0, 1, 2], {1: 1000.0, 2: 3000.0}, prev, 10.0, {1: 2, 2: 2})
    assert sorted(p.assignment.values()).count(2) == 2 and len(p.moved) == 1


def test_scheduler_sends_a_moving_expert_where_it_is_fetched_fastest():
    """An expert that must move goes to the node that lacks the least of it on its link, and the plan
    predicts each node's fetch time (which extends its round deadline)."""
    lacks = {(0, 1): 30.0, (0, 2): 0.5, (1, 1): 0.0, (1, 2): 8.0}  # seconds to fetch, by (expert, node)
    p = scheduler.plan([0, 1], {1: 100.0, 2: 100.0}, {}, 10.0, {1: 2, 2: 2}, lambda e, n: lacks[(e, n)])
    assert p.assignment == {0: 2, 1: 1} and p.transfer == {1: 0.0, 2: 0.5}


def test_link_rate_is_measured_from_large_messages_only():
    assert scheduler.link_rate(None, 100_000, 20.0, 5.0) is None  # Flower's overhead would dominate
    seen = scheduler.link_rate(None, 1_000_000, 12.0, 5.0)  # 1 MB in 12 - 5 - 4.5 s
    assert seen == pytest.approx(400_000)
    assert scheduler.link_rate(seen, 1_000_000, 7.0, 5.0) == pytest.approx(0.5 * 400_000 + 0.5 * 1_000_000 / 0.5)
    assert scheduler.link_rate(seen, 1_000_000, float("nan"), 5.0) == seen
    # 12 - 5 - 4.5 s is a time the transfer took; 7 - 5 - 4.5 s is within Flower's overhead: only a floor
    assert scheduler.link_seen(None, False, 1_000_000, 12.0, 5.0) == (pytest.approx(400_000), False)
    assert scheduler.link_seen(None, False, 1_000_000, 7.0, 5.0) == (pytest.approx(2_000_000), True)
    assert scheduler.link_seen(seen, True, 100_000, 7.0, 5.0) == (seen, True)  # too small to time at all


def test_heartbeat_advice_holds_while_queued_pieces_come_back_one_by_one(run):
    """A 1 Mbit/s link: 20 shard pieces of 5 s each and a 1M expert's version are pushed at once, and the
    pieces' replies come back one after another (5 s on the wire + Flower's 4.5 s each). Timed from their
    push, the pieces measured the link ever slower and the advice rose to 25 minutes, so that a worker killed
    then went unnoticed for most of an hour. Timed from when the link was free, the rate holds and the advice
    stays where the first piece put it."""
    from coordinator.fleet import Fleet, Node, NodeStatus, Outgoing, Sent

    now = [0.0]
    piece, version, link = 625_000, 12_600_000, 125_000.0
    fleet = Fleet(None, run, run.load_config(), None, version, lambda **kw: None, clock=lambda: now[0])
    fleet.advise = lambda nid: None  # no grid to push advice on: the advised interval is read below
    fleet.nodes[7] = Node(id=7, status=NodeStatus.ACTIVE)
    reply = SimpleNamespace(content=RecordDict())  # a stored piece's acknowledgement: no payload
    outs = [Outgoing(node=7, kind=Sent.PIECES, bytes_down=piece, sent_at=0.0) for _ in range(20)]
    advice = []
    for k, o in enumerate(outs, start=1):
        now[0] = k * (piece / link + scheduler.FLOWER_SECONDS)
        fleet.time_link(o, reply, 0.0)
        advice.append(fleet.heartbeat(7))
    assert fleet.nodes[7].link == pytest.approx(link)
    assert max(advice) == min(advice) == heartbeat_mod.interval(version, run.load_config().federation.piece_bytes, link)
    assert max(advice) <= 150  # two intervals, under 5 minutes
    # Each timed from its push, as before: the measured rate falls piece after piece, the advice climbs.
    old = None
    for k in range(1, 21):
        old = scheduler.link_rate(old, piece, k * (piece / link + scheduler.FLOWER_SECONDS), 0.0)
    assert old < link / 5


def test_a_round_deadline_prices_the_reply_up_a_measured_link(run, tmp_path):
    """Weights mode sends weights and Adam moments up; log mode a few bytes per step; an unmeasured link
    is priced at UNMEASURED_LINK. The round deadline adds what the slowest node's fetch and reply take."""
    set_fed(run, rounds=1, reply="weights")
    coord = Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run)
    coord.main()
    loop = coord.loop
    a = loop.fleet.nodes[1000]
    a.link, steps = None, {0: 1000, 1: 1000}
    unmeasured = loop.planner.reply_seconds(1000, [0, 1], 2, steps)
    assert unmeasured == pytest.approx(2 * 12 * loop.ledger.size / scheduler.UNMEASURED_LINK)
    a.link = 1e5
    assert loop.planner.reply_seconds(1000, [0, 1], 2, steps) == pytest.approx(2 * 12 * loop.ledger.size / 1e5)
    set_fed(run, reply="log")
    loop.cfg.federation.reply = run.load_config().federation.reply  # the config every part of the loop shares
    phase = loop.ledger.phase_config()
    assert loop.planner.reply_seconds(1000, [0, 1], 2, steps) == pytest.approx(2 * log_bytes(phase, 1000) / 1e5)
    assert log_bytes(phase, 1000) < 12 * loop.ledger.size


def test_scheduler_bounds_claimed_rates_and_steps():
    """A node claiming 1e300 evals/s gets a bounded rate and step counts that msgpack can encode."""
    from soma_edge import codec

    assert scheduler.clamp_rate(1e300) == scheduler.MAX_RATE and scheduler.clamp_rate(5.0) == 5.0
    assert scheduler.update_rate(100.0, 1e300) <= scheduler.MAX_RATE
    assert scheduler.update_rate(0.0, 1e300) == scheduler.MAX_RATE
    assert scheduler.steps_for(1e300, 1, 1e6, 1) == scheduler.MAX_STEPS
    p = scheduler.plan([0, 1, 2, 3], {1: 100.0, 2: 1e300}, {}, 10.0, {1: 8, 2: 8})
    assert all(1 <= s <= scheduler.MAX_STEPS for s in p.steps.values()) and math.isfinite(p.makespan)
    codec.encode({"steps": max(p.steps.values())}, "train_request")
