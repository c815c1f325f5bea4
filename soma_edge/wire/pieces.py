"""Shard bytes in pieces: a node's missing shards cut into messages' worth (`split_pieces`), regrouped for
its link (`group_pieces`), and type-checked on arrival (`check_pieces`). The messages that carry them are
soma_edge.wire.protocol's (`pieces_request`, and a train request's last piece).
"""

from __future__ import annotations

from typing import Any

from soma_edge.errors import ValidationError
from soma_edge.wire.protocol import MAX_SHARD_BYTES, PIECE_BYTES, is_int, is_sha256


def piece(sha256: str, offset: int, total: int, data: bytes) -> dict[str, Any]:
    """Bytes [offset, offset + len(data)) of the shard `sha256` of `total` bytes."""
    return {"sha256": sha256, "offset": int(offset), "total": int(total), "data": bytes(data)}


def split_pieces(shards: dict[str, bytes], limit: int | None = None) -> list[list[dict[str, Any]]]:
    """Shard bytes as messages' worth of pieces, each list at most `limit` (PIECE_BYTES) bytes of data:
    small shards share a message, a large one is cut across several."""
    limit = limit or PIECE_BYTES
    out: list[list[dict[str, Any]]] = [[]]
    room = limit
    for sha in sorted(shards):
        data, offset = shards[sha], 0
        while True:
            if room == 0:
                out.append([])
                room = limit
            n = min(room, len(data) - offset)
            out[-1].append(piece(sha, offset, len(data), data[offset : offset + n]))
            offset, room = offset + n, room - n
            if offset >= len(data):
                break
    return [p for p in out if p]


def group_pieces(pieces: list[dict[str, Any]], limit: int) -> list[list[dict[str, Any]]]:
    """Pieces (as `split_pieces` cut them) regrouped into messages of at most `limit` bytes of data each,
    in order; a piece larger than `limit` goes alone."""
    out: list[list[dict[str, Any]]] = []
    room = 0
    for p in pieces:
        if not out or len(p["data"]) > room:
            out.append([])
            room = limit
        out[-1].append(p)
        room -= len(p["data"])
    return out


def check_pieces(pieces: Any) -> list[dict[str, Any]]:
    """The pieces of a request, type-checked (a worker trusts the coordinator's bytes only once they hash)."""
    if not isinstance(pieces, list):
        raise ValidationError("pieces is not a list")
    for p in pieces:
        if not isinstance(p, dict) or not is_sha256(p.get("sha256")) or not isinstance(p.get("data"), bytes):
            raise ValidationError("a piece lacks its sha256 or its bytes")
        off, total = p.get("offset"), p.get("total")
        if not (is_int(off) and is_int(total) and 0 <= off and off + len(p["data"]) <= total <= MAX_SHARD_BYTES):
            raise ValidationError(
                f"piece of shard {p['sha256'][:12]}: offset {off!r} and size {len(p['data'])} do not "
                f"fit its total {total!r}"
            )
    return pieces
