"""Update logs: a worker's round of SPSA steps as scalars, replayed bit for bit in another process.

Each variant trains 200 real steps with the worker's loop (`worker.trainer.train`, ORT on the CPU EP) and
records its log; one separate process replays every log from the version it started at, as the
coordinator would, and must land on the same weights and optimizer state byte for byte.
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from soma_edge import checkpoint, params, spsa
from soma_edge.config import Config, from_dict
from soma_edge.errors import CheckpointError

STEPS = 200
BASE = {"model": {"embed": 8, "hidden": 16}, "data": {"batch": 2, "seq_len": 16}, "device": "cpu",
        "spsa": {"directions": 2, "warmup_steps": 5}}  # fmt: skip
VARIANTS = {  # every noise kind and optimizer option the trainer has
    "rademacher-sparse-adam-delta": {},
    "rademacher-dense-rms-momentum": {"density": 1.0, "update": "rms", "momentum": 0.9, "decoder": "spsa"},
    "gaussian-sgd-momentum-wd": {"noise": "gaussian", "update": "sgd", "lr": 1e-4, "momentum": 0.5,
                                 "weight_decay": 1e-3, "decoder": "frozen"},  # fmt: skip
    "gaussian-adam-accumulate-delta": {"noise": "gaussian", "accumulate": 2, "total_steps": 150},
    "rms-delta-tied-eps": {"update": "rms", "tie_eps_to_lr": True, "plateau": False},
    "soma-kind-adam-delta": {"model": {"kind": "soma", "embed": 8, "hidden": 8}},
}


def _config(name: str) -> Config:
    v = dict(VARIANTS[name])
    model = {**BASE["model"], **v.pop("model", {})}
    return from_dict({**BASE, "model": model, "spsa": {**BASE["spsa"], **v}})


def _train(cfg: Config, expert: int, start: spsa.State) -> tuple[spsa.State, spsa.UpdateLog]:
    from soma_edge.runtime import evaluator_for
    from worker.trainer import train

    state = spsa.State(start.weights.copy(), step=start.step, opt=spsa._copy_opt(start.opt))
    state.opt.lr_scale = 0.5  # the coordinator's plateau factor for the round: the log carries it
    data = np.frombuffer(b"".join(bytes([i % 97 + 32]) * (i % 7 + 1) for i in range(4000)), dtype=np.uint8)
    lay = params.layout(cfg.model)
    rep = train(state, data, cfg, evaluator_for(cfg, threads=1, parallel=1), expert=expert, steps=STEPS)
    assert rep.steps == STEPS
    return state, spsa.record_log(start.step, 0.5, rep.grads, state, lay.body if cfg.spsa.decoder == "delta" else 0)


REPLAY_CHILD = """
import sys
import numpy as np
from soma_edge import checkpoint, params, spsa
from soma_edge.config import from_dict
jobs = checkpoint.load(sys.argv[1], "replay_jobs")
out = {}
for name, job in jobs.items():
    cfg = from_dict(job["config"])
    lay = params.layout(cfg.model)
    base = spsa.State(job["weights"], step=job["step"], opt=spsa.OptState.from_record(job["opt"], job["weights"].size))
    log = spsa.UpdateLog.from_record(job["log"])
    got = spsa.replay(cfg.spsa, base, log, seed=cfg.seed, expert=job["expert"], body=lay.body, dense=lay.dense())
    out[name] = {"weights": got.weights, "opt": got.opt.to_record(), "step": got.step}
