"""The federation's message schema, shared by the coordinator and the worker, and the checks on replies.

Every Flower message of ours carries one bounded, schema-versioned `codec` body as the bytes of a single
Flower `Array` (stype `soma/msgpack`), so Flower chunks large weights for us and nothing is ever
unpickled. Four exchanges exist, each a Flower message type and the codec kinds of its two bodies:

- `query.capabilities`: `capability_query` (`capability_query`: version, run id, the run's config) ->
  `capabilities` (`Capabilities`: version, providers, memory, measured forward evaluations/s for the
  run's model shape, and what the worker's disk cache holds).
- `train`: `train_request` (`train_request`: one per node per round, one `Task` per expert it trains) ->
  `train_reply` (one result per task, or what the worker was missing).
- `query.shards`: `shard_pieces` (`pieces_request`) -> `shard_ack`. Shard bytes a node lacks travel in
  pieces of at most PIECE_BYTES (soma_edge.wire.pieces): the last piece rides in the train request, any before it go
  first as their own messages, so no message of ours carries more than one piece of data besides one
  round's weights.
- `query.end`: `run_end` (`run_end`: the run is over) -> `shard_ack`; `soma-worker join` exits.

The coordinator trusts nothing in a reply: `check_result` verifies node, expert, base version hash,
shape, dtype, finiteness, loss, counters and the claimed sha256 before a version is accepted;
`check_reply_header` and `check_caps` type-check every other field it records or acts on.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NotRequired, TypedDict

import numpy as np

from soma_edge import __version__, codec
from soma_edge.config import Config, Evaluator
from soma_edge.errors import CheckpointError, CodecError, ValidationError
from soma_edge.expert.params import count
from soma_edge.spsa.log import UpdateLog
from soma_edge.spsa.optim import OptState
from soma_edge.spsa.recipe import Probes, Recipe
from soma_edge.wire import compute_share

# bump on any incompatible change of the bodies below (2: optimizer state and lr scale; 3: pieces; 4: a log's
# decoder as int8 codes, and without its Adam moments; 5: a log's recipe; 6: a capability reply's probes)
PROTOCOL = 6
STYPE = "soma/msgpack"
RECORD = "soma"
QUERY_CAPABILITIES = "query.capabilities"  # Flower routes it to @app.query("capabilities")
QUERY_SHARDS = "query.shards"
QUERY_END = "query.end"  # the run is over: `soma-worker join` exits (or, with --stay, waits for the next)
QUERY_ADVICE = "query.advice"  # a new heartbeat interval, as soon as a measured link changes it
TRAIN = "train"
KIND_QUERY, KIND_CAPS = "capability_query", "capabilities"
KIND_TRAIN, KIND_REPLY = "train_request", "train_reply"
KIND_PIECES, KIND_ACK = "shard_pieces", "shard_ack"
KIND_END = "run_end"
KIND_ADVICE = "heartbeat_advice"
# Heartbeat intervals (s) the coordinator advises: fast where the node's largest message moves within
# HEARTBEAT_FAST, else Flower's 30 s (a slow link's queue can hold off heartbeats for longer than 2 x 10 s).
HEARTBEAT_FAST, HEARTBEAT_SLOW = 10.0, 30.0
HEARTBEAT_MIN, HEARTBEAT_MAX = 10.0, 1800.0  # the intervals flwr's fleet API accepts (HEARTBEAT_MIN/MAX_INTERVAL)
# What the worker's ClientApp logs on QUERY_END; `soma-worker join` reads its SuperNode's output for it.
RUN_ENDED = "the coordinator ended the run:"
REPLY_DTYPES = ("float32", "float16")
SMALL_BYTES = 1 << 20  # queries, capability replies and acks are tiny; refuse anything larger
TRAINED_BY = (Evaluator.LOOP.value, Evaluator.POPULATION.value)  # a result's `evaluator`: how its steps ran
PIECE_BYTES = 32 << 20  # most shard bytes per message (federation.piece_bytes): big enough that Flower's
# ~5 s per message is rare, small enough that neither side holds a whole corpus in one decoded message
MAX_SHARD_BYTES = 1 << 40  # a shard's declared size (a worker assembles pieces on disk, never in memory)


def weights_sha256(weights: np.ndarray) -> str:
    """The identity of an expert version: sha256 of the weight bytes exactly as stored and sent."""
    return hashlib.sha256(np.ascontiguousarray(weights).tobytes()).hexdigest()


# --- Flower records <-> bodies -------------------------------------------------------------------------


def pack(body: dict[str, Any], kind: str):
    """A Flower RecordDict holding `body` as one codec blob."""
    from flwr.app import Array, ArrayRecord, RecordDict  # flwr (~1 s): the worker CLI's own training never sends

    data = codec.encode({"protocol": PROTOCOL, **body}, kind)
    return RecordDict({RECORD: ArrayRecord({"body": Array(dtype="uint8", shape=(len(data),), stype=STYPE, data=data)})})


def unpack(content, kind: str, max_bytes: int = codec.MAX_BYTES) -> dict[str, Any]:
    """The body of a RecordDict made by `pack`; CodecError when it is not one, is too big, or is another protocol."""
    try:
        arr = content[RECORD]["body"]
    except (KeyError, TypeError):
        raise CodecError(f"{kind}: not a soma-edge message (no '{RECORD}' record)") from None
    if getattr(arr, "stype", None) != STYPE:
        raise CodecError(f"{kind}: unexpected payload type {getattr(arr, 'stype', None)!r}")
    body = codec.decode(bytes(arr.data), kind, max_bytes)
    if not isinstance(body, dict):
        raise CodecError(f"{kind}: body is not a map")
    if not is_int(body.get("protocol")) or body["protocol"] != PROTOCOL:
        raise CodecError(f"{kind}: protocol {body.get('protocol')!r}, this soma-edge speaks {PROTOCOL}")
    return body


def payload_bytes(content) -> int:
    """Size of the codec blob in a packed RecordDict (what actually moved), 0 if none."""
    try:
        return len(content[RECORD]["body"].data)
    except (KeyError, TypeError, AttributeError):
        return 0


# --- bodies ---------------------------------------------------------------------------------------------


def capability_query(config: dict[str, Any], run_id: str, heartbeat: float = HEARTBEAT_SLOW) -> dict[str, Any]:
    """The first message a node gets; `heartbeat`: the interval it should report, ahead of round 1's download."""
    return {"soma_version": __version__, "run_id": run_id, "config": config, "heartbeat": float(heartbeat)}


