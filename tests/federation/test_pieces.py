"""Shard pieces: shards travel to a node in pieces under a byte bound (the first sized to time an
unmeasured link, the rest as that link allows), the worker's cache joins them in any order and drops a set
that does not hash to its name, malformed pieces are refused, and no train request a worker decodes is
larger than its run's model allows.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from coordinator import heartbeat as heartbeat_mod
from coordinator import scheduler
from coordinator.loop import Coordinator
from soma_edge.errors import CheckpointError, CodecError, ValidationError
from soma_edge.wire import pieces as pieces_mod
from soma_edge.wire import protocol
from tests.helpers.fakegrid import FakeGrid, equal_rates, set_fed
from worker import client_app
from worker.cache import Cache


def test_shards_travel_in_bounded_pieces(run, tmp_path, monkeypatch):
    """With a small piece size, a node's missing shards go as several query.shards messages before its
    train request (which carries the last piece); no message holds more than one piece of shard bytes. One
    node, so that it lacks every expert's shards (~290 KB of this corpus): several pieces of 64 KiB."""
    limit = 1 << 16
    equal_rates(monkeypatch)
    set_fed(run, rounds=1, piece_bytes=limit, min_nodes=1)  # one node: round 1 waits for no other
    grid = FakeGrid(tmp_path / "nodes", ["a"])
    state = Coordinator(grid, run).main()
    assert all(x.version == 1 for x in state.experts.values())
    for nid, name in ((1000, "a"),):
        mine = [
            m
            for m in grid.sent
            if m.metadata.dst_node_id == nid
            and m.metadata.message_type not in (protocol.QUERY_CAPABILITIES, protocol.QUERY_END)
        ]
        kinds = [m.metadata.message_type for m in mine]
        assert kinds.count(protocol.QUERY_SHARDS) >= 2 and kinds[-1] == protocol.TRAIN, kinds
        for m in mine:
            kind = protocol.KIND_TRAIN if m.metadata.message_type == protocol.TRAIN else protocol.KIND_PIECES
            assert sum(len(p["data"]) for p in protocol.unpack(m.content, kind)["pieces"]) <= limit
        cache = Cache(tmp_path / "nodes" / name)
        held = set(cache.shards())
        needed = {
            h
            for m in mine
            if m.metadata.message_type == protocol.TRAIN
            for t in protocol.unpack(m.content, protocol.KIND_TRAIN)["tasks"]
            for h in t["shards"]
        }
        assert needed <= held and all(cache.get_shard(h) is not None for h in needed)
        assert not any((tmp_path / "nodes" / name / "parts").iterdir())  # every piece joined, nothing left over


def test_a_first_piece_times_an_unmeasured_link_and_the_rest_go_in_pieces_it_allows(run, tmp_path, monkeypatch, caplog):
    """Round 1, links not yet measured: a first piece goes alone, sized for the feared 1 Mbit/s (here a slower
    fear, so that the shards make several pieces); its exchange times the link, and the rest of the shards go
    in messages sized for the link it showed, not in a long run of small ones (each costs a process start)."""
    equal_rates(monkeypatch)
    first = heartbeat_mod.MIN_PIECE_BYTES  # one node lacks every expert's shards: ~290 KB of this corpus
    monkeypatch.setattr(scheduler, "UNMEASURED_LINK", first / heartbeat_mod.PIECE_SECONDS)
    monkeypatch.setattr(scheduler, "MIN_PROBE_BYTES", first)  # so that one piece times the link
    set_fed(run, rounds=1, min_nodes=1)  # one node: round 1 waits for no other
    grid = FakeGrid(tmp_path / "nodes", ["a"])
    with caplog.at_level(logging.INFO, logger="soma.coord"):
        state = Coordinator(grid, run).main()
    assert all(x.version == 1 for x in state.experts.values())
    # The fake grid answers at once: the piece crossed within Flower's overhead, which shows only a floor
    assert "link timed at " in caplog.text and " Mbit/s or more (the piece crossed within" in caplog.text
    for nid in (1000,):
        mine = [
            m
            for m in grid.sent
            if m.metadata.dst_node_id == nid and m.metadata.message_type in (protocol.QUERY_SHARDS, protocol.TRAIN)
        ]
        kinds = [m.metadata.message_type for m in mine]
        data = [
            sum(len(p["data"]) for p in protocol.unpack(m.content, kind)["pieces"])
            for m, kind in zip(
                mine, [protocol.KIND_PIECES if k == protocol.QUERY_SHARDS else protocol.KIND_TRAIN for k in kinds]
            )
        ]
        assert kinds[0] == protocol.QUERY_SHARDS and data[0] == first, (kinds, data)  # the first, alone
        assert kinds[-1] == protocol.TRAIN and max(data[1:]) > first, (kinds, data)  # then as the timed link allows
        assert len(mine) < sum(data) / first, (kinds, data)  # fewer messages than the feared link's pieces


