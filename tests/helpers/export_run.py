"""A run directory in the coordinator's layout, built directly with soma_edge.checkpoint and a real router
fitted on three small domains: what the export tests read, without a federation or the corpus cache."""

from __future__ import annotations

import hashlib
import json
import pydoc_data.topics
import textwrap
from pathlib import Path

import numpy as np

from soma_edge import checkpoint
from soma_edge.config import Config, DataConfig, ModelConfig
from soma_edge.corpus import router
from soma_edge.expert import params

T = 32  # the runs' seq_len: the window of their bundles


def domains() -> list[bytes]:
    """Three small, clearly different domains: Python source, English prose, numeric tables."""
    code = b"".join(Path(m.__file__).read_bytes() for m in (textwrap, json.decoder, json.encoder))
    prose = "\n\n".join(list(pydoc_data.topics.topics.values())[:40]).encode()
    rng = np.random.default_rng(0)
    table = "\n".join(",".join(f"{v:.3f}" for v in rng.standard_normal(6)) for _ in range(600)).encode()
    docs = []
    for text in (code, prose, table):
        docs += [text[i : i + 2048] for i in range(0, min(len(text), 12 * 2048), 2048)]
    return docs


def _weights(m: ModelConfig, seed: int) -> np.ndarray:
    # std 0.5 on every tensor: experts far from uniform and far from each other.
    return (np.random.default_rng(seed).standard_normal(params.count(m)) * 0.5).astype(np.float32)


def make_run(root: Path, m: ModelConfig, n: int, docs: list[bytes], f16: tuple[int, ...] = ()) -> dict[int, np.ndarray]:
    """A run directory as the coordinator writes it; returns the float32 weights training would use."""
    cfg = Config(model=m, data=DataConfig(batch=4, seq_len=T), device="cpu")
    r, _ = router.fit(docs, n, seed=0, dim=256)
    checkpoint.atomic_write(root / "router.msgpack", r.to_bytes())
    experts, used = {}, {}
    for e in range(n):
        w = _weights(m, 100 + e)
        stored = w.astype(np.float16) if e in f16 else w
        sha = hashlib.sha256(stored.tobytes()).hexdigest()
        rel = f"experts/{e}/v{e + 1}.msgpack"
        body = {
            "expert": e,
            "version": e + 1,
            "sha256": sha,
            "config": cfg.to_dict(),
            "step": 10 * (e + 1),
            "weights": stored,
            "val_loss": 2.5 + e if e else None,
        }
        checkpoint.save(root / rel, body, "expert")
        experts[str(e)] = {"version": e + 1, "sha256": sha, "path": rel}
        used[e] = stored.astype(np.float32)
    checkpoint.save(root / "state.msgpack", {"round": 4, "experts": experts}, "run_state")
    return used
