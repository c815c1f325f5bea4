"""What an operator meets, without the network: the end of a run reaching the workers, round 1 waiting
for workers started together, late joiners taking idle experts, the coordinator's events on the console,
and `soma-worker join`'s output and supervision. Real-process versions: tests/e2e/test_e2e_operator.py."""

from __future__ import annotations

import io
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator import heartbeat as heartbeat_mod
from coordinator import scheduler
from coordinator.loop import Coordinator
from coordinator.progress import Events, Follower
from soma_edge.wire import protocol
from tests.helpers.fakegrid import FakeGrid, equal_rates, set_fed
from worker import join


def _round_nodes(run, r: int) -> dict[int, str]:
    return {m["expert"]: m["node"] for m in run.read_metrics() if m["type"] == "expert" and m["round"] == r}


def test_the_end_of_a_run_reaches_every_worker(run, tmp_path):
    import logging

    set_fed(run, rounds=1)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    said = io.StringIO()
    handler = logging.StreamHandler(said)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))  # the format `join` reads
    logging.getLogger("soma.worker").addHandler(handler)
    try:
        Coordinator(grid, run).main()
    finally:
        logging.getLogger("soma.worker").removeHandler(handler)
    ends = [m for m in grid.sent if m.metadata.message_type == protocol.QUERY_END]
    assert sorted(m.metadata.dst_node_id for m in ends) == [1000, 1001]
    assert ends[-1] is grid.sent[-1]  # after every round's work
    body = protocol.unpack(ends[0].content, protocol.KIND_END)
    assert protocol.end_summary(body) == "1/1 rounds, complete"
    # each node's ClientApp said it, in the line that `join` watches its SuperNode's output for
    assert said.getvalue().count(join.Relay.ENDED.decode() + " 1/1 rounds, complete") == 2
    assert "run over (complete): 2 worker(s) told" in (run.logs / "coordinator.log").read_text()


def _late(grid: FakeGrid, nid: int, after: float) -> None:
    """Node `nid` connects `after` seconds from now."""
    t0, real = time.monotonic(), grid.get_node_ids
    grid.get_node_ids = lambda: [n for n in real() if n != nid or time.monotonic() - t0 >= after]


@pytest.mark.parametrize("grace", [0.0, 3.0])
def test_round_1_waits_join_grace_for_a_second_worker(run, tmp_path, monkeypatch, grace):
    """b connects 1 s after a (min_nodes 1): with a grace both train in round 1, without one a has it all."""
    equal_rates(monkeypatch)
    set_fed(run, rounds=1, min_nodes=1, join_grace=grace)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    _late(grid, 1001, after=1.0)
    Coordinator(grid, run).main()
    assert set(_round_nodes(run, 1).values()) == ({"a", "b"} if grace else {"a"})


def test_a_late_joiner_takes_the_experts_of_a_node_that_left(run, tmp_path, monkeypatch):
    """Node b is reported gone as soon as round 1 is sent; c joins then: it gets b's experts in round 1,
    instead of their sitting the round out."""
    equal_rates(monkeypatch)
    set_fed(run, rounds=1, min_nodes=2, deadline_factor=20.0)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b", "c"])
    grid.gone.add(1002)
    grid.delay[1000] = 2.0  # a trains for a while, as a real node would
    real_push = grid.push_messages

    def push(messages):
        if any(m.metadata.message_type == protocol.TRAIN for m in messages) and 1001 not in grid.unavailable:
            grid.unavailable.add(1001)
            grid.gone.discard(1002)
        return real_push(messages)

    grid.push_messages = push
    state = Coordinator(grid, run).main()
    lines = {m["expert"]: m for m in run.read_metrics() if m["type"] == "expert" and m["round"] == 1}
    moved = [e for e, m in lines.items() if m["node"] == "c"]
    assert moved and all(lines[e]["accepted"] for e in moved)
    assert all(x.version == 1 for x in state.experts.values())  # nothing sat out
    log = (run.logs / "coordinator.log").read_text()
    assert "is gone (no heartbeat)" in log and f"idle experts {sorted(moved)} go to c" in log