def advice(run_id: str, heartbeat: float) -> dict[str, Any]:
    """A heartbeat interval on its own, sent when the node's measured link changes what it should report
    (a train request would bring it only once the node pulls its next round's work)."""
    return {"soma_version": __version__, "run_id": run_id, "heartbeat": float(heartbeat)}


def run_end(run_id: str, rounds: int, of: int, why: str) -> dict[str, Any]:
    return {"run_id": run_id, "rounds": rounds, "of": of, "why": why}


def end_summary(body: dict[str, Any]) -> str:
    """The worker's one line about a run_end body (fields checked: it came from the network)."""
    rounds, of, why = body.get("rounds"), body.get("of"), body.get("why")
    if not (is_int(rounds) and is_int(of) and isinstance(why, str)):
        raise ValidationError("run_end: rounds, of and why must be two integers and a string")
    return f"{rounds}/{of} rounds, {why[:200]}"


def train_request(
    *,
    round: int,
    node: int,
    run_id: str,
    config: dict[str, Any],
    reply_dtype: str,
    max_seconds: float,
    tasks: list[Task],
    pieces: list[dict[str, Any]],
    heartbeat: float = HEARTBEAT_SLOW,
    next_experts: list[int] | None = None,
    next_tasks: list[Task] | None = None,
) -> dict[str, Any]:
    """One node's work for one round. `pieces` holds the last piece of the shard bytes the node lacked;
    `heartbeat` is the interval the node's SuperNode should report from now on (`join --heartbeat auto`).
    `next_experts`, `next_tasks`: its experts next round, where they change (worker.speculation.following)."""
    return {
        **({} if next_experts is None else {"next_experts": next_experts, "next_tasks": next_tasks or []}),
        "soma_version": __version__,
        "round": round,
        "node": node,
        "run_id": run_id,
        "config": config,
        "reply_dtype": reply_dtype,
        "max_seconds": float(max_seconds),
        "tasks": tasks,
        "pieces": pieces,
        "heartbeat": float(heartbeat),
    }


def heartbeat_advice(body: dict[str, Any]) -> float | None:
    """A capability query's or train request's heartbeat interval, if it is one Flower accepts."""
    x = body.get("heartbeat")
    return float(x) if _is_number(x) and HEARTBEAT_MIN <= x <= HEARTBEAT_MAX else None


