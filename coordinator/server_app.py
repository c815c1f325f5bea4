"""The SOMA coordinator as a Flower ServerApp: the round loop.

Each round: find live nodes (`grid.get_node_ids()`), ask new ones for their capabilities, plan a sticky,
makespan-minimizing assignment (`coordinator.scheduler`), send each node one message with all its
experts (weights and shards only where its cache lacks them; shard bytes beyond one piece go ahead in
`query.shards` messages), collect replies until the round deadline, validate every result
(`soma_edge.protocol.check_result`, the guard in `coordinator.guard`, log replies replayed by
`coordinator.replay`), checkpoint accepted versions atomically, compute val losses, and commit the
round by writing state.msgpack last. Where every reply is in (and `federation.pipeline`), the next round
is planned and sent before those checks, from the versions the replies claim (`_start_round` with
`ahead`), so the workers train while the coordinator checks and commits.

The round ends when every node has replied or Flower has reported it gone (NODE_UNAVAILABLE, after two
of its heartbeats: 10 s ones where `_heartbeat` finds the node's link fast), or at the deadline. A node that fails or
misses the deadline (killed, hung, too slow) is set aside until it answers a capability query again, so
its experts go to others: at once to a node that has no work this round, else next round. Nodes that
join mid-round are probed during it. Error replies come from node 1, so they are mapped to our messages
by `reply_to_message_id`. At the end, every live node hears that the run is over (`query.end`).

Flower launches this process itself (next to the SuperLink), so progress goes to RUN/status.json and
RUN/metrics.jsonl, which `soma-coord start` tails.
"""

from __future__ import annotations

import functools
import logging
import math
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from coordinator import guard, scheduler
from soma_edge import __version__, params, protocol
from soma_edge import seed as seed_mod
from soma_edge.config import Config
from soma_edge.corpus import SEPARATOR, eval_windows
from soma_edge.errors import CheckpointError, CodecError, CorpusError, SomaError, ValidationError
from soma_edge.logs import role_logger
from soma_edge.rundir import RunDir, RunLockedError
from soma_edge.spsa import OptState, State, UpdateLog, evals_per_step, plateau, schedule

log = role_logger("soma.coord")

POLL_SECONDS = 0.5
QUERY_SECONDS = 90.0  # a capability query includes the node's throughput probe
GRACE_QUERY_SECONDS = 30.0  # after join_grace, how long round 1 waits for a node still answering its query
NODE_UNAVAILABLE = 5  # flwr's ErrorCode: the node missed two heartbeats
END_SECONDS = 15.0  # how long the end of the run waits for the workers to hear of it
MIXTURE_TOP_K = 2  # the per-round routed val loss mixes the top-2 experts (top-1 when N = 1)
STOPPED = "stopped (soma-coord stop)"


@dataclass
class Node:
    id: int
    name: str = "?"
    label: str = "?"  # the name, plus "#id" when another live node has the same name (both default to the host name)
    status: str = "new"  # new | querying | active | probation (missed a deadline) | excluded
    rate: float = 0.0  # forward evaluations/s, probed then updated from real rounds
    link: float | None = None  # bytes/s, measured from large train exchanges, both ways (None: not yet)
    weights: set[str] = field(default_factory=set)  # version hashes its cache holds (as far as we know)
    shards: set[str] = field(default_factory=set)
    caps: dict[str, Any] = field(default_factory=dict)
    query_mid: str | None = None
    query_sent: float = 0.0
    identity: str = ""  # who strikes count against (`coordinator.guard.identity`), set when it answers a query

    @property
    def who(self) -> str:
        return self.identity or f"node:{self.id}"


@dataclass
class Outgoing:
    node: int
    kind: str  # "query" | "pieces" | "train" | "end"
    expected: protocol.Expected | None = None
    bytes_down: int = 0
    per_expert: dict[int, dict[str, int]] = field(default_factory=dict)  # expert -> weight/shard bytes sent
    sent_at: float = 0.0
    mid: str = ""


