"""A fake Flower Grid that hands each message straight to the real ClientApp, the tiny config the
round-loop tests train with, and helpers several of those tests share. Only Flower's transport is replaced:
training runs for real on ORT."""

from __future__ import annotations

import hashlib
import time
import uuid
from pathlib import Path

from flwr.app import Context, Message, RecordDict
from flwr.serverapp import Grid

from coordinator import scheduler
from soma_edge import config as config_mod
from soma_edge.rundir.layout import RunDir
from soma_edge.wire import protocol
from worker import client_app

TINY = {
    "model": {"embed": 8, "hidden": 16, "layers": 1},
    "data": {"batch": 2, "seq_len": 32},
    "spsa": {"directions": 2, "lr": 5e-3, "warmup_steps": 0},
    "device": "cpu",
    "federation": {
        "experts": 4,
        "rounds": 2,
        "round_seconds": 0.2,
        "deadline_factor": 1.0,
        "deadline_slack": 3.0,
        "val_windows": 4,
        "min_nodes": 2,
        "wait_seconds": 5.0,
        "join_grace": 0.0,
    },  # the guard at its default rule: its margin follows the noise of these 4 val windows of 32 bytes
}


# Rounds for the tests about what a run keeps, refuses or resumes, not about how far its experts train: each
# node trains for round_seconds, and at the fake grid's 0.2 s a round of two nodes took 0.4 s.
SHORT_ROUND = 0.05


class FakeGrid(Grid):
    """Delivers each pushed message to the real ClientApp of its node when pulled."""

    def __init__(self, root: Path, names: list[str], tamper=None):
        from flwr.supercore.task_identity import TaskIdentity

        # What flwr-serverapp sets before calling the ServerApp; Message() reads it.
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
        self.nodes = {
            1000 + i: {
                "name": n,
                "cache": str(root / n),
                "device": "cpu",
                "threads": 1,
                "spin": 0,
                "parallel": 1,
                "probe-seconds": 0.05,
            }
            for i, n in enumerate(names)
        }
        self.dead: set[int] = set()  # nodes that never answer (killed mid-round)
        self.gone: set[int] = set()  # nodes no longer listed
        self.delay: dict[int, float] = {}  # node -> seconds before its replies can be pulled (a slow node)
        self.pushed_at: dict[str, float] = {}
        self.unavailable: set[int] = set()  # nodes Flower reports gone: their messages get error replies (code 5)
        self.tamper = tamper  # fn(node_id, body) -> body, applied to train replies
        self.pending: dict[str, Message] = {}
        self.sent: list[Message] = []

    def set_run(self, run):
        pass

    @property
    def run(self):
        return None

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id=dst_node_id, message_type=message_type)

    def get_node_ids(self):
        return [n for n in self.nodes if n not in self.gone]

    def push_messages(self, messages):
        ids = []
        for m in messages:
            mid = uuid.uuid4().hex
            m.metadata.__dict__["_message_id"] = mid
            self.pending[mid] = m
            self.pushed_at[mid] = time.monotonic()
            self.sent.append(m)
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids):
        out = []
        for mid in list(message_ids):
            m = self.pending.get(mid)
            if m is None or m.metadata.dst_node_id in self.dead:
                continue
            if time.monotonic() - self.pushed_at[mid] < self.delay.get(m.metadata.dst_node_id, 0.0):
                continue
            del self.pending[mid]
            nid = m.metadata.dst_node_id
            if nid in self.unavailable:
                from flwr.app import Error

                reply = Message(error=Error(code=5, reason="Error: Node Unavailable"), reply_to=m)
                reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
                out.append(reply)
                continue
            ctx = Context(run_id=1, node_id=nid, node_config=self.nodes[nid], state=RecordDict(), run_config={})
            reply = client_app.app(m, ctx)
            if self.tamper and m.metadata.message_type == protocol.TRAIN:
                body = protocol.unpack(reply.content, protocol.KIND_REPLY)
                reply = Message(protocol.pack(self.tamper(nid, body), protocol.KIND_REPLY), reply_to=m)
            reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            out.append(reply)
        return out

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(messages))