def train_request_limit(cfg) -> int:
    """The most bytes a train request of this run (a `Config`) can need: every expert's weights and
    optimizer state (the seed's too) and one piece of shards, with room for the rest; what a worker
    decodes at most, once the capability query told it the run's config."""
    per = count(cfg.model) * 4 * 4 + 64 * 1024
    return min(codec.MAX_BYTES, (cfg.federation.experts + 1) * per + PIECE_BYTES + SMALL_BYTES)


def pieces_request(run_id: str, node: int, pieces: list[dict[str, Any]]) -> dict[str, Any]:
    return {"soma_version": __version__, "run_id": run_id, "node": node, "pieces": pieces}


class ReplyMode(StrEnum):
    """What a task asks back. A str, so the wire carries the same bytes as the bare strings did."""

    WEIGHTS = "weights"  # the new weights and optimizer state
    LOG = "log"  # the round's update log, which the coordinator replays bit for bit
    BOTH = "both"  # both: the weights are a checkpoint the replay must match


class BaseLog(TypedDict):
    """A task's base sent as a log: the replay of `log` (an `UpdateLog` record) from version `from_sha256`."""

    from_sha256: str
    log: dict[str, Any]


class Task(TypedDict):
    """One expert's work in a train request, as `task` builds it (a map on the wire, in this key order)."""

    expert: int
    version: int
    base_sha256: str
    step: int
    steps: int
    shards: list[str]
    lr_scale: float
    weights: np.ndarray | None  # None: the node holds the base version already (or gets it as base_log)
    opt: dict[str, Any] | None  # spsa.optim.OptState.to_record of the base
    reply: ReplyMode
    base_log: BaseLog | None
    keep_sha256: NotRequired[str]


class Inventory(TypedDict):
    """Hashes by kind: what a worker's cache holds, or what it lacked for a round."""

    weights: list[str]
    shards: list[str]


class Failure(TypedDict):
    """One expert of a train request that its worker could not train (a reply's `failed`): the expert, and
    why, in one line of at most MAX_REASON characters. The other experts of the request train and return."""

    expert: int
    reason: str


MAX_REASON = 300  # characters of a failure's reason: one console line, bounded like every other field


def failure(expert: int, reason: str) -> Failure:
    """A Failure, its reason made one line and cut to MAX_REASON."""
    one = " ".join(str(reason).split())
    return {"expert": int(expert), "reason": one if len(one) <= MAX_REASON else one[: MAX_REASON - 3] + "..."}


class Capabilities(TypedDict, total=False):
    """A worker's capability reply (`worker.client_app.capabilities`). It comes from the network: any key
    may be missing or of the wrong type until `check_caps` has passed it."""

    soma_version: str
    node: int
    name: str
    pid: int
    torch_importable: bool
    cache: Inventory
    numpy: str  # numpy's version: gaussian noise is bit-identical only across equal versions
    evals_per_s: float  # measured on whole SPSA steps of its recipe (the run's with its probes) x evals_per_step
    providers: list[str]
    device: str
    threads: int
    parallel: int
    device_memory: int | None
    probe_seconds: float
    probe_cached: bool
    probes: dict[str, Any]  # the probes it trains with (soma_edge.spsa.recipe.Probes), checked by `caps_probes`
    recipe_line: str  # how it chose them, for its own log


def task(
    *,
    expert: int,
    version: int,
    base_sha256: str,
    step: int,
    steps: int,
    shards: list[str],
    lr_scale: float = 1.0,
    weights: np.ndarray | None = None,
    opt: dict[str, Any] | None = None,
    reply: ReplyMode = ReplyMode.WEIGHTS,
    base_log: BaseLog | None = None,
    keep_sha256: str | None = None,
) -> Task:
    """Train `expert` from version `version` (identified by `base_sha256`) for `steps` SPSA steps.

    `weights` and `opt` (its optimizer state, `spsa.optim.OptState.to_record`) are None when the node already
    holds that version in its cache: an unchanged assignment moves no weights. `lr_scale` is the plateau
    rule's factor for the whole round, decided by the coordinator; it overrides the cached one. A base still
    to be judged (planned ahead) names the accepted version under it, `keep_sha256`, for the node to keep."""
    return {
        "expert": expert,
        "version": version,
        "base_sha256": base_sha256,
        "step": step,
        "steps": steps,
        "shards": list(shards),
        "lr_scale": float(lr_scale),
        "weights": weights,
        "opt": opt,
        "reply": reply,
        "base_log": base_log,  # the base is the replay of this log from a version the node has
        **({} if keep_sha256 is None else {"keep_sha256": keep_sha256}),
    }


