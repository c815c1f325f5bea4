"""What the benches share, in one place: progress and machine lines, FLOP counts, markdown tables, plots,
expert shapes at a fixed total size, prepared runs and their shards, routed-mixture scores, the recipe's
arms (one expert on one cluster), and the command lines of a federation's processes.

Every bench is a module run from the repository root as `python -m bench.NAME`; this one is not run.
"""

from __future__ import annotations

import multiprocessing
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from coordinator.prepare import prepare
from soma_edge.config import Config, ModelConfig, evals_per_step
from soma_edge.corpus import documents, mixture
from soma_edge.engine.evaluator import evaluator_for, mean_loss
from soma_edge.engine.runtime import cpu_count, make_session
from soma_edge.expert import params
from soma_edge.expert.graph import build
from soma_edge.rundir.layout import RunDir
from soma_edge.spsa.optim import State, plateau
from worker.trainer import train as spsa_train

ROOT = Path(__file__).resolve().parent.parent  # the repository root: child processes run from it


# --- lines, tables, plots ----------------------------------------------------------------------------


def say(*a: Any) -> None:
    """Progress goes to stderr: stdout is the table, or the one JSON object with --json."""
    print(*a, file=sys.stderr, flush=True)


def machine() -> str:
    """The short machine field of a result's JSON: architecture and usable cores."""
    return f"{platform.machine()} {cpu_count()} cores"


def platform_line() -> str:
    """The machine line of the benches that run real processes on simulated boxes."""
    return f"machine: {platform.platform()}, {os.cpu_count()} cores"


def md_row(cells: list[str]) -> str:
    """One markdown table row; an empty cell is a single space."""
    return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"


def md_head(columns: list[str]) -> str:
    """A markdown table's header row and the rule under it."""
    return md_row(columns) + "\n|" + "---|" * len(columns)


def pyplot():
    """matplotlib's pyplot on the Agg backend: the benches write files, never open windows."""
    import matplotlib  # optional (the bench extra): only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional, as above

    return plt


def savefig(fig, path: Path, dpi: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)


def forward_flops(m: ModelConfig, batch: int, seq: int) -> float:
    """Analytic FLOPs (2 x multiply-adds) of one forward pass on a [batch, seq] minibatch.

    Per byte: the LSTM gate matmuls 2*4H*(in+H) per layer and the head 2*256*H; the embedding is a lookup,
    and the element-wise gate math and log-softmax (O(H) and O(256)) are left out, as usual."""
    per_byte, inp = 0, m.embed
    for _ in range(m.layers):
        per_byte += 2 * 4 * m.hidden * (inp + m.hidden)
        inp = m.hidden
    per_byte += 2 * 256 * m.hidden
    return float(per_byte * batch * seq)


# --- expert shapes at a fixed total parameter count ---------------------------------------------------

EMBED = 16  # the lstm kind's embedding width when only the total size is given
SOMA_BLOCKS = 2  # the paper's depth


def model_of(kind: str, h: int) -> ModelConfig:
    if kind == "soma":
        return ModelConfig(kind="soma", embed=h, hidden=h, layers=SOMA_BLOCKS)
    return ModelConfig(embed=EMBED, hidden=h, layers=1)


def perturbed(m: ModelConfig) -> int:
    """How many leading weights the estimators cover: all of an lstm expert, the soma kind's body."""
    lay = params.layout(m)
    return lay.body if m.kind == "soma" else lay.size


def expert_shape(total: int, n: int, kind: str = "lstm") -> ModelConfig:
    """The width whose expert has closest to total/n perturbed parameters (lstm: embed fixed)."""
    target = total / n
    best = min(range(2, 2048), key=lambda h: abs(perturbed(model_of(kind, h)) - target))
    return model_of(kind, best)


# --- prepared runs and their shards -------------------------------------------------------------------


def prepared_run(d: Path, corpus_name: str, n: int, seed: int) -> RunDir:
    """`soma-coord prepare CORPUS --experts n` into `d`, once: a complete prepare is reused."""
    if not (d / "prepare.json").exists():
        prepare(corpus_name, n, d, seed=seed, progress=False)
    return RunDir(d)


def shard_stream(rd: RunDir, expert: int, split: str) -> np.ndarray:
    data = [rd.shard(h) for h in rd.read_prepare().shards(expert, split)]
    return np.frombuffer(documents.SEPARATOR.join(data), dtype=np.uint8)


# --- routed-mixture scores ----------------------------------------------------------------------------

TOP_K = 2  # the mixture's top-k (top-1 when N = 1), as the coordinator's per-round val loss