def hold_first_train_reply(grid: FakeGrid, monkeypatch, node: int) -> None:
    """Node `node` answers its first train request only once the round has given up on it: its reply is
    there when the next round collects late replies (`Loop.collect_late`)."""
    from coordinator.loop import Loop

    real_pull, real_collect = grid.pull_messages, Loop.collect_late
    first: list[str] = []
    collecting: list[int] = []

    def pull(ids):
        for mid in ids:
            m = grid.pending.get(mid)
            if (
                not first
                and m is not None
                and m.metadata.dst_node_id == node
                and m.metadata.message_type == protocol.TRAIN
            ):
                first.append(mid)
        return real_pull([mid for mid in ids if mid not in first or collecting])

    def collect(self, r):
        collecting.append(r)
        try:
            return real_collect(self, r)
        finally:
            collecting.pop()

    grid.pull_messages = pull
    monkeypatch.setattr(Loop, "collect_late", collect)


def set_fed(rd: RunDir, **fed) -> None:
    cfg = rd.load_config()
    for k, v in fed.items():
        setattr(cfg.federation, k, v)
    rd.save_config(config_mod.validate(cfg))


def step_budgets_bind(grid: FakeGrid, request=None) -> None:
    """Train requests carry a time limit (max_seconds) far above what their step budgets need, so that each
    expert takes exactly its budget of steps. Under the round's own limit (round_seconds, 0.2 s: 0.1 s an
    expert) a busy box once stopped an expert at 58 of its 60 steps in one copy and not in the other.
    `request(body)`, where given, edits each train request's body too."""
    real = grid.push_messages

    def push(messages):
        for m in messages:
            if m.metadata.message_type == protocol.TRAIN:
                body = protocol.unpack(m.content, protocol.KIND_TRAIN)
                body = request(body) if request else body
                m.content = protocol.pack({**body, "max_seconds": 600.0}, protocol.KIND_TRAIN)
        return real(messages)

    grid.push_messages = push


def equal_rates(monkeypatch) -> None:
    """Nodes claim, and keep, 1000 evals/s: the probe and the measured rates are noisy on a busy box, and a
    2x difference between two nodes rightly moves an expert."""
    real = client_app.capabilities

    def equal(msg, context):
        body = protocol.unpack(real(msg, context).content, protocol.KIND_CAPS)
        return Message(protocol.pack({**body, "evals_per_s": 1000.0}, protocol.KIND_CAPS), reply_to=msg)

    monkeypatch.setitem(client_app.app._registered_funcs, "query.capabilities", equal)
    monkeypatch.setattr(scheduler, "update_rate", lambda old, measured: old)


def claim_log(coord, res: dict, log) -> None:
    """Make result `res` claim update log `log` (an UpdateLog a liar edited) and the hash that log replays
    to from the expert's current version on coordinator `coord`: the replay alone cannot tell the lie."""
    from coordinator import replay
    from soma_edge.spsa import optim

    x = coord.loop.ledger.expert(res["expert"])
    stored = coord.run.load_expert(x.path)
    w = protocol.decode_weights(stored["weights"])
    base = optim.State(w, step=x.step, opt=coord.loop.ledger.checked_opt(stored, x.path))
    got = replay.rebuild(coord.loop.ledger.phase_config(), base, log, res["expert"])
    res["log"], res["sha256"] = log.to_record(), protocol.weights_sha256(got.weights)


def hashes(root: Path, subdirs=("experts", "shards")) -> dict[str, str]:
    """SHA-256 of each file of a run directory that a refused reply or command must leave as it was."""
    out = {}
    for sub in subdirs:
        for p in sorted((root / sub).rglob("*")):
            if p.is_file():
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    for name in ("router.msgpack", "prepare.json", "run.toml"):
        out[name] = hashlib.sha256((root / name).read_bytes()).hexdigest()
    return out


def train_tasks(grid: FakeGrid) -> list[dict]:
    """Every task of every train request the grid carried, in the order sent."""
    return [
        t
        for m in grid.sent
        if m.metadata.message_type == protocol.TRAIN
        for t in protocol.unpack(m.content, protocol.KIND_TRAIN)["tasks"]
    ]


def cli(argv, capsys):
    """Run `soma-coord ARGV` in-process: (exit code, stdout, stderr)."""
    from coordinator.cli import app
    from soma_edge.cli import run as run_cli

    code = run_cli(app, argv, prog="soma-coord")
    out = capsys.readouterr()
    return code, out.out, out.err
