"""The SOMA worker as a Flower ClientApp: answers the capability query, stores shard pieces, trains experts,
takes heartbeat advice.

The SuperNode starts a fresh process for every message, so all state between rounds lives in the disk
cache (`worker.cache`): shards by hash, weights by version hash, the throughput probe. The one process
that outlives a message is the speculating trainer (`worker.speculation`), which trains on while a reply
is in flight and hands the next round back when it is the one the trainer ran. Settings come
from the SuperNode's `--node-config` (name, cache, device, threads, spin), which `soma-worker join` sets.

With SOMA_BLOCK_TORCH=1 in the environment (`soma-worker join` always sets it) torch is made
unimportable before anything else runs, and every reply says whether torch could be imported: the
end-to-end test uses that to prove the training path is torch-free.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("SOMA_BLOCK_TORCH") == "1" and "torch" not in sys.modules:
    sys.modules["torch"] = None  # type: ignore[assignment]  # any `import torch` now raises ImportError

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from soma_edge import __version__, codec
from soma_edge import config as config_mod
from soma_edge.config import Config
from soma_edge.corpus.documents import SEPARATOR
from soma_edge.corpus.sources import cache_dir
from soma_edge.errors import CheckpointError, SomaError, ValidationError
from soma_edge.expert import steps
from soma_edge.processes import logs
from soma_edge.processes.logs import role_logger
from soma_edge.spsa import recipe as recipe_mod
from soma_edge.spsa.log import UpdateLog
from soma_edge.spsa.optim import OptState, State
from soma_edge.spsa.recipe import Choice
from soma_edge.wire import pieces as pieces_mod
from soma_edge.wire import protocol
from worker import probe, speculation, task
from worker.cache import HEARTBEAT_ADVICE, Cache

log = role_logger("soma.worker")

app = ClientApp()


@dataclass
class Settings:
    name: str
    cache: Path
    device: str
    threads: int
    spin: bool
    parallel: int
    cache_bytes: int
    probe_seconds: float
    speculate: bool  # keep training while the reply goes up (worker.speculation); join sets it, a bare node_config not
    recipe: Choice  # which probes it trains with (worker.device_recipe)


def settings(node_config: dict[str, Any]) -> Settings:
    def get(key: str, default: Any) -> Any:
        v = node_config.get(key, default)
        return default if v in ("", None) else v

    return Settings(
        name=str(get("name", f"pid{os.getpid()}")),
        cache=Path(str(get("cache", cache_dir() / "worker"))),
        device=str(get("device", "auto")),
        threads=int(get("threads", 0)),
        spin=bool(int(get("spin", 1))),
        parallel=int(get("parallel", 0)),
        cache_bytes=int(float(get("cache-mb", 2048)) * (1 << 20)),
        probe_seconds=float(get("probe-seconds", probe.PROBE_SECONDS)),
        speculate=bool(int(get("speculate", 0))),
        recipe=recipe_mod.parse(str(get("recipe", "auto"))),
    )


def torch_importable() -> bool:
    """Could this process import torch? Asked without importing it (find_spec is None when blocked)."""
    return importlib.util.find_spec("torch") is not None


def _reply(msg: Message, body: dict[str, Any], kind: str) -> Message:
    return Message(protocol.pack(body, kind), reply_to=msg)


@app.query("capabilities")
def capabilities(msg: Message, context: Context) -> Message:
    body = protocol.unpack(msg.content, protocol.KIND_QUERY, protocol.SMALL_BYTES)
    s = settings(dict(context.node_config))
    cfg = config_mod.from_dict(body["config"])
    cache = Cache(s.cache, max_bytes=s.cache_bytes, keep_versions=cfg.federation.keep_versions)
    _take_advice(cache, body)  # before round 1's download, which may take minutes on a slow link
    caps = probe.capabilities(cfg, cache, s.device, s.threads, s.spin, s.parallel, s.probe_seconds, s.recipe)
    # The run's model fixes how large its train requests can be: decode none larger (`train`).
    cache.put_json(_limit_name(context.run_id), protocol.train_request_limit(cfg))
    log.info(
        "capabilities: %.1f forward evals/s on %s with the %s evaluator (probe %s)",
        caps["evals_per_s"],
        caps["providers"][0],
        caps["evaluator"],
        "cached" if caps["probe_cached"] else f"{caps['probe_seconds']:.1f} s",
    )
    log.info("recipe (--recipe %s): %s", s.recipe, caps["recipe_line"])
    reply: protocol.Capabilities = {
        "soma_version": __version__,
        "node": context.node_id,
        "name": s.name,
        "pid": os.getpid(),
        "torch_importable": torch_importable(),
        "cache": cache.inventory(),
        "numpy": np.__version__,
        **caps,
    }
    return _reply(msg, reply, protocol.KIND_CAPS)


def _take_advice(cache: Cache, body: dict[str, Any]) -> None:
    """Keep the coordinator's heartbeat advice where `join --heartbeat auto`'s SuperNode reads it
    (worker.supernode), from a capability query or a train request."""
    advice = protocol.heartbeat_advice(body)
    if advice is not None and cache.get_json(HEARTBEAT_ADVICE) != advice:
        cache.put_json(HEARTBEAT_ADVICE, advice)


def _from_downstream_log(
    cache: Cache, cfg: Config, t: protocol.Task, run_id: str, errors: list[str]
) -> dict[str, Any] | None:
    """The task's base version rebuilt from a version this node holds and the log the coordinator sent in
    place of the weights (`base_log`), cached like sent weights; None (reported missing) if that fails."""
    sent = t.get("base_log")
    if not isinstance(sent, dict):
        return None
    prev = cache.get_weights(str(sent.get("from_sha256"))) if protocol.is_sha256(sent.get("from_sha256")) else None
    if prev is None:
        return None
    try:
        ulog = UpdateLog.from_record(sent.get("log"), f"expert {t['expert']}: downstream log")
        w0 = protocol.decode_weights(prev["weights"])
        start = State(w0, step=int(prev["step"]), opt=OptState.from_record(prev.get("opt"), w0.size))
        # Under the recipe it ran, which may be another node's: the hash below is what vouches for it.
        got = steps.replay(cfg if ulog.recipe is None else ulog.recipe.apply(cfg), start, ulog, t["expert"])
    except (CheckpointError, ValueError, KeyError, TypeError) as e:
        errors.append(f"expert {t['expert']}: the downstream log does not replay here ({e})")
        return None
    if protocol.weights_sha256(got.weights) != t["base_sha256"]:
        errors.append(f"expert {t['expert']}: the downstream log replays to other weights than {t['base_sha256'][:12]}")
        return None
    opt = got.opt.to_record()
    cache.put_weights(
        t["base_sha256"],
        expert=t["expert"],
        version=t["version"],
        step=got.step,
        weights=got.weights,
        opt=opt,
        run_id=run_id,
    )
    return {"weights": got.weights, "opt": opt}


def _store_pieces(cache: Cache, pieces: Any) -> tuple[list[str], list[str]]:
    """Put shard pieces into the cache: the shards now complete, and one error line per bad piece (its
    shard is then reported missing and comes again)."""
    try:
        pieces = pieces_mod.check_pieces(pieces)
    except ValidationError as e:
        return [], [str(e)]
    done, errors = [], []
    for p in pieces:
        try:
            if cache.put_piece(p["sha256"], p["offset"], p["total"], p["data"]):
                done.append(p["sha256"])
        except CheckpointError as e:
            errors.append(str(e))
    return sorted(set(done)), errors


@app.query("shards")
def shard_pieces(msg: Message, context: Context) -> Message:
    body = protocol.unpack(msg.content, protocol.KIND_PIECES, protocol.PIECE_BYTES + protocol.SMALL_BYTES)
    s = settings(dict(context.node_config))
    done, errors = _store_pieces(Cache(s.cache, max_bytes=s.cache_bytes), body.get("pieces"))
    log.info(
        "stored %d shard pieces: %d shards complete%s",
        len(body.get("pieces") or []),
        len(done),
        f", errors: {errors}" if errors else "",
    )
    return _reply(msg, {"node": context.node_id, "complete": done, "errors": errors}, protocol.KIND_ACK)


@app.query("advice")
def heartbeat_advice(msg: Message, context: Context) -> Message:
    body = protocol.unpack(msg.content, protocol.KIND_ADVICE, protocol.SMALL_BYTES)
    _take_advice(Cache(settings(dict(context.node_config)).cache), body)
    log.info("heartbeat advice: %s s", protocol.heartbeat_advice(body))
    return _reply(msg, {"node": context.node_id}, protocol.KIND_ACK)


@app.query("end")
def run_end(msg: Message, context: Context) -> Message:
    body = protocol.unpack(msg.content, protocol.KIND_END, protocol.SMALL_BYTES)
    speculation.stop(settings(dict(context.node_config)).cache)  # nothing comes after the end
    log.info("%s %s", protocol.RUN_ENDED, protocol.end_summary(body))
    return _reply(msg, {"node": context.node_id}, protocol.KIND_ACK)


def _limit_name(run_id: Any) -> str:
    return "limit-" + "".join(c for c in str(run_id) if c.isalnum())[:64]


def _train_limit(cache_root: Path, flower_run: int) -> int:
    """The train-request bound that the capability query of this Flower run set (the codec's own bound
    for a run this cache never answered a query of: the coordinator always asks first)."""
    limit = Cache(cache_root).get_json(_limit_name(flower_run))
    return int(limit) if isinstance(limit, int) and 0 < limit <= codec.MAX_BYTES else codec.MAX_BYTES


@app.train()
def train(msg: Message, context: Context) -> Message:
    t_start = time.perf_counter()
    s = settings(dict(context.node_config))
    body = protocol.unpack(msg.content, protocol.KIND_TRAIN, _train_limit(s.cache, context.run_id))
    header = {
        "node": context.node_id,
        "name": s.name,
        "round": body.get("round"),
        "pid": os.getpid(),
        "torch_importable": torch_importable(),
        "soma_version": __version__,
    }
    if body.get("node") != context.node_id:
        log.warning("refusing a request addressed to node %s (this is node %s)", body.get("node"), context.node_id)
        return _reply(
            msg, {**header, "results": [], "errors": ["request addressed to another node"]}, protocol.KIND_REPLY
        )
    cfg = config_mod.from_dict(body["config"])
    reply_dtype = body["reply_dtype"]
    if reply_dtype not in protocol.REPLY_DTYPES:
        raise SomaError(f"unknown reply dtype {reply_dtype!r}")
    cache = Cache(s.cache, max_bytes=s.cache_bytes, keep_versions=cfg.federation.keep_versions)
    _take_advice(cache, body)
    run_id = str(body.get("run_id"))  # versions are pruned per run: a cache serves many runs
    _, errors = _store_pieces(cache, body.get("pieces", []))

    keys = _keys(body, context.node_id, reply_dtype) if s.speculate else []
    nxt = speculation.following(body) if keys else None  # the experts its trainer trains after this round
    results, failed = _claimed(s, keys, body, nxt), []
    missing: protocol.Inventory = {"weights": [], "shards": []}
    _pin(cache, run_id, body["tasks"], [])
    if results is None:
        runnable, missing = _runnable(cache, cfg, body["tasks"], run_id, errors)
        if missing["weights"] or missing["shards"]:
            # Say so at once, training nothing: the coordinator resends the request with what was missing
            # while the round still has its time, and one miss costs a round trip, not the expert's round.
            log.info(
                "round %s: cache misses: %d weight versions, %d shards; asking for them before training",
                body["round"],
                len(missing["weights"]),
                len(missing["shards"]),
            )
            runnable = []
        results, failed = _train_all(runnable, cfg, s, cache, run_id, reply_dtype, float(body["max_seconds"]), body)
        if keys and results:
            _speculate(s, keys, runnable, results, body, nxt)
    _pin(cache, run_id, body["tasks"], results)
    ahead = nxt[1] if nxt else []  # what the trainer may start from next round
    protect = {r["sha256"] for r in results} | {t["base_sha256"] for t in ahead}
    protect |= {h for t in [*body["tasks"], *ahead] for h in t["shards"]}
    cache.evict(protect)
    reply = {
        **header,
        "results": results,
        "missing": missing,
        "errors": errors,
        "failed": failed,
        "seconds_total": time.perf_counter() - t_start,
    }
    return _reply(msg, reply, protocol.KIND_REPLY)


def _pin(cache: Cache, run_id: str, tasks: list[protocol.Task], results: list[dict[str, Any]]) -> None:
    """Pin each task's expert's versions that the coordinator may name next: the base it trains from, the
    accepted version under a base still to be judged, and the result sent (the next base once accepted)."""
    made = {r.get("expert"): r.get("sha256") for r in results}
    for t in tasks:
        cache.pin(run_id, t["expert"], [t["base_sha256"], t.get("keep_sha256"), made.get(t["expert"])])


def _keys(body: dict[str, Any], node: int, reply_dtype: str) -> list[speculation.Key]:
    """The speculation key of each task of a request, in its order."""
    return [speculation.key_of(node, body["run_id"], body["config"], reply_dtype, t) for t in body["tasks"]]


def _claimed(
    s: Settings, keys: list[speculation.Key], body: dict[str, Any], nxt: speculation.Following | None
) -> list[dict[str, Any]] | None:
    """The round, trained by this worker's speculating trainer where it ran every task from its base; None:
    train it here."""
    if not keys:
        return None
    if any(speculation.brings_base(t) for t in body["tasks"]):
        speculation.stop(s.cache)  # whatever it trains, this round starts elsewhere
        return None
    t0 = time.perf_counter()
    results = speculation.claim(s.cache, keys, body["tasks"], float(body["max_seconds"]), nxt)
    if results is None:
        return None
    seconds = sum(r["seconds"] for r in results)
    log.info(
        "round %s: experts %s trained while the last reply went up (%.1f s of their %.1f s before this request)",
        body["round"],
        logs.expert_set(k.expert for k in keys),
        max(0.0, seconds - (time.perf_counter() - t0)),
        seconds,
    )
    return results


def _speculate(
    s: Settings,
    keys: list[speculation.Key],
    runnable: list[Runnable],
    results: list[dict[str, Any]],
    body: dict,
    nxt: speculation.Following | None,
) -> None:
    """Start the speculating trainer on the round after this one: for each expert that trained, from the
    version it just cached, or for the experts the request names for the next round (`next_experts`)."""
    settings = {
        "cache": str(s.cache),
        "cache_bytes": s.cache_bytes,
        "device": s.device,
        "threads": s.threads,
        "spin": int(s.spin),
        "parallel": s.parallel,
        "probe_seconds": s.probe_seconds,
    }
    key_of = {k.expert: k for k in keys}
    task_of = {t["expert"]: t for t, *_ in runnable}
    done = [(key_of[r["expert"]], task_of[r["expert"]], r) for r in results]
    speculation.spawn(s.cache, done, body["config"], float(body["max_seconds"]), settings, nxt)


Runnable = tuple[protocol.Task, State, list[bytes]]  # a task, its base state, its shards' bytes


def _runnable(
    cache: Cache, cfg: Config, tasks: list[protocol.Task], run_id: str, errors: list[str]
) -> tuple[list[Runnable], protocol.Inventory]:
    """The tasks this node can run now, each with its base state and shards (sent weights are cached),
    and the weight versions and shards it lacks for the others (reported back as missing)."""
    runnable, missing_w, missing_s = [], [], []
    for t in tasks:
        base = t["base_sha256"]
        if t.get("weights") is not None:
            w, opt = t["weights"], t.get("opt")
            if protocol.weights_sha256(w) != base:
                errors.append(f"expert {t['expert']}: sent weights do not hash to {base[:12]}")
                continue
            cache.put_weights(
                base, expert=t["expert"], version=t["version"], step=t["step"], weights=w, opt=opt, run_id=run_id
            )
        else:
            hit = cache.get_weights(base) or _from_downstream_log(cache, cfg, t, run_id, errors)
            if hit is None:
                missing_w.append(base)
                sent = t.get("base_log")  # the version its log starts from is gone too: not sent again
                if isinstance(sent, dict) and protocol.is_sha256(sent.get("from_sha256")):
                    missing_w.append(sent["from_sha256"])
                continue
            # The task's optimizer state, where it sends one, is the version's (version 0 after a seed hashes
            # like the seed's final weights, which this cache holds with the seed's state).
            w, opt = hit["weights"], t.get("opt") if t.get("opt") is not None else hit.get("opt")
        shards = [cache.get_shard(h) for h in t["shards"]]
        if any(x is None for x in shards):
            missing_s += [h for h, x in zip(t["shards"], shards) if x is None]
            continue
        try:
            state = task.base_state(t, w, opt)
        except CheckpointError as err:
            errors.append(str(err))
            continue
        runnable.append((t, state, shards))
    return runnable, {"weights": missing_w, "shards": sorted(set(missing_s))}


def _train_all(
    runnable: list[Runnable],
    cfg: Config,
    s: Settings,
    cache: Cache,
    run_id: str,
    reply_dtype: str,
    budget: float,
    body: dict[str, Any],
) -> tuple[list[dict[str, Any]], list[protocol.Failure]]:
    """Train each runnable task in turn within the round's `budget` seconds of compute (shared out evenly
    among the tasks left), cache each new version, and return their results, and the experts that could not
    train with why: a failure belongs to its expert, and the others of the request still train."""
    if not runnable:
        return [], []
    # The capability query measured (and cached) which evaluator this box trains with under "auto", for the
    # recipe it chose, which `cfg` (the request's) already is.
    caps = probe.capabilities(cfg, cache, s.device, s.threads, s.spin, s.parallel, s.probe_seconds, probe.AS_SENT)
    evaluator = probe.make_evaluator(cfg, s.device, s.threads, s.spin, s.parallel, probe.chosen(caps))
    log.info(
        "round %s: training experts %s for up to %.0f s",
        body["round"],
        logs.expert_set(t["expert"] for t, *_ in runnable),
        budget,
    )
    # The budget is the compute the coordinator planned; it starts here, once the sessions are built. Set-up
    # (the message's decode, its pieces, building the sessions) took all of a 4 s budget on a loaded box,
    # which then trained one step a round; the deadline's slack, not the compute, pays for it.
    t_start = time.perf_counter()
    results, failed = [], []
    for i, (t, state, shards) in enumerate(runnable):
        remaining = budget - (time.perf_counter() - t_start)
        cap = max(0.01, remaining / (len(runnable) - i))  # at least one step per expert
        data = np.frombuffer(SEPARATOR.join(shards), dtype=np.uint8)
        try:
            results.append(task.run(t, cfg, state, data, evaluator, cap, reply_dtype, cache, run_id))
        except Exception as e:  # its shard too short, a graph error, anything: this expert's, not the request's
            failed.append(protocol.failure(t["expert"], f"{type(e).__name__}: {e}"))
            log.warning("round %s: expert %d cannot train: %s", body["round"], t["expert"], failed[-1]["reason"])
    return results, failed
