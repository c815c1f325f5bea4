"""Configuration: plain dataclasses, loadable from TOML, validated with messages that name the field."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from soma_edge import devices
from soma_edge.errors import ConfigError


class ReplyPolicy(StrEnum):
    """`federation.reply`: what the coordinator asks its workers to send back each round."""

    WEIGHTS = "weights"
    LOG = "log"
    AUTO = "auto"  # per node: the weights on a fast link, the log on a slow one (coordinator.dispatch.reply_mode)


class LogDecoder(StrEnum):
    """`federation.log_decoder`: how a log reply carries the delta-rule decoder (spsa.log.UpdateLog)."""

    INT8 = "int8"  # its change in int8 codes per block of 256 (soma_edge.spsa.quant), adopted by both sides
    FLOAT32 = "float32"  # its final weights, lossless, 4 bytes a weight


class Noise(StrEnum):
    """`spsa.noise`: how a probe direction is drawn from its key (soma_edge.spsa)."""

    RADEMACHER = "rademacher"
    GAUSSIAN = "gaussian"
    RANK1 = "rank1"  # each weight matrix a·bᵀ of two Rademacher vectors, vectors full Rademacher; density 1 only


class Evaluator(StrEnum):
    """`spsa.evaluator`: how a step's losses are evaluated, never what they are (soma_edge.engine.population)."""

    LOOP = "loop"  # one ORT call per probe (2K per minibatch), plus the clean forward
    POPULATION = "population"  # one ORT call per minibatch: the clean forward and the 2K members together
    AUTO = "auto"  # the loop on the CPU EP (measured faster there: docs/BENCHMARKS.md), else the population


@dataclass
class ModelConfig:
    """One expert, of one of two kinds.

    - "lstm": byte embedding [256, embed] -> `layers` LSTM layers of `hidden` -> linear to 256 logits.
    - "soma" (the paper's expert): `layers` pre-norm residual blocks of width d = `hidden`, each
      x += LSTM(LN(x)) then x += MLP(LN(x)) (bias-free, d -> 4d -> d, exact GELU), a final LN, and one byte
      matrix E [256, d] tied as embedding and decoder (logits = h E^T); `embed` must equal `hidden`.
    """

    embed: int = 32
    hidden: int = 128
    layers: int = 1
    input_gain: float = 4.0  # lstm kind: init scale of the first layer's input weights, uniform ±gain/√hidden
    kind: str = "lstm"  # after the sizes, so ModelConfig(embed, hidden, layers) still reads as it always did
    seed_decoder: str = "frozen"  # after a seed run (federation.seed_steps): frozen | delta (keeps learning)


@dataclass
class SPSAConfig:
    """Central-difference SPSA on the body, plus how the decoder (the head) learns.

    Defaults are the setting that learned best on 2 CPU cores (docs/RESULTS.md: `bench/recipe.py`, and for the
    directions on their own rows with the probes' decoder gradient, `bench/body.py`).
    """

    directions: int = 4  # K perturbations per step; each costs two forward passes (with split_rows: their share)
    eps: float = 1e-3
    eps_min: float = 1e-4  # floor for eps when tie_eps_to_lr, so warmup never makes eps zero
    tie_eps_to_lr: bool = False
    lr: float = 2e-3  # 4e-3 for model.kind = "soma" unless set (SOMA_KIND_LR)
    lr_min_frac: float = 0.1  # cosine decays to lr * lr_min_frac
    warmup_steps: int = 20
    total_steps: int = 0  # cosine horizon; 0 keeps lr constant after warmup (the plateau rule decays it)
    noise: Noise = Noise.RADEMACHER  # rademacher | gaussian | rank1 (needs density = 1)
    evaluator: Evaluator = Evaluator.AUTO  # loop | population | auto: how the losses are evaluated (not what)
    density: float = 1.0  # share of ordinary weights a probe touches (< 1: sparse probes); norm gains stay dense
    update: str = "adam"  # body update from the estimate: rms (unit-RMS step) | adam | sgd
    momentum: float = 0.0  # heavy-ball momentum for update = rms | sgd
    beta1: float = 0.9  # Adam moments, for update = adam and for the delta-rule decoder
    beta2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.0  # coupled: wd * w is added to the body's SPSA estimate before the moments
    accumulate: int = 1  # A batches per update, each with its own K fresh directions
    # Each direction's antithetic pair on its own data.batch / K rows of the minibatch, not on all of them:
    # K directions then cost the forward passes of one (a forward pass is data.batch rows).
    split_rows: bool = True
    shaping: str = "none"  # none | zscore | sign | rank: how a step's differences weigh its directions (spsa.shaping)
    decoder: str = "delta"  # delta: exact decoder-path gradient + Adam | spsa: perturbed with the body | frozen
    decoder_lr: float = 3e-2  # 3e-3 for model.kind = "soma" unless set (TIED_DECODER_LR)
    # Where the delta rule's gradient comes from: a clean forward at w (one more forward pass a minibatch),
    # or the mean of the probes' own at w ± eps z (the same to O(eps²), at no forward pass of its own).
    decoder_from: str = "probes"
    plateau: bool = True  # halve lr and eps together when the val loss stops improving
    plateau_patience: int = 1000  # ... for this many steps
    plateau_factor: float = 0.5
    plateau_min_delta: float = 1e-8  # an improvement smaller than this does not count
    lr_floor: float = 1e-5  # the plateau rule never takes lr below this