def test_the_console_shows_the_coordinators_events_but_not_its_detail(tmp_path):
    from soma_edge.rundir.layout import RunDir

    rd = RunDir(tmp_path / "run")
    rd.logs.mkdir(parents=True)
    path = rd.logs / "coordinator.log"
    path.write_text("2026-12-01 10:00:00,000 soma.coord INFO from an earlier start\n")
    events = Events(path)
    with open(path, "a") as f:
        f.write(
            "2026-12-01 10:00:01,123 soma.coord INFO node 7 (w0) active: 3.0 forward evals/s\n"
            "2026-12-01 10:00:02,000 soma.coord DEBUG round 1: accepted expert 0\n"
            "2026-12-01 10:00:03,000 soma.coord WARNING round 1: node 7 (w0) is gone (no heartbeat)\n"
            "2026-12-01 10:00:04,000 soma.coord INFO half a li"
        )
    assert events.new() == [
        "10:00:01 node 7 (w0) active: 3.0 forward evals/s",
        "10:00:03 warning: round 1: node 7 (w0) is gone (no heartbeat)",
    ]
    with open(path, "a") as f:
        f.write("ne [0, 2]\n")
    assert events.new() == ["10:00:04 half a line [0, 2]"]
    from rich.console import Console

    out = io.StringIO()
    follower = Follower(rd, console=Console(file=out, width=60))
    with open(path, "a") as f:
        f.write("2026-12-01 10:00:05,000 soma.coord INFO round 2/4: w0<-[0, 2] (moved: none)\n")
    follower.update(None)
    assert "10:00:05 round 2/4: w0<-[0, 2] (moved: none)" in out.getvalue()  # brackets are not rich markup


class _Proc:
    """Stands in for the SuperNode: its stdout is these bytes."""

    def __init__(self, data: bytes) -> None:
        self.stdout = io.BytesIO(data)


FLOWER_OUTPUT = (
    b"\x1b[92mINFO \x1b[0m:      Starting Flower SuperNode\n"
    b"\x1b[93mWARNING \x1b[0m:   Option `--insecure` was set. Starting insecure channel to 10.0.0.1:9092.\n"
    b"INFO:     Started server process [12269]\n"
    b"\x1b[92mINFO \x1b[0m:      SuperNode ID: 18302947805548554181\n"
    b"\x1b[92mINFO \x1b[0m:      \n"
    b"\x1b[92mINFO \x1b[0m:      Receiving: train message (ID: 1db23c)\n"
    b"Successfully installed soma-edge-app to /x/apps/soma-edge.\n"
    b"2026-12-01 10:53:37,867 soma.worker INFO sent expert=0 version=1\n"
    b"Traceback (most recent call last):\n"
    b"2026-12-01 10:54:00,000 soma.worker INFO " + protocol.RUN_ENDED.encode() + b" 4/4 rounds, complete\n"
    b"\x1b[92mINFO \x1b[0m:      Sent successfully\n"
    b"\x1b[93mWARNING \x1b[0m:   Connection attempt failed, retrying in 0.71 seconds\n"
)


def _relay(level: str, capsys, monkeypatch) -> tuple[join.Relay, str]:
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    j = join.Join(name="w0", host="h", port=1, cmd=[], env={}, log_level=level)
    relay = join.Relay(_Proc(FLOWER_OUTPUT), j)
    relay.join()
    return relay, capsys.readouterr().out


def test_join_passes_on_what_a_person_needs_and_hears_the_end(capsys, monkeypatch):
    relay, out = _relay("info", capsys, monkeypatch)
    assert relay.ended == "4/4 rounds, complete" and relay.answered_at is not None and not relay.refused
    # The SuperNode stays up a moment after sending the answer (signing off would void it), then may stop.
    assert not relay.done(now=relay.answered_at) and relay.done(now=relay.answered_at + join.END_LINGER_SECONDS)
    assert "Connection attempt failed" not in out  # after the end: the SuperNode signing off
    assert "\x1b[" not in out  # not a terminal: no colour codes
    assert "Receiving:" not in out and "Started server process" not in out and "Successfully installed" not in out
    assert "soma-worker w0: connected as node 18302947805548554181" in out
    assert "WARNING :   Option `--insecure` was set" in out and "soma.worker INFO sent expert=0" in out
    assert "Traceback" in out
    _, out = _relay("debug", capsys, monkeypatch)
    assert "Receiving: train message" in out and "\x1b[" not in out
    relay, out = _relay("warning", capsys, monkeypatch)
    assert relay.ended and "sent expert" not in out and "Option `--insecure`" in out