class Coordinator:
    def __init__(
        self,
        grid,
        run: RunDir,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        setup: Callable[[], None] | None = None,
    ) -> None:
        self.grid, self.run, self.setup = grid, run, setup  # setup: runs first under the run lock
        self.clock, self.sleep = clock, sleep
        self.nodes: dict[int, Node] = {}
        self.out: dict[str, Outgoing] = {}  # message id -> what it was
        self.late: dict[str, Outgoing] = {}  # train requests of the last round that missed its deadline
        self.refused: set[str] = set()  # version hashes claimed by results that their checks refused
        self.board = None  # RUN/tb/'s event writer (coordinator.board), when federation.tensorboard
        self._ahead: _RoundCtx | None = None  # while planning a round ahead of the last one's checks
        self._locked_at = math.inf  # when this coordinator took the run lock (`main`)

    # --- entry ----------------------------------------------------------------------------------------

    def main(self, lock_wait: float = 60.0) -> dict[str, Any]:
        # Flower keeps the ServerApp's own output to itself (`flwr log`); ours also goes to RUN/logs.
        self.run.logs.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(self.run.logs / "coordinator.log")
        handler.setFormatter(logging.Formatter("%(asctime)s soma.coord %(levelname)s %(message)s"))
        # The file has every line; `soma-coord start` shows its INFO and higher ones (the events, the
        # commits), not the DEBUG ones (each accepted expert: the experts table shows those).
        log.addHandler(handler)
        log.setLevel(logging.DEBUG)
        try:
            with self.run.lock(wait=lock_wait):
                self._locked_at = time.time()
                if self.setup is not None:
                    self.setup()
                return self._main()
        except Exception as e:
            log.error("coordinator failed: %s: %s", type(e).__name__, e)
            if not isinstance(e, RunLockedError) and hasattr(self, "cfg"):
                self._status("failed", message=f"{type(e).__name__}: {e}", user_error=isinstance(e, SomaError))
            raise
        finally:
            if self.board is not None:
                self.board.close()
            log.removeHandler(handler)
            handler.close()

    def _main(self) -> dict[str, Any]:
        run = self.run
        self.cfg: Config = run.load_config()
        fed = self.cfg.federation
        self.prep = run.load_prepare()
        self.size = params.layout(self.cfg.model).size
        self._val_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._evaluator = None
        state = run.load_state(verify=True)
        if run.fallback:
            log.warning("%s", run.fallback)
        if state is None:
            state = self._init_state()
        self.state = state
        self.state.setdefault("strikes", {})
        self._check_best()
        self._committed = self._kept()  # what state.msgpack holds: the fallback once the next round commits
        if run.clean_debris():
            log.info("removed the temp files of writes a crash interrupted")
        self._prune(self._kept_in(run.prev_state_path))  # a prune that a crash after the commit cut short
        run.truncate_metrics(state["round"])
        run.clear_stop(before=self._locked_at)  # a stop addresses the coordinator that held the lock then
        if state["round"] >= fed.rounds:
            log.info("run %s already completed its %d rounds", run.root, fed.rounds)
            self._status("done")
            return state
        if fed.tensorboard:
            from coordinator.board import Board

            self.board = Board(run.tb, state["round"])
        log.info(
            "run %s: resuming after round %d of %d" if state["round"] else "run %s: starting, round %d of %d",
            run.root,
            state["round"],
            fed.rounds,
        )
        if self._fan_out():  # a seed that finished in a round whose commit never happened
            self.run.save_state(self.state)
        self._wait_for_nodes(fed.min_nodes, grace=fed.join_grace, stoppable=True)
        why, ctx = "complete", None
        for r in range(state["round"] + 1, fed.rounds + 1):
            if ctx is None:
                if self.run.stop_requested():
                    why = STOPPED
                    log.info("stop requested (soma-coord stop): stopping after round %d of %d", r - 1, fed.rounds)
                    break
                if self._capped() and not self._steps_left():
                    why = f"every expert has its {seed_mod.expert_steps(self.cfg)} steps (federation.max_steps)"
                    log.info("%s: stopping before round %d", why, r)
                    break
                ctx = self._start_round(r)
                if ctx is None:
                    why = STOPPED
                    log.info(
                        "stop requested (soma-coord stop) while no worker was left: stopping after round %d of %d",
                        r - 1,
                        fed.rounds,
                    )
                    break
            ctx = self._round(ctx)
        self._end_run(why)
        if why == STOPPED:
            self.run.clear_stop()
            self._status("done", stopped=True)
            log.info(
                "run stopped after round %d of %d: `soma-coord start --run %s` resumes it",
                self.state["round"],
                fed.rounds,
                run.root,
            )
        else:
            self._status("done")
            log.info("run complete: %d rounds", self.state["round"])
        return self.state

    def _end_run(self, why: str) -> None:
        """Tell every live node that the run is over, so that its `soma-worker join` exits (or waits for
        the next run); wait up to END_SECONDS for them to hear it, as Flower drops a finished run's messages."""
        body = protocol.run_end(self.state["run_id"], self.state["round"], self.cfg.federation.rounds, why)
        self._push(
            [
                (self._message(body, protocol.KIND_END, nid, protocol.QUERY_END), Outgoing(node=nid, kind="end"))
                for nid in sorted(self._live_ids())
            ]
        )
        deadline, heard = self.clock() + END_SECONDS, set()

        def ack(mid: str, reply, o: Outgoing) -> None:
            if o.kind == "end" and not reply.has_error():
                heard.add(o.node)

        # Only for nodes that were working: one that missed a deadline may be dead, and Flower takes as long
        # as its heartbeat patience to say so.
        waited = {nid for nid, n in self.nodes.items() if n.status == "active"}
        while any(o.kind == "end" and o.node in waited for o in self.out.values()) and self.clock() < deadline:
            self.sleep(POLL_SECONDS)
            self._pull(ack)
        log.info("run over (%s): %d worker(s) told", why, len(heard))

    # --- state ----------------------------------------------------------------------------------------

    def _init_state(self) -> dict[str, Any]:
        """Version 0 of every expert: the same seeded initialization (a common start, as in c-BTM). With a
        seed run, only the seed starts from it; the experts start from the seed (`_fan_out`)."""
        w = params.init(self.cfg.model, self.cfg.seed)
        seeded = seed_mod.enabled(self.cfg)
        ids = [seed_mod.seed_expert(self.cfg)] if seeded else range(self.cfg.federation.experts)
        experts = {str(e): self._version0(e, w) for e in ids}
        state = {
            "round": 0,
            "rounds": self.cfg.federation.rounds,
            "run_id": uuid.uuid4().hex,
            "experts": experts,
            "assignment": {},
            "phase": "seed" if seeded else "experts",
            "strikes": {},
            "soma_version": __version__,
        }
        self.run.save_state(state)
        return state

    def _version0(self, e: int, w: np.ndarray) -> dict[str, Any]:
        """Write version 0 of expert `e` with weights `w`, fresh optimizer state and step 0; its state entry.
        Its val loss is the first best that the guard measures replies against."""
        sha = protocol.weights_sha256(w)
        val = self._val_loss(e, protocol.decode_weights(w))
        body = {
            "expert": e,
            "version": 0,
            "sha256": sha,
            "config": self.cfg.to_dict(),
            "step": 0,
            "weights": w,
            "opt": None,
            "val_loss": val,
        }
        rel = self.run.save_expert(body)
        return {
            "version": 0,
            "sha256": sha,
            "path": rel,
            "step": 0,
            "train_loss": None,
            "val_loss": val,
            "node": None,
            "best": guard.Best(0, sha, rel, val).to_record(),
            **_plateau_fields(OptState()),
        }

    def _check_best(self) -> None:
        """Every expert's best version loads and matches its hash; else (corrupt, or a run from before
        guards) the current version becomes the best, with one warning."""
        for e, x in self.state["experts"].items():
            rec = x.get("best")
            try:
                body = self.run.load_expert(rec["path"]) if rec else None
                if body is not None and protocol.weights_sha256(body["weights"]) != rec["sha256"]:
                    raise CheckpointError(f"{self.run.root / rec['path']}: weights do not match its sha256")
            except (CheckpointError, KeyError, TypeError) as err:
                log.warning(
                    "expert %s: its best version does not load (%s); the current version v%s is the best now",
                    e,
                    err,
                    x["version"],
                )
                body = None
            if body is None:
                val = x.get("val_loss")
                if val is None:
                    val = self._val_loss(int(e), protocol.decode_weights(self.run.load_expert(x["path"])["weights"]))
                x["best"] = guard.Best(int(x["version"]), x["sha256"], x["path"], float(val)).to_record()

    def _seeding(self) -> bool:
        return self.state.get("phase") == "seed"

    def _fan_out(self) -> bool:
        """When the seed has its steps: every expert's version 0 is the seed's weights, bit for bit (not yet
        committed: the caller's save_state is the commit point). True if it fanned out."""
        sid = str(seed_mod.seed_expert(self.cfg))
        seed = self.state["experts"].get(sid)
        if not self._seeding() or seed is None or seed["step"] < self.cfg.federation.seed_steps:
            return False
        w = self.run.load_expert(seed["path"])["weights"]
        if protocol.weights_sha256(w) != seed["sha256"]:
            raise SomaError(f"{self.run.root / seed['path']}: the seed's weights do not match state.msgpack")
        experts = {str(e): self._version0(e, w) for e in range(self.cfg.federation.experts)}
        self.state["seed"] = {**seed, "expert": int(sid)}
        self.state["experts"], self.state["phase"] = experts, "experts"
        self.state["assignment"] = {}  # the experts' versions 0 are on no node yet
        log.info(
            "seed expert %s done at step %d (val %.4f): version 0 of all %d experts is its weights %s",
            sid,
            seed["step"],
            seed.get("val_loss") or float("nan"),
            len(experts),
            seed["sha256"][:12],
        )
        return True

    def _phase_config(self) -> Config:
        """What the current phase trains with: the run's config for the seed (or no seed), else the experts'."""
        return self.cfg if self._seeding() else seed_mod.expert_config(self.cfg)

    def _capped(self) -> bool:
        return self._seeding() or bool(self.cfg.federation.max_steps)

    def _steps_left(self) -> dict[int, int]:
        """Steps each expert may still take (experts with none left omitted): the seed's seed_steps, else
        federation.max_steps less the seed's share."""
        cap = self.cfg.federation.seed_steps if self._seeding() else seed_mod.expert_steps(self.cfg)
        left = {e: cap - int(self._base(e)["step"]) for e in self.expert_ids()}
        return {e: n for e, n in left.items() if n > 0}

    def _kept(self, state: dict[str, Any] | None = None) -> dict[int, set[int]]:
        """The versions a state refers to (the current one by default), per expert: current and best."""
        experts = (state or self.state)["experts"]
        return {int(e): {int(x["version"]), int(guard.Best.of(x).version)} for e, x in experts.items()}

    def _kept_in(self, path) -> dict[int, set[int]]:
        """`_kept` of a state file, or nothing when it does not load."""
        try:
            return self._kept(self.run.load_state_file(path))
        except (CheckpointError, KeyError, TypeError, ValueError, AttributeError):
            return {}

    def _prune(self, fallback: dict[int, set[int]]) -> None:
        """Old versions beyond keep_versions go; never a best version, or one the fallback state refers to."""
        for e in self.expert_ids():
            keep = tuple(sorted(fallback.get(e, set()) | self._committed[e]))
            self.run.prune(e, self.cfg.federation.keep_versions, self.state["experts"][str(e)]["version"], protect=keep)

    def expert_ids(self) -> list[int]:
        return sorted(int(e) for e in self.state["experts"])

    def current_sha(self) -> dict[int, str]:
        return {int(e): x["sha256"] for e, x in self.state["experts"].items()}

    # --- talking to nodes -----------------------------------------------------------------------------

    def _live_ids(self) -> set[int]:
        return {int(n) for n in self.grid.get_node_ids()}

    def _message(self, body: dict[str, Any], kind: str, node: int, message_type: str):
        from flwr.app import Message

        return Message(protocol.pack(body, kind), dst_node_id=node, message_type=message_type)

    def _push(self, items: list[tuple[Any, Outgoing]]) -> None:
        if not items:
            return
        mids = list(self.grid.push_messages([m for m, _ in items]))
        for mid, (m, o) in zip(mids, items):
            o.bytes_down, o.sent_at, o.mid = protocol.payload_bytes(m.content), self.clock(), mid
            self.out[mid] = o
            if o.kind == "query":
                self.nodes[o.node].query_mid = mid
                self.nodes[o.node].query_sent = self.clock()

    def _query_new_nodes(self) -> None:
        """Send a capability query to every live node we have not heard from (or that missed a deadline)."""
        live = self._live_ids()
        items = []
        for nid in sorted(live):
            node = self.nodes.setdefault(nid, Node(id=nid))
            stale = node.query_mid is not None and self.clock() - node.query_sent > QUERY_SECONDS
            if node.status in ("new", "probation", "gone") or (node.status == "querying" and stale):
                if stale:
                    self.out.pop(node.query_mid, None)
                body = protocol.capability_query(self.cfg.to_dict(), self.state["run_id"])
                items.append(
                    (
                        self._message(body, protocol.KIND_QUERY, nid, protocol.QUERY_CAPABILITIES),
                        Outgoing(node=nid, kind="query"),
                    )
                )
                node.status = "querying"
        self._push(items)

    def _pull(self, handle_train: Callable[[str, Any, Outgoing], None]) -> None:
        """Pull replies for every outstanding message once; dispatch them."""
        if not self.out:
            return
        for reply in self.grid.pull_messages(list(self.out)):
            mid = reply.metadata.reply_to_message_id
            o = self.out.pop(mid, None)
            if o is None:
                log.warning("reply to an unknown message %r from node %s ignored", mid, reply.metadata.src_node_id)
                continue
            if o.kind == "query":
                self._on_capabilities(reply, o)
            else:
                handle_train(mid, reply, o)

    def _on_capabilities(self, reply, o: Outgoing) -> None:
        node = self.nodes[o.node]
        node.query_mid = None
        if reply.has_error():
            log.warning("node %s did not answer the capability query: %s", o.node, reply.error.reason)
            node.status = "probation"
            return
        try:
            if reply.metadata.src_node_id != o.node:
                raise ValidationError(f"capabilities for node {o.node} came from node {reply.metadata.src_node_id}")
            caps = protocol.unpack(reply.content, protocol.KIND_CAPS, protocol.SMALL_BYTES)
            rate = scheduler.clamp_rate(protocol.check_caps(caps))
        except (CodecError, ValidationError) as e:
            log.warning("node %s: bad capability reply (%s); excluded", o.node, e)
            node.status = "excluded"
            return
        node.name = str(caps.get("name") or o.node)
        live = self._live_ids()
        twins = [
            n
            for n in self.nodes.values()
            if n.id != node.id
            and n.id in live
            and n.name == node.name
            and n.status in ("active", "querying", "probation")
        ]
        node.label = f"{node.name}#{node.id}" if twins else node.name
        node.caps = {k: v for k, v in caps.items() if k != "cache"}
        if caps.get("soma_version") != __version__:
            log.warning(
                "node %s (%s) runs soma-edge %s but the coordinator runs %s: excluded",
                o.node,
                node.name,
                caps.get("soma_version"),
                __version__,
            )
            node.status = "excluded"
            return
        node.identity = guard.identity(self.run, node.id)
        if guard.excluded(self.state["strikes"], node.who, self.cfg.federation.max_strikes):
            log.warning(
                "node %s (%s) is excluded from this run: %d strikes against %s",
                o.node,
                node.name,
                self.state["strikes"][node.who]["count"],
                node.who,
            )
            node.status = "excluded"
            return
        inv = caps.get("cache") or {}
        node.weights = set(inv.get("weights", []))
        node.shards = set(inv.get("shards", []))
        node.rate = rate if node.rate <= 0 else node.rate
        node.status = "active"
        log.info(
            "node %s (%s) active: %.1f forward evals/s on %s, torch importable: %s, cache: %d versions, %d shards",
            o.node,
            node.name,
            rate,
            (caps.get("providers") or ["?"])[0],
            caps.get("torch_importable"),
            len(node.weights),
            len(node.shards),
        )

    def _active(self) -> dict[int, Node]:
        live = self._live_ids()
        for nid, node in self.nodes.items():
            if nid not in live and node.status in ("active", "querying"):
                log.warning("node %s (%s) left the federation", nid, node.name)
                node.status = "gone"
        return {nid: n for nid, n in self.nodes.items() if n.status == "active" and nid in live}

    def _wait_for_nodes(self, want: int, grace: float = 0.0, stoppable: bool = False) -> dict[int, Node]:
        """Wait (up to wait_seconds) for `want` active nodes; then `grace` seconds more, and for any node
        still answering its capability query, so that workers started together all get round 1's work.
        `stoppable`: a stop request (`soma-coord stop`) ends the wait too."""
        fed = self.cfg.federation
        deadline, enough_at = self.clock() + fed.wait_seconds, None
        self._status("waiting", message=f"waiting for {want} worker(s)")
        while True:
            self._query_new_nodes()
            self._pull(lambda mid, reply, o: None)
            active = self._active()
            if stoppable and self.run.stop_requested():
                return active
            if len(active) >= want and enough_at is None:
                enough_at = self.clock()
                if grace > 0:
                    log.info(
                        "%d worker(s) in; waiting %.0f s more for others (federation.join_grace)", len(active), grace
                    )
            if enough_at is not None:
                waited = self.clock() - enough_at
                querying = any(n.status == "querying" for n in self.nodes.values())
                if (
                    waited >= grace
                    and (not querying or waited >= grace + GRACE_QUERY_SECONDS)
                    or self.clock() >= deadline
                ):
                    return active
            if self.clock() >= deadline:
                if active:
                    log.warning(
                        "only %d of %d wanted workers after %.0f s; going on", len(active), want, fed.wait_seconds
                    )
                    return active
                raise SomaError(
                    f"no worker joined within {fed.wait_seconds:.0f} s: start `soma-worker join "
                    f"--coordinator HOST:PORT` on a worker box (or use --local-workers)"
                )
            self.sleep(POLL_SECONDS)

    # --- one round ------------------------------------------------------------------------------------

    def _version_bytes(self) -> int:
        """What a version weighs on the wire: float32 weights and Adam's two moments."""
        return 3 * 4 * self.size

    def _downstream_log(self, e: int, node: Node) -> tuple[dict[str, Any], int] | None:
        """For a node that holds the version before expert e's current one: the log between them (and its
        bytes), when it is shorter than the weights and optimizer state it replaces (downstream logs)."""
        x = self.state["experts"][str(e)]
        rec = self.run.load_log(e, int(x["version"])) if int(x["version"]) > 0 else None
        if rec is None or rec.get("from_sha256") not in node.weights or rec.get("sha256") != x["sha256"]:
            return None
        try:
            nbytes = sum(UpdateLog.from_record(rec.get("log")).nbytes().values())
        except CheckpointError:
            return None
        if nbytes >= self._version_bytes():
            return None
        return {"from_sha256": rec["from_sha256"], "log": rec["log"]}, nbytes

    def _transfer_seconds(self, e: int, nid: int) -> float:
        """How long node `nid` would take to fetch what expert e needs and its cache lacks (0 while its
        link is unmeasured): the version with its optimizer state, and the shards."""
        node = self.nodes[nid]
        if not node.link:
            return 0.0
        nbytes = 0 if self._holds(nid, e) else self._version_bytes()
        sizes = self._shard_sizes()
        nbytes += sum(sizes.get(h, 0) for h in self._train_shards(e) if h not in node.shards)
        return nbytes / node.link

    def _heartbeat(self, nid: int) -> float:
        """The heartbeat interval to advise node `nid`: 10 s where its measured link moves the largest
        message it may get (a version and a piece of shards) or send (a version) within 10 s, else 30 s:
        a saturated slow link queues heartbeats for longer than two 10 s intervals, and the SuperLink
        would declare a node gone in the middle of a download."""
        link = self.nodes[nid].link
        biggest = self._version_bytes() + min(self.cfg.federation.piece_bytes, sum(self._shard_sizes().values()))
        fast = link is not None and biggest / link <= protocol.HEARTBEAT_FAST
        return protocol.HEARTBEAT_FAST if fast else protocol.HEARTBEAT_SLOW

    def _shard_sizes(self) -> dict[str, int]:
        if getattr(self, "_sizes", None) is None:
            self._sizes = {c["shards"][s]: int(c["bytes"][s]) for c in self.prep["clusters"] for s in c["shards"]}
        return self._sizes

    def _previous(self, active: dict[int, Node]) -> dict[int, int]:
        """Where each expert's current version already is: last round's node, else any node caching it."""
        prev: dict[int, int] = {}
        last: dict[int, int | str] = {int(e): n for e, n in self.state.get("assignment", {}).items()}
        last.update(self._ahead.plan.assignment if self._ahead else {})
        by_label = {n.label: nid for nid, n in active.items()}
        for e in self.expert_ids():
            nid = last.get(e)
            if isinstance(nid, str):
                nid = by_label.get(nid)
            if nid in active and self._holds(nid, e):
                prev[e] = nid
                continue
            holders = sorted(nid for nid in active if self._holds(nid, e))
            if holders:
                prev[e] = holders[0]
        return prev

    def _base(self, e: int) -> dict[str, Any]:
        """The version expert e trains from next: its current one or, while a round is planned ahead of
        the last one's checks, the version a result of that round claims (not stored yet: no path)."""
        x = self.state["experts"][str(e)]
        c = self._ahead.claims.get(e) if self._ahead else None
        if c is None:
            return x
        return {**x, "version": c.res["version"], "sha256": c.res["sha256"], "step": c.res["step"], "path": None}

    def _holds(self, nid: int, e: int) -> bool:
        """Whether node `nid` holds the version expert e trains from next (a claimed one: the node that made it)."""
        c = self._ahead.claims.get(e) if self._ahead else None
        return c.node == nid if c is not None else self.state["experts"][str(e)]["sha256"] in self.nodes[nid].weights

    def _send_train(
        self, ctx: "_RoundCtx", nid: int, experts: list[int], steps: dict[int, int], max_seconds: float | None = None
    ) -> None:
        """Give node `nid` its experts: the shard bytes it lacks in pieces of at most PIECE_BYTES, all but
        the last as messages of their own, then (once those are stored) the train request with the last."""
        shards, shard_bytes = self._missing_shards(nid, experts)
        pieces = protocol.split_pieces(shards, self.cfg.federation.piece_bytes)
        last = pieces.pop() if pieces else []
        if not pieces:
            self._push_train(ctx, self._tasks_for(ctx.r, nid, experts, steps, max_seconds, last, shard_bytes))
            return
        before = set(self.out)
        self._push(
            [
                (
                    self._message(
                        protocol.pieces_request(self.state["run_id"], nid, p),
                        protocol.KIND_PIECES,
                        nid,
                        protocol.QUERY_SHARDS,
                    ),
                    Outgoing(node=nid, kind="pieces"),
                )
                for p in pieces
            ]
        )
        ctx.waiting[nid] = _Waiting(set(self.out) - before, experts, steps, last, shard_bytes)
        log.info(
            "round %d: node %s lacks %.1f MiB of shards: %d pieces go before its experts %s",
            ctx.r,
            self.nodes[nid].label,
            sum(map(len, shards.values())) / 2**20,
            len(pieces) + 1,
            experts,
        )

    def _push_train(self, ctx: "_RoundCtx", item: tuple[Any, Outgoing]) -> None:
        before = set(self.out)
        self._push([item])
        ctx.train_mids |= set(self.out) - before

    def _on_pieces(self, mid: str, reply, o: Outgoing, ctx: "_RoundCtx") -> None:
        """A piece was stored (or not: the train request then finds the shard missing and it comes again).
        The node's train request goes out with the last piece once every earlier one is answered."""
        ctx.bytes_down += o.bytes_down
        wait = ctx.waiting.get(o.node)
        if wait is None:
            return
        if reply.has_error():
            log.warning("round %d: node %s did not store shard pieces: %s", ctx.r, o.node, reply.error.reason)
        wait.mids.discard(mid)
        if wait.mids:
            return
        del ctx.waiting[o.node]
        left = ctx.deadline - self.clock() - self.cfg.federation.deadline_slack
        self._push_train(
            ctx, self._tasks_for(ctx.r, o.node, wait.experts, wait.steps, max(left, 1.0), wait.last, wait.shard_bytes)
        )

    def _missing_shards(self, nid: int, experts: list[int]) -> tuple[dict[str, bytes], dict[int, int]]:
        """The train shards of `experts` that node `nid` lacks, and how many of their bytes each expert
        is the first to need."""
        node, shards, per_expert = self.nodes[nid], {}, {}
        for e in experts:
            hashes = self._train_shards(e)
            if not hashes:
                raise CorpusError(f"expert {e} has no train shards in {self.run.prepare_json}")
            per_expert[e] = 0
            for h in hashes:
                if h not in node.shards and h not in shards:
                    shards[h] = self.run.shard(h)
                    per_expert[e] += len(shards[h])
        return shards, per_expert

    def _tasks_for(
        self,
        r: int,
        nid: int,
        experts: list[int],
        steps: dict[int, int],
        max_seconds: float | None,
        pieces: list[dict[str, Any]],
        shard_bytes: dict[int, int],
    ) -> tuple[Any, Outgoing]:
        node = self.nodes[nid]
        tasks, per_expert, exp_tasks = [], {}, {}
        mode = self._reply_mode(node, r, max((steps[e] for e in experts), default=0))
        for e in experts:
            x = self._base(e)
            send_w = not self._holds(nid, e)
            downstream = self._downstream_log(e, node) if send_w else None
            base_log, log_bytes = downstream or (None, 0)
            send_w = send_w and base_log is None
            body = self.run.load_expert(x["path"]) if send_w else None
            w = body["weights"] if body else None
            stored = self._checked_opt(body, x["path"]) if body else None
            opt = stored.to_record() if stored is not None else None
            scale = float(x.get("lr_scale", 1.0))
            tasks.append(
                protocol.task(
                    expert=e,
                    version=x["version"],
                    base_sha256=x["sha256"],
                    step=x["step"],
                    steps=steps[e],
                    shards=self._train_shards(e),
                    lr_scale=scale,
                    weights=w,
                    opt=opt,
                    reply=mode,
                    base_log=base_log,
                )
            )
            exp_tasks[e] = {
                "version": x["version"],
                "base_sha256": x["sha256"],
                "step": x["step"],
                "steps": steps[e],
                "lr_scale": scale,
                "reply": mode,
            }
            opt_bytes = stored.nbytes() if stored is not None else 0
            per_expert[e] = {
                "weights": log_bytes if w is None else w.nbytes + opt_bytes,
                "shards": shard_bytes.get(e, 0),
            }
        fed, config = self.cfg.federation, self._phase_config().to_dict()
        body = protocol.train_request(
            round=r,
            node=nid,
            run_id=self.state["run_id"],
            config=config,
            reply_dtype=fed.reply_dtype,
            max_seconds=max_seconds or fed.round_seconds,
            tasks=tasks,
            pieces=pieces,
            heartbeat=self._heartbeat(nid),
        )
        expected = protocol.Expected(node=nid, round=r, tasks=exp_tasks, size=self.size, reply_dtype=fed.reply_dtype)
        msg = self._message(body, protocol.KIND_TRAIN, nid, protocol.TRAIN)
        return msg, Outgoing(node=nid, kind="train", expected=expected, per_expert=per_expert)

    def _collect_late(self, r: int) -> "_RoundCtx":
        """Replies to last round's requests that came after its deadline but before this round is planned:
        checked like any other, and accepted where their base version is still current. What they give
        (metrics lines marked late, rejections) commits with round r."""
        ctx = _RoundCtx(r=r, plan=scheduler.Plan({}, {}, 0.0, []), deadline=self.clock(), t_sent=self.clock())
        if not self.late:
            return ctx
        late, self.late = self.late, {}
        self.out.update(late)
        self._pull(lambda mid, reply, o: self._on_train(mid, reply, o, ctx) if mid in late else None)
        for mid in late:
            self.out.pop(mid, None)
        self._settle_all(ctx)
        for line in ctx.accepted.values():
            line["late"] = True
            log.info(
                "round %d: accepted expert %d v%d from %s after the last round's deadline",
                r,
                line["expert"],
                line["version"],
                line["node"],
            )
            self.nodes[line["node_id"]].status = "active"  # it answered after all
        return ctx

    def _start_round(self, r: int, ahead: "_RoundCtx | None" = None) -> "_RoundCtx | None":
        """Plan round r and send it. With `ahead` (round r - 1, every reply in but not all of them checked
        yet: pipelining), an expert with an unchecked result trains on from the version it claims, on the
        node that made it, which holds it; a node given an expert whose claimed version it does not hold
        gets its request only once round r - 1 has committed (`_send_deferred`). None: no worker was left
        and a stop was requested while waiting for one."""
        fed = self.cfg.federation
        t_round = self.clock()
        late = self._collect_late(r)
        self._query_new_nodes()
        self._pull(lambda mid, reply, o: None)
        active = self._active()
        if not active:
            active = self._wait_for_nodes(1, stoppable=True)
            if not active:
                return None
        with self._planning(ahead):
            rates = {nid: n.rate for nid, n in active.items()}
            plan = scheduler.plan(
                self.expert_ids(),
                rates,
                self._previous(active),
                fed.round_seconds,
                evals_per_step(self._phase_config().spsa),
                self._transfer_seconds,
            )
            if self._capped():  # a fixed budget: never past it; experts that have it all sit the round out
                left = self._steps_left()
                plan.steps = {e: min(s, left[e]) for e, s in plan.steps.items() if e in left}
            by_node: dict[int, list[int]] = {}
            for e, nid in sorted(plan.assignment.items()):
                if e in plan.steps:
                    by_node.setdefault(nid, []).append(e)
            log.info(
                "round %d/%d: %s (predicted compute %.1f s; moved: %s%s)",
                r,
                fed.rounds,
                ", ".join(f"{self.nodes[n].label}<-{es}" for n, es in by_node.items()),
                plan.makespan,
                plan.moved or "none",
                "; before round %d's checks" % (r - 1) if ahead else "",
            )

            # A node on a slow link gets the time to fetch what it lacks (weights, shards) and to send its reply.
            transfer = max(
                (plan.transfer.get(n, 0.0) + self._reply_seconds(n, es, r, plan.steps) for n, es in by_node.items()),
                default=0.0,
            )
            deadline = self.clock() + fed.round_seconds * fed.deadline_factor + fed.deadline_slack + transfer
            ctx = _RoundCtx(
                r=r,
                plan=plan,
                deadline=deadline,
                t_sent=self.clock(),
                t_round=t_round,
                late=list(late.accepted.values()),
                rejected=late.rejected,
                excluded=late.excluded,
                bytes_up=late.bytes_up,
                bytes_down=late.bytes_down,
            )
            for nid, es in sorted(by_node.items()):
                if ahead and any(e in ahead.claims and ahead.claims[e].node != nid for e in es):
                    ctx.deferred[nid] = es
                else:
                    self._send_train(ctx, nid, es, plan.steps)
        self._round_status(ctx)
        return ctx

    def _send_deferred(self, ctx: "_RoundCtx") -> None:
        """After the last round's commit: the requests `_start_round` held back for it go out, and the
        round's deadline moves by the time the coordinator spent on that round's checks and commit (it
        pulled no replies meanwhile, and the held-back requests went out only now)."""
        ctx.deadline += self.clock() - ctx.t_sent
        for nid, es in sorted(ctx.deferred.items()):
            self._send_train(ctx, nid, es, ctx.plan.steps)
        ctx.deferred.clear()

    def _round_status(self, ctx: "_RoundCtx") -> None:
        self._status(
            "round",
            round=ctx.r,
            started=time.time() - (self.clock() - ctx.t_sent),
            deadline_in=ctx.deadline - self.clock(),
            assignment={str(e): self.nodes[n].label for e, n in ctx.plan.assignment.items()},
        )

    def _round(self, ctx: "_RoundCtx") -> "_RoundCtx | None":
        """Collect round ctx.r's replies, start the next round where it can go ahead of this one's checks
        (`_pipelines`), then check what came back and commit. Returns the next round, if started."""
        self._collect(ctx)
        nxt = self._start_round(ctx.r + 1, ahead=ctx) if self._pipelines(ctx) else None
        self._settle_all(ctx)
        self._commit(ctx.r, ctx, nxt.t_round if nxt else None)
        if nxt is not None:
            self._send_deferred(nxt)
            self._round_status(nxt)
        return nxt

    def _pipelines(self, ctx: "_RoundCtx") -> bool:
        """Whether the next round may start before this one's results are checked: only when every reply
        is in (none may still come late), outside the seed phase (its commit may fan out), with no stop
        requested, and when a round is left to run with steps to take and a node to take them."""
        fed = self.cfg.federation
        if not fed.pipeline or ctx.r >= fed.rounds or self.late or self._seeding() or self.run.stop_requested():
            return False
        if not self._active():
            return False
        with self._planning(ctx):
            return not self._capped() or bool(self._steps_left())

    @contextmanager
    def _planning(self, ahead: "_RoundCtx | None") -> Iterator[None]:
        """While planning ahead of round `ahead`'s checks, `_base` and `_holds` see its claims."""
        self._ahead = ahead
        try:
            yield
        finally:
            self._ahead = None

    def _collect(self, ctx: "_RoundCtx") -> None:
        """Pull replies until every request is answered or the deadline passes, checking the results that
        are in while waiting for the rest; a node that misses the deadline is set aside."""
        r = ctx.r

        def handle(mid: str, reply, o: Outgoing) -> None:
            (self._on_pieces if o.kind == "pieces" else self._on_train)(mid, reply, o, ctx)

        def waiting() -> bool:
            return bool(ctx.waiting) or any(mid in self.out for mid in ctx.train_mids)

        while self.clock() < ctx.deadline and waiting():
            self._pull(handle)
            self._query_new_nodes()  # a worker that joins now is probed, and ready for the next plan
            self._give_idle(ctx)
            if waiting():
                if ctx.claims:  # use the wait: check a result that is in
                    self._settle(ctx, next(iter(ctx.claims)))
                else:
                    self.sleep(POLL_SECONDS)
        if waiting():
            self._pull(handle)  # what came in while a long check ran past the deadline
        ctx.t_done = self.clock()
        late = [self.out.pop(mid) for mid in sorted(self.out) if self.out[mid].kind in ("train", "pieces")]
        self.late = {
            o.mid: o for o in late if o.kind == "train"
        }  # their replies may still come in time (_collect_late)
        for nid in sorted({o.node for o in late}):
            node = self.nodes[nid]
            tasks = {e for o in late if o.node == nid and o.expected for e in o.expected.tasks}
            tasks |= set(ctx.waiting[nid].experts) if nid in ctx.waiting else set()
            log.warning(
                "round %d: node %s (%s) missed the deadline; its experts %s move next round",
                r,
                nid,
                node.name,
                sorted(tasks),
            )
            node.status = "probation"
            for e in tasks:
                ctx.failed.setdefault(e, f"node {node.label} missed the round deadline")

    def _give_idle(self, ctx: "_RoundCtx") -> None:
        """Experts left idle this round, because their node left or failed, go at once to a node without
        work this round (a worker that joined since the plan), when a whole round_seconds of training
        still fits before the deadline. The round then waits for that node's reply too."""
        fed = self.cfg.federation
        if ctx.deadline - self.clock() - fed.deadline_slack < fed.round_seconds:
            return
        idle = sorted(
            e
            for e, why in ctx.failed.items()
            if not why.startswith("rejected") and e not in ctx.accepted and e not in ctx.pending_resend
        )
        if not idle:  # the usual case: no need to ask the SuperLink for its nodes on every poll
            return
        busy = set(ctx.plan.assignment.values())
        free = [nid for nid in self._active() if nid not in busy]
        if not free:
            return
        nid = max(free, key=lambda n: (self.nodes[n].rate, -n))
        per = scheduler.steps_for(
            self.nodes[nid].rate, len(idle), fed.round_seconds, evals_per_step(self._phase_config().spsa)
        )
        steps = {e: min(scheduler.MAX_STEPS, math.ceil(scheduler.HEADROOM * per)) for e in idle}
        if self._capped():
            left = self._steps_left()
            steps = {e: min(s, left[e]) for e, s in steps.items() if left.get(e)}
        if not steps:
            return
        for e in steps:
            ctx.failed.pop(e)
            ctx.plan.assignment[e] = nid
            ctx.plan.moved = sorted(set(ctx.plan.moved) | {e})
        ctx.plan.steps.update(steps)
        log.info(
            "round %d: idle experts %s go to %s, which has no work this round",
            ctx.r,
            sorted(steps),
            self.nodes[nid].label,
        )
        self._send_train(ctx, nid, sorted(steps), steps, max_seconds=fed.round_seconds)

    def _on_train(self, mid: str, reply, o: Outgoing, ctx: "_RoundCtx") -> None:
        node, exp = self.nodes[o.node], o.expected
        ctx.bytes_down += o.bytes_down
        if reply.has_error():
            gone = reply.error.code == NODE_UNAVAILABLE
            if gone:
                log.warning(
                    "round %d: node %s (%s) is gone (no heartbeat); its experts %s go to other nodes",
                    ctx.r,
                    o.node,
                    node.name,
                    sorted(exp.tasks),
                )
            else:
                log.warning(
                    "round %d: node %s (%s) failed: code %s, %s",
                    ctx.r,
                    o.node,
                    node.name,
                    reply.error.code,
                    reply.error.reason,
                )
            node.status = "probation"
            for e in exp.tasks:
                ctx.failed.setdefault(
                    e, f"node {node.label} is gone" if gone else f"node {node.label} error {reply.error.code}"
                )
            return
        ctx.bytes_up += protocol.payload_bytes(reply.content)
        if node.status == "excluded":  # struck out after this request went (it went ahead of the checks)
            for e in exp.tasks:
                ctx.failed.setdefault(e, f"node {node.label} is excluded")
            return
        try:
            body = protocol.unpack(reply.content, protocol.KIND_REPLY, exp.max_reply_bytes())
            protocol.check_reply_header(body, exp, reply.metadata.src_node_id)
        except (CodecError, ValidationError) as err:
            self._reject(ctx, node, list(exp.tasks), str(err))
            return
        node.caps["torch_importable"] = body.get("torch_importable")
        seen, evals, secs = set(), 0, 0.0
        for res in body["results"]:
            e = res.get("expert") if isinstance(res, dict) else None
            e = e if isinstance(e, int) and not isinstance(e, bool) else None  # anything else is only logged
            if node.status == "excluded":  # struck out by an earlier result of this reply
                if e in exp.tasks:
                    ctx.failed.setdefault(e, f"node {node.label} is excluded")
                continue
            if e in exp.tasks and exp.tasks[e]["base_sha256"] in self.refused:
                seen.add(e)  # trained on from a claimed version that its checks then refused (pipelining)
                ctx.failed.setdefault(e, f"trained from v{exp.tasks[e]['version']}, which was refused")
                continue
            try:
                if e in seen:
                    raise ValidationError(f"expert {e} appears twice in one reply")
                w, opt = protocol.check_result(res, exp, self.current_sha())
                ulog = protocol.check_log(res, exp)
            except ValidationError as err:
                self._reject(ctx, node, [e], str(err))
                continue
            seen.add(e)  # checked for what it claims; its replay, audit and val loss come in _settle
            ctx.claims[e] = Claim(node.id, res, w, opt, o.per_expert.get(e, {}), body, ulog)
            node.shards |= set(self._train_shards(e))  # it trained on them, whatever its result's checks say
            evals += res["forward_evals"]
            secs += float(res["seconds"])
        if secs > 0:
            node.rate = scheduler.update_rate(node.rate, evals / secs)
        took = body.get("seconds_total")
        # The exchange moved the request down and the reply up, one after the other, over the same link.
        node.link = scheduler.link_rate(
            node.link,
            o.bytes_down + protocol.payload_bytes(reply.content),
            self.clock() - o.sent_at,
            float(took) if protocol.is_number(took) else secs,
        )
        ctx.compute[node.id] = ctx.compute.get(node.id, 0.0) + secs
        for err in body.get("errors") or []:
            log.warning("round %d: node %s (%s) reports: %s", ctx.r, o.node, node.name, err)
        missing = body.get("missing") or {}
        node.weights -= set(missing.get("weights") or [])
        node.shards -= set(missing.get("shards") or [])
        redo = [e for e in exp.tasks if e not in seen and e not in ctx.failed]
        if redo and (missing.get("weights") or missing.get("shards")):
            self._resend(ctx, o.node, redo)
        for e in redo:
            if e not in ctx.accepted and e not in ctx.failed and e not in ctx.pending_resend:
                ctx.failed[e] = f"node {node.label} returned no result"

    def _settle(self, ctx: "_RoundCtx", e: int) -> None:
        """Check expert e's claimed result fully (a log's audit and replay, the guard's val loss) and accept
        or refuse it. A refused claim's sha256 is remembered: the next round may already train from it."""
        c = ctx.claims.pop(e)
        node = self.nodes[c.node]
        if node.status == "excluded":  # struck out by an earlier result of the same node
            ctx.failed.setdefault(e, f"node {node.label} is excluded")
        else:
            try:
                w, opt = (c.w, c.opt) if c.ulog is None else self._from_log(c.res, c.ulog, c.w, c.opt)
            except ValidationError as err:
                self._reject(ctx, node, [e], str(err))
            else:
                self._accept(ctx, node, c.res, w, opt, c.sent, c.reply, c.ulog)
        if e not in ctx.accepted:
            self.refused.add(c.res["sha256"])

    def _settle_all(self, ctx: "_RoundCtx") -> None:
        while ctx.claims:
            self._settle(ctx, next(iter(ctx.claims)))

    def _resend(self, ctx: "_RoundCtx", nid: int, experts: list[int]) -> None:
        """The node lacked something it was assumed to cache: send again, with the payload, if time allows."""
        fed = self.cfg.federation
        left = ctx.deadline - self.clock() - fed.deadline_slack
        if left < fed.round_seconds * 0.25:
            for e in experts:
                ctx.failed.setdefault(e, "node lacked cached data and too little round time was left to resend")
            return
        scale = left / (fed.round_seconds * fed.deadline_factor)
        steps = {e: max(1, int(ctx.plan.steps[e] * min(1.0, scale))) for e in experts}
        log.info("round %d: resending %s to node %s with their payload (cache miss)", ctx.r, experts, nid)
        self._send_train(ctx, nid, experts, steps, max_seconds=min(left, fed.round_seconds))
        ctx.pending_resend |= set(experts)

    def _reject(self, ctx: "_RoundCtx", node: Node, experts: list, reason: str, **extra: Any) -> None:
        """Refuse these results (the current versions stay) and count a strike for each against the node."""
        fed = self.cfg.federation
        for e in experts:
            n = guard.strike(self.state["strikes"], node.who, node.label, reason, ctx.r)
            log.warning(
                "round %d: rejected expert %s from node %s (%s), strike %d of %s: %s",
                ctx.r,
                e,
                node.id,
                node.name,
                n,
                fed.max_strikes or "unlimited",
                reason,
            )
            ctx.rejected.append(
                {"expert": e, "node": node.label, "node_id": node.id, "reason": reason, "strike": n, **extra}
            )
            if isinstance(e, int) and e in ctx.plan.assignment:
                ctx.failed.setdefault(e, f"rejected: {reason}")
        if node.status != "excluded" and guard.excluded(self.state["strikes"], node.who, fed.max_strikes):
            log.warning(
                "round %d: node %s (%s) has %d strikes (federation.max_strikes): excluded for the rest of the run",
                ctx.r,
                node.id,
                node.name,
                fed.max_strikes,
            )
            node.status = "excluded"
            ctx.excluded.append(node.label)

    def _from_log(
        self, res: dict, ulog: UpdateLog, w: np.ndarray | None, opt: OptState | None
    ) -> tuple[np.ndarray, OptState]:
        """The version a log reply stands for: the replay of its log from the current version, which must
        hash to what the worker claims (log alone) or equal the weights it sent too; audited steps first."""
        from coordinator import replay as replay_mod

        e, cfg, fed = res["expert"], self._phase_config(), self.cfg.federation
        x = self.state["experts"][str(e)]
        stored = self.run.load_expert(x["path"])
        base = State(
            protocol.decode_weights(stored["weights"]), step=int(x["step"]), opt=self._checked_opt(stored, x["path"])
        )
        if fed.audit_steps:
            picks = replay_mod.sample_steps(ulog.steps, fed.audit_steps, cfg.seed, e, int(res["version"]))
            data = np.frombuffer(SEPARATOR.join(self.run.shard(h) for h in self._train_shards(e)), dtype=np.uint8)
            replay_mod.audit(cfg, base, ulog, e, data, self._audit_evaluator(cfg), picks)
        got = replay_mod.rebuild(cfg, base, ulog, e)
        if w is None:
            if protocol.weights_sha256(got.weights) != res["sha256"]:
                raise ValidationError(f"expert {e}: its update log replays to other weights than the sha256 it claims")
            return got.weights, got.opt
        if got.weights.astype(w.dtype).tobytes() != w.tobytes():
            raise ValidationError(f"expert {e}: the weights it sent are not what its update log replays to")
        return w, opt

    def _audit_evaluator(self, cfg: Config):
        from soma_edge.runtime import evaluator_for

        if getattr(self, "_auditor", None) is None:  # one thread, no spinning, as for the val loss
            self._auditor = evaluator_for(cfg, "cpu", threads=1, spin=False, parallel=1)
        return self._auditor

    def _reply_mode(self, node: Node, r: int, steps: int) -> str:
        """What to ask a node's experts back this round: weights, the update log, or both (a checkpoint)."""
        fed, cfg = self.cfg.federation, self._phase_config()
        if fed.reply == "weights":
            return "weights"
        if cfg.spsa.noise == "gaussian" and node.caps.get("numpy") != np.__version__:
            return "weights"  # numpy does not promise the same Gaussian stream from one version to the next
        if fed.reply == "log":
            return "log"
        if self._log_bytes(steps) >= self._version_bytes():  # a log longer than the weights and their Adam moments
            return "weights"
        return "both" if r % fed.weights_every == 0 else "log"

    def _log_bytes(self, steps: int) -> int:
        """An update log's size: 4 bytes per direction per step, and a delta-rule decoder's weights and moments."""
        cfg = self._phase_config()
        lay = params.layout(cfg.model)
        dense = 3 * (lay.size - lay.body) if cfg.spsa.decoder == "delta" else 0
        return 4 * (steps * cfg.spsa.directions * cfg.spsa.accumulate + dense)

    def _reply_seconds(self, nid: int, experts: list[int], r: int, steps: dict[int, int]) -> float:
        """How long node `nid`'s reply for `experts` takes up its link (0 while the link is unmeasured)."""
        node = self.nodes[nid]
        if not node.link:
            return 0.0
        mode = self._reply_mode(node, r, max(steps[e] for e in experts))  # as _tasks_for asks
        weights = self._version_bytes() if mode in ("weights", "both") else 0
        return sum(weights + (self._log_bytes(steps[e]) if mode in ("log", "both") else 0) for e in experts) / node.link

    def _accept(
        self,
        ctx: "_RoundCtx",
        node: Node,
        res: dict,
        w: np.ndarray,
        opt: OptState,
        sent: dict[str, int],
        reply: dict,
        ulog: UpdateLog | None = None,
    ) -> None:
        e = res["expert"]
        val = self._val_loss(e, protocol.decode_weights(w))
        best = guard.Best.of(self.state["experts"][str(e)])
        why = guard.verdict(val, best, self.cfg.federation.guard_tolerance)
        if why is not None:
            self._reject(ctx, node, [e], why, guard=True, val_loss=val, **self._slow_down(e))
            return
        # The plateau counters are the coordinator's own (never the worker's): restore them, then decide the
        # next round's lr scale from this version's val loss.
        prev, trained_at = self.state["experts"][str(e)], opt.lr_scale
        opt.lr_scale, opt.best_val = prev.get("lr_scale", 1.0), prev.get("best_val")
        opt.best_step = prev.get("best_step", 0)
        if plateau(self.cfg.spsa, opt, val, res["step"]):
            log.info(
                "round %d: expert %d plateaued (val %.4f, best %.4f): lr and eps now x%g",
                ctx.r,
                e,
                val,
                opt.best_val,
                opt.lr_scale,
            )
        body = {
            "expert": e,
            "version": res["version"],
            "sha256": res["sha256"],
            "config": self.cfg.to_dict(),
            "step": res["step"],
            "weights": w,
            "opt": opt.to_record(),
            "val_loss": val,
        }
        rel = self.run.save_expert(body)
        if ulog is not None and w.dtype == np.float32:  # then the stored weights are the log's replay
            self.run.save_log(
                e, res["version"], {"from_sha256": res["base_sha256"], "sha256": res["sha256"], "log": ulog.to_record()}
            )
        lr, eps = schedule(self._phase_config().spsa, res["step"] - 1, trained_at)  # at the round's last step
        if val < best.val_loss:
            best = guard.Best(res["version"], res["sha256"], rel, val)
            guard.forgive(self.state["strikes"], node.who)
        self.state["experts"][str(e)] = {
            "version": res["version"],
            "sha256": res["sha256"],
            "path": rel,
            "step": res["step"],
            "train_loss": float(res["train_loss"]),
            "val_loss": val,
            "node": node.label,
            "best": best.to_record(),
            **_plateau_fields(opt),
        }
        node.weights.add(res["sha256"])
        self.refused.discard(res["sha256"])  # the same version made again and accepted (refused for its node)
        ctx.accepted[e] = {
            "type": "expert",
            "round": ctx.r,
            "expert": e,
            "accepted": True,
            "version": res["version"],
            "sha256": res["sha256"],
            "node": node.label,
            "node_id": node.id,
            "train_loss": float(res["train_loss"]),
            "val_loss": val,
            "steps": res["steps"],
            "forward_evals": res["forward_evals"],
            "seconds": float(res["seconds"]),
            "steps_per_s": res["steps"] / res["seconds"] if res["seconds"] else None,
            "weights_bytes_down": sent.get("weights", 0),
            "shard_bytes_down": sent.get("shards", 0),
            "weights_bytes_up": int(w.nbytes) if res.get("weights") is not None else 0,
            "opt_bytes_up": opt.nbytes() if res.get("opt") is not None else 0,
            "log_bytes_up": ulog.nbytes() if ulog is not None else None,
            "torch_importable": reply.get("torch_importable"),
            "lr_scale": trained_at,
            "next_lr_scale": opt.lr_scale,
            "best_version": best.version,
            "step": res["step"],
            "lr": lr,
            "eps": eps,
        }
        ctx.failed.pop(e, None)
        ctx.pending_resend.discard(e)
        log.debug(
            "round %d: accepted expert %d v%d from %s: train %.4f, val %.4f nats/byte, %d steps in %.1f s",
            ctx.r,
            e,
            res["version"],
            node.label,
            res["train_loss"],
            val,
            res["steps"],
            res["seconds"],
        )
        self._status("round", round=ctx.r)

    def _slow_down(self, e: int) -> dict[str, float]:
        """After a refused version: the expert retrains from the same version at a lower lr and eps (the
        plateau factor), so an honest node does not repeat the same refused steps bit for bit."""
        s, x = self.cfg.spsa, self.state["experts"][str(e)]
        old = float(x.get("lr_scale", 1.0))
        x["lr_scale"] = max(s.lr_floor / s.lr, old * s.plateau_factor)
        return {"lr_scale": old, "next_lr_scale": x["lr_scale"]}

    def _checked_opt(self, body: dict[str, Any], rel: str) -> OptState:
        """The optimizer state of a stored version, checked against its weights (CheckpointError if not)."""
        return OptState.from_record(body.get("opt"), self.size, f"{self.run.root / rel}: optimizer state")

    def _shards(self, e: int, split: str) -> list[str]:
        """Expert e's shards of `split`; the seed's are every cluster's."""
        from coordinator.prepare import expert_shards

        if seed_mod.enabled(self.cfg) and e == seed_mod.seed_expert(self.cfg):
            return [h for x in range(self.cfg.federation.experts) for h in expert_shards(self.prep, x, split)]
        return list(expert_shards(self.prep, e, split))

    def _train_shards(self, e: int) -> list[str]:
        return self._shards(e, "train")

    # --- evaluation -----------------------------------------------------------------------------------

    def _val_stream(self, e: int) -> np.ndarray:
        data = [self.run.shard(h) for h in self._shards(e, "val")]
        stream = np.frombuffer(SEPARATOR.join(data), dtype=np.uint8)
        if stream.size <= self.cfg.data.seq_len + 1:  # a cluster with almost no held-out text: use all of it
            fed = self.cfg.federation
            data = [self.run.shard(h) for x in range(fed.experts) for h in self._shards(x, "val")]
            stream = np.frombuffer(SEPARATOR.join(data), dtype=np.uint8)
        return stream

    def _val_loss(self, e: int, weights: np.ndarray) -> float:
        from soma_edge.runtime import LossEvaluator, mean_loss

        if e not in self._val_cache:
            self._val_cache[e] = eval_windows(
                self._val_stream(e), self.cfg.data.seq_len, self.cfg.federation.val_windows
            )
        if self._evaluator is None:
            # One thread, no spinning: on a coordinator box that also hosts workers, this must not steal cores.
            self._evaluator = LossEvaluator(self.cfg.model, "cpu", 1, False)
        x, y = self._val_cache[e]
        return float(mean_loss(self._evaluator, weights, x, y))

    def _mixture_val_loss(self) -> float | None:
        """Routed-mixture nats/byte of the whole model on held-out text (None if it cannot be computed)."""
        from soma_edge import mixture
        from soma_edge import router as router_mod
        from soma_edge.graph import build
        from soma_edge.runtime import make_session

        if self._seeding():  # one seed, no experts to route between yet
            return None
        try:
            router = self._router = getattr(self, "_router", None) or router_mod.load(self.run.router)
            seq = self.cfg.data.seq_len
            per = self.cfg.federation.val_windows * seq
            data = np.concatenate([self._val_stream(e)[:per] for e in self.expert_ids()])
            fns = {}
            for e in self.expert_ids():
                w = protocol.decode_weights(self.run.load_expert(self.state["experts"][str(e)]["path"])["weights"])
                sess = make_session(build(self.cfg.model, "logprobs", weights=w), "cpu", 1, False)
                fns[e] = lambda x, s=sess: s.run(None, {"x": x})[0]
            top_k = min(MIXTURE_TOP_K, len(fns))
            return float(mixture.evaluate(router, fns, data, seq, top_k, router.temperature).nats_per_byte)
        except (SomaError, AttributeError, ValueError, OSError) as e:
            log.warning("routed-mixture val loss failed: %s", e)
            return None

    # --- commit ---------------------------------------------------------------------------------------

    def _commit(self, r: int, ctx: "_RoundCtx", t_next: float | None) -> None:
        """Write round r's metrics and state (the commit point). Its span runs from its plan to the next
        round's plan when that went ahead of this commit (`t_next`), else to now: spans tile the run."""
        fed = self.cfg.federation
        lines = list(ctx.late)
        for e in self.expert_ids():
            if e in ctx.accepted:
                lines.append(ctx.accepted[e])
            else:
                x = self.state["experts"][str(e)]
                lines.append(
                    {
                        "type": "expert",
                        "round": r,
                        "expert": e,
                        "accepted": False,
                        "reason": ctx.failed.get(e, "not trained this round"),
                        "version": x["version"],
                        "sha256": x["sha256"],
                        "node": self.nodes[ctx.plan.assignment[e]].label,
                        "val_loss": x.get("val_loss"),
                        "train_loss": x.get("train_loss"),
                        "steps": 0,
                        "forward_evals": 0,
                        "seconds": 0.0,
                    }
                )
        mix = self._mixture_val_loss()
        vals = [self.state["experts"][str(e)]["val_loss"] for e in self.expert_ids()]
        vals = [v for v in vals if v is not None]
        wall = max(ctx.t_done - ctx.t_sent, 1e-9)
        round_total = (self.clock() if t_next is None else t_next) - ctx.t_round
        planned = set(ctx.plan.assignment.values())  # by id: two workers may share a name
        nodes = sorted(self.nodes[n].label for n in planned)
        lines.append(
            {
                "type": "round",
                "round": r,
                "rounds": fed.rounds,
                "phase": self.state.get("phase", "experts"),
                "accepted": len(ctx.accepted),
                "rejected": ctx.rejected,
                "excluded": ctx.excluded,
                "missed": sorted(ctx.failed),
                "val_loss_mean": float(np.mean(vals)) if vals else None,
                "mixture_val_loss": mix,
                "wall_seconds": wall,
                "round_seconds_total": round_total,
                "compute_seconds": {self.nodes[n].label: s for n, s in sorted(ctx.compute.items())},
                "compute_share": (sum(ctx.compute.values()) / (len(planned) * round_total)) if nodes else 0.0,
                "predicted_makespan": ctx.plan.makespan,
                "moved": ctx.plan.moved,
                "bytes_down": ctx.bytes_down,
                "bytes_up": ctx.bytes_up,
                "nodes": nodes,
                "time": time.time(),
                "next_round_ahead": t_next is not None,
            }
        )
        self.state["round"] = r
        self.state["assignment"] = {str(e): self.nodes[n].label for e, n in ctx.plan.assignment.items()}
        if self._fan_out():
            lines[-1]["seed_done"] = {k: self.state["seed"][k] for k in ("expert", "step", "version", "sha256")}
        self.run.append_metrics(lines)  # the resume's truncate_metrics removed any line of round r
        if self.board is not None:
            self.board.commit(lines)
        self.run.save_state(self.state)  # the commit point; the state before it becomes the fallback
        fallback, self._committed = self._committed, self._kept()
        self._prune(fallback)
        log.info(
            "round %d/%d committed: %d/%d experts advanced, mean val %.4f, routed val %s nats/byte, %.1f s, "
            "compute share %.0f%%",
            r,
            fed.rounds,
            len(ctx.accepted),
            len(self.expert_ids()),
            lines[-1]["val_loss_mean"] or float("nan"),
            "n/a" if mix is None else f"{mix:.4f}",
            round_total,
            100 * lines[-1]["compute_share"],
        )
        self._status("committed", round=r)

    def _status(self, phase: str, **extra: Any) -> None:
        st = getattr(self, "state", None) or {}
        self.run.write_status(
            {
                "phase": phase,
                "pid": _pid(),
                "time": time.time(),
                "round": st.get("round", 0),
                "rounds": self.cfg.federation.rounds if hasattr(self, "cfg") else None,
                "round_seconds": self.cfg.federation.round_seconds if hasattr(self, "cfg") else None,
                "experts": st.get("experts", {}),
                "nodes": {
                    str(n.id): {
                        "name": n.name,
                        "status": n.status,
                        "rate": n.rate,
                        "torch_importable": n.caps.get("torch_importable"),
                    }
                    for n in self.nodes.values()
                },
                **extra,
            }
        )


