"""A worker that keeps training while its reply crosses the link: the speculating trainer.

Flower starts a fresh ClientApp process for every message, so between two rounds a worker sat idle: its
reply went up, the coordinator took it and sent the next request, a new process started and built its
sessions. On a 1 Mbit/s link that was ~10 s of a 60 s round at 8M.

So the ClientApp that finishes a round starts this trainer (`soma-worker join` enables it; `--no-speculate`
does not). It goes on from the versions just sent, as the next round will most likely ask: the same
experts, shards, config, lr scales and reply dtype, from the next versions and steps. It trains them in the
order the request named them, each for its share of the round's budget as the ClientApp shares it out, and
the same experts' sessions serve round after round. The next request's ClientApp claims the round when
it is of the trainer's run, node, config and reply dtype and no task brings its own base, and the trainer
finishes it: the steps it ran before the request came are the ones a fresh process would have run from
that base (their noise and batches come from the step's keys), and the round's budget counts its
training seconds from there. A task of another key (the coordinator refused a version, moved an expert,
changed an lr scale), or one whose step cap is below the steps run ahead, starts again from the version
it names, in the cache; the other experts keep their steps (at 64 experts a node, one changed expert
used to cost the node every step it ran ahead). Any other request stops the trainer, and the ClientApp
trains from the bases itself, as without speculation: nothing but idle compute is lost, and the next
trainer starts from its results.
After a claimed round the trainer goes on from the new versions of the experts claimed, so with a stable
assignment it starts once per run. Where the experts train in turn (`federation.min_expert_seconds`), a
request names the node's experts of the next round (`following`: those it trains now go on from their
results, the others start from the versions the node holds), and the trainer trains those instead. A
request that names none (the run's last round) stops it after the round, and the round's budget counts
from the request, not from the steps ahead of it: a node that trained ahead would otherwise finish first
and wait for the others, and what it trained after the run's last round would be for a round never sent.

One trainer per cache folder, under <cache>/speculation: `current.json` names the one wanted (none after
a mismatched claim or the run's end), which holds `lock` for its life and says which rounds it trains in
`state.json`; a ClientApp claims with `claim.json` and gets `result-<nonce>.msgpack` back. A trainer
stops when it is no longer the one wanted, when the SuperExec that started its ClientApp is gone, or when
no claim came for IDLE_SECONDS.

    python -m worker.speculation SPEC   (started by the ClientApp; SPEC: a msgpack file in that folder)
"""

from __future__ import annotations

import os
import sys

if os.environ.get("SOMA_BLOCK_TORCH") == "1" and "torch" not in sys.modules:
    sys.modules["torch"] = None  # type: ignore[assignment]  # as in the ClientApp: the worker path is torch-free

import fcntl
import hashlib
import json
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from soma_edge import codec
from soma_edge import config as config_mod
from soma_edge.checkpoint import atomic_write
from soma_edge.config import Config
from soma_edge.corpus.documents import SEPARATOR
from soma_edge.errors import CheckpointError, SomaError
from soma_edge.processes import logs
from soma_edge.processes.logs import role_logger
from soma_edge.processes.pids import pid_alive
from soma_edge.spsa.optim import State
from soma_edge.wire import protocol
from worker import probe, task
from worker.cache import Cache
from worker.trainer import TrainReport

log = role_logger("soma.worker")

FOLDER = "speculation"
SPEC_KIND, RESULT_KIND = "speculation_spec", "speculated_result"
POLL = 0.05  # seconds between looks for a claim (while idle) or a result
LOCK_WAIT = 10.0  # a new trainer waits this long for the one it replaces to stop (one step of it)
IDLE_SECONDS = 1800.0  # an unclaimed trainer stops after this long: a 91 MB weights reply takes 12 min at 1 Mbit/s
RESULT_SLACK = 60.0  # a claimed round's result is given up on this long past its budget
START_SECONDS = 20.0  # a claim waits this long for a trainer that is still starting
STARTED_UNDER = os.getppid()  # the process that started this one (the ClientApp's: its SuperExec)


