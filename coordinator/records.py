"""The records the coordinator writes, each built here in one function from what the round knows: the
run state of a new run and an expert's entry in it (soma_edge.rundir's RunState and ExpertRecord), a
stored version's checkpoint body, the expert and round lines of metrics.jsonl and status.json
(soma_edge.rundir.metrics's ExpertLine, RoundLine and Status). Their dicts, and so their bytes, come from the
records' `to_dict` when they are written (coordinator.ledger, `Loop.status`).

Called by coordinator.ledger (state, expert entries, checkpoints), coordinator.intake (accepted results)
and coordinator.loop (the round's lines, status).
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from typing import Any

import numpy as np

from soma_edge import __version__
from soma_edge.config import Config
from soma_edge.rundir import seed as seed_mod
from soma_edge.rundir.metrics import ExpertLine, Line, NodeEntry, RoundLine, Status
from soma_edge.rundir.state import BestVersion, ExpertRecord, GuardBar, PrepareSummary, RunState
from soma_edge.spsa.log import UpdateLog
from soma_edge.spsa.optim import OptState
from soma_edge.wire import compute_share


def run_state(cfg: Config, experts: dict[str, ExpertRecord], seeded: bool) -> RunState:
    """A new run's state.msgpack: round 0, every expert at version 0."""
    return RunState(
        round=0,
        rounds=cfg.federation.rounds,
        run_id=uuid.uuid4().hex,
        experts=experts,
        assignment={},
        phase="seed" if seeded else "experts",
        strikes={},
        soma_version=__version__,
    )


def expert_record(
    version: int,
    sha256: str,
    path: str,
    step: int,
    train_loss: float | None,
    val_loss: float,
    node: str | None,
    best: BestVersion,
    opt: OptState,
    bar: GuardBar | None = None,
) -> ExpertRecord:
    """An expert's entry in state.msgpack: its current version, where it is stored, its best version, the
    plateau rule's state (the next round's task reads it) and the guard's bar."""
    return ExpertRecord(
        version=version,
        sha256=sha256,
        path=path,
        step=step,
        train_loss=train_loss,
        val_loss=val_loss,
        node=node,
        best=best,
        lr_scale=opt.lr_scale,
        best_val=opt.best_val,
        best_step=opt.best_step,
        bar=bar,
    )


def expert_body(
    e: int, version: int, sha256: str, cfg: Config, step: int, w: np.ndarray, opt: OptState | None, val: float
) -> dict[str, Any]:
    """A stored version of expert `e` (RUN/experts/<e>/v<version>.msgpack)."""
    return {
        "expert": e,
        "version": version,
        "sha256": sha256,
        "config": cfg.to_dict(),
        "step": step,
        "weights": w,
        "opt": opt.to_record() if opt is not None else None,
        "val_loss": val,
    }


def epochs(cfg: Config, prep: PrepareSummary, e: int, step: int) -> float | None:
    """How many times expert e's steps have read its train text: the bytes of `step` steps' batches
    (data.batch windows of data.seq_len bytes) over its train shards' bytes (None: it has none)."""
    sizes = prep.shard_sizes()
    total = sum(sizes.get(h, 0) for h in seed_mod.shards(cfg, prep, e, "train"))
    return step * cfg.data.batch * cfg.data.seq_len / total if total else None


def expert_line(
    r: int,
    res: dict[str, Any],
    node: Any,
    val: float,
    w: np.ndarray,
    opt: OptState,
    ulog: UpdateLog | None,
    sent: dict[str, int],
    reply: dict[str, Any],
    trained_at: float,
    best: BestVersion,
    lr: float,
    eps: float,
) -> ExpertLine:
    """The metrics line of an accepted version (`node`: a coordinator.fleet.Node)."""
    return ExpertLine(
        round=r,
        expert=res["expert"],
        accepted=True,
        version=res["version"],
        sha256=res["sha256"],
        node=node.label,
        node_id=node.id,
        train_loss=float(res["train_loss"]),
        val_loss=val,
        steps=res["steps"],
        forward_evals=res["forward_evals"],
        seconds=float(res["seconds"]),
        steps_per_s=res["steps"] / res["seconds"] if res["seconds"] else None,
        weights_bytes_down=sent.get("weights", 0),
        shard_bytes_down=sent.get("shards", 0),
        weights_bytes_up=int(w.nbytes) if res.get("weights") is not None else 0,
        opt_bytes_up=opt.nbytes() if res.get("opt") is not None else 0,
        log_bytes_up=ulog.nbytes() if ulog is not None else None,
        torch_importable=reply.get("torch_importable"),
        lr_scale=trained_at,
        next_lr_scale=opt.lr_scale,
        best_version=best.version,
        step=res["step"],
        lr=lr,
        eps=eps,
        evaluator=res.get("evaluator"),
        recipe=_probes(ulog, node),
    )


def _probes(ulog: UpdateLog | None, node: Any) -> dict[str, Any] | None:
    """The probes a version was made with: its log's, else its node's (a weights reply)."""
    if ulog is not None and ulog.recipe is not None:
        return ulog.recipe.probes().to_record()
    return node.probes.to_record() if node.probes is not None else None