@dataclass
class _RoundCtx:
    r: int
    plan: scheduler.Plan
    deadline: float
    t_sent: float
    t_done: float = 0.0
    accepted: dict[int, dict[str, Any]] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    compute: dict[int, float] = field(default_factory=dict)  # node id -> compute seconds this round
    excluded: list[str] = field(default_factory=list)  # nodes that reached their strike limit this round
    late: list[dict[str, Any]] = field(default_factory=list)  # last round's late replies, settled this round
    train_mids: set[str] = field(default_factory=set)  # every train request of the round, resends included
    waiting: dict[int, "_Waiting"] = field(default_factory=dict)  # node -> its train request, held for pieces
    pending_resend: set[int] = field(default_factory=set)
    claims: dict[int, "Claim"] = field(default_factory=dict)  # expert -> a result in, its checks to come
    deferred: dict[int, list[int]] = field(default_factory=dict)  # node -> experts sent once the last round commits
    t_round: float = 0.0  # when the round began: its plan
    bytes_down: int = 0
    bytes_up: int = 0


@dataclass
class Claim:
    """One expert's result that passed the reply's cheap checks (header, shapes, base version, log
    structure), waiting for the costly ones (`Coordinator._settle`)."""

    node: int
    res: dict[str, Any]
    w: np.ndarray | None  # as received (None for a log alone)
    opt: OptState | None
    sent: dict[str, int]  # weight and shard bytes sent down for it
    reply: dict[str, Any]
    ulog: UpdateLog | None