@dataclass(frozen=True)
class Key:
    """What a round must match for the trainer's steps to be the ones it asks for."""

    node: int
    run_id: str
    expert: int
    version: int
    base_sha256: str
    step: int
    lr_scale: float
    shards: tuple[str, ...]
    reply_dtype: str
    config: str  # sha256 of the round's config

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "shards": list(self.shards)}

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> "Key":
        return cls(**{**rec, "shards": tuple(rec["shards"])})


def brings_base(t: protocol.Task) -> bool:
    """Does task t bring its own base (weights, optimizer state, a downstream log)? No trainer ran from it."""
    return any(t.get(k) is not None for k in ("weights", "opt", "base_log"))


def _task_fields(t: protocol.Task) -> dict[str, Any]:
    """The fields of a key that its task sets."""
    return {
        "expert": int(t["expert"]),
        "version": int(t["version"]),
        "base_sha256": str(t["base_sha256"]),
        "step": int(t["step"]),
        "lr_scale": float(t["lr_scale"]),
        "shards": tuple(str(h) for h in t["shards"]),
    }


def key_of(node: int, run_id: str, config: dict[str, Any], reply_dtype: str, t: protocol.Task) -> Key:
    """Task t's key."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    return Key(node=int(node), run_id=str(run_id), reply_dtype=str(reply_dtype), config=digest, **_task_fields(t))


def same_run(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Are two key records of the same run, node, config and reply dtype (the trainer's steps of one can
    then stand for the other's, where their expert, version, step, lr scale and shards match too)?"""
    return all(a.get(f) == b.get(f) for f in ("node", "run_id", "config", "reply_dtype"))


def key_for(template: Key, t: protocol.Task) -> Key:
    """Task t's key in the round whose other keys are like `template` (node, run, reply dtype, config)."""
    return replace(template, **_task_fields(t))


Following = tuple[list[int], list[protocol.Task]]


def following(body: dict[str, Any]) -> Following | None:
    """A request's `next_experts` (the node's experts next round, in order) and `next_tasks` (for those it
    does not train this round: their task from a version the node holds); None where it names none (the
    same experts next round) or names them malformed (then the same experts too)."""
    order, tasks = body.get("next_experts"), body.get("next_tasks", [])
    if order is None:
        return None
    fields = (("expert", int), ("version", int), ("step", int), ("steps", int), ("lr_scale", float))
    ok = isinstance(order, list) and all(isinstance(e, int) for e in order) and isinstance(tasks, list)
    ok = ok and all(
        isinstance(t, dict)
        and all(isinstance(t.get(k), kind) for k, kind in fields)
        and isinstance(t.get("base_sha256"), str)
        and isinstance(t.get("shards"), list)
        and not brings_base(t)
        for t in tasks
    )
    if not ok:
        log.warning("a request's next_experts or next_tasks are malformed: training on the same experts")
        return None
    return order, tasks


def _named(keys: list[Key], nxt: Following) -> list[tuple[Key, protocol.Task | None]]:
    """The experts a trainer trains after a round whose next keys are `keys`, as `nxt` names them, in its
    order: (key, None) for one it trains on from its result, (key, task) for one it starts from the version
    the node holds."""
    order, ahead = nxt
    out: list[tuple[Key, protocol.Task | None]] = [(k, None) for k in keys if k.expert in order]
    held = {k.expert for k, _ in out}
    out += [(key_for(keys[0], t), t) for t in ahead if t["expert"] in order and t["expert"] not in held]
    return sorted(out, key=lambda p: order.index(p[0].expert))


def _next(key: Key, t: protocol.Task, res: dict[str, Any]) -> tuple[Key, dict[str, Any]]:
    """The key and task of the round after `t`, whose result is `res`, as the coordinator will most likely send it."""
    key = replace(key, version=res["version"], base_sha256=res["sha256"], step=res["step"])
    nt = {**t, "version": key.version, "base_sha256": key.base_sha256, "step": key.step}
    return key, {**nt, "weights": None, "opt": None, "base_log": None}


# --- the ClientApp's side ----------------------------------------------------------------------------------