def test_supervise_stops_the_supernode_once_the_run_ended():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        t0, calls = time.monotonic(), []
        code = join.supervise(
            proc, "127.0.0.1", server.getsockname()[1], stop_when=lambda: calls.append(1) or len(calls) > 1
        )
        assert code == 0 and proc.poll() is not None and time.monotonic() - t0 < 20
    finally:
        proc.kill()
        server.close()


def test_help_renders_defaults_without_escapes():
    out = subprocess.run(
        [sys.executable, "-m", "worker.cli", "join", "--help"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "COLUMNS": "100"},
    )
    assert out.returncode == 0, out.stderr
    assert "[default: auto]" in out.stdout and "\\[" not in out.stdout
    assert "--stay" in out.stdout and "--heartbeat" in out.stdout


def test_supernode_launcher_sets_the_heartbeat_flower_uses():
    from flwr.supercore import heartbeat  # where the reported interval lives
    from flwr.supernode import fleet_http_connection

    from worker import supernode

    before = heartbeat.HEARTBEAT_DEFAULT_INTERVAL, fleet_http_connection.HEARTBEAT_DEFAULT_INTERVAL
    try:
        supernode.set_heartbeat(30.0)  # reported 30 s, sent every ~4 s (the period of a 10 s interval)
        assert fleet_http_connection.HEARTBEAT_DEFAULT_INTERVAL == 30.0 and heartbeat.HEARTBEAT_DEFAULT_INTERVAL == 10.0
    finally:
        heartbeat.HEARTBEAT_DEFAULT_INTERVAL, fleet_http_connection.HEARTBEAT_DEFAULT_INTERVAL = before
    bad = subprocess.run(
        [sys.executable, "-m", "worker.supernode", "5", "cache"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert bad.returncode != 0 and bad.stderr.strip().startswith("error: heartbeat 5 s")


def test_supernode_polls_eagerly_for_a_while_after_start_and_each_reply(monkeypatch):
    """Flower's SuperNode waits a bare time.sleep(3) after a pull that found nothing; the launcher makes
    that 0.5 s for 20 s after it starts and after each reply it pushes, and leaves every other sleep alone."""
    import inspect

    from flwr.supernode import start_client_internal as sci

    from worker import supernode

    assert "time.sleep(3)" in inspect.getsource(sci.start_client_internal)  # what eager_polls shortens
    now, slept, pushed = [100.0], [], []

    class FakeTime:
        @staticmethod
        def monotonic():
            return now[0]

        @staticmethod
        def sleep(s):
            slept.append(s)

    monkeypatch.setattr(sci, "time", FakeTime)
    monkeypatch.setattr(sci, "_push_messages", lambda *a, **k: pushed.append(a))
    supernode.eager_polls()
    sci.time.sleep(3)  # just started: the capability query is due
    now[0] += supernode.EAGER_SECONDS
    sci.time.sleep(3)  # nothing came: Flower's poll
    sci._push_messages("state")
    now[0] += 5.0
    sci.time.sleep(3)
    sci.time.sleep(0.5)  # the reply wait inside _push_messages: untouched
    now[0] += supernode.EAGER_SECONDS
    sci.time.sleep(3)
    assert pushed == [("state",)] and slept == [supernode.EAGER_POLL, 3, supernode.EAGER_POLL, 0.5, 3]
    assert sci.time.monotonic() == now[0]  # everything else is the real module's


def test_auto_heartbeat_follows_the_coordinators_advice(run, tmp_path):
    """The coordinator advises 10 s where a node's link moves the largest message it may get within 10 s,
    else an interval whose two periods outlast that download (30 s at least), an unmeasured link priced at
    1 Mbit/s; the advice goes with the capability query (before round 1's download) and each train request,
    and on its own as soon as a measured link changes it; the ClientApp leaves it in the cache; the
    SuperNode's thread applies it."""
    import threading

    from flwr.supernode import fleet_http_connection as heartbeat  # where the reported interval lives

    from worker import supernode
    from worker.cache import HEARTBEAT_ADVICE, Cache

    set_fed(run, rounds=1)
    coord = Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run)
    coord.main()
    sent = [
        protocol.unpack(m.content, protocol.KIND_TRAIN)
        for m in coord.grid.sent
        if m.metadata.message_type == protocol.TRAIN and m.metadata.dst_node_id == 1000
    ]
    queries = [
        protocol.unpack(m.content, protocol.KIND_QUERY)
        for m in coord.grid.sent
        if m.metadata.message_type == protocol.QUERY_CAPABILITIES and m.metadata.dst_node_id == 1000
    ]
    loop = coord.loop
    a, vb = loop.fleet.nodes[1000], loop.ledger.version_bytes()

    def advice_at(link: float) -> float:  # the largest message: a version and a piece of PIECE_SECONDS' worth
        seconds = (vb + max(heartbeat_mod.MIN_PIECE_BYTES, int(heartbeat_mod.PIECE_SECONDS * link))) / link
        return 10.0 if seconds <= 10 else max(30.0, math.ceil(0.75 * seconds))

    first = advice_at(scheduler.UNMEASURED_LINK)
    assert queries and protocol.heartbeat_advice(queries[0]) == first  # before round 1: the link is not measured
    assert Cache(tmp_path / "nodes" / "a").get_json(HEARTBEAT_ADVICE) == first
    assert sent and protocol.heartbeat_advice(sent[0]) == first
    # The link measured in round 1 moves a version in 1 s: 10 s; in 40 s, 400 s: intervals whose two periods
    # outlast the download.
    a.link = vb
    assert loop.fleet.heartbeat(1000) == advice_at(vb) == 10.0
    for link in (vb / 40, vb / 400):
        a.link = link
        advice = loop.fleet.heartbeat(1000)
        assert advice == advice_at(link) and 2 * advice > vb / link >= 40 and advice >= 30, link
    assert loop.fleet.piece_bytes(1000) == heartbeat_mod.MIN_PIECE_BYTES  # a slow link's pieces are small
    # A measured link that changes the advice sends it at once, in a message of its own, and only once.
    a.link, a.advised = vb, 30.0
    grid, pushed = coord.grid, len(coord.grid.sent)
    loop.fleet.advise(1000)
    loop.fleet.advise(1000)
    (msg,) = grid.sent[pushed:]
    assert msg.metadata.message_type == protocol.QUERY_ADVICE and a.advised == 10.0
    assert protocol.heartbeat_advice(protocol.unpack(msg.content, protocol.KIND_ADVICE)) == 10.0
    loop.fleet.pull(lambda *_: pytest.fail("an advice reply is the fleet's own"))
    assert not loop.fleet.out and Cache(tmp_path / "nodes" / "a").get_json(HEARTBEAT_ADVICE) == 10.0

    before, stop = heartbeat.HEARTBEAT_DEFAULT_INTERVAL, threading.Event()
    cache = Cache(tmp_path / "w")
    cache.put_json(HEARTBEAT_ADVICE, 10.0)
    t = threading.Thread(target=supernode.follow_advice, args=(tmp_path / "w", stop, 0.02))
    t.start()
    try:
        assert _until(lambda: heartbeat.HEARTBEAT_DEFAULT_INTERVAL == 10.0)
        cache.put_json(HEARTBEAT_ADVICE, 5.0)  # not one Flower accepts: ignored
        time.sleep(0.1)
        assert heartbeat.HEARTBEAT_DEFAULT_INTERVAL == 10.0
        cache.put_json(HEARTBEAT_ADVICE, 30.0)
        assert _until(lambda: heartbeat.HEARTBEAT_DEFAULT_INTERVAL == 30.0)
    finally:
        stop.set()
        t.join()
        supernode.set_heartbeat(before)  # (the sender's period stays at 10 s's in this test process)


def _until(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False