@dataclass
class DataConfig:
    batch: int = 16
    seq_len: int = 128


@dataclass
class FederationConfig:
    """The federated run (`soma-coord start`): experts, rounds, and how long each round computes.

    Flower's round trip costs >= 4.5 s (a fresh ClientApp process per message, 3 s polling), so a round
    carries tens of seconds of compute; `round_seconds` is the compute each node is given per round.
    """

    experts: int = 4
    rounds: int = 3
    round_seconds: float = 60.0
    # When there are more experts than the nodes can give this much compute each in a round, a round trains
    # only that many, those with the fewest steps so far (every expert in turn); 0: every expert every round.
    min_expert_seconds: float = 0.0
    local_workers: int = 0  # SuperNodes that `soma-coord start` launches on this box
    min_nodes: int = 1  # round 1 waits (up to `wait_seconds`) for this many live nodes
    wait_seconds: float = 120.0  # later rounds: how long after the last live node stopped working (coordinator.late)
    join_grace: float = 5.0  # once min_nodes are in, round 1 waits this much longer for more (0: none)
    keep_versions: int = 3  # checkpoints kept per expert; older versions are pruned
    reply_dtype: str = "float32"  # or "float16": workers send that, the coordinator stores it as received
    deadline_factor: float = 1.5  # a node misses the round when it has not replied by
    deadline_slack: float = 30.0  # round_seconds * deadline_factor + deadline_slack + its transfers' time
    val_windows: int = 64  # held-out windows per expert for the per-round val loss
    corpus: str = "default"
    max_steps: int = 0  # SPSA steps per expert over the whole run (a fixed compute budget); 0 = no cap
    seed_steps: int = 0  # > 0: first train one seed expert on all shards; its weights start every expert
    # Guarded updates (coordinator.guard): a new version is refused when its val loss exceeds the guard's
    # bar (the expert's last version that beat the one before beyond the noise) by more than
    # `guard_tolerance` (nats/byte) plus `guard_sigmas` standard errors (a confidence, as Student's t) of
    # that difference, measured window by window. A result the protocol checks refuse is a strike against
    # the node's key; the guard's refusals are judged per node once a round's verdicts are in (one strike
    # for a round that refused some of its versions, one each when most were refused), and a node with
    # `max_strikes` strikes takes no part in the rest of the run (0: never excluded).
    guard_tolerance: float = 0.01
    guard_sigmas: float = 3.0
    max_strikes: int = 3
    # Finished experts (coordinator.finish): an expert stops training, on its best version, after
    # `finish_patience` accepted versions in a row that did not bring its val loss `finish_min_delta`
    # (nats/byte) below its last such gain, or after `finish_refusals` guard refusals with no such gain
    # between them (0: that rule is off).
    finish_patience: int = 6
    finish_min_delta: float = 0.001
    finish_refusals: int = 3
    piece_bytes: int = 32 << 20  # shard bytes a node lacks travel in messages of at most this many (<= 32 MiB)
    # What a worker returns: weights (and optimizer state), log (the round's update log: the SPSA scalars,
    # which the coordinator replays bit for bit), or auto: per node and round, the weights where its measured
    # link carries them within 5% of round_seconds, else the log (an unmeasured link counts as slow), with
    # the weights as well every `weights_every` rounds (a checkpoint the replay must match) where they
    # cross within 25%.
    reply: ReplyPolicy = ReplyPolicy.AUTO
    weights_every: int = 10
    # How a log reply carries a delta-rule decoder: int8 (its change, coded: ~1/4 of float32 on the wire;
    # the worker adopts the coded change) or float32 (its weights, lossless). Its Adam moments stay on the
    # worker unless audit_steps > 0 (the audit rebuilds the decoder's steps from them); the coordinator's
    # copy is refreshed by each weights reply (see `reply`, `weights_every`).
    log_decoder: LogDecoder = LogDecoder.INT8
    audit_steps: int = 0  # steps per log reply whose losses the coordinator recomputes to check its scalars
    # The share of log replies audited (each drawn from the coordinator's secret key): an audit costs about
    # the worker's own forward work, which a CPU coordinator cannot match for GPU workers (coordinator.check_budget).
    audit_share: float = 1.0
    # Start the next round as soon as every reply of this one is in, from the versions the replies claim,
    # while the coordinator replays, audits and evaluates them; a version its checks refuse costs its
    # expert the next round too. false: each round waits for the last one's checks and commit.
    pipeline: bool = True
    # Threads for the coordinator's checks of a round's results (val losses, replays, audits), run side by
    # side once the last reply is in; 0: the cores this box's local workers leave (at least 1), every core
    # when it has none.
    check_threads: int = 0
    tensorboard: bool = True  # RUN/tb/: TensorBoard event files of the metrics (`tensorboard --logdir runs/`)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    spsa: SPSAConfig = field(default_factory=SPSAConfig)
    data: DataConfig = field(default_factory=DataConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda[:i] | any ORT execution provider name
    threads: int = 0  # ORT intra-op threads per evaluation; 0 = cores / parallel
    parallel: int = 0  # loss evaluations run concurrently (L+ and L- of a direction); 0 = auto

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def evals_per_step(spsa: SPSAConfig) -> int:
    """Forward passes one update costs, per batch: 2K probes (2 when each direction has its own rows),
    plus a clean forward for the delta rule. A forward pass is data.batch rows."""
    probes = 2 if spsa.split_rows else 2 * spsa.directions
    return spsa.accumulate * (probes + (1 if spsa.decoder == "delta" and spsa.decoder_from == "clean" else 0))


# The seed run's config rules (soma_edge.rundir.seed holds the rest of it). They live here, below spsa and seed,
# because `validate` checks the budget they define: a seed run must leave the experts steps.


def expert_config(cfg: Config) -> Config:
    """The config the experts train with after a seed run (the run's own config without one)."""
    if cfg.federation.seed_steps <= 0 or cfg.model.seed_decoder != "frozen":
        return cfg
    out = copy.deepcopy(cfg)
    out.spsa.decoder = "frozen"
    return out


def expert_steps(cfg: Config) -> int:
    """Steps each expert may take under `federation.max_steps` once the seed's forward passes are paid:
    max_steps - ceil(seed_steps * seed evals per step / (N * expert evals per step)). 0 means no cap."""
    f = cfg.federation
    if not f.max_steps or f.seed_steps <= 0:
        return f.max_steps
    seed_evals = f.seed_steps * evals_per_step(cfg.spsa)
    return f.max_steps - math.ceil(seed_evals / (f.experts * evals_per_step(expert_config(cfg).spsa)))


_SECTIONS = {"model": ModelConfig, "spsa": SPSAConfig, "data": DataConfig, "federation": FederationConfig}


def _coerce(path: str, value: Any, typ: type) -> Any:
    # TOML gives ints where users write `eps = 1`; accept those for float fields, reject everything else.
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, bool):
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if not isinstance(value, typ):
        raise ConfigError(f"{path}: expected {typ.__name__}, got {type(value).__name__} {value!r}")
    return value