def _held(folder: Path) -> bool:
    """Does a trainer hold this folder's lock (is one alive)?"""
    try:
        with open(folder / "lock", "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            return False
    except OSError:
        return False


def running(root: Path) -> bool:
    """Does a trainer run for this cache folder?"""
    return _held(root / FOLDER)


def _read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _current(folder: Path) -> dict[str, Any]:
    """The trainer this folder wants ({"id", "pid"}), or {} for none."""
    c = _read_json(folder / "current.json")
    return c if isinstance(c, dict) and isinstance(c.get("id"), str) and isinstance(c.get("pid"), int) else {}


def stop(root: Path) -> None:
    """Stop this cache's trainer, if one runs (before its next step, or as soon as it has started)."""
    folder = root / FOLDER
    if folder.is_dir():
        atomic_write(folder / "current.json", b"{}")


def _ready(folder: Path) -> dict[str, Any] | None:
    """The wanted trainer's state ({"id", "pid", "key"}) once it trains, waiting for it while it starts
    (imports, its base read back, its sessions: seconds, which the round would spend on the same); None
    if none is wanted, or it died or stopped."""
    want, until = _current(folder), time.monotonic() + START_SECONDS
    while want and time.monotonic() < until:
        state = _read_json(folder / "state.json")
        if isinstance(state, dict) and state.get("id") == want["id"]:
            return state if _held(folder) else None
        if not pid_alive(want["pid"]) or _current(folder) != want:
            return None
        time.sleep(POLL)
    return None


def claim(
    root: Path, keys: list[Key], tasks: list[protocol.Task], budget: float, nxt: Following | None = None
) -> list[dict[str, Any]] | None:
    """The results of `tasks` (as sent, in their order; `keys`, each task's key), trained by this cache's
    trainer where it trains this run for this node, config and reply dtype, within `budget` seconds of
    training shared out among them and each task's step cap (a task of a key it does not hold starts from
    its base in the cache); None if it does not (any trainer is then stopped), and the ClientApp trains the
    tasks. `nxt`: the experts the trainer trains after this round (`following`; None: the same)."""
    folder = root / FOLDER
    state = _ready(folder)
    held = state.get("keys") if state is not None else None
    ours = isinstance(held, list) and held and isinstance(held[0], dict)  # a trainer of some round, alive
    if not ours or not all(same_run(held[0], k.record()) for k in keys):
        stop(root)
        return None
    nonce = uuid.uuid4().hex
    request = {"nonce": nonce, "keys": [k.record() for k in keys], "budget": float(budget), "tasks": tasks}
    if nxt is not None:
        request.update(next_experts=nxt[0], next_tasks=nxt[1])
    atomic_write(folder / "claim.json", json.dumps(request).encode())
    path, give_up = folder / f"result-{nonce}.msgpack", time.monotonic() + budget + RESULT_SLACK
    while time.monotonic() < give_up:
        if path.exists():
            res = _result(path, keys)
            if res is None:
                stop(root)
            return res
        if not _held(folder) or not pid_alive(state["pid"]):
            log.warning("the speculating trainer stopped before its results; training here")
            return None
        time.sleep(POLL)
    stop(root)
    log.warning("no results from the speculating trainer in %.0f s; training here", budget)
    return None


def _result(path: Path, keys: list[Key]) -> list[dict[str, Any]] | None:
    """The trainer's answer to a claim: a result per key, in order, or None (it refused, or the answer
    does not read)."""
    try:
        body = codec.decode(path.read_bytes(), RESULT_KIND)
    except (OSError, SomaError) as e:
        body = {"refused": f"its answer does not read: {e}"}
    finally:
        path.unlink(missing_ok=True)
    if not isinstance(body, dict):
        body = {"refused": "its answer is not a map"}
    elif "refused" not in body:
        got = body.get("results")
        ok = isinstance(got, list) and len(got) == len(keys) and all(isinstance(r, dict) for r in got)
        if not ok or [(r.get("expert"), r.get("base_sha256")) for r in got] != [
            (k.expert, k.base_sha256) for k in keys
        ]:
            body = {"refused": "its answer is the result of another round"}
    if "refused" in body:
        log.info("the speculating trainer did not give the round (%s); training here", body["refused"])
        return None
    return body["results"]


def spawn(
    root: Path,
    done: list[tuple[Key, protocol.Task, dict[str, Any]]],
    config: dict[str, Any],
    budget: float,
    settings: dict[str, Any],
    nxt: Following | None = None,
) -> None:
    """Start a trainer on the round after each (key, task, result) in `done`, from the result's version,
    which is in the cache; any trainer before it stops. With `nxt` (`following`), on the experts it names
    instead, in its order: those in `done` from their result, the others from their task. None starts where
    the SuperExec that started this ClientApp is gone (the worker is stopping, and this process was handed
    to another parent): no request would come, and a trainer watching that other parent would outlive the
    worker."""
    if os.getppid() != STARTED_UNDER or STARTED_UNDER <= 1 or not done:
        stop(root)
        return
    pairs = [_next(k, t, res) for k, t, res in done]
    if nxt is not None:
        tasks = {k.expert: t for k, t in pairs}
        pairs = [(k, tasks[k.expert] if t is None else t) for k, t in _named([k for k, _ in pairs], nxt)]
    if not pairs:
        stop(root)
        return
    folder = root / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    jobs = [{"key": k.record(), "task": t} for k, t in pairs]
    ident = uuid.uuid4().hex
    spec = {"id": ident, "jobs": jobs, "config": config, "budget": budget}
    spec.update(settings=settings, watch=STARTED_UNDER)
    path = folder / f"spec-{ident}.msgpack"
    atomic_write(path, codec.encode(spec, SPEC_KIND))
    atomic_write(folder / "current.json", json.dumps({"id": ident, "pid": os.getpid()}).encode())  # before it looks
    # Our stderr: its lines go where the ClientApp's go. Its own process group stays ours (the SuperNode's),
    # so stopping the worker's group stops it too.
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.speculation", str(path)], stdin=subprocess.DEVNULL, close_fds=True
    )
    atomic_write(folder / "current.json", json.dumps({"id": ident, "pid": proc.pid}).encode())


