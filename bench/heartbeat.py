"""What the worker's heartbeat interval costs, and how soon a dead worker is noticed.

    sudo .venv/bin/python -m bench.heartbeat [--intervals 10,30] [--idle-seconds 60] [--mbit 1]
    sudo .venv/bin/python -m bench.heartbeat --kill-during-download 124K,1M [--mbit 1]

For each interval, on simulated boxes (tests/helpers/netboxes.py): a coordinator in one network namespace
that waits for a second worker (so no training traffic), one `soma-worker join --heartbeat S` in another.
Once the worker is active: the bytes and packets its link carries in `--idle-seconds` (heartbeats, plus
the SuperNode's polling for messages, which does not depend on the interval); then, with `--mbit`, the
link is limited and saturated in both directions by bulk TCP transfers for `--idle-seconds` (as a large
upload or download would), and we note whether the coordinator lost the node meanwhile (its heartbeats
queue behind the bulk data); then every process in the worker's namespace gets SIGKILL, and the time
until the coordinator logs that the node left. Needs root.

`--kill-during-download SIZES`: for each expert size, a run at the shipped settings but the model size
(one expert, one worker behind `--mbit`, default 1 Mbit/s): once round 1's shard pieces are on their way
and the first has timed the link, plus KILL_AFTER seconds, every process in the worker's namespace gets
SIGKILL; we note the heartbeat advice the coordinator sent until then, and the time from the kill until it
declares the node gone (target: 5 minutes).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, coordinator_cmd, platform_line, worker_cmd
from soma_edge.processes.launch import free_port
from tests.helpers import netboxes

CONFIG = """
[federation]
experts = 2
rounds = 1
min_nodes = 2
wait_seconds = 3600
"""


def _counters(boxes, box) -> tuple[int, int]:
    """Bytes and packets, both directions, on the worker's end of its link."""
    dev = box.devices[0]

    def read(what: str) -> int:
        cmd = ["ip", "netns", "exec", box.name, "cat", f"/sys/class/net/{dev}/statistics/{what}"]
        return int(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)

    return read("rx_bytes") + read("tx_bytes"), read("rx_packets") + read("tx_packets")


def _wait_for(path: Path, text: str, timeout: float) -> float | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return time.monotonic()
        time.sleep(0.2)
    return None


SINK = """
import socket, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", {port})); s.listen()
def drain(c):
    while c.recv(1 << 16): pass
def feed(c):
    while True: c.sendall(b"x" * (1 << 16))
while True:
    c, _ = s.accept()
    threading.Thread(target=drain if c.recv(1) == b"u" else feed, args=(c,), daemon=True).start()
"""
BULK = """
import socket, sys, time
c = socket.create_connection(("{host}", {port})); c.sendall(b"{way}"); end = time.time() + {seconds}
while time.time() < end:
    c.sendall(b"x" * (1 << 16)) if b"{way}" == b"u" else c.recv(1 << 16)
"""


def _saturate(boxes, coord, w, seconds: float, work: Path) -> None:
    """Bulk TCP both ways across the worker's link for `seconds` (returns at once)."""
    port = free_port()
    boxes.popen(coord, [sys.executable, "-c", SINK.format(port=port)], work / "sink.log")
    time.sleep(1.0)
    for way in ("u", "d"):
        boxes.popen(
            w,
            [sys.executable, "-c", BULK.format(host=w.peer, port=port, way=way, seconds=seconds)],
            work / f"bulk-{way}.log",
        )


def one(interval: float, args, work: Path) -> tuple[float, float, float, float, str]:
    (work / "fed.toml").write_text(CONFIG)
    run, port = work / f"run-{interval:g}", free_port()
    boxes = netboxes.Boxes()
    try:
        coord = boxes.add("coord")
        w = boxes.add("w", link_to=coord, mbit=args.mbit)
        boxes.popen(
            coord,
            coordinator_cmd(run, work / "fed.toml", port),
            work / f"start-{interval:g}.log",
            env=dict(os.environ),
            cwd=ROOT,
        )
        boxes.popen(
            w,
            worker_cmd(f"{w.peer}:{port}", "w", work / "cache", "--heartbeat", f"{interval:g}"),
            work / f"w-{interval:g}.log",
            env=dict(os.environ),
            cwd=ROOT,
        )
        log = run / "logs" / "coordinator.log"
        if _wait_for(log, "(w) active", 300) is None:
            raise SystemExit(f"the worker did not become active; see {work}")
        time.sleep(5.0)  # the capability reply is done
        b0, p0 = _counters(boxes, w)
        time.sleep(args.idle_seconds)
        b1, p1 = _counters(boxes, w)
        lost, busy = "-", 0.0
        if args.mbit:
            _saturate(boxes, coord, w, args.idle_seconds, work)
            time.sleep(args.idle_seconds / 2)
            b2, _ = _counters(boxes, w)
            time.sleep(args.idle_seconds / 2 + 2)
            busy = (_counters(boxes, w)[0] - b2) / (args.idle_seconds / 2 + 2)  # both ways: ~2x the link when full
            lost = "yes" if "(w) left the federation" in log.read_text(errors="replace") else "no"
            if lost == "yes":
                return (b1 - b0) / args.idle_seconds, (p1 - p0) / args.idle_seconds, busy, float("nan"), lost
        t_kill = time.monotonic()
        for pid in boxes.pids(w):
            os.kill(pid, signal.SIGKILL)
        t_gone = _wait_for(log, "(w) left the federation", 300)
        noticed = (t_gone - t_kill) if t_gone else float("nan")
    finally:
        boxes.close()
    return (b1 - b0) / args.idle_seconds, (p1 - p0) / args.idle_seconds, busy, noticed, lost


