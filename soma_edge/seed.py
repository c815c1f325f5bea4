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

import copy
import math

from soma_edge.config import Config
from soma_edge.spsa import evals_per_step


def enabled(cfg: Config) -> bool:
    return cfg.federation.seed_steps > 0


def seed_expert(cfg: Config) -> int:
    """The seed's expert id (noise key and batch stream): one past the last expert."""
    return cfg.federation.experts


def expert_config(cfg: Config) -> Config:
    """The config the experts train with after a seed run (the run's own config without one)."""
    if not enabled(cfg) or cfg.model.seed_decoder != "frozen":
        return cfg
    out = copy.deepcopy(cfg)
    out.spsa.decoder = "frozen"
    return out


def expert_steps(cfg: Config) -> int:
    """Steps each expert may take under `federation.max_steps` once the seed's forward passes are paid:
    max_steps - ceil(seed_steps * seed evals per step / (N * expert evals per step)). 0 means no cap."""
    f = cfg.federation
    if not f.max_steps or not enabled(cfg):
        return f.max_steps
    seed_evals = f.seed_steps * evals_per_step(cfg.spsa)
    return f.max_steps - math.ceil(seed_evals / (f.experts * evals_per_step(expert_config(cfg).spsa)))