_VALUE_TYPES: dict[str, type] = {
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    "ReplyPolicy": ReplyPolicy,
    "LogDecoder": LogDecoder,
    "Noise": Noise,
    "Evaluator": Evaluator,
}


def _fill(obj: Any, values: dict[str, Any], prefix: str) -> None:
    types = {f.name: f.type for f in dataclasses.fields(obj)}
    for key, value in values.items():
        path = f"{prefix}{key}"
        if key not in types:
            raise ConfigError(f"{path}: unknown setting (known: {', '.join(sorted(types))})")
        typ = _VALUE_TYPES.get(str(types[key]))
        if typ is None:
            raise ConfigError(f"{path}: is a section, not a value")
        if issubclass(typ, StrEnum):  # TOML holds the member's string; validate names the field if it is none
            value = _coerce(path, value, str)
            setattr(obj, key, typ(value) if value in {m.value for m in typ} else value)
        else:
            setattr(obj, key, _coerce(path, value, typ))


def from_dict(values: dict[str, Any]) -> Config:
    """Build and validate a Config from nested dicts (the TOML layout)."""
    cfg = Config()
    flat = {k: v for k, v in values.items() if k not in _SECTIONS}
    _fill(cfg, flat, "")
    for name in _SECTIONS:
        section = values.get(name, {})
        if not isinstance(section, dict):
            raise ConfigError(f"{name}: expected a [{name}] table")
        _fill(getattr(cfg, name), section, f"{name}.")
    if cfg.model.kind == "soma":
        # decoder_lr: the tied E is the body's input too, a path whose gradient the delta rule leaves out: it
        # runs against the decoder's and grows as E trains, so at the lstm head's 3e-2 E's steps turn to ascent
        # and the train loss climbs (docs/RESULTS.md, "The paper's expert on small shards"). lr: this expert
        # learns most in its body (its E is a small share), and every estimator's best body lr was 4e-3 there,
        # twice the lstm kind's (docs/RESULTS.md, "The body's own learning"). A value the config sets wins.
        for key, value in {"decoder_lr": TIED_DECODER_LR, "lr": SOMA_KIND_LR}.items():
            if key not in values.get("spsa", {}):
                setattr(cfg.spsa, key, value)
    validate(cfg)
    return cfg