def test_group_pieces_keeps_order_and_bounds():
    data = {"a" * 64: bytes(10_000), "b" * 64: bytes(3_000)}
    pieces = [p for m in pieces_mod.split_pieces(data, 2_000) for p in m]
    messages = pieces_mod.group_pieces(pieces, 5_000)
    assert [p for m in messages for p in m] == pieces
    assert all(sum(len(p["data"]) for p in m) <= 5_000 for m in messages) and len(messages) == 3
    assert pieces_mod.group_pieces(pieces, 1_000) == [[p] for p in pieces]  # a piece over the limit goes alone


def test_cache_joins_pieces_in_any_order_and_drops_bad_ones(tmp_path):
    import random

    data = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    sha = hashlib.sha256(data).hexdigest()
    pieces = [p for msg in pieces_mod.split_pieces({sha: data}, 3_000) for p in msg]
    assert len(pieces) == 4 and sum(len(p["data"]) for p in pieces) == len(data)
    random.Random(1).shuffle(pieces)
    cache = Cache(tmp_path / "c")
    done = [cache.put_piece(p["sha256"], p["offset"], p["total"], p["data"]) for p in pieces]
    assert done == [False, False, False, True] and cache.get_shard(sha) == data
    assert not any((tmp_path / "c" / "parts").iterdir())
    # One flipped byte: the piece that completes the shard finds the hash wrong, and every piece is dropped.
    bad = Cache(tmp_path / "bad")
    pieces[0] = {**pieces[0], "data": bytes([pieces[0]["data"][0] ^ 1]) + pieces[0]["data"][1:]}
    for p in pieces[:-1]:
        assert not bad.put_piece(p["sha256"], p["offset"], p["total"], p["data"])
    with pytest.raises(CheckpointError, match="joined from pieces, do not hash to its name"):
        bad.put_piece(pieces[-1]["sha256"], pieces[-1]["offset"], pieces[-1]["total"], pieces[-1]["data"])
    assert bad.get_shard(sha) is None and not any((tmp_path / "bad" / "parts").iterdir())


@pytest.mark.parametrize(
    "piece,why",
    [
        ({"offset": -1}, "do not fit its total"),
        ({"offset": 9_000}, "do not fit its total"),
        ({"total": 2**41}, "do not fit its total"),
        ({"data": "text"}, "lacks its sha256 or its bytes"),
        ({"sha256": "../../etc"}, "lacks its sha256 or its bytes"),
        ({"offset": True}, "do not fit its total"),
    ],
)
def test_malformed_pieces_are_refused(piece, why):
    good = pieces_mod.piece("a" * 64, 0, 10_000, b"x" * 2_000)
    with pytest.raises(ValidationError, match=why):
        pieces_mod.check_pieces([{**good, **piece}])
    with pytest.raises(ValidationError, match="not a list"):
        pieces_mod.check_pieces({"a": 1})


def test_worker_decodes_no_train_request_beyond_its_runs_model(run, tmp_path):
    """The capability query tells the worker the run's model, which bounds every train request it decodes."""
    from soma_edge.expert import params

    set_fed(run, rounds=1)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    Coordinator(grid, run).main()
    cfg = run.load_config()
    limit = Cache(tmp_path / "nodes" / "a").get_json("limit-1")  # the fake grid's Flower run id is 1
    assert (
        limit
        == protocol.train_request_limit(cfg)
        == 5 * (params.count(cfg.model) * 16 + 65536) + protocol.PIECE_BYTES + (1 << 20)
    )
    train = next(m for m in grid.sent if m.metadata.message_type == protocol.TRAIN)
    ctx = Context(
        run_id=1,
        node_id=train.metadata.dst_node_id,
        node_config=grid.nodes[train.metadata.dst_node_id],
        state=RecordDict(),
        run_config={},
    )
    Cache(tmp_path / "nodes" / "a").put_json("limit-1", 100)  # as if the run's model were tiny
    Cache(tmp_path / "nodes" / "b").put_json("limit-1", 100)
    with pytest.raises(CodecError, match="exceeds the limit of 100 bytes"):
        client_app.app(train, ctx)