# --- the trainer ---------------------------------------------------------------------------------------------


@dataclass
class Job:
    """One expert the trainer holds: the round it trains (key and task), its state and shards, and what
    that round has run so far."""

    key: Key
    task: dict[str, Any]
    state: State
    data: np.ndarray
    start: int = 0  # its step as the round began
    base_decoder: np.ndarray | None = None
    rep: TrainReport = field(default_factory=lambda: TrainReport(steps=0, seconds=0.0, loss=0.0, forward_evals=0))

    def begin(self, cfg: Config) -> None:
        self.start, self.base_decoder = self.state.step, task.decoder_base(cfg, self.state)
        self.rep = TrainReport(steps=0, seconds=0.0, loss=0.0, forward_evals=0)

    @property
    def cap(self) -> int:
        return int(self.task["steps"])


class Trainer:
    """Trains its experts round after round, each from the version it last sent, until a round is not
    claimed or it is told to stop."""

    def __init__(self, folder: Path, spec: dict[str, Any], cfg: Config, cache: Cache, jobs: list[Job], evaluator):
        self.folder, self.cfg, self.cache, self.jobs, self.evaluator = folder, cfg, cache, jobs, evaluator
        self.budget, self.watch, self.id = float(spec["budget"]), int(spec["watch"]), str(spec["id"])
        self.claimed: dict[str, Any] | None = None

    def run(self) -> None:
        while self._round():
            pass

    def _gone(self) -> bool:
        """Told to stop (another trainer is wanted, or none), or the SuperExec of our ClientApp is gone."""
        return _current(self.folder).get("id") != self.id or self.watch <= 1 or not pid_alive(self.watch)

    def _interrupt(self) -> bool:
        return self._gone() or (self.claimed is None and (self.folder / "claim.json").exists())

    def _take_claim(self) -> dict[str, Any] | None:
        path = self.folder / "claim.json"
        c = _read_json(path)
        path.unlink(missing_ok=True)
        return c if isinstance(c, dict) and isinstance(c.get("nonce"), str) else None

    def _advertise(self) -> None:
        """Say which rounds this trainer trains: a claim must have their keys."""
        body = {"id": self.id, "pid": os.getpid(), "keys": [j.key.record() for j in self.jobs]}
        atomic_write(self.folder / "state.json", json.dumps(body).encode())

    def _adopt(self, c: dict[str, Any]) -> str | None:
        """Take claim `c`: its tasks become the round's, in its order (the experts it does not name are
        dropped). Why not, if it cannot be."""
        keys, tasks = c.get("keys"), c.get("tasks")
        if not isinstance(keys, list) or not isinstance(tasks, list) or len(keys) != len(tasks) or not keys:
            return "a malformed claim"
        if not isinstance(c.get("budget"), (int, float)):
            return "a malformed claim"
        if not all(isinstance(k, dict) and same_run(k, self.jobs[0].key.record()) for k in keys):
            return "it trained another run, node, config or reply dtype"
        held = {json.dumps(j.key.record(), sort_keys=True): j for j in self.jobs}
        chosen, afresh = [], []
        for k, t in zip(keys, tasks):
            if not isinstance(t, dict) or not isinstance(t.get("steps"), int) or brings_base(t):
                return "a malformed claim"
            j = held.get(json.dumps(k, sort_keys=True))
            if j is None or t["steps"] < j.rep.steps:
                # Another version, lr scale or shards, or more steps ahead than the task allows: this expert
                # alone starts again from the version the task names; the others keep their steps.
                try:
                    j = _job(self.cache, Key.from_record(k), t)
                except (TypeError, KeyError):
                    return "a malformed claim"
                if j is None:
                    return f"expert {k.get('expert')}: the version or shards its task names are not in the cache"
                j.begin(self.cfg)
                afresh.append(j.key.expert)
            j.task = t
            chosen.append(j)
        if afresh:
            log.info("experts %s start again from the versions the request names", logs.expert_set(afresh))
        self.jobs, self.claimed = chosen, c
        return None

    def _answer(self, nonce: str, body: dict[str, Any]) -> None:
        atomic_write(self.folder / f"result-{nonce}.msgpack", codec.encode(body, RESULT_KIND))

    def _turn(self, budget: float) -> tuple[Job, float] | None:
        """The expert to train next and for how long: the first whose share of `budget` is not spent (the
        ClientApp's rule: what is left over the experts left, at least one step each), or None."""
        spent = 0.0
        for i, j in enumerate(self.jobs):
            share = max(0.01, (budget - spent) / (len(self.jobs) - i))
            if j.rep.steps < j.cap and (j.rep.seconds < share or not j.rep.steps):
                return j, max(share - j.rep.seconds, 0.01)
            spent += j.rep.seconds
        return None

    def _round(self) -> bool:
        """Train one round from the current versions until it is claimed and done; False to stop."""
        self._advertise()
        for j in self.jobs:
            j.begin(self.cfg)
        budget, idle_from, self.claimed = self.budget, time.monotonic(), None
        while True:
            if self._gone():
                return False
            if self.claimed is None and (self.folder / "claim.json").exists():
                c = self._take_claim()
                if c is None:
                    continue
                why = self._adopt(c)
                if why:
                    self._answer(c["nonce"], {"refused": why})
                    return False
                budget = float(c["budget"])
                if c.get("next_experts") == []:  # nothing follows: train this round as long after the request
                    budget += sum(j.rep.seconds for j in self.jobs)  # as a fresh ClientApp would, not less
            turn = self._turn(budget)
            if turn is not None:
                j, seconds = turn
                more = task.train_loop(
                    j.state,
                    j.data,
                    self.cfg,
                    self.evaluator,
                    expert=j.key.expert,
                    steps=j.cap - j.rep.steps,
                    seconds=seconds,
                    stop=self._interrupt,
                )
                j.rep.add(more)
                if more.steps:
                    idle_from = time.monotonic()
                continue
            if self.claimed is not None:
                break
            if time.monotonic() - idle_from > IDLE_SECONDS:
                return False
            time.sleep(POLL)
        return self._finish(budget)

    def _finish(self, budget: float) -> bool:
        """Answer the claim with each expert's result, then go on from the new versions: of the experts the
        claim names for the next round, where it names them (`following`). False: none is left to train."""
        results = [
            task.finish(j.task, self.cfg, j.state, j.start, j.base_decoder, j.rep, j.key.reply_dtype) for j in self.jobs
        ]
        self._answer(self.claimed["nonce"], {"results": [task.as_reply(j.task, r) for j, r in zip(self.jobs, results)]})
        for j, res in zip(self.jobs, results):
            j.key, j.task = _next(j.key, j.task, res)
        done, nxt = list(zip(self.jobs, results)), following(self.claimed)
        if nxt is not None:
            jobs = {j.key.expert: j for j in self.jobs}
            named = [
                jobs[k.expert] if t is None else _job(self.cache, k, t)
                for k, t in _named([j.key for j in self.jobs], nxt)
            ]
            self.jobs = [j for j in named if j is not None]
        self._advertise()  # before the cache writes (0.5 s an expert at 8M): a claim may come from then on
        for j, res in done:  # every result, trained on or not: the coordinator takes the node to hold them
            task.keep(self.cache, res, j.key.run_id)
            j.state = task.base_state(j.task, res["weights"], res["opt"])  # as the next ClientApp would load it
        self.budget = budget
        return bool(self.jobs)


