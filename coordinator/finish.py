"""Finished experts: an expert that can no longer improve stops training, as Keras's EarlyStopping and the
Hugging Face Trainer's early stopping stop a model, and keeps its best version.

At the preprint's N an expert has little text (35 KB on average at N = 256 on the default corpus): its
SPSA steps soon read each byte many times, its val loss stops falling, then rises as it overfits, and the
plateau rule's lr halvings only slow that down. Training it on costs the round's share it takes from
experts that still learn. Two rules, counted in the expert's own verdicts (each round's result of it, as
the guard judged it), never in rounds of the run (an expert in turn trains only some rounds) or steps (a
slow node's round is a verdict too):

- patience: `federation.finish_patience` accepted versions in a row, none of which brought its val loss
  `federation.finish_min_delta` nats/byte below its mark (the val loss of its last such gain);
- refusals: `federation.finish_refusals` guard refusals with no such gain between them (an expert that
  overfits, or overshoots at every lr the plateau rule leaves it).

A finished expert leaves the plans (its share of each round goes to the others), and what `soma-export`
ships is its best version, as for every expert. `soma-coord start --reopen` trains the finished experts
of a resumed run again, their counts started afresh. When every expert is finished, the run ends.

Called by coordinator.intake with each verdict; the counts live in the expert's state.msgpack entry.
"""

from __future__ import annotations

from soma_edge.config import FederationConfig
from soma_edge.rundir.state import ExpertRecord

PATIENCE = "patience"
REFUSALS = "refusals"


def after_accept(x: ExpertRecord, val: float, fed: FederationConfig) -> str | None:
    """Count an accepted version of val loss `val` into x (the expert's new entry, with the counts its last
    one had); why it is finished now, else None."""
    if x.mark is None or val < x.mark - fed.finish_min_delta:
        x.mark, x.stale, x.refusals = val, 0, 0
        return None
    x.stale += 1
    if fed.finish_patience and x.stale >= fed.finish_patience:
        return finish(
            x,
            PATIENCE,
            f"{x.stale} versions without a gain of {fed.finish_min_delta:g} nats/byte below {x.mark:.4f} "
            f"(federation.finish_patience)",
        )
    return None


def after_refusal(x: ExpertRecord, fed: FederationConfig) -> str | None:
    """Count a guard refusal into x; why it is finished now, else None."""
    x.refusals += 1
    if fed.finish_refusals and x.refusals >= fed.finish_refusals:
        return finish(
            x,
            REFUSALS,
            f"{x.refusals} versions refused by the guard with no gain of {fed.finish_min_delta:g} nats/byte "
            f"between them (federation.finish_refusals)",
        )
    return None


def finish(x: ExpertRecord, rule: str, why: str) -> str:
    x.finished = f"{rule}: {why}"
    return x.finished


def rule_of(finished: str) -> str:
    """The rule named in a `finished` reason ("patience" or "refusals")."""
    return finished.split(":", 1)[0]


def reopen(x: ExpertRecord) -> bool:
    """Train a finished expert again, its counts afresh; True if it was finished."""
    was = x.finished is not None
    x.finished, x.stale, x.refusals = None, 0, 0
    return was
