"""Which shards each expert trains and validates on (RUN/prepare.json), and how many bytes each shard has.

Called by coordinator.dispatch (what a node must fetch), coordinator.evaluation (val streams),
coordinator.intake (audits) and coordinator.fleet (heartbeat advice).
"""

from __future__ import annotations

from typing import Any

from coordinator.prepare import expert_shards
from soma_edge import seed as seed_mod
from soma_edge.config import Config


class Shards:
    def __init__(self, cfg: Config, prep: dict[str, Any]) -> None:
        self.cfg, self.prep = cfg, prep
        self.sizes: dict[str, int] = {
            c["shards"][s]: int(c["bytes"][s]) for c in prep["clusters"] for s in c["shards"]
        }  # shard hash -> bytes

    def of(self, e: int, split: str) -> list[str]:
        """Expert e's shards of `split`; the seed's are every cluster's."""
        if seed_mod.enabled(self.cfg) and e == seed_mod.seed_expert(self.cfg):
            return [h for x in range(self.cfg.federation.experts) for h in expert_shards(self.prep, x, split)]
        return list(expert_shards(self.prep, e, split))

    def train(self, e: int) -> list[str]:
        return self.of(e, "train")