def ort_logprobs(m: ModelConfig, w: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    sess = make_session(build(m, "logprobs", weights=np.asarray(w, dtype=np.float32)), "cpu", cpu_count(), False)
    return lambda x: sess.run(None, {"x": x})[0]


def mixture_loss(router, fns: dict[int, Callable], data: np.ndarray, seq: int) -> float:
    k = min(TOP_K, len(fns))
    return float(mixture.evaluate(router, fns, data, seq, k, router.temperature).nats_per_byte)


@dataclass
class ProtocolScores:
    """One stream's held-out nats/byte under both protocols (soma_edge.corpus.mixture)."""

    stream: float  # the stream protocol, `mixture_loss`'s top-k, every byte after the first
    stream_bytes: int
    paper: float | None  # the paper protocol, top-min(4, N) uniform on its scored bytes (None: no full window)
    paper_bytes: int
    stream_on_paper: float | None  # the stream protocol on the paper protocol's scored bytes

    def arm_fields(self) -> dict[str, float | None]:
        return {
            "test_nats_per_byte": self.stream,
            "test_paper": self.paper,
            "test_stream_paper_bytes": self.stream_on_paper,
        }


def protocol_scores(router, fns: dict[int, Callable], data: np.ndarray, seq: int) -> ProtocolScores:
    stream = mixture.evaluate(router, fns, data, seq, min(TOP_K, len(fns)), router.temperature, keep_logprobs=True)
    if data.size < mixture.PAPER_WINDOW:
        return ProtocolScores(stream.nats_per_byte, stream.bytes, None, 0, None)
    paper = mixture.evaluate_paper(router, fns, data, min(4, len(fns)), router.temperature, uniform=True)
    return ProtocolScores(
        stream.nats_per_byte,
        stream.bytes,
        paper.nats_per_byte,
        paper.bytes,
        float(-stream.logprobs[paper.positions].mean()),
    )


# --- the recipe's arms: one expert on one cluster of the demo's split (bench/recipe.py, recipe_seed.py) --

MODEL = ModelConfig(embed=32, hidden=128, layers=1, input_gain=1.0)
N_CLUSTERS = 4  # the demo's split
TEST_WINDOWS = 256
VAL_WINDOWS = 32

# Cumulative arms: each adds its settings to all those above it. The last, `default`, is what
# soma-edge ships: the config's own defaults (fewer directions, a lower body lr, a stronger input drive).
ARMS: list[tuple[str, dict[str, Any]]] = [
    (
        "today",
        {
            "decoder": "spsa",
            "update": "rms",
            "lr": 1e-2,
            "directions": 8,
            "density": 1.0,
            "weight_decay": 0.0,
            "plateau": False,
            "model.input_gain": 1.0,
        },
    ),
    ("+delta", {"decoder": "delta", "decoder_lr": 3e-2}),
    ("+adam", {"update": "adam", "lr": 1e-3}),
    ("+sparse", {"density": 0.5}),
    ("+wd+plat", {"weight_decay": 1e-4, "plateau": True, "plateau_patience": 300}),
    ("default", {}),  # filled in by arm_config: Config()'s [spsa] and model.input_gain
]
# On top of `default`, not cumulative: the paper's expert.
SOMA_ARMS: dict[str, dict[str, Any]] = {
    "soma": {"kind": "soma", "embed": 32, "hidden": 32, "layers": 2},
    "soma-d64": {"kind": "soma", "embed": 64, "hidden": 64, "layers": 2},
}
ARM_NAMES = [n for n, _ in ARMS] + list(SOMA_ARMS)


@dataclass
class Data:
    train: np.ndarray
    val: tuple[np.ndarray, np.ndarray]
    test: tuple[np.ndarray, np.ndarray]
    unigram: float


@dataclass
class Result:
    name: str
    test: float
    steps: int
    evals: int
    seconds: float
    curve: list[tuple[float, float]] = field(default_factory=list)  # (train seconds, val nats/byte)
    weights: np.ndarray | None = None  # the trained weights (SPSA arms)
    val: float = float("nan")  # val nats/byte of the final weights (the BPTT lr sweep picks by it)
    lr: float | None = None  # the BPTT reference's Adam lr


def prepared(corpus_name: str, work: Path, seed: int = 0) -> RunDir:
    """The demo's split of `corpus_name` (prepared once under `work`), as a RunDir."""
    return prepared_run(work / f"prepared-{corpus_name}-n{N_CLUSTERS}-s{seed}", corpus_name, N_CLUSTERS, seed)


def cluster_data(corpus_name: str, cluster: int, work: Path, seed: int = 0) -> Data:
    rd = prepared(corpus_name, work, seed)
    seq = Config().data.seq_len

    def stream(split: str) -> np.ndarray:
        data = shard_stream(rd, cluster, split)
        if data.size <= 4 * seq:  # a tiny corpus: the split of every cluster
            say(f"cluster {cluster} has {data.size} {split} bytes: using the {split} split of all clusters")
            data = np.concatenate([shard_stream(rd, e, split) for e in range(N_CLUSTERS)])
        return data

    train, val, test = stream("train"), stream("val"), stream("test")
    return Data(
        train=train,
        val=documents.eval_windows(val, seq, VAL_WINDOWS),
        test=documents.eval_windows(test, seq, TEST_WINDOWS),
        unigram=documents.unigram_entropy(train, test),
    )


def arm_config(name: str, seed: int = 0) -> Config:
    cfg = Config(model=MODEL, seed=seed, device="cpu", threads=1, parallel=1)
    if name in SOMA_ARMS:
        cfg.model = ModelConfig(**SOMA_ARMS[name])
        return cfg
    if name == "default":
        cfg.model = ModelConfig(embed=MODEL.embed, hidden=MODEL.hidden, layers=MODEL.layers)
        return cfg
    upto = [n for n, _ in ARMS].index(name)
    for _, overrides in ARMS[: upto + 1]:
        for k, v in overrides.items():
            if k.startswith("model."):
                cfg.model = ModelConfig(**{**cfg.model.__dict__, k.removeprefix("model."): v})
            else:
                setattr(cfg.spsa, k, v)
    return cfg


def arm_init(cfg: Config) -> np.ndarray:
    """An arm's initial weights: its model's seeded init. The BPTT reference starts from the same vector."""
    return params.init(cfg.model, cfg.seed)


def run_spsa(
    name: str,
    cfg: Config,
    data: Data,
    seconds: float | None,
    evals: int | None,
    check_steps: int,
    state: State | None = None,
    expert: int = 0,
    steps: int | None = None,
    score_test: bool = True,
) -> Result:
    """Train `state` (default: a fresh init) for `seconds`, `evals` forward passes or `steps` steps; then
    score the test split unless `score_test` is False (.test NaN: the caller scores the weights itself)."""
    ev = evaluator_for(cfg, "cpu", threads=1, parallel=1)
    state = state if state is not None else State(arm_init(cfg))
    per = evals_per_step(cfg.spsa)
    budget_steps = steps if evals is None else max(1, evals // per)
    res = Result(name=name, test=0.0, steps=0, evals=0, seconds=0.0)
    while (seconds is None or res.seconds < seconds) and (budget_steps is None or res.steps < budget_steps):
        chunk = check_steps if budget_steps is None else min(check_steps, budget_steps - res.steps)
        left = None if seconds is None else seconds - res.seconds
        rep = spsa_train(state, data.train, cfg, ev, expert=expert, steps=chunk, seconds=left)
        res.steps, res.evals, res.seconds = (
            res.steps + rep.steps,
            res.evals + rep.forward_evals,
            res.seconds + rep.seconds,
        )
        val = mean_loss(ev, state.weights, *data.val)
        res.curve.append((res.seconds, val))
        res.val = val
        if plateau(cfg.spsa, state.opt, val, state.step):
            say(f"  {name}: plateau at step {state.step}, lr scale now {state.opt.lr_scale:g}")
    res.test = mean_loss(ev, state.weights, *data.test) if score_test else float("nan")
    res.weights = state.weights
    return res


def map_jobs(fn, work: list, jobs: int) -> list:
    """`fn` over `work`, in `jobs` spawned processes (one per core) when jobs > 1."""
    if jobs <= 1:
        return [fn(w) for w in work]
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        return pool.map(fn, work, chunksize=1)


# --- a federation's processes on simulated boxes (bench/heartbeat.py, bench/slow_link.py) -------------


def coordinator_cmd(run: Path, config: Path, port: int) -> list[str]:
    """`soma-coord start` listening on every interface of its box."""
    return [
        sys.executable,
        "-m",
        "coordinator",
        "start",
        "--run",
        str(run),
        "--config",
        str(config),
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
    ]


def worker_cmd(coordinator: str, name: str, cache: Path, *extra: str) -> list[str]:
    """`soma-worker join` to `coordinator` (host:port), with `extra` options."""
    return [
        sys.executable,
        "-m",
        "worker.cli",
        "join",
        "--coordinator",
        coordinator,
        "--name",
        name,
        "--cache",
        str(cache),
        *extra,
    ]