# Settings added to [spsa] after runs were saved without them, with what those runs did: a run's run.toml
# (written in full) that lacks one resumes with this value, not with today's default, so its recipe stays.
SAVED_WITHOUT = {"split_rows": False, "shaping": "none", "decoder_from": "clean"}


def load(path: str | Path, saved_run: bool = False) -> Config:
    """The config in TOML file `path`; `saved_run`: a run's own run.toml, whose missing [spsa] settings are
    the ones it predates (SAVED_WITHOUT)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: config is not UTF-8 text") from None
    try:
        values = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: invalid TOML ({e})") from None
    if saved_run and isinstance(values.get("spsa", {}), dict):
        values["spsa"] = SAVED_WITHOUT | values.get("spsa", {})
    try:
        return from_dict(values)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None


def tables(path: str | Path) -> list[str]:
    """The [sections] a config file sets (after `load` accepted it): a command that reads only some of them
    names the others, which would else be ignored without a word."""
    return [k for k, v in tomllib.loads(Path(path).read_text(encoding="utf-8")).items() if k in _SECTIONS]


def _check(ok: bool, path: str, rule: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{path} must be {rule}, got {value!r}")


MAX_SEED = 2**32 - 1  # the SPSA noise key holds the seed in 32 bits
UPDATES = ("rms", "adam", "sgd")
SHAPINGS = ("none", "zscore", "sign", "rank")  # soma_edge.spsa.shaping.KINDS (config imports nothing of spsa)
DECODERS = ("delta", "spsa", "frozen")
KINDS = ("lstm", "soma")
TIED_DECODER_LR = 3e-3  # spsa.decoder_lr's default for model.kind = "soma" (its E is tied); a set value wins
SOMA_KIND_LR = 4e-3  # spsa.lr's default for model.kind = "soma"; a set value wins
SEED_DECODERS = ("frozen", "delta")


REPLIES = tuple(p.value for p in ReplyPolicy)
LOG_DECODERS = tuple(d.value for d in LogDecoder)
NOISES = tuple(n.value for n in Noise)
EVALUATORS = tuple(e.value for e in Evaluator)


def _check_finite(obj: Any, prefix: str) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _check_finite(value, f"{f.name}.")
        elif isinstance(value, float):
            _check(math.isfinite(value), f"{prefix}{f.name}", "a finite number", value)


def validate(cfg: Config) -> Config:
    """`cfg`, once every setting is in its range (ConfigError naming the first that is not)."""
    _check_finite(cfg, "")
    _check_model(cfg.model)
    _check_spsa(cfg.spsa)
    d = cfg.data
    _check(d.batch >= 1, "data.batch", ">= 1", d.batch)
    _check(d.seq_len >= 1, "data.seq_len", ">= 1", d.seq_len)
    if cfg.spsa.split_rows and d.batch % cfg.spsa.directions:
        raise ConfigError(
            f"spsa.split_rows needs data.batch ({d.batch}) to be a multiple of spsa.directions "
            f"({cfg.spsa.directions}): each direction takes batch / directions rows (set data.batch to a "
            f"multiple of it, spsa.directions to a divisor of the batch, or spsa.split_rows = false)"
        )
    _check_federation(cfg)
    _check(0 <= cfg.seed <= MAX_SEED, "seed", f"between 0 and {MAX_SEED}", cfg.seed)
    _check(cfg.threads >= 0, "threads", ">= 0", cfg.threads)
    _check(0 <= cfg.parallel <= 2, "parallel", "0 (auto), 1 or 2", cfg.parallel)
    try:
        devices.parse(cfg.device)
    except ConfigError as e:
        raise ConfigError(f"device: {e}") from None
    return cfg


def _check_model(m: ModelConfig) -> None:
    _check(m.kind in KINDS, "model.kind", " | ".join(map(repr, KINDS)), m.kind)
    _check(m.embed >= 1, "model.embed", ">= 1", m.embed)
    if m.kind == "soma" and m.embed != m.hidden:
        raise ConfigError(
            f"model.embed must equal model.hidden for model.kind = 'soma' (E [256, d] is both the "
            f"embedding and the decoder), got embed = {m.embed}, hidden = {m.hidden}"
        )
    _check(m.seed_decoder in SEED_DECODERS, "model.seed_decoder", " | ".join(map(repr, SEED_DECODERS)), m.seed_decoder)
    _check(m.hidden >= 1, "model.hidden", ">= 1", m.hidden)
    _check(1 <= m.layers <= 8, "model.layers", "between 1 and 8", m.layers)
    _check(0 < m.input_gain <= 100, "model.input_gain", "> 0 and <= 100", m.input_gain)


def _check_spsa(s: SPSAConfig) -> None:
    _check(1 <= s.directions <= 65536, "spsa.directions", "between 1 and 65536", s.directions)
    _check(s.eps > 0 and s.eps < 1, "spsa.eps", "> 0 and < 1", s.eps)
    _check(0 < s.eps_min <= 1, "spsa.eps_min", "> 0 and <= 1", s.eps_min)
    _check(s.lr > 0 and s.lr < 10, "spsa.lr", "> 0 and < 10", s.lr)
    _check(0 <= s.lr_min_frac <= 1, "spsa.lr_min_frac", "between 0 and 1", s.lr_min_frac)
    _check(s.warmup_steps >= 0, "spsa.warmup_steps", ">= 0", s.warmup_steps)
    _check(s.total_steps >= 0, "spsa.total_steps", ">= 0", s.total_steps)
    _check(s.noise in NOISES, "spsa.noise", " | ".join(map(repr, NOISES)), s.noise)
    s.noise = Noise(s.noise)  # a config built in code may hold the bare string
    _check(s.evaluator in EVALUATORS, "spsa.evaluator", " | ".join(map(repr, EVALUATORS)), s.evaluator)
    s.evaluator = Evaluator(s.evaluator)
    _check(0 <= s.momentum < 1, "spsa.momentum", ">= 0 and < 1", s.momentum)
    _check(0 < s.density <= 1, "spsa.density", "> 0 and <= 1", s.density)
    if s.noise == Noise.RANK1 and s.density != 1:
        # A rank-1 probe's entries are products a_i b_j of its two vectors' signs: a mask would break the
        # a·bᵀ structure that lets the population graph share one base matmul (and make E[z zᵀ] != I).
        raise ConfigError(f"spsa.noise = 'rank1' needs spsa.density = 1.0 (rank-1 probes are dense), got {s.density!r}")
    _check(s.update in UPDATES, "spsa.update", " | ".join(map(repr, UPDATES)), s.update)
    _check(0 <= s.beta1 < 1, "spsa.beta1", ">= 0 and < 1", s.beta1)
    _check(0 <= s.beta2 < 1, "spsa.beta2", ">= 0 and < 1", s.beta2)
    _check(s.adam_eps > 0, "spsa.adam_eps", "> 0", s.adam_eps)
    _check(0 <= s.weight_decay < 1, "spsa.weight_decay", ">= 0 and < 1", s.weight_decay)
    _check(1 <= s.accumulate <= 1024, "spsa.accumulate", "between 1 and 1024", s.accumulate)
    _check(
        s.accumulate * s.directions <= 1 << 24,
        "spsa.accumulate * spsa.directions",
        "<= 2^24",
        s.accumulate * s.directions,
    )
    _check(s.shaping in SHAPINGS, "spsa.shaping", " | ".join(map(repr, SHAPINGS)), s.shaping)
    if s.shaping in ("zscore", "rank") and s.directions * s.accumulate < 2:
        raise ConfigError(
            f"spsa.shaping = {s.shaping!r} needs at least 2 directions a step (spsa.directions * spsa.accumulate), "
            f"got {s.directions * s.accumulate}"
        )
    _check(s.decoder in DECODERS, "spsa.decoder", " | ".join(map(repr, DECODERS)), s.decoder)
    _check(0 < s.decoder_lr < 10, "spsa.decoder_lr", "> 0 and < 10", s.decoder_lr)
    _check(s.decoder_from in ("clean", "probes"), "spsa.decoder_from", "'clean' | 'probes'", s.decoder_from)
    _check(s.plateau_patience >= 1, "spsa.plateau_patience", ">= 1 step", s.plateau_patience)
    _check(0 < s.plateau_factor < 1, "spsa.plateau_factor", "> 0 and < 1", s.plateau_factor)
    _check(s.plateau_min_delta >= 0, "spsa.plateau_min_delta", ">= 0", s.plateau_min_delta)
    _check(0 < s.lr_floor <= s.lr, "spsa.lr_floor", f"> 0 and <= spsa.lr ({s.lr})", s.lr_floor)


def _check_federation(cfg: Config) -> None:
    f = cfg.federation
    _check(1 <= f.experts <= 4096, "federation.experts", "between 1 and 4096", f.experts)
    _check(f.rounds >= 0, "federation.rounds", ">= 0", f.rounds)
    _check(f.round_seconds > 0, "federation.round_seconds", "> 0", f.round_seconds)
    _check(0 <= f.check_threads <= 256, "federation.check_threads", "between 0 and 256", f.check_threads)
    _check(f.min_expert_seconds >= 0, "federation.min_expert_seconds", ">= 0", f.min_expert_seconds)
    _check(0 <= f.local_workers <= 64, "federation.local_workers", "between 0 and 64", f.local_workers)
    _check(f.min_nodes >= 1, "federation.min_nodes", ">= 1", f.min_nodes)
    _check(f.wait_seconds > 0, "federation.wait_seconds", "> 0", f.wait_seconds)
    _check(0 <= f.join_grace <= 600, "federation.join_grace", "in [0, 600]", f.join_grace)
    _check(f.keep_versions >= 1, "federation.keep_versions", ">= 1", f.keep_versions)
    _check(f.reply_dtype in ("float32", "float16"), "federation.reply_dtype", "'float32' or 'float16'", f.reply_dtype)
    _check(f.deadline_factor >= 1, "federation.deadline_factor", ">= 1", f.deadline_factor)
    _check(f.deadline_slack >= 0, "federation.deadline_slack", ">= 0", f.deadline_slack)
    _check(f.val_windows >= 2, "federation.val_windows", ">= 2 (the guard needs 2 windows for a spread)", f.val_windows)
    _check(bool(f.corpus), "federation.corpus", "a corpus name or path", f.corpus)
    _check(f.max_steps >= 0, "federation.max_steps", ">= 0", f.max_steps)
    _check(0 <= f.seed_steps < 2**40, "federation.seed_steps", ">= 0", f.seed_steps)
    if f.max_steps and f.seed_steps:
        left = expert_steps(cfg)
        _check(
            left >= 1,
            "federation.seed_steps",
            f"small enough to leave the experts steps of their "
            f"federation.max_steps = {f.max_steps} (the seed's compute is paid out of it; {left} left)",
            f.seed_steps,
        )
    _check(
        0 <= f.guard_tolerance <= 100, "federation.guard_tolerance", "between 0 and 100 nats/byte", f.guard_tolerance
    )
    _check(0 <= f.guard_sigmas <= 10, "federation.guard_sigmas", "between 0 and 10", f.guard_sigmas)
    _check(0 <= f.finish_patience <= 10**6, "federation.finish_patience", "between 0 and 1000000", f.finish_patience)
    delta = f.finish_min_delta
    _check(0 <= delta <= 10, "federation.finish_min_delta", "between 0 and 10 nats/byte", delta)
    _check(0 <= f.finish_refusals <= 10**6, "federation.finish_refusals", "between 0 and 1000000", f.finish_refusals)
    _check(
        1 << 16 <= f.piece_bytes <= 32 << 20,
        "federation.piece_bytes",
        "between 65536 and 33554432 (32 MiB)",
        f.piece_bytes,
    )
    _check(f.reply in REPLIES, "federation.reply", " | ".join(map(repr, REPLIES)), f.reply)
    f.reply = ReplyPolicy(f.reply)  # a config built in code may hold the bare string
    _check(f.weights_every >= 1, "federation.weights_every", ">= 1", f.weights_every)
    _check(f.log_decoder in LOG_DECODERS, "federation.log_decoder", " | ".join(map(repr, LOG_DECODERS)), f.log_decoder)
    f.log_decoder = LogDecoder(f.log_decoder)
    _check(0 <= f.audit_steps <= 1024, "federation.audit_steps", "between 0 and 1024", f.audit_steps)
    _check(0 < f.audit_share <= 1, "federation.audit_share", "> 0 and <= 1", f.audit_share)
    _check(f.max_strikes >= 0, "federation.max_strikes", ">= 0 (0: never exclude)", f.max_strikes)


def local_worker_threads(n: int) -> int:
    """ORT threads of each of `n` local workers on a CPU box (0: ORT's own choice, for a worker alone): they
    split the cores between them."""
    return 0 if n == 1 else max(1, (os.cpu_count() or 1) // max(n, 1))


def check_threads(cfg: Config) -> int:
    """The threads the coordinator checks results with (`FederationConfig.check_threads`, 0 resolved): the
    cores its local workers leave. On the CPU they take the cores they split; on a GPU (`device` cuda or
    TensorRT) one each, the thread that feeds it."""
    fed = cfg.federation
    if fed.check_threads:
        return fed.check_threads
    cores, n = os.cpu_count() or 1, fed.local_workers
    if devices.parse(cfg.device).provider in devices.NVIDIA:
        taken = n
    else:
        taken = 0 if n == 0 else cores if n == 1 else n * local_worker_threads(n)
    return max(1, cores - taken)
