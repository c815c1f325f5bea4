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