def missed_line(r: int, e: int, x: ExpertRecord, reason: str, node: str) -> ExpertLine:
    """The metrics line of an expert that did not advance this round (`x`: its state.msgpack entry)."""
    return ExpertLine(
        round=r,
        expert=e,
        accepted=False,
        reason=reason,
        version=x.version,
        sha256=x.sha256,
        node=node,
        val_loss=x.val_loss,
        train_loss=x.train_loss,
        steps=0,
        forward_evals=0,
        seconds=0.0,
    )


def commit_lines(
    rnd: Any,
    cfg: Config,
    state: RunState,
    labels: dict[int, str],
    mix: float | None,
    round_total: float,
    ahead: bool,
    settle: float | None = None,
) -> list[Line]:
    """What round `rnd` (a coordinator.round.Round) appends to metrics.jsonl: last round's late versions, a
    line per expert, accepted or not, then the round's line."""
    lines: list[Line] = list(rnd.late)
    ids = state.expert_ids()
    for e in ids:
        if e in rnd.accepted:
            lines.append(rnd.accepted[e])
        elif e in rnd.plan.assignment:
            why = rnd.failed.get(e, "not trained this round")
            lines.append(missed_line(rnd.r, e, state.expert(e), why, labels[rnd.plan.assignment[e]]))
        # else: left out of the round (it cannot train: state.msgpack's `cannot_train` says why)
    vals = [v for v in (state.expert(e).val_loss for e in ids) if v is not None]
    line = round_line(rnd, cfg, state, vals, mix, labels, round_total, ahead)
    line.settle_seconds = settle
    lines.append(line)
    return lines


def round_line(
    rnd: Any,
    cfg: Config,
    state: RunState,
    vals: list[float],
    mix: float | None,
    labels: dict[int, str],
    round_total: float,
    ahead: bool,
) -> RoundLine:
    """Round `rnd`'s metrics line (`rnd`: a coordinator.round.Round; `labels`: node id -> label)."""
    wall = max(rnd.t_done - rnd.t_sent, 1e-9)
    planned = set(rnd.plan.assignment.values())  # by id: two workers may share a name
    nodes = sorted(labels[n] for n in planned)
    return RoundLine(
        round=rnd.r,
        rounds=cfg.federation.rounds,
        phase=state.phase,
        accepted=len(rnd.accepted),
        rejected=rnd.rejected,
        excluded=rnd.excluded,
        missed=sorted(rnd.failed),
        val_loss_mean=float(np.mean(vals)) if vals else None,
        mixture_val_loss=mix,
        wall_seconds=wall,
        round_seconds_total=round_total,
        compute_seconds={labels[n]: s for n, s in sorted(rnd.compute.items())},
        compute_share=share_at_commit(rnd, round_total),
        predicted_makespan=rnd.plan.makespan,
        moved=rnd.plan.moved,
        bytes_down=rnd.bytes_down,
        bytes_up=rnd.bytes_up,
        nodes=nodes,
        time=time.time(),
        planned_at=rnd.planned_at or None,
        trained={labels[n]: compute_share.record(spans) for n, spans in rnd.trained.items()},
        next_round_ahead=ahead,
        finished={str(e): why for e, why in sorted(rnd.finished.items())},
    )


def share_at_commit(rnd: Any, round_total: float) -> float:
    """Round `rnd`'s compute share as far as its commit knows (soma_edge.wire.compute_share): the training its
    results (and last round's late ones) report inside its span, on the nodes it planned. What the next
    round's results trained inside this span (a worker training on while its reply was in flight) is not in
    yet; `soma-coord report` recounts with it."""
    planned = set(rnd.plan.assignment.values())  # node ids
    return compute_share.share(rnd.trained, planned, rnd.planned_at, rnd.planned_at + round_total)


def status(phase: str, cfg: Config, state: RunState | None, nodes: dict[int, Any], **extra: Any) -> Status:
    """status.json: the run's phase, its experts and its nodes (coordinator.fleet.Node), as `soma-coord`
    shows them; `extra`: the phase's own fields (Status). `state` None: the run state did not load."""
    status = Status(
        phase=phase,
        pid=os.getpid(),
        time=time.time(),
        round=0 if state is None else state.round,
        rounds=cfg.federation.rounds,
        round_seconds=cfg.federation.round_seconds,
        experts={} if state is None else state.experts,
        nodes={
            str(n.id): NodeEntry(
                name=n.name,
                status=n.status,
                rate=n.rate,
                torch_importable=n.caps.get("torch_importable"),
                recipe=n.probes.describe() if n.probes is not None else None,
            )
            for n in nodes.values()
        },
    )
    return dataclasses.replace(status, **extra)  # the phase's own fields, or a round other than the committed one


def reasons(experts: dict[int, str], most: int = 4) -> str:
    """Experts and why, grouped by reason, in one line that stays short at any N."""
    by: dict[str, list[int]] = {}
    for e, why in sorted(experts.items()):
        by.setdefault(why, []).append(e)
    parts = [f"{_ids(es)}: {why}" for why, es in sorted(by.items(), key=lambda kv: -len(kv[1]))]
    return "; ".join(parts[:most]) + (f"; and {len(parts) - most} other reasons" if len(parts) > most else "")


def _ids(es: list[int]) -> str:
    return (
        f"expert {es[0]}"
        if len(es) == 1
        else f"{len(es)} experts ({', '.join(map(str, es[:6]))}{', ...' * (len(es) > 6)})"
    )
