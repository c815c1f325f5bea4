"""Many experts on few nodes: a round trains those the nodes can give `federation.min_expert_seconds` each,
the ones with the fewest steps first, so that every expert trains in turn."""

from coordinator import planning


def test_experts_train_in_turn_when_the_nodes_cannot_give_each_its_least_seconds():
    ids = list(range(10))
    steps = {e: 0 for e in ids}
    assert planning.in_turn(ids, steps.__getitem__, 2, 60.0, 0.0) == ids  # off: every expert every round
    assert planning.in_turn(ids, steps.__getitem__, 2, 60.0, 12.0) == ids  # 2 nodes x 5 slots of 12 s: room for all
    first = planning.in_turn(ids, steps.__getitem__, 2, 60.0, 20.0)  # 2 nodes x 3 slots of 20 s
    assert first == [0, 1, 2, 3, 4, 5]
    for e in first:
        steps[e] += 100
    second = planning.in_turn(ids, steps.__getitem__, 2, 60.0, 20.0)
    assert second == [0, 1, 6, 7, 8, 9]  # the 4 untrained first, then the fewest steps, lower ids on ties
    assert set(first) | set(second) == set(ids)
    assert planning.in_turn(ids, steps.__getitem__, 3, 10.0, 20.0) == [
        6,
        7,
        8,
    ]  # a round shorter than the least: one each


def test_a_round_names_each_node_s_experts_of_the_next_one():
    """Planner.following: the experts in turn once this round's steps are taken, each on the node that trains
    it now or holds its version; nothing where every expert trains every round."""
    from types import SimpleNamespace

    from coordinator import scheduler
    from soma_edge.config import FederationConfig

    steps = {e: 0 for e in range(6)}
    holder = {0: 1, 1: 2, 2: 1, 3: 2, 4: 1, 5: 2}  # node holding each expert's version
    ledger = SimpleNamespace(trainable_ids=lambda: list(range(6)), expert_ids=lambda: list(range(6)))
    bases = SimpleNamespace(
        base=lambda e: SimpleNamespace(step=steps[e]),
        last_assignment=lambda: {},
        holds=lambda nid, e: holder[e] == nid,
    )
    planner = planning.Planner.__new__(planning.Planner)
    planner.ledger = ledger
    planner.cfg = SimpleNamespace(federation=FederationConfig(round_seconds=60.0, min_expert_seconds=30.0))
    active = {n: SimpleNamespace(label=f"w{n}") for n in (1, 2)}  # 2 nodes x 2 slots: 4 of the 6 a round
    plan = scheduler.Plan({0: 1, 1: 2, 2: 1, 3: 2}, {0: 50, 1: 50, 2: 50, 3: 50}, 0.0, [])
    # Next round: 4 and 5 (no steps yet) and then 0 and 1 (fewest once this round's 50 are taken, lower ids).
    assert planner.following(active, bases, plan) == {1: [0, 4], 2: [1, 5]}
    planner.cfg.federation.min_expert_seconds = 0.0  # every expert every round: the next round is this one's
    every = scheduler.Plan({e: holder[e] for e in range(6)}, {e: 50 for e in range(6)}, 0.0, [])
    assert planner.following(active, bases, every) == {}
