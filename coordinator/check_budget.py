"""What checking a node's update logs costs the coordinator, and the plan that keeps a round's checks within
CHECK_SHARE of the round.

A log's replay rebuilds every step of it, body-many additions a direction; its audit (federation.audit_steps)
recomputes the sampled steps' losses and, under the delta rule, the decoder along every step: about the
worker's own forward work. A GPU worker's logs can therefore cost the coordinator's CPU more than the round
they came from (docs/BENCHMARKS.md, "Checking update logs"). Both parts are timed on every log checked, per
node (its recipe fixes the cost per log step), as log steps per second of one check thread; a node whose
logs have not been timed yet is planned as if they were free.

With `reply = "auto"`, logs that would take longer to check than the node's share of the budget (`budget`)
give way to the weights, where those cross the node's link sooner than the logs would be checked
(`prefer_weights`). Where logs are asked all the same (`reply = "log"`, or a link slower still), the
coordinator says so when a node's logs go over their budget (coordinator.dispatch); `federation.audit_share`
audits only that share of the logs, each drawn from the coordinator's secret key (`audited`) so that no
worker can tell which of its logs will be. Every log is still replayed: the replay is what gives the version.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from soma_edge.config import Config, check_threads

CHECK_SHARE = 0.10  # of a round: what its checks may take, beyond its compute


@dataclass
class CheckCost:
    """A node's logs as the coordinator's checks ran them: log steps per second of one check thread, for
    the replay and for the audit (None: not timed yet)."""

    replay: float | None = None
    audit: float | None = None

    def seen(self, steps: int, replay_seconds: float, audit_seconds: float | None) -> None:
        """Blend in one checked log of `steps` steps (audit_seconds None: not audited)."""
        if steps <= 0:
            return
        self.replay = _blend(self.replay, steps / max(replay_seconds, 1e-6))
        if audit_seconds is not None:
            self.audit = _blend(self.audit, steps / max(audit_seconds, 1e-6))


def _blend(old: float | None, seen: float) -> float:
    return seen if old is None else 0.5 * old + 0.5 * seen


def budget(cfg: Config, nodes: int) -> float:
    """Check seconds of one thread that one of `nodes` nodes' logs may take a round: CHECK_SHARE of the round
    on each of the check threads, shared out among the nodes."""
    return CHECK_SHARE * cfg.federation.round_seconds * check_threads(cfg) / max(nodes, 1)


def audit_share(cfg: Config) -> float:
    """The share of a node's logs the coordinator audits: federation.audit_share where audits are on, else 0."""
    return cfg.federation.audit_share if cfg.federation.audit_steps else 0.0


def log_seconds(cost: CheckCost, steps: int, audit_share: float) -> float:
    """One thread's seconds to check a node's logs of `steps` log steps in all, auditing `audit_share` of them
    (0 where not timed yet)."""
    replay = steps / cost.replay if cost.replay else 0.0
    return replay + (audit_share * steps / cost.audit if cost.audit and audit_share else 0.0)


def prefer_weights(cost: CheckCost, steps: int, seconds: float, audit_share: float, weights_seconds: float) -> bool:
    """Whether a node's logs of `steps` log steps, `audit_share` of them audited, would take longer than
    `seconds` to check, and its weights (`weights_seconds` on its link) would cost the round less."""
    took = log_seconds(cost, steps, audit_share)
    return took > seconds and math.isfinite(weights_seconds) and weights_seconds < took


def audited(key: int, expert: int, version: int, audit_share: float) -> bool:
    """Whether the log that made `version` of `expert` is audited, at `audit_share`: drawn from the
    coordinator's secret key, as its steps are (coordinator.replay.sample_steps). A worker that invents a share
    f of a log's steps is caught in an audited log with probability about 1 - (1 - f)^s."""
    if audit_share >= 1.0:
        return True
    return bool(np.random.default_rng([key, expert, version, 0xA0D2]).random() < audit_share)
