"""Routed top-k inference over a deploy bundle: eval (nats/byte of data files) and generation.

Needs only onnxruntime, numpy and msgpack (plus soma_edge modules that import nothing else at module
level): no onnx, flwr or torch. Sessions are created lazily, so experts the router never selects are never
loaded, let alone run.

Generation walks the same windows as eval: position p belongs to window p // seq_len; at each window start
the router picks experts from the previous window's bytes (the prior for window 0) and their LSTM states
restart from zero, as in training. The mixture that samples each byte is therefore exactly the mixture that
eval scores, byte for byte.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from export.bundle import Bundle, BundleError, ExpertEntry, read
from soma_edge import config as config_mod
from soma_edge.corpus import mixture
from soma_edge.corpus.router import Router
from soma_edge.engine.runtime import make_session
from soma_edge.errors import CodecError, ConfigError, CorpusError, DeviceError, SomaError
from soma_edge.rundir.layout import RunDir

MAX_DATA_FILES = 100_000


class Expert:
    """One exported expert: a scoring session and a streaming session, each created on first use."""

    def __init__(self, bundle: Bundle, entry: ExpertEntry, device: str, threads: int):
        self.bundle, self.entry, self.device, self.threads = bundle, entry, device, threads
        # From the config `read` validated, with its defaults: a manifest may leave out fields that have one.
        m = config_mod.from_dict(entry.config).model
        self.hidden, self.layers, self.kind = m.hidden, m.layers, m.kind
        # The streaming graph's state inputs, in its order: h0, c0, h1, c1, ...
        self.state_names = [f"{s}{layer}" for layer in range(self.layers) for s in ("h", "c")]
        self._score = self._stream = None

    def _session(self, rel: str, states: bool):
        data = self.bundle.read_verified(rel)
        try:
            sess = make_session(data, self.device, self.threads)
        except DeviceError as e:
            if "INVALID_PROTOBUF" in str(e) or "INVALID_GRAPH" in str(e) or "NO_MODEL" in str(e):
                raise BundleError(
                    f"{self.bundle.path(rel)}: not a loadable ONNX model (truncated or corrupt)"
                ) from None
            raise
        self._check_graph(sess, rel, states)
        return sess

    def _check_graph(self, sess, rel: str, states: bool) -> None:
        """The graph is the expert the manifest describes: its kind, and (streaming) one [1, B, hidden] state
        pair per layer."""
        desc = sess.get_modelmeta().graph_description
        kind = desc.partition("model.kind = ")[2].strip("'") or "lstm"  # graphs from before the soma kind: lstm
        want = [("x", ["B", "T"])] + ([(n, [1, "B", self.hidden]) for n in self.state_names] if states else [])
        got = [(i.name, list(i.shape)) for i in sess.get_inputs()]
        if kind != self.kind or got != want:
            raise BundleError(
                f"{self.bundle.path(rel)}: the graph (model.kind {kind!r}, inputs {got}) does not match "
                f"the manifest's expert (model.kind {self.kind!r}, inputs {want})"
            )

    def logprobs(self, x: np.ndarray) -> np.ndarray:
        """x int64[B, T] -> log-probs float32[B, T, 256] (the scoring graph)."""
        if self._score is None:
            self._score = self._session(self.entry.score, states=False)
        return self._score.run(None, {"x": x})[0]

    def zero_state(self, batch: int = 1) -> list[np.ndarray]:
        """The LSTM state in the streaming graph's order (`state_names`)."""
        return [np.zeros((1, batch, self.hidden), dtype=np.float32)] * len(self.state_names)

    def step(self, x: np.ndarray, state: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Feed x int64[B, T] from `state`; returns logits float32[B, T, 256] and the state after x."""
        if self._stream is None:
            self._stream = self._session(self.entry.stream, states=True)
        logits, *state = self._stream.run(None, dict(zip(["x", *self.state_names], [x, *state])))
        return logits, state


class Deployment:
    """A verified bundle, its router, and its experts (sessions created lazily)."""

    def __init__(self, root: str | Path, device: str = "cpu", threads: int = 1):
        # One intra-op thread per session: on a 2-core box eval ran 2-4x faster than with ORT's default
        # pool of spinning threads, which fight each other and any neighbour (bench/routed_inference.py).
        self.bundle = read(root)
        rel = self.bundle.manifest["router"]["file"]
        try:
            self.router = Router.from_bytes(self.bundle.read_verified(rel))
        except CodecError as e:
            raise BundleError(f"{self.bundle.path(rel)}: cannot load the router ({e})") from None
        if self.router.n_experts != self.bundle.n_experts:
            raise BundleError(
                f"{self.bundle.root}: the router maps {self.router.n_experts} experts,"
                f" the manifest lists {self.bundle.n_experts}"
            )
        self.experts = [Expert(self.bundle, e, device, threads) for e in self.bundle.experts]

    @property
    def n_experts(self) -> int:
        return self.bundle.n_experts

    @property
    def seq_len(self) -> int:
        return self.bundle.seq_len

    def check_top_k(self, top_k: int) -> None:
        mixture.check_top_k(top_k, self.n_experts)

    def default_top_k(self, protocol: str = "stream") -> int:
        """Experts mixed per window: min(2, N) for the stream protocol, the paper's min(4, N) for its own."""
        return min(4 if protocol == "paper" else 2, self.n_experts)

    def score(
        self,
        data: np.ndarray,
        top_k: int,
        temperature: float | None = None,
        uniform: bool = False,
        keep_logprobs: bool = False,
        protocol: str = "stream",
    ) -> mixture.MixtureResult:
        """The routed mixture's score of `data` under `protocol` (soma_edge.corpus.mixture.PROTOCOLS)."""
        fns = [e.logprobs for e in self.experts]
        temperature = self.bundle.temperature if temperature is None else temperature
        if protocol == "paper":
            return mixture.evaluate_paper(
                self.router, fns, data, top_k, temperature, uniform, keep_logprobs=keep_logprobs
            )
        mixture.check_protocol(protocol)
        return mixture.evaluate(
            self.router, fns, data, self.seq_len, top_k, temperature, uniform=uniform, keep_logprobs=keep_logprobs
        )

    # -- generation ------------------------------------------------------------------------------------------

    def stream(self, prompt: bytes, top_k: int, temperature: float | None = None, uniform: bool = False) -> "Streamer":
        return Streamer(self, prompt, top_k, self.bundle.temperature if temperature is None else temperature, uniform)


class Streamer:
    """Incremental routed mixture: feed bytes, read the distribution of the next byte.

    The mixture is kept as unnormalized probabilities `p` (sum_e w_e softmax(z_e), up to a constant), so
    the per-byte path is one ORT run per selected expert and a handful of numpy calls on 256 floats.
    """

    def __init__(self, dep: Deployment, prompt: bytes, top_k: int, temperature: float, uniform: bool):
        if not prompt:
            raise ConfigError("the prompt must not be empty: generation continues from at least one byte")
        dep.check_top_k(top_k)
        self.dep, self.top_k, self.temperature, self.uniform = dep, top_k, temperature, uniform
        self.text = bytearray()
        self.p = np.ones(256)  # of the next byte, given self.text
        self._x1 = np.zeros((1, 1), dtype=np.int64)
        self.feed(prompt)

    @property
    def logprobs(self) -> np.ndarray:
        with np.errstate(divide="ignore"):
            return np.log(self.p / self.p.sum())

    def _route(self, window: int) -> None:
        T = self.dep.seq_len
        if window == 0:
            dists = None
        else:
            dists = self.dep.router.distances([bytes(self.text[(window - 1) * T : window * T])])
        experts, weights = self.dep.router.route(dists, self.top_k, self.temperature)
        self.chosen = [self.dep.experts[int(e)] for e in experts[0]]
        self.weights = np.full(self.top_k, 1.0 / self.top_k) if self.uniform else np.asarray(weights[0], np.float64)
        self.states = [e.zero_state() for e in self.chosen]

    def _run(self, x: np.ndarray) -> None:
        """x int64[1, n], all inside the current window, through every selected expert; mix the last logits."""
        last = []
        for j, expert in enumerate(self.chosen):
            logits, self.states[j] = expert.step(x, self.states[j])
            last.append(logits[0, -1])
        if self.top_k == 1:
            z = last[0].astype(np.float64)
            self.p = np.exp(z - z.max())
        else:
            z = np.stack(last).astype(np.float64)
            e = np.exp(z - z.max(axis=1, keepdims=True))
            self.p = (self.weights / e.sum(axis=1)) @ e

    def push(self, b: int) -> None:
        """Append one byte (the generation hot path)."""
        p = len(self.text)
        if p % self.dep.seq_len == 0:
            self._route(p // self.dep.seq_len)
        self.text.append(b)
        self._x1[0, 0] = b  # ORT reads its inputs during run() only, so one array serves every byte
        self._run(self._x1)

    def feed(self, data: bytes) -> None:
        """Append bytes; each window's chunk goes through the selected experts in one call."""
        T = self.dep.seq_len
        i = 0
        while i < len(data):
            p = len(self.text)  # input position of data[i]
            if p % T == 0:
                self._route(p // T)
            n = min(len(data) - i, T - p % T)
            self.text += data[i : i + n]
            self._run(np.frombuffer(data, dtype=np.uint8, count=n, offset=i).astype(np.int64)[None, :])
            i += n


def sample(p: np.ndarray, temperature: float, rng: np.random.Generator) -> tuple[int, float]:
    """A byte drawn from unnormalized probabilities p at `temperature` (0: the most likely), and its
    log-prob under p itself."""
    c = np.cumsum(p)
    if temperature == 0:
        b = int(np.argmax(p))
    elif temperature == 1:
        b = int(np.searchsorted(c, rng.random() * c[-1], side="right"))
    else:
        with np.errstate(divide="ignore", over="ignore"):
            lp = np.log(p)
            # shifted before the division: a tiny temperature sends the others to -inf, never all to nan
            z = (lp - lp.max()) / temperature
        ct = np.cumsum(np.exp(z))
        b = int(np.searchsorted(ct, rng.random() * ct[-1], side="right"))
    b = min(b, 255)  # rounding at the very top of the cdf
    return b, math.log(p[b] / c[-1])


def generate(
    dep: Deployment,
    prompt: bytes,
    n: int,
    top_k: int,
    temperature: float = 1.0,
    seed: int = 0,
    router_temperature: float | None = None,
) -> Iterator[tuple[int, float]]:
    """Yield (byte, its log-prob under the untempered mixture) for n sampled bytes after `prompt`."""
    if not (math.isfinite(temperature) and temperature >= 0):  # NaN would sample byte 255 forever
        raise ConfigError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
    if n < 0:
        raise ConfigError(f"bytes must be >= 0, got {n}")
    rng = np.random.default_rng(seed)
    s = dep.stream(prompt, top_k, router_temperature)  # bad input fails here, before the first byte

    def run() -> Iterator[tuple[int, float]]:
        for _ in range(n):
            b, logprob = sample(s.p, temperature, rng)
            yield b, logprob
            s.push(b)

    return run()


# -- eval over files -----------------------------------------------------------------------------------------


def data_files(paths: list[Path]) -> tuple[list[Path], int]:
    """FILE... where each is a file or a directory of them (recursively, sorted, hidden entries skipped), each
    file once however often it was named (by the same path resolved); and how many repeats were left out."""
    if not paths:
        raise CorpusError("no data given: pass --data FILE (a file or a directory of files)")
    found, seen, unique = _data_files(paths), set(), []
    for f in found:
        if f.resolve() not in seen:
            seen.add(f.resolve())
            unique.append(f)
    return unique, len(found) - len(unique)


def _data_files(paths: list[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(
                f
                for f in p.rglob("*")
                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
            )
            if not found:
                raise CorpusError(f"{p}: directory holds no files to evaluate")
            out += found
        elif p.is_file():
            out.append(p)
        elif p.exists():
            raise CorpusError(f"{p}: not a regular file or directory")
        else:
            raise CorpusError(f"{p}: no such file or directory")
        if len(out) > MAX_DATA_FILES:
            raise CorpusError(f"more than {MAX_DATA_FILES} data files; pass fewer or larger files")
    return out


def check_data(path: Path) -> None:
    try:
        size = path.stat().st_size
    except OSError as e:
        raise CorpusError(f"{path}: cannot read ({e.strerror})") from None
    if size < 2:
        what = "empty data file" if size == 0 else "data file of 1 byte"
        raise CorpusError(f"{path}: {what}; need at least 2 bytes to score the bytes after the first")


def read_data(path: Path) -> np.ndarray:
    check_data(path)
    try:
        return np.frombuffer(path.read_bytes(), dtype=np.uint8)
    except OSError as e:
        raise CorpusError(f"{path}: cannot read ({e.strerror})") from None


def run_split(path: Path, data: np.ndarray, router_sha256: str) -> str | None:
    """The split (train, val or test) of the run this bundle was exported from that `path` is a shard of:
    RUN/shards/<sha256>.bin holding those bytes, listed in RUN/prepare.json, whose router is the bundle's.
    None for any other file: nothing is known of where it came from."""
    if path.suffix != ".bin" or path.parent.name != "shards":
        return None
    try:
        prep = RunDir(path.parent.parent).read_prepare()
    except SomaError:
        return None
    if prep.router is None or prep.router.sha256 != router_sha256:
        return None
    if hashlib.sha256(data.tobytes()).hexdigest() != path.stem:
        return None
    return next((split for c in prep.clusters for split, sha in c.shards.items() if sha == path.stem), None)


@dataclass
class FileScore:
    path: str
    bytes: int  # bytes scored
    nats_per_byte: float
    seconds: float
    compared: float | None = None  # with `compare`: the stream protocol's nats/byte on the same bytes
    split: str | None = None  # the bundle's run's split it is a shard of (`run_split`); None: not known


@dataclass
class EvalReport:
    top_k: int
    uniform: bool
    protocol: str = "stream"
    files: list[FileScore] = field(default_factory=list)
    expert_windows: dict[int, int] = field(default_factory=dict)
    expert_weight: dict[int, float] = field(default_factory=dict)
    expert_bytes: dict[int, int] = field(default_factory=dict)
    expert_nats_sum: dict[int, float] = field(default_factory=dict)
    repeated: int = 0  # data files named more than once, scored once

    @property
    def held_out(self) -> bool:
        """Every scored byte is from the test split of the bundle's run: neither trained on nor used to pick
        versions. Of any other file the tool cannot know it."""
        return all(f.split == "test" for f in self.files if f.bytes)

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    @property
    def nats_per_byte(self) -> float:
        return sum(f.nats_per_byte * f.bytes for f in self.files) / self.bytes

    @property
    def compared(self) -> float | None:
        if any(f.compared is None for f in self.files if f.bytes):
            return None
        return sum(f.compared * f.bytes for f in self.files if f.bytes) / self.bytes

    @property
    def seconds(self) -> float:
        return sum(f.seconds for f in self.files)


def evaluate(
    dep: Deployment,
    paths: list[Path],
    top_k: int,
    temperature: float | None = None,
    uniform: bool = False,
    protocol: str = "stream",
    compare: bool = False,
) -> EvalReport:
    """Routed mixture nats/byte of each file (each its own stream) under `protocol`. With `compare` (paper
    protocol), each file is also scored by the stream protocol at its defaults, on the paper's scored bytes."""
    dep.check_top_k(top_k)
    mixture.check_protocol(protocol)
    if compare and protocol != "paper":
        raise ConfigError(
            "--compare scores the stream protocol on the paper protocol's bytes: use it with --protocol paper"
        )
    files, repeated = data_files(paths)
    for f in files:  # every file is checked before any scoring starts; each is read when its turn comes
        check_data(f)
    report = EvalReport(top_k, uniform, protocol, repeated=repeated)
    router_sha256 = dep.bundle.manifest["files"][dep.bundle.manifest["router"]["file"]]["sha256"]
    for f in files:
        data = read_data(f)
        split = run_split(f, data, router_sha256)
        if protocol == "paper" and data.size < mixture.PAPER_WINDOW:
            report.files.append(FileScore(str(f), 0, 0.0, 0.0, split=split))  # no full window: nothing to score
            continue
        t0 = time.perf_counter()
        r = dep.score(data, top_k, temperature, uniform, protocol=protocol)
        seconds = time.perf_counter() - t0
        compared = None
        if compare:
            other = dep.score(data, dep.default_top_k(), keep_logprobs=True)
            compared = float(-other.logprobs[r.positions].sum() / r.bytes)
        report.files.append(FileScore(str(f), r.bytes, r.nats_per_byte, seconds, compared, split))
        for e, n in r.expert_windows.items():
            report.expert_windows[e] = report.expert_windows.get(e, 0) + n
            report.expert_weight[e] = report.expert_weight.get(e, 0.0) + r.expert_weight[e]
            report.expert_bytes[e] = report.expert_bytes.get(e, 0) + r.expert_bytes[e]
            report.expert_nats_sum[e] = report.expert_nats_sum.get(e, 0.0) + r.expert_nats[e] * r.expert_bytes[e]
    if not report.bytes:
        raise CorpusError(f"no data file holds a full {mixture.PAPER_WINDOW}-byte window for the paper protocol")
    return report
