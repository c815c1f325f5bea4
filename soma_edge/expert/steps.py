"""An expert's SPSA steps as a run's config defines them, shared by whoever takes or retakes them: the
worker's training loop, the coordinator's replay and audit of update logs, and a worker rebuilding a
version from a downstream log. Each must use the same stepper (the layout's body, dense gains and tensor
shapes, which rank-1 probes split into matrices and vectors) and
the same minibatches (drawn from the step's key), or the bits would differ.
"""

from __future__ import annotations

import numpy as np

from soma_edge.config import Config
from soma_edge.corpus.documents import batch_rng, sample_batch
from soma_edge.expert.params import layout
from soma_edge.spsa import recipe
from soma_edge.spsa.log import UpdateLog
from soma_edge.spsa.log import replay as replay_log
from soma_edge.spsa.optim import State
from soma_edge.spsa.stepper import Objective, Stepper


def stepper(cfg: Config, expert: int, parallel: int = 1) -> Stepper:
    lay = layout(cfg.model)
    return Stepper(
        cfg.spsa, seed=cfg.seed, expert=expert, parallel=parallel, body=lay.body, dense=lay.dense(), shapes=lay.shapes
    )


def objectives(data: np.ndarray, cfg: Config, evaluator, expert: int, step: int) -> list[Objective]:
    """The step's `accumulate` minibatches, each drawn from its own key, as SPSA objectives
    (`evaluator`: a `soma_edge.engine.evaluator.LossEvaluator` of the run's model). Where it carries a population
    evaluator (evaluator.evaluator_for chose it), each objective's `members` evaluates the minibatch's whole
    population in one call, and the Stepper takes that path."""
    out = []
    pop = evaluator.population
    for x, y in batches(data, cfg, expert, step):
        clean = (lambda w, x=x, y=y: evaluator.clean(w, x, y)) if evaluator.train_session is not None else None
        members = (lambda w, probes, eps, x=x, y=y: pop.members(w, probes, eps, x, y)) if pop is not None else None
        out.append(
            Objective(
                loss=lambda w, x=x, y=y: evaluator.loss(w, x, y),
                clean=clean,
                members=members,
                part=lambda w, i, n, x=x, y=y: evaluator.loss(w, *rows_part(x, y, i, n)),
                part_clean=lambda w, i, n, x=x, y=y: evaluator.clean(w, *rows_part(x, y, i, n)),
            )
        )
    return out


def rows_part(x: np.ndarray, y: np.ndarray, i: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Part i of a minibatch's rows cut in n equal slices (spsa.split_rows: direction i's own rows)."""
    if len(x) % n:  # config.validate refuses such a batch; a Config built in code is not validated
        raise ValueError(f"a minibatch of {len(x)} rows does not cut into {n} equal slices (spsa.split_rows)")
    rows = len(x) // n
    return x[i * rows : (i + 1) * rows], y[i * rows : (i + 1) * rows]


def batches(data: np.ndarray, cfg: Config, expert: int, step: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The step's `accumulate` minibatches (x, y), each drawn from its own key."""
    keys = [batch_rng(cfg.seed, expert, step, part) for part in range(cfg.spsa.accumulate)]
    return [sample_batch(data, cfg.data.batch, cfg.data.seq_len, key) for key in keys]


def replay(cfg: Config, state: State, log: UpdateLog, expert: int) -> State:
    """`soma_edge.spsa.log.replay` of expert `expert`'s log under the run's config (ValueError if it does not fit,
    or ran another recipe)."""
    recipe.check(log.recipe, cfg)
    lay = layout(cfg.model)
    return replay_log(
        cfg.spsa, state, log, seed=cfg.seed, expert=expert, body=lay.body, dense=lay.dense(), shapes=lay.shapes
    )


def log_body(cfg: Config) -> int:
    """What `spsa.log.record_log` needs to know of the layout: the body's size when a delta-rule decoder's
    dense update must ride along with the scalars, else 0."""
    return layout(cfg.model).body if cfg.spsa.decoder == "delta" else 0