checkpoint.save(sys.argv[2], out, "replay_results")
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every variant trained for STEPS steps from a mid-run version (step 37, optimizer state present)."""
    runs = {}
    for i, name in enumerate(VARIANTS):
        cfg = _config(name)
        w0 = params.init(cfg.model, cfg.seed)
        warm, _ = _train(cfg, i, spsa.State(w0))  # a version with a history, as a second round starts from
        warm.step = 37  # any step: the keys and the schedule follow it
        end, log = _train(cfg, i, warm)
        runs[name] = (cfg, i, warm, end, log)
    root = tmp_path_factory.mktemp("replay")
    jobs = {name: {"config": cfg.to_dict(), "expert": e, "weights": warm.weights, "step": warm.step,
                   "opt": warm.opt.to_record(), "log": log.to_record()}
            for name, (cfg, e, warm, end, log) in runs.items()}  # fmt: skip
    checkpoint.save(root / "jobs.msgpack", jobs, "replay_jobs")
    r = subprocess.run([sys.executable, "-c", REPLAY_CHILD, str(root / "jobs.msgpack"), str(root / "out.msgpack")],
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return runs, checkpoint.load(root / "out.msgpack", "replay_results")


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_replay_in_another_process_matches_the_worker_bit_for_bit(trained, name):
    runs, replayed = trained
    cfg, _, warm, end, log = runs[name]
    got = replayed[name]
    assert got["step"] == end.step == warm.step + STEPS
    assert got["weights"].tobytes() == end.weights.tobytes()
    assert not np.array_equal(end.weights, warm.weights)
    for k in ("momentum", "adam_m", "adam_v"):
        a, b = got["opt"][k], getattr(end.opt, k)
        assert (a is None and b is None) or a.tobytes() == b.tobytes(), k
    assert got["opt"]["adam_t"] == end.opt.adam_t and got["opt"]["lr_scale"] == 0.5
    sizes = log.nbytes()
    assert sizes["body"] == STEPS * cfg.spsa.directions * cfg.spsa.accumulate * 4
    dense = cfg.spsa.decoder == "delta"
    assert (sizes["decoder"] > 0) == dense
    if not dense:  # the log is tiny next to the weights and optimizer state it stands for
        assert sizes["body"] * 3 < end.weights.nbytes


def _good(trained, name="rademacher-sparse-adam-delta"):
    runs, _ = trained
    cfg, e, warm, end, log = runs[name]
    return cfg, e, warm, log


@pytest.mark.parametrize("breaker,message", [
    (lambda log: spsa.UpdateLog(log.start, log.grads[:, :1], log.lr_scale, log.decoder, log.decoder_m, log.decoder_v),
     "each step needs 2"),
    (lambda log: spsa.UpdateLog(log.start, np.where(np.arange(log.grads.size).reshape(log.grads.shape) == 7, np.nan,
                                                    log.grads).astype(np.float32), log.lr_scale, log.decoder,
                                log.decoder_m, log.decoder_v), "non-finite scalars"),
    (lambda log: spsa.UpdateLog(log.start + 1, log.grads, log.lr_scale, log.decoder, log.decoder_m, log.decoder_v),
     "the log starts at step 38, the version is at step 37"),
    (lambda log: spsa.UpdateLog(log.start, log.grads, log.lr_scale, None, None, None), "needs its finite float32"),
    (lambda log: spsa.UpdateLog(log.start, log.grads, log.lr_scale, log.decoder[:-1], log.decoder_m, log.decoder_v),
     "needs its finite float32"),
])  # fmt: skip
def test_replay_refuses_a_log_that_does_not_fit(trained, breaker, message):
    cfg, e, warm, log = _good(trained)
    before = warm.weights.tobytes()
    lay = params.layout(cfg.model)
    with pytest.raises(ValueError, match=message):
        spsa.replay(cfg.spsa, warm, breaker(log), seed=cfg.seed, expert=e, body=lay.body, dense=lay.dense())
    assert warm.weights.tobytes() == before  # nothing changed


@pytest.mark.parametrize("edit,message", [
    ({"start": -1}, "is not a step"), ({"grads": [1.0]}, "float32 [steps, directions]"),
    ({"lr_scale": 2.0}, "not in (0, 1]"), ({"decoder": None}, "all be float32 vectors, or none"),
    ({"extra": 1}, "not an update log record"),
])  # fmt: skip
def test_update_log_records_are_type_checked(trained, edit, message):
    _, _, _, log = _good(trained)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        spsa.UpdateLog.from_record({**log.to_record(), **edit})
