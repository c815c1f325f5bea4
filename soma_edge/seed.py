"""The seed run (`federation.seed_steps > 0`), as the SOMA paper starts its experts.

One seed expert, with its own id (`seed_expert`: the first id after the experts, so its noise and batch
keys are its own) trains on every training shard for `seed_steps` SPSA steps, with the run's config.
Its weights then become version 0 of every expert, which start at step 0 with fresh optimizer state
and train with `expert_config`: the decoder frozen (`model.seed_decoder = "frozen"`, the paper's choice)
or still learning by the run's `spsa.decoder` rule ("delta").

Under a fixed budget (`federation.max_steps`, steps per expert) the seed's forward passes are paid out of
the experts' steps, so a seeded run and an unseeded one cost the same compute (`expert_steps`).
"""

from __future__ import annotations

# The seed run's config and budget are config rules (config.validate checks the budget), defined there;
# named here too, with the rest of the seed run, for the round loop.
from soma_edge.config import Config
from soma_edge.config import expert_config as expert_config
from soma_edge.config import expert_steps as expert_steps


def enabled(cfg: Config) -> bool:
    return cfg.federation.seed_steps > 0


def seed_expert(cfg: Config) -> int:
    """The seed's expert id (noise key and batch stream): one past the last expert."""
    return cfg.federation.experts