class SentTask(TypedDict, total=False):
    """The fields of a sent `Task` that its result is checked against (no reply: ReplyMode.WEIGHTS)."""

    version: int
    base_sha256: str
    step: int
    steps: int
    lr_scale: float
    reply: ReplyMode


@dataclass
class Expected:
    """What the coordinator sent one node, so that its reply can be checked against it."""

    node: int
    round: int
    tasks: dict[int, SentTask]  # expert -> what its task asked
    size: int  # parameters per expert
    reply_dtype: str
    width: int = 0  # scalars per step of a log reply: spsa.accumulate x spsa.directions (0: not checked)
    recipe: Recipe | None = None  # the recipe the node trains with, which its logs must carry (None: not checked)

    def max_reply_bytes(self) -> int:
        # weights and up to three optimizer vectors (momentum, Adam's two moments) per task, plus generous
        # room for metrics; bigger replies are refused unread
        per = self.size * 4 * 4 + 64 * 1024
        return len(self.tasks) * per + SMALL_BYTES


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_sha256(x: Any) -> bool:
    return _is_sha256(x)


def is_number(x: Any) -> bool:
    """A finite int or float (not a bool): what a reply may use for a count of seconds."""
    return _is_number(x)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_flag(x: Any) -> bool:
    """True, False or None, and nothing that merely compares equal to one (1, 0.0, an array)."""
    return x is None or type(x) is bool


def _short(x: Any) -> str:
    """A field of a reply as it may appear in an error line: repr, cut short."""
    text = f"an array of shape {list(x.shape)}" if isinstance(x, np.ndarray) else repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_sha256(x: Any) -> bool:
    return isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x)


def _check_hash_lists(value: Any, what: str) -> None:
    """`value` is None or a map of "weights"/"shards" to lists of sha256 hex digests (inventories, misses)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValidationError(f"{what} is not a map")
    for key in ("weights", "shards"):
        items = value.get(key)
        if items is not None and (not isinstance(items, list) or not all(_is_sha256(h) for h in items)):
            raise ValidationError(f"{what}.{key} is not a list of sha256 hex digests")


def check_reply_header(body: dict[str, Any], exp: Expected, src_node: int) -> None:
    """The parts of a reply that concern the whole message: whose it is, which round, and the fields the
    coordinator records or acts on (torch_importable, missing, errors, failed), so that none of them can crash it."""
    if src_node != exp.node or not is_int(body.get("node")) or body["node"] != exp.node:
        raise ValidationError(
            f"reply for node {exp.node} came from node {src_node} claiming node {_short(body.get('node'))}"
        )
    if not is_int(body.get("round")) or body["round"] != exp.round:
        raise ValidationError(f"reply is for round {_short(body.get('round'))}, expected round {exp.round}")
    if not isinstance(body.get("results"), list):
        raise ValidationError("reply has no results list")
    if not _is_flag(body.get("torch_importable")):
        raise ValidationError(f"torch_importable is {type(body.get('torch_importable')).__name__}, not a bool")
    _check_hash_lists(body.get("missing"), "missing")
    errors = body.get("errors")
    if errors is not None and (not isinstance(errors, list) or not all(isinstance(x, str) for x in errors)):
        raise ValidationError("errors is not a list of strings")
    check_failures(body.get("failed"), exp)


def check_failures(failed: Any, exp: Expected) -> None:
    """A reply's `failed` (absent in replies of workers before it): a list of Failure, each for an expert of
    the request, once, with a reason of at most MAX_REASON characters."""
    if failed is None:
        return
    if not isinstance(failed, list):
        raise ValidationError("failed is not a list")
    seen = set()
    for f in failed:
        if not isinstance(f, dict) or set(f) != {"expert", "reason"}:
            raise ValidationError("failed holds an entry that is not {expert, reason}")
        e, why = f["expert"], f["reason"]
        if not is_int(e) or e not in exp.tasks or e in seen:
            raise ValidationError(f"failed names expert {_short(e)}, not one of the request's, or twice")
        if not isinstance(why, str) or len(why) > MAX_REASON:
            raise ValidationError(f"expert {e}'s failure reason is not a string of at most {MAX_REASON} characters")
        seen.add(e)


def check_caps(caps: Capabilities) -> float:
    """Validate a capability reply (the fields the coordinator uses); returns its throughput in forward
    evaluations/s, or raises ValidationError. The caller still clamps the rate (a huge claim is legal here)."""
    rate = caps.get("evals_per_s")
    if not _is_number(rate) or rate <= 0:
        raise ValidationError(f"throughput {rate!r} is not a positive number")
    for key in ("name", "soma_version", "numpy"):
        if caps.get(key) is not None and not isinstance(caps[key], str):
            raise ValidationError(f"{key} is {type(caps[key]).__name__}, not a string")
    providers = caps.get("providers")
    if providers is not None and (not isinstance(providers, list) or not all(isinstance(x, str) for x in providers)):
        raise ValidationError("providers is not a list of strings")
    if not _is_flag(caps.get("torch_importable")):
        raise ValidationError(f"torch_importable is {type(caps.get('torch_importable')).__name__}, not a bool")
    _check_hash_lists(caps.get("cache"), "cache")
    return float(rate)


def caps_probes(caps: Capabilities, cfg: Config) -> Probes:
    """The probes a capability reply says its node trains with, if the run's `cfg` can take them (its other
    settings stay the run's); ValidationError otherwise."""
    try:
        return Probes.from_record(caps.get("probes"), cfg, "its probes")
    except ValueError as e:
        raise ValidationError(str(e)) from None