SIZES = {"124K": (32, 128), "1M": (64, 448), "8M": (128, 1280)}  # (embed, hidden), as bench/slow_link.py
KILL_AFTER = 20.0  # seconds after the first piece timed the link: the rest of the pieces are in flight
GONE = ("left the federation", "is gone (no heartbeat)")


def killed_in_download(size: str, mbit: float, work: Path) -> tuple[list[float], float, float]:
    """(advice seconds sent until the kill, seconds from round 1's plan to the kill, kill -> gone seconds)."""
    embed, hidden = SIZES[size]
    cfg = work / f"kill-{size}.toml"
    cfg.write_text(f"[model]\nembed = {embed}\nhidden = {hidden}\n[federation]\nexperts = 1\nmin_nodes = 1\n")
    run, port = work / f"run-kill-{size}", free_port()
    boxes = netboxes.Boxes()
    try:
        coord = boxes.add("coord")
        w = boxes.add("w", link_to=coord, mbit=mbit)
        boxes.popen(coord, coordinator_cmd(run, cfg, port), work / f"kill-{size}.log", env=dict(os.environ), cwd=ROOT)
        boxes.popen(
            w,
            worker_cmd(f"{w.peer}:{port}", "w", work / f"cache-kill-{size}"),
            work / f"kill-{size}-w.log",
            env=dict(os.environ),
            cwd=ROOT,
        )
        log = run / "logs" / "coordinator.log"
        t_plan = _wait_for(log, "round 1/", 600)
        if _wait_for(log, "link timed at", 600) is None or t_plan is None:
            raise SystemExit(f"{size}: round 1's first piece never timed the link; see {work}")
        time.sleep(KILL_AFTER)
        t_kill = time.monotonic()
        advice = [float(x) for x in re.findall(r"heartbeat advice now ([0-9.]+) s", log.read_text(errors="replace"))]
        for pid in boxes.pids(w):
            os.kill(pid, signal.SIGKILL)
        t_gone = _wait_any(log, GONE, 1800)
        return advice, t_kill - t_plan, (t_gone - t_kill) if t_gone else float("nan")
    finally:
        boxes.close()


def _wait_any(path: Path, texts: tuple[str, ...], timeout: float) -> float | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and any(t in path.read_text(errors="replace") for t in texts):
            return time.monotonic()
        time.sleep(0.5)
    return None


def kill_arm(sizes: list[str], mbit: float) -> None:
    print(f"{platform_line()}; link {mbit:g} Mbit/s; shipped settings, one expert, one worker")
    print(f"{'size':>5} {'advice sent until the kill (s)':>32} {'plan -> kill s':>14} {'kill -> gone s':>14}")
    work = Path(tempfile.mkdtemp(prefix="soma-heartbeat-kill-"))
    for size in sizes:
        advice, before, gone = killed_in_download(size, mbit, work)
        sent = ", ".join(f"{a:g}" for a in advice) or "-"
        print(f"{size:>5} {sent:>32} {before:>14.1f} {gone:>14.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--intervals", default="10,30")
    ap.add_argument("--idle-seconds", type=float, default=60.0)
    ap.add_argument("--mbit", type=float, default=None, help="limit the link, and saturate it for --idle-seconds")
    ap.add_argument("--kill-during-download", default="", metavar="SIZES", help="e.g. 124K,1M (see above)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (network namespaces, veth)")
    if args.kill_during_download:
        kill_arm(args.kill_during_download.split(","), args.mbit or 1.0)
        return
    args.mbit = args.mbit or 0.0
    print(f"{platform_line()}; {args.idle_seconds:g} s idle per interval")
    print(
        f"{'heartbeat s':>11} {'idle B/s':>9} {'packets/s':>9} {'saturated B/s':>13} {'lost then':>9} "
        f"{'kill -> gone s':>14}"
    )
    work = Path(tempfile.mkdtemp(prefix="soma-heartbeat-"))
    for interval in map(float, args.intervals.split(",")):
        rate, pkts, busy, noticed, lost = one(interval, args, work)
        print(f"{interval:>11g} {rate:>9.0f} {pkts:>9.1f} {busy:>13,.0f} {lost:>9} {noticed:>14.1f}", flush=True)


if __name__ == "__main__":
    main()
