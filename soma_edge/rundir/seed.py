"""The seed run (`federation.seed_steps > 0`), as the SOMA paper starts its experts.

One seed expert, with its own id (`seed_expert`: the first id after the experts, so its noise and batch
keys are its own) trains on every training shard for `seed_steps` SPSA steps, with the run's config.
Its weights then become version 0 of every expert, which start at step 0 with fresh optimizer state
and train with `soma_edge.config.expert_config`: the decoder frozen (`model.seed_decoder = "frozen"`, the
paper's choice) or still learning by the run's `spsa.decoder` rule ("delta").

Under a fixed budget (`federation.max_steps`, steps per expert) the seed's forward passes are paid out of
the experts' steps, so a seeded run and an unseeded one cost the same compute (`soma_edge.config.expert_steps`:
a config rule, which config.validate checks).
"""

from __future__ import annotations

from soma_edge.config import Config
from soma_edge.rundir.state import PrepareSummary


def enabled(cfg: Config) -> bool:
    return cfg.federation.seed_steps > 0


def seed_expert(cfg: Config) -> int:
    """The seed's expert id (noise key and batch stream): one past the last expert."""
    return cfg.federation.experts


def shards(cfg: Config, prep: PrepareSummary, e: int, split: str) -> list[str]:
    """Expert e's shards of `split` (RUN/prepare.json); the seed's are every expert's, in expert order."""
    if enabled(cfg) and e == seed_expert(cfg):
        return [h for x in range(cfg.federation.experts) for h in prep.shards(x, split)]
    return prep.shards(e, split)