@dataclass
class _Waiting:
    """A node's train request, held until the shard pieces sent before it are answered."""

    mids: set[str]
    experts: list[int]
    steps: dict[int, int]
    last: list[dict[str, Any]]  # the last piece, which rides in the train request
    shard_bytes: dict[int, int]


def _plateau_fields(opt: OptState) -> dict[str, Any]:
    """The plateau rule's state kept per expert in state.msgpack: the next round's task reads it."""
    return {"lr_scale": opt.lr_scale, "best_val": opt.best_val, "best_step": opt.best_step}


def _pid() -> int:
    import os

    return os.getpid()


def _make_app():
    from flwr.serverapp import ServerApp

    server = ServerApp()

    @server.main()
    def main(grid, context) -> None:
        run_dir = str(context.run_config.get("run-dir", "")).strip()
        if not run_dir:
            raise SomaError("run config 'run-dir' is empty: pass --run-config \"run-dir='/path/to/RUN'\" to flwr run")
        run, request = RunDir(run_dir), str(context.run_config.get("start", "")).strip()
        setup = None
        if request:  # external mode: `soma-coord start --superlink` sent the config along
            from coordinator.remote import apply_request

            setup = functools.partial(apply_request, run, request)
        Coordinator(grid, run, setup=setup).main()

    return server


app = _make_app()