def check_result(res: Any, exp: Expected, current_sha: dict[int, str]) -> tuple[np.ndarray | None, OptState | None]:
    """Validate one expert's result; returns its weights (exactly as received) and optimizer state (both
    None for a task that asked for the update log alone: see `check_log`), or raises ValidationError.

    `current_sha` is the coordinator's current accepted version hash per expert."""
    if not isinstance(res, dict):
        raise ValidationError("result is not a map")
    e = res.get("expert")
    if not is_int(e):
        raise ValidationError(f"result names no expert ({e!r})")
    if e not in current_sha:
        raise ValidationError(f"unknown expert {e}")
    if e not in exp.tasks:
        raise ValidationError(f"expert {e} was not assigned to node {exp.node} this round")
    sent = exp.tasks[e]
    base = res.get("base_sha256")
    if not _is_sha256(base) or base != current_sha[e] or sent["base_sha256"] != current_sha[e]:
        shown = base[:12] if isinstance(base, str) else _short(base)
        raise ValidationError(
            f"expert {e}: stale base version {shown} (sent {sent['base_sha256'][:12]}), current is "
            f"{current_sha[e][:12]}"
        )
    if not is_int(res.get("version")) or res["version"] != sent["version"] + 1:
        raise ValidationError(f"expert {e}: version {res.get('version')!r}, expected {sent['version'] + 1}")
    steps = res.get("steps")
    if not is_int(steps) or not 1 <= steps <= sent["steps"]:
        raise ValidationError(f"expert {e}: ran {steps!r} steps, asked for 1..{sent['steps']}")
    if not is_int(res.get("step")) or res["step"] != sent["step"] + steps:
        raise ValidationError(f"expert {e}: step counter {res.get('step')!r}, expected {sent['step'] + steps}")
    if sent.get("reply", ReplyMode.WEIGHTS) == ReplyMode.LOG:  # the weights come from the coordinator's replay
        if res.get("weights") is not None or res.get("opt") is not None:
            raise ValidationError(f"expert {e}: weights or optimizer state in a reply that was asked for its log")
        _check_tail(res, e)
        return None, None
    w = res.get("weights")
    if not isinstance(w, np.ndarray):
        raise ValidationError(f"expert {e}: weights missing")
    if w.dtype.name != exp.reply_dtype:
        raise ValidationError(f"expert {e}: weights are {w.dtype.name}, expected {exp.reply_dtype}")
    if w.shape != (exp.size,):
        raise ValidationError(f"expert {e}: weights have shape {list(w.shape)}, expected [{exp.size}]")
    if not np.isfinite(w).all():
        raise ValidationError(f"expert {e}: weights contain NaN or infinity")
    try:
        opt = OptState.from_record(res.get("opt"), exp.size, f"expert {e}: optimizer state")
    except CheckpointError as err:
        raise ValidationError(str(err)) from None
    if opt.lr_scale != sent["lr_scale"]:
        raise ValidationError(f"expert {e}: trained at lr scale {opt.lr_scale:g}, the round's is {sent['lr_scale']:g}")
    _check_tail(res, e)
    if res["sha256"] != weights_sha256(w):
        raise ValidationError(f"expert {e}: weights do not match the sha256 the worker claims")
    return w, opt


