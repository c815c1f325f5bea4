"""The heartbeat interval advised to each node, and the size of the shard pieces that keeps it short.

The SuperLink declares a node gone after two missed heartbeat intervals, so a short interval notices a
dead worker soon; but a saturated link queues heartbeats behind a large message, and too short an interval
would declare a node gone in the middle of a download. So a node gets 10 s where its link moves the
largest message it may get (one expert's version and a piece of shards) within 10 s, and elsewhere an
interval whose two periods outlast that download. Shard pieces are cut to cross the node's link in
PIECE_SECONDS, so that shards never make that message large: a small expert's node is on 10 s heartbeats
from its capability query on, before its link is measured. An unmeasured link is priced at
scheduler.UNMEASURED_LINK (1 Mbit/s), so round 1's downloads are covered before the link is known.
"""

from __future__ import annotations

import math

from coordinator import scheduler
from soma_edge.wire import protocol

HEARTBEAT_COVER = 0.75  # two intervals must outlast the largest download: 0.75 x its time leaves 50% to spare
PIECE_SECONDS = 5.0
MIN_PIECE_BYTES = 64 << 10  # below this, a message's own overhead dominates


def piece_bytes(limit: int, measured: float | None) -> int:
    """Shard bytes per message to a node: what its link moves in PIECE_SECONDS, within [MIN_PIECE_BYTES,
    `limit` (federation.piece_bytes)]."""
    return min(limit, max(MIN_PIECE_BYTES, int(PIECE_SECONDS * scheduler.priced_link(measured))))


def interval(version_bytes: int, limit: int, measured: float | None) -> float:
    """The heartbeat interval (s) to advise a node whose link is `measured` (bytes/s, None: not yet)."""
    seconds = (version_bytes + piece_bytes(limit, measured)) / scheduler.priced_link(measured)
    if seconds <= protocol.HEARTBEAT_FAST:
        return protocol.HEARTBEAT_FAST
    return float(min(protocol.HEARTBEAT_MAX, max(protocol.HEARTBEAT_SLOW, math.ceil(HEARTBEAT_COVER * seconds))))
