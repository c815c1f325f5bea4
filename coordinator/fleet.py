"""The nodes of the federation: who is live (the grid's node ids), what each one is (its capability
reply: name, throughput, cache), its status, and the messages in flight to it. Also waiting for nodes
before a round, and the heartbeat interval advised to each.

A node that fails or misses a deadline goes on probation until it answers a capability query again; one
whose reply is bad, whose soma-edge version differs or that has too many strikes is excluded for the run.

Called by coordinator.loop (waiting, pulling replies), coordinator.dispatch (sending) and
coordinator.intake (a node's status, rate and cache as its replies tell them).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Callable

from coordinator import guard, heartbeat, scheduler
from coordinator.check_budget import CheckCost
from soma_edge import __version__
from soma_edge.config import Config
from soma_edge.errors import CodecError, SomaError, ValidationError
from soma_edge.processes.logs import role_logger
from soma_edge.rundir.layout import RunDir
from soma_edge.rundir.state import RunState
from soma_edge.spsa.recipe import Probes
from soma_edge.wire import protocol

log = role_logger("soma.coord")
POLL_SECONDS = 0.5
END_SECONDS = 15.0  # how long the end of the run waits for the workers to hear of it
QUERY_SECONDS = 90.0  # a capability query includes the node's throughput probe
GRACE_QUERY_SECONDS = 30.0  # after join_grace, how long round 1 waits for a node still answering its query
BUSY_LOG_SECONDS = 30.0  # how often a wait for a busy node says so


class NodeStatus(StrEnum):
    """A node's status. A str, so that status.json carries the same bytes as the bare strings did."""

    NEW = "new"  # live, not yet asked for its capabilities
    QUERYING = "querying"  # asked, no answer yet
    ACTIVE = "active"  # answered: it gets work
    PROBATION = "probation"  # failed or missed a deadline: asked again before it gets work
    EXCLUDED = "excluded"  # bad capability reply, another soma-edge version, or struck out: for the run
    GONE = "gone"  # left the federation (no longer among the grid's nodes)


@dataclass
class Node:
    id: int
    name: str = "?"
    label: str = "?"  # the name, plus "#id" when another live node has the same name (both default to the host name)
    status: NodeStatus = NodeStatus.NEW
    rate: float = 0.0  # forward evaluations/s, probed then updated from real rounds
    link: float | None = None  # bytes/s, measured from large train exchanges, both ways (None: not yet)
    weights: set[str] = field(default_factory=set)  # version hashes its cache holds (as far as we know)
    shards: set[str] = field(default_factory=set)
    caps: protocol.Capabilities = field(default_factory=dict)  # its last reply, less the cache inventory
    query_mid: str | None = None
    query_sent: float = 0.0
    identity: str = ""  # who strikes count against (`coordinator.guard.identity`), set when it answers a query
    advised: float | None = None  # the heartbeat interval last sent to it
    link_free: float = 0.0  # when its link last finished an exchange that was timed (a reply came in)
    link_at_least: bool = False  # its last timed exchange crossed within Flower's overhead: `link` is a floor
    probes: Probes | None = None  # how it probes (its capability reply): its recipe is the run's with these
    checks: CheckCost = field(default_factory=CheckCost)  # what its logs cost the coordinator's checks
    over_budget: bool = False  # its logs' checks were last planned beyond their budget (said as they went over)

    def config(self, phase: Config) -> Config:
        """What this node trains the phase's experts with: `phase` with its own probes (spsa.recipe.Probes)."""
        return phase if self.probes is None else self.probes.apply(phase)

    @property
    def who(self) -> str:
        return self.identity or f"node:{self.id}"


class Sent(StrEnum):
    """What an outgoing message asked of its node, which says what its reply means."""

    QUERY = "query"  # the capability query: the reply's probe and link
    PIECES = "pieces"  # shard pieces ahead of a round: the reply says the node is free of them
    TRAIN = "train"  # a round's experts: the reply carries their versions
    ADVICE = "advice"  # heartbeat advice on its own: the reply is an acknowledgement
    END = "end"  # the end of the run


@dataclass
class Outgoing:
    node: int
    kind: Sent
    expected: protocol.Expected | None = None
    bytes_down: int = 0
    per_expert: dict[int, dict[str, int]] = field(default_factory=dict)  # expert -> weight/shard bytes sent
    sent_at: float = 0.0
    mid: str = ""