def _check_tail(res: dict[str, Any], e: int) -> None:
    """The fields of a result besides its weights: loss, counters, the claimed hash's form."""
    loss = res.get("train_loss")
    if not isinstance(loss, (int, float)) or isinstance(loss, bool) or not math.isfinite(loss):
        raise ValidationError(f"expert {e}: train loss {loss!r} is not finite")
    evals, seconds = res.get("forward_evals"), res.get("seconds")
    if not is_int(evals) or evals < 0:
        raise ValidationError(f"expert {e}: forward_evals {evals!r} is not a count")
    if not _is_number(seconds) or seconds < 0:
        raise ValidationError(f"expert {e}: seconds {seconds!r} is not a finite duration")
    if not _is_sha256(res.get("sha256")):
        raise ValidationError(f"expert {e}: weights do not match the sha256 the worker claims")
    _check_trained(res.get("trained"), e)
    how = res.get("evaluator")  # absent from a worker of an earlier version
    if how is not None and not (isinstance(how, str) and how in TRAINED_BY):
        raise ValidationError(f"expert {e}: evaluator {_short(how)} is not one of {list(TRAINED_BY)}")


def trained_of(res: dict[str, Any]) -> list[list[float]]:
    """When a result says it trained (its `trained`), or [] where that is absent or malformed."""
    try:
        _check_trained(res.get("trained"), -1)
    except ValidationError:
        return []
    return res.get("trained") or []


def _check_trained(spans: Any, e: int) -> None:
    """A result's `trained` (absent from a worker of an earlier version): at most MAX_SPANS [start, end]
    pairs of finite seconds, each ending after it starts (soma_edge.wire.compute_share)."""
    if spans is None:
        return
    if not isinstance(spans, list) or len(spans) > compute_share.MAX_SPANS:
        raise ValidationError(f"expert {e}: trained is not a list of at most {compute_share.MAX_SPANS} stretches")
    for s in spans:
        if not (isinstance(s, list) and len(s) == 2 and all(_is_number(x) for x in s) and s[0] <= s[1]):
            raise ValidationError(f"expert {e}: trained holds {_short(s)}, not a [start, end] pair of seconds")


def check_log(res: dict[str, Any], exp: Expected) -> UpdateLog | None:
    """The update log of a result that `check_result` passed, if its task asked for one: type-checked
    and continuing the version it was sent (whether it replays to the claimed weights is the caller's)."""
    e = res["expert"]
    sent = exp.tasks[e]
    if sent.get("reply", ReplyMode.WEIGHTS) == ReplyMode.WEIGHTS:
        return None
    try:
        log = UpdateLog.from_record(res.get("log"), f"expert {e}: update log")
    except CheckpointError as err:
        raise ValidationError(str(err)) from None
    if log.steps != res["steps"]:
        raise ValidationError(f"expert {e}: the log holds {log.steps} steps, the result claims {res['steps']}")
    if exp.width and log.grads.shape[1] != exp.width:  # the audit and the replay index the scalars by it
        raise ValidationError(
            f"expert {e}: the log holds {log.grads.shape[1]} scalars a step, the run's config gives each step "
            f"{exp.width} (spsa.accumulate x spsa.directions)"
        )
    if exp.recipe is not None and log.recipe is None:
        raise ValidationError(f"expert {e}: the log carries no recipe (this node's is checked against it)")
    if exp.recipe is not None and log.recipe != exp.recipe:
        raise ValidationError(
            f"expert {e}: the log ran another recipe than this node's "
            f"({'; '.join(log.recipe.differences(exp.recipe)[:3])}, the node's second)"
        )
    if log.start != sent["step"]:
        raise ValidationError(
            f"expert {e}: the log starts at step {log.start}, the version it was sent is at step {sent['step']}"
        )
    if log.lr_scale != sent["lr_scale"]:
        raise ValidationError(
            f"expert {e}: the log's lr scale {log.lr_scale:g} is not the round's {sent['lr_scale']:g}"
        )
    return log


def decode_weights(w: np.ndarray) -> np.ndarray:
    """Training always runs in float32, whatever dtype a version was stored in."""
    return np.ascontiguousarray(w, dtype=np.float32)
