"""The worker's cache of shards and expert versions: it verifies what it stores by hash, prunes old
versions per run, and evicts to its byte bound without tripping over files another worker removed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from soma_edge.errors import CheckpointError
from soma_edge.wire import protocol
from worker.cache import Cache


def test_cache_verifies_prunes_and_evicts(tmp_path):
    c = Cache(tmp_path / "c", max_bytes=10_000, keep_versions=2)
    data = b"shard bytes" * 100
    sha = hashlib.sha256(data).hexdigest()
    c.put_shard(sha, data)
    assert c.get_shard(sha) == data
    with pytest.raises(CheckpointError, match="do not hash"):
        c.put_shard("0" * 64, data)
    (tmp_path / "c" / "shards" / f"{sha}.bin").write_bytes(b"corrupt")
    assert c.get_shard(sha) is None and sha not in c.shards()  # dropped, reported missing
    shas = []
    for v in range(4):
        w = np.full(100, v, dtype=np.float32)
        shas.append(protocol.weights_sha256(w))
        c.put_weights(shas[-1], expert=0, version=v, step=v, weights=w, opt=None)
    assert sorted(c.weights()) == sorted(shas[2:])  # only the newest keep_versions=2
    assert c.get_weights(shas[3])["version"] == 3
    big = np.zeros(3000, dtype=np.float32)  # 12 KB > max_bytes
    c.put_weights(protocol.weights_sha256(big), expert=1, version=0, step=0, weights=big, opt=None)
    dropped = c.evict(protect={protocol.weights_sha256(big)})
    assert set(dropped) == set(shas[2:]) and c.weights() == [protocol.weights_sha256(big)]


def test_cache_prunes_per_run_so_an_old_run_cannot_evict_a_new_one(tmp_path):
    """One join cache serves every run: v48..v50 of expert 0 from an old run must not prune v0 of a new one."""
    c = Cache(tmp_path / "c", keep_versions=3)

    def put(run_id, v):
        w = np.full(10, v, dtype=np.float32) + (0.5 if run_id == "new" else 0.0)
        sha = protocol.weights_sha256(w)
        c.put_weights(sha, expert=0, version=v, step=v, weights=w, opt=None, run_id=run_id)
        return sha

    old = [put("old", v) for v in (48, 49, 50)]
    v0 = put("new", 0)
    assert c.get_weights(v0) is not None and set(old) <= set(c.weights())
    new = [v0] + [put("new", v) for v in (1, 2, 3)]
    assert set(c.weights()) == set(old) | set(new[1:])  # each run keeps its own newest 3


def test_cache_evict_tolerates_files_vanishing(tmp_path, monkeypatch):
    """A file unlinked by another worker between listing and stat is skipped, not an error."""
    c = Cache(tmp_path / "c", max_bytes=0)
    data = b"x" * 100
    sha = hashlib.sha256(data).hexdigest()
    c.put_shard(sha, data)
    gone = tmp_path / "c" / "shards" / f"{sha}.bin"
    real_stat = Path.stat

    def stat(self, *a, **k):
        if self == gone:
            raise FileNotFoundError(self)
        return real_stat(self, *a, **k)

    monkeypatch.setattr(Path, "stat", stat)
    monkeypatch.setattr(Path, "exists", lambda self, *a, **k: True)
    assert c.evict() == []