def message(body: dict[str, Any], kind: str, node: int, message_type: str) -> Any:
    # flwr is heavy (grpc, protobuf): imported only where a message is made.
    from flwr.app import Message

    return Message(protocol.pack(body, kind), dst_node_id=node, message_type=message_type)


def active_line(node: Node, rate: float) -> str:
    """The line that says a node answered its capability query and gets work."""
    return (
        f"node {node.id} ({node.name}) active: {rate:.1f} forward evals/s on {(node.caps.get('providers') or ['?'])[0]}"
        f" with {node.probes.describe() if node.probes else 'the run probes'}, torch importable: "
        f"{node.caps.get('torch_importable')}, cache: {len(node.weights)} versions, {len(node.shards)} shards"
    )


class Fleet:
    def __init__(
        self,
        grid: Any,
        run: RunDir,
        cfg: Config,
        state: RunState,
        version_bytes: int,
        status: Callable[..., None],
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.grid, self.run, self.cfg, self.clock, self.sleep = grid, run, cfg, clock, sleep
        # The ledger's RunState object itself (never replaced; strikes change in place): passing the Ledger
        # instead would make fleet and ledger import each other (the ledger uses Node).
        self.state = state  # the run state: its run id and strikes
        self.version_bytes = version_bytes  # what one expert's version weighs on the wire
        self.status = status  # writes status.json (`Loop.status`)
        self.nodes: dict[int, Node] = {}
        self.out: dict[str, Outgoing] = {}  # message id -> what it was

    def live_ids(self) -> set[int]:
        return {int(n) for n in self.grid.get_node_ids()}

    def push(self, items: list[tuple[Any, Outgoing]]) -> None:
        if not items:
            return
        mids = list(self.grid.push_messages([m for m, _ in items]))
        for mid, (m, o) in zip(mids, items):
            o.bytes_down, o.sent_at, o.mid = protocol.payload_bytes(m.content), self.clock(), mid
            self.out[mid] = o
            if o.kind is Sent.QUERY:
                self.nodes[o.node].query_mid = mid
                self.nodes[o.node].query_sent = self.clock()

    def pull(self, handle_train: Callable[[str, Any, Outgoing], None]) -> None:
        """Pull replies for every outstanding message once; dispatch them."""
        if not self.out:
            return
        for reply in self.grid.pull_messages(list(self.out)):
            mid = reply.metadata.reply_to_message_id
            o = self.out.pop(mid, None)
            if o is None:
                log.warning("reply to an unknown message %r from node %s ignored", mid, reply.metadata.src_node_id)
                continue
            if o.kind is Sent.QUERY:
                self.on_capabilities(reply, o)
            elif o.kind is Sent.ADVICE:
                if reply.has_error():
                    log.info("node %s did not take its heartbeat advice: %s", o.node, reply.error.reason)
            else:
                handle_train(mid, reply, o)

    def query_new_nodes(self) -> None:
        """Send a capability query to every live node we have not heard from (or that missed a deadline)."""
        items = []
        for nid in sorted(self.live_ids()):
            node = self.nodes.setdefault(nid, Node(id=nid))
            stale = node.query_mid is not None and self.clock() - node.query_sent > QUERY_SECONDS
            again = (NodeStatus.NEW, NodeStatus.PROBATION, NodeStatus.GONE)
            if node.status in again or (node.status == NodeStatus.QUERYING and stale):
                if stale:
                    self.out.pop(node.query_mid, None)
                # The advice goes with the query, before round 1's large download: with a train request
                # it would arrive only once that download is done.
                body = protocol.capability_query(self.cfg.to_dict(), self.state.run_id, self.advised(nid))
                msg = message(body, protocol.KIND_QUERY, nid, protocol.QUERY_CAPABILITIES)
                items.append((msg, Outgoing(node=nid, kind=Sent.QUERY)))
                node.status = NodeStatus.QUERYING
        self.push(items)

    def on_capabilities(self, reply: Any, o: Outgoing) -> None:
        node = self.nodes[o.node]
        node.query_mid = None
        if reply.has_error():
            log.warning("node %s did not answer the capability query: %s", o.node, reply.error.reason)
            node.status = NodeStatus.PROBATION
            return
        try:
            if reply.metadata.src_node_id != o.node:
                raise ValidationError(f"capabilities for node {o.node} came from node {reply.metadata.src_node_id}")
            caps: protocol.Capabilities = protocol.unpack(reply.content, protocol.KIND_CAPS, protocol.SMALL_BYTES)
            rate = scheduler.clamp_rate(protocol.check_caps(caps))
            probes = protocol.caps_probes(caps, self.cfg)
        except (CodecError, ValidationError) as e:
            log.warning("node %s: bad capability reply (%s); excluded", o.node, e)
            node.status = NodeStatus.EXCLUDED
            return
        node.name = str(caps.get("name") or o.node)
        node.label = f"{node.name}#{node.id}" if self._twins(node) else node.name
        node.caps = protocol.Capabilities(**{k: v for k, v in caps.items() if k != "cache"})
        if probes != node.probes:  # a first answer, or a restart with other probes: its rate and costs start over
            node.rate, node.checks, node.over_budget = 0.0, CheckCost(), False
        node.probes = probes
        if self._refused(node, caps):
            node.status = NodeStatus.EXCLUDED
            return
        inv = caps.get("cache") or {}
        node.weights = set(inv.get("weights", []))
        node.shards = set(inv.get("shards", []))
        node.rate = rate if node.rate <= 0 else node.rate
        node.status = NodeStatus.ACTIVE
        log.info("%s", active_line(node, rate))

    def _twins(self, node: Node) -> bool:
        """Whether another live node that answered has the same name."""
        live = self.live_ids()
        working = (NodeStatus.ACTIVE, NodeStatus.QUERYING, NodeStatus.PROBATION)
        return any(
            n.id != node.id and n.id in live and n.name == node.name and n.status in working
            for n in self.nodes.values()
        )

    def _refused(self, node: Node, caps: dict[str, Any]) -> bool:
        """Whether a node that answered is excluded all the same: another soma-edge, or struck out."""
        if caps.get("soma_version") != __version__:
            log.warning(
                "node %s (%s) runs soma-edge %s but the coordinator runs %s: excluded",
                node.id,
                node.name,
                caps.get("soma_version"),
                __version__,
            )
            return True
        node.identity = guard.identity(self.run, node.id)
        if guard.excluded(self.state.strikes, node.who, self.cfg.federation.max_strikes):
            log.warning(
                "node %s (%s) is excluded from this run: %d strikes against %s",
                node.id,
                node.name,
                self.state.strikes[node.who]["count"],
                node.who,
            )
            return True
        return False

    def active(self) -> dict[int, Node]:
        live = self.live_ids()
        for nid, node in self.nodes.items():
            if nid not in live and node.status in (NodeStatus.ACTIVE, NodeStatus.QUERYING):
                log.warning("node %s (%s) left the federation", nid, node.name)
                node.status = NodeStatus.GONE
        return {nid: n for nid, n in self.nodes.items() if n.status == NodeStatus.ACTIVE and nid in live}

    def wait_for_nodes(
        self,
        want: int,
        grace: float = 0.0,
        stoppable: bool = False,
        busy: Callable[[], dict[int, float]] | None = None,
    ) -> dict[int, Node]:
        """Wait (up to wait_seconds) for `want` active nodes; then `grace` seconds more, and for any node
        still answering its capability query, so that workers started together all get round 1's work.
        `stoppable`: a stop request (`soma-coord stop`) ends the wait too. `busy` (called at each poll):
        the live nodes still working on a request of the last round, and since when (`Late.poll`, which
        also takes their replies); while there are any and no node is free, the wait goes on, and
        wait_seconds counts from when the last of them stopped working."""
        fed = self.cfg.federation
        deadline, enough_at, told = self.clock() + fed.wait_seconds, None, -math.inf
        self.status("waiting", message=f"waiting for {want} worker(s)")
        while True:
            self.query_new_nodes()
            self.pull(lambda mid, reply, o: None)
            working = busy() if busy is not None else {}
            active = self.active()
            if stoppable and self.run.stop_requested():
                return active
            if working and not active:
                deadline = max(deadline, self.clock() + fed.wait_seconds)
                if self.clock() - told >= BUSY_LOG_SECONDS:
                    told = self.clock()
                    self._tell_busy(working)
            if len(active) >= want and enough_at is None:
                enough_at = self.clock()
                if grace > 0:
                    log.info(
                        "%d worker(s) in; waiting %.0f s more for others (federation.join_grace)", len(active), grace
                    )
            if enough_at is not None:
                waited = self.clock() - enough_at
                querying = any(n.status == NodeStatus.QUERYING for n in self.nodes.values())
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

    def _tell_busy(self, working: dict[int, float]) -> None:
        """Say, in the log and status.json, which nodes the wait is for."""
        what = ", ".join(
            f"{self.nodes[nid].label} (sent {self.clock() - since:.0f} s ago)" for nid, since in sorted(working.items())
        )
        log.info("no free worker: waiting for %s, still on the last round's request", what)
        self.status("waiting", message=f"waiting for {what}, still on the last round's request")

    def piece_bytes(self, nid: int) -> int:
        return heartbeat.piece_bytes(self.cfg.federation.piece_bytes, self.nodes[nid].link)

    def heartbeat(self, nid: int) -> float:
        return heartbeat.interval(self.version_bytes, self.cfg.federation.piece_bytes, self.nodes[nid].link)

    def advised(self, nid: int) -> float:
        """`heartbeat(nid)`, noted as sent: for a message that carries it (a query, a train request)."""
        self.nodes[nid].advised = self.heartbeat(nid)
        return self.nodes[nid].advised

    def time_link(self, o: Outgoing, reply: Any, compute: float) -> None:
        """What the exchange of `o` and its reply (the request down, the reply up, beyond `compute` seconds of
        work on the node) showed of the node's link; the heartbeat advice follows the link as measured."""
        node = self.nodes.get(o.node)
        if node is None:
            return
        nbytes = o.bytes_down + protocol.payload_bytes(reply.content)
        # Timed from when the link was free for it: pieces pushed together queue, and timing each from its push
        # measured the link ever slower (the heartbeat advice rose to 25 minutes during one download).
        now = self.clock()
        seen = scheduler.link_seen(node.link, node.link_at_least, nbytes, now - max(o.sent_at, node.link_free), compute)
        node.link, node.link_at_least = seen
        node.link_free = now
        self.advise(o.node)

    def advise(self, nid: int) -> None:
        """Send node `nid` its heartbeat interval in a message of its own if its newly measured link changed
        it: a worker killed before it pulls its next train request is then still noticed within two of
        the new intervals, not two of the old."""
        node = self.nodes[nid]
        if node.status != NodeStatus.ACTIVE or self.heartbeat(nid) == node.advised:
            return
        body = protocol.advice(self.state.run_id, self.advised(nid))
        self.push(
            [(message(body, protocol.KIND_ADVICE, nid, protocol.QUERY_ADVICE), Outgoing(node=nid, kind=Sent.ADVICE))]
        )
        log.info("node %s (%s): heartbeat advice now %g s", nid, node.label, node.advised)


def end_run(fleet: Fleet, body: dict[str, Any], why: str) -> None:
    """Tell every live node that the run is over (`body`: protocol.run_end), so that its `soma-worker
    join` exits (or waits for the next run); wait up to END_SECONDS for them to hear it, as Flower drops
    a finished run's messages."""
    items = [
        (message(body, protocol.KIND_END, nid, protocol.QUERY_END), Outgoing(node=nid, kind=Sent.END))
        for nid in sorted(fleet.live_ids())
    ]
    fleet.push(items)
    deadline, heard = fleet.clock() + END_SECONDS, set()

    def ack(mid: str, reply: Any, o: Outgoing) -> None:
        if o.kind is Sent.END and not reply.has_error():
            heard.add(o.node)

    # Only for nodes that were working: one that missed a deadline may be dead, and Flower takes as long
    # as its heartbeat patience to say so.
    waited = {nid for nid, n in fleet.nodes.items() if n.status == NodeStatus.ACTIVE}
    while any(o.kind is Sent.END and o.node in waited for o in fleet.out.values()) and fleet.clock() < deadline:
        fleet.sleep(POLL_SECONDS)
        fleet.pull(ack)
    log.info("run over (%s): %d worker(s) told", why, len(heard))
