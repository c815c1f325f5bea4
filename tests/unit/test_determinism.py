"""Same seed and config: bit-identical weights from two separate processes on the CPU EP.

Each comparison trains in two processes: this test process (`train`), and a fresh one, which for the seed
test is `python -m worker.cli` itself. Only that one reads the default corpus (~2 s a process); the others
take the session's copy (tests/unit/conftest.py), which the CLI then reads as it would its own."""

import subprocess
import sys

import numpy as np
import pytest

from soma_edge import checkpoint
from soma_edge.config import ModelConfig
from soma_edge.expert import params


def _train_args(tmp_path, name: str, seed: int) -> list[str]:
    cfg = tmp_path / "cfg.toml"
    cfg.write_text('device = "cpu"\n[model]\nembed = 16\nhidden = 48\n[data]\nbatch = 4\nseq_len = 32\n')
    run = ["--steps", "20", "--seed", str(seed), "--out", str(tmp_path / f"{name}.msgpack")]
    return ["--config", str(cfg), *run, "--eval-windows", "4", "--json"]


def _weights(tmp_path, name: str) -> np.ndarray:
    body = checkpoint.load(tmp_path / f"{name}.msgpack", "expert")
    assert body["step"] == 20
    return body["weights"]


def test_same_seed_same_bits_other_seed_differs(tmp_path, train):
    cmd = [sys.executable, "-m", "worker.cli", "train", *_train_args(tmp_path, "a", 0)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    train(*_train_args(tmp_path, "b", 0))
    train(*_train_args(tmp_path, "c", 1))
    a, b, c = (_weights(tmp_path, name) for name in "abc")
    assert a.dtype == np.float32
    assert a.tobytes() == b.tobytes()
    init = params.init(ModelConfig(embed=16, hidden=48), 0)
    assert not np.array_equal(a, init)
    assert not np.array_equal(a, c)


def test_concurrency_does_not_change_the_bits():
    """parallel=1 and parallel=2 (two ORT runs at once) give the same weights: g z is summed in index
    order and the probes' decoder gradients in probe order, with the delta rule, Adam, sparse probes on
    their own rows and accumulation."""
    from soma_edge.config import Config
    from soma_edge.engine.evaluator import evaluator_for
    from soma_edge.expert.steps import rows_part
    from soma_edge.spsa.optim import State
    from soma_edge.spsa.stepper import Objective, Stepper

    cfg = Config(model=ModelConfig(embed=8, hidden=24))
    cfg.spsa.update, cfg.spsa.accumulate, cfg.spsa.density = "adam", 2, 0.5  # 4 directions on their own rows
    rng = np.random.default_rng(0)
    xs = [rng.integers(0, 256, (4, 32)).astype(np.int64) for _ in range(2)]
    out = []
    for parallel in (1, 2):
        ev = evaluator_for(cfg, "cpu", threads=1, parallel=parallel)
        objs = [
            Objective(
                lambda w, x=x, ev=ev: ev.loss(w, x, x),
                part=lambda w, i, n, x=x, ev=ev: ev.loss(w, *rows_part(x, x, i, n)),
                part_clean=lambda w, i, n, x=x, ev=ev: ev.clean(w, *rows_part(x, x, i, n)),
            )
            for x in xs
        ]
        stepper = Stepper(cfg.spsa, seed=5, parallel=ev.parallel, body=params.layout(cfg.model).body)
        state = State(params.init(cfg.model, 0))
        for _ in range(5):
            stepper.step(state, objs)
        stepper.close()
        out.append(state)
    assert out[0].weights.tobytes() == out[1].weights.tobytes()
    assert out[0].opt.adam_v.tobytes() == out[1].opt.adam_v.tobytes()


def _resume_args(tmp_path, *args: str) -> list[str]:
    cfg = tmp_path / "resume.toml"
    cfg.write_text(
        'device = "cpu"\n[model]\nembed = 8\nhidden = 24\n[data]\nbatch = 4\nseq_len = 32\n'
        '[spsa]\ndirections = 2\nupdate = "adam"\nlr = 1e-3\ndensity = 0.5\nweight_decay = 1e-4\n'
        "plateau = true\nplateau_patience = 4\n"
    )
    return ["--config", str(cfg), "--eval-windows", "4", "--check-steps", "4", "--json", *args]


def _cli_train(tmp_path, *args: str):
    cmd = [sys.executable, "-m", "worker.cli", "train", *_resume_args(tmp_path, *args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_resume_restores_the_optimizer_state_bit_for_bit(tmp_path, train):
    """12 steps straight equal 8 steps, a checkpoint, and 4 more: weights, both Adam moments, lr scale. The
    resumed run is a fresh process, so all it can start from is the checkpoint."""
    from soma_edge.spsa.optim import OptState

    straight, first, resumed = tmp_path / "straight.msgpack", tmp_path / "first.msgpack", tmp_path / "resumed.msgpack"
    train(*_resume_args(tmp_path, "--steps", "12", "--out", str(straight)))
    train(*_resume_args(tmp_path, "--steps", "8", "--out", str(first)))
    train(*_resume_args(tmp_path, "--steps", "4", "--resume", str(first), "--out", str(resumed)), fresh=True)
    a, b = checkpoint.load(straight, "expert"), checkpoint.load(resumed, "expert")
    assert a["step"] == b["step"] == 12
    assert a["weights"].tobytes() == b["weights"].tobytes()
    oa, ob = (OptState.from_record(x["opt"], a["weights"].size) for x in (a, b))
    assert oa.adam_m.tobytes() == ob.adam_m.tobytes() and oa.adam_v.tobytes() == ob.adam_v.tobytes()
    assert (oa.lr_scale, oa.best_val, oa.best_step) == (ob.lr_scale, ob.best_val, ob.best_step)


def test_resume_refuses_optimizer_state_that_does_not_fit(tmp_path, train):
    # The refusals run `python -m worker.cli`, for its stderr: they stop before it reads the corpus.
    ckpt = tmp_path / "first.msgpack"
    train(*_resume_args(tmp_path, "--steps", "2", "--out", str(ckpt)))
    body = checkpoint.load(ckpt, "expert")
    body["opt"]["adam_v"] = body["opt"]["adam_v"][:-3]
    checkpoint.save(ckpt, body, "expert")
    r = _cli_train(tmp_path, "--steps", "1", "--resume", str(ckpt))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith("error: --resume")
    assert "adam_v is float32[" in r.stderr
    body["opt"] = None
    body["weights"] = body["weights"].copy()
    body["weights"][5] = np.inf
    checkpoint.save(ckpt, body, "expert")
    r = _cli_train(tmp_path, "--steps", "1", "--resume", str(ckpt))
    assert r.returncode == 2 and "NaN or infinity" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("kind", ["lstm", "soma"])
def test_replay_of_a_real_training_run_is_bit_identical(kind):
    """The worker's own loop on ORT (delta-rule decoder, sparse K = 2, Adam, weight decay, 2 batches per
    update): its scalars and decoder gradients replay the run exactly, without one loss evaluation."""
    from soma_edge.config import Config
    from soma_edge.engine.evaluator import evaluator_for
    from soma_edge.spsa.optim import State
    from soma_edge.spsa.stepper import Stepper
    from worker.trainer import train

    m = ModelConfig(embed=8, hidden=24) if kind == "lstm" else ModelConfig(kind="soma", embed=12, hidden=12, layers=2)
    cfg = Config(model=m, device="cpu")
    cfg.spsa.directions, cfg.spsa.accumulate, cfg.spsa.weight_decay, cfg.spsa.density = 2, 2, 1e-3, 0.5
    cfg.data.batch, cfg.data.seq_len = 4, 32
    data = np.frombuffer(b"replayable forward-only training, one key at a time. " * 40, dtype=np.uint8)
    live = State(params.init(cfg.model, 0))
    rep = train(live, data, cfg, evaluator_for(cfg, threads=1), expert=3, steps=6, keep_decoder_grads=True)
    replayed = State(params.init(cfg.model, 0))
    lay = params.layout(cfg.model)
    stepper = Stepper(cfg.spsa, seed=cfg.seed, expert=3, body=lay.body, dense=lay.dense())
    for g, d in zip(rep.grads, rep.decoder_grads, strict=True):
        stepper.replay(replayed, g, d)
    stepper.close()
    assert replayed.step == live.step == 6
    assert replayed.weights.tobytes() == live.weights.tobytes()
    assert replayed.opt.adam_v.tobytes() == live.opt.adam_v.tobytes()
    if kind == "soma":  # the worker kept the norm gains dense: replaying with sparse gains gives other weights
        assert lay.dense().sum() == 5 * 12
        sparse_gains = State(params.init(cfg.model, 0))
        stepper = Stepper(cfg.spsa, seed=cfg.seed, expert=3, body=lay.body)
        for g, d in zip(rep.grads, rep.decoder_grads, strict=True):
            stepper.replay(sparse_gains, g, d)
        stepper.close()
        assert not np.array_equal(sparse_gains.weights, live.weights)


@pytest.mark.parametrize("decoder", ["delta", "spsa", "frozen"])
def test_tied_decoder_rules_on_the_soma_kind(decoder):
    """delta: E moves by its decoder-path gradient only (never perturbed); spsa: E is perturbed with the
    body (its probes reach both roles); frozen: E never changes."""
    from soma_edge.config import Config
    from soma_edge.engine.evaluator import evaluator_for
    from soma_edge.spsa.optim import State
    from worker.trainer import train

    cfg = Config(model=ModelConfig(kind="soma", embed=8, hidden=8, layers=1), device="cpu")
    cfg.spsa.decoder, cfg.data.batch, cfg.data.seq_len = decoder, 4, 32
    lay = params.layout(cfg.model)
    data = np.frombuffer(b"a tied byte matrix reads and writes every byte. " * 40, dtype=np.uint8)
    state = State(params.init(cfg.model, 0))
    rep = train(state, data, cfg, evaluator_for(cfg, threads=1), steps=4, keep_decoder_grads=True)
    e0, e1 = params.init(cfg.model, 0)[lay.body :], state.weights[lay.body :]
    assert (e1.tobytes() == e0.tobytes()) == (decoder == "frozen")
    assert len(rep.decoder_grads) == (4 if decoder == "delta" else 0)
    assert rep.forward_evals == 4 * 2  # each of 4 directions on its own rows; the head's gradient from the probes
    assert not np.array_equal(state.weights[: lay.body], params.init(cfg.model, 0)[: lay.body])