def _start(folder: Path, spec: dict[str, Any]) -> Trainer | None:
    """The trainer of `spec`, with each expert's base version and shards from the cache (an expert whose
    are gone is left out; None if every one is)."""
    s, cfg = spec["settings"], config_mod.from_dict(spec["config"])
    cache = Cache(Path(s["cache"]), max_bytes=int(s["cache_bytes"]), keep_versions=cfg.federation.keep_versions)
    jobs = [j for j in (_job(cache, Key.from_record(job["key"]), job["task"]) for job in spec["jobs"]) if j]
    if not jobs:
        return None
    device, threads, spin, parallel = s["device"], int(s["threads"]), bool(s["spin"]), int(s["parallel"])
    caps = probe.capabilities(cfg, cache, device, threads, spin, parallel, float(s["probe_seconds"]), probe.AS_SENT)
    evaluator = probe.make_evaluator(cfg, device, threads, spin, parallel, probe.chosen(caps))
    return Trainer(folder, spec, cfg, cache, jobs, evaluator)


def _job(cache: Cache, key: Key, t: dict[str, Any]) -> Job | None:
    """Task t as a job, from its base version and shards in the cache (None where either is gone)."""
    hit = cache.get_weights(t["base_sha256"])
    shards = [cache.get_shard(h) for h in t["shards"]]
    if hit is None or any(x is None for x in shards):
        return None
    state = task.base_state(t, hit["weights"], hit.get("opt"))
    return Job(key, t, state, np.frombuffer(SEPARATOR.join(shards), dtype=np.uint8))


def _lock(folder: Path):
    """This folder's lock, held (the file stays open), once the trainer it replaces has stopped; None if
    that one does not stop within LOCK_WAIT."""
    f = open(folder / "lock", "a+")
    until = time.monotonic() + LOCK_WAIT
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f
        except BlockingIOError:
            if time.monotonic() > until:
                f.close()
                return None
            time.sleep(POLL)


def main(argv: list[str]) -> int:
    path = Path(argv[0])
    folder = path.parent
    try:
        spec = codec.decode(path.read_bytes(), SPEC_KIND)
    except (OSError, SomaError) as e:
        log.warning("the speculating trainer did not start: %s", e)
        return 2
    finally:
        path.unlink(missing_ok=True)
    lock = _lock(folder)
    if lock is None:
        return 0
    try:
        if _current(folder).get("id") != spec["id"]:
            return 0  # stopped, or another trainer is wanted, before this one started
        stale = _read_json(folder / "claim.json")  # a claim on the trainer before this one, which stopped
        (folder / "claim.json").unlink(missing_ok=True)
        if isinstance(stale, dict) and isinstance(stale.get("nonce"), str):
            body = codec.encode({"refused": "it stopped"}, RESULT_KIND)
            atomic_write(folder / f"result-{stale['nonce']}.msgpack", body)
        trainer = _start(folder, spec)
        if trainer is not None:
            log.info(
                "experts %s: training on from the versions just sent while the reply goes up",
                logs.expert_set(j.key.expert for j in trainer.jobs),
            )
            trainer.run()
    except (CheckpointError, SomaError, OSError, ValueError, KeyError, TypeError) as e:
        log.warning("the speculating trainer stopped: %s", e)
    finally:
        (folder / "state.json").unlink(missing_ok=True)
        lock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
