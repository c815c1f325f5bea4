"""Simulated boxes: the coordinator and each worker in a Linux network namespace of their own.

Each worker namespace is joined to the coordinator's by a veth pair with a private /30 that exists only
inside those two namespaces; a link may be limited with a `tc` htb class on both ends (this kernel has
no netem or tbf). Needs root and `ip netns`; `require()` skips a test with the reason where they are
missing. Every namespace (with its links) and every process started in one is removed on exit, even
when the test fails.

    with Boxes() as boxes:
        coord = boxes.add("coord")
        slow = boxes.add("w1", link_to=coord, mbit=1)
        proc = boxes.popen(coord, [...])   # a process inside the coordinator's namespace
        slow.peer                          # the coordinator's address as seen from w1
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SUBNET = "10.213"  # 10.213.<link>.0/30: .1 the coordinator's end, .2 the worker's (inside the two namespaces only)
_HARNESSES = itertools.count()  # Boxes made by this process


def require() -> None:
    """Skip the calling test unless this process can make network namespaces."""
    if os.geteuid() != 0:
        pytest.skip("simulated boxes need root (network namespaces, veth links, tc)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            pytest.skip(f"simulated boxes need `{tool}` (iproute2)")
    probe = f"soma-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {r.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)


@dataclass
class Box:
    name: str  # the namespace
    addr: str = "127.0.0.1"  # this box's address on its link (the coordinator: loopback only)
    peer: str = ""  # the other end of its link (for a worker: the coordinator's address)
    devices: list[str] = field(default_factory=list)


class Boxes:
    def __init__(self) -> None:
        # Unique per process and per harness, so that tests in parallel processes (pytest-xdist) never share
        # or delete each other's namespaces; `ip netns` names have no practical length limit.
        self.prefix = f"soma{os.getpid()}-{next(_HARNESSES)}"
        self.boxes: list[Box] = []
        self.procs: list[subprocess.Popen] = []
        self._links = 0

    def __enter__(self) -> "Boxes":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ip(self, *args: str, ns: str | None = None) -> None:
        cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")

    def add(self, name: str, link_to: Box | None = None, mbit: float | None = None) -> Box:
        """A new namespace (loopback up); with `link_to`, a veth link to that box, limited to `mbit`."""
        box = Box(name=f"{self.prefix}-{name}")
        self._ip("ip", "netns", "add", box.name)
        self.boxes.append(box)
        self._ip("ip", "link", "set", "lo", "up", ns=box.name)
        if link_to is not None:
            self._links += 1
            n = self._links
            mine, theirs = f"s{n}a", f"s{n}b"  # veth names are per namespace, so short ones do not clash
            self._ip(
                "ip",
                "link",
                "add",
                mine,
                "netns",
                box.name,
                "type",
                "veth",
                "peer",
                "name",
                theirs,
                "netns",
                link_to.name,
            )
            box.addr, box.peer = f"{SUBNET}.{n}.2", f"{SUBNET}.{n}.1"
            for ns, dev, addr in ((box.name, mine, box.addr), (link_to.name, theirs, box.peer)):
                self._ip("ip", "addr", "add", f"{addr}/30", "dev", dev, ns=ns)
                self._ip("ip", "link", "set", dev, "up", ns=ns)
                if mbit is not None:
                    self._limit(ns, dev, mbit)
            box.devices.append(mine)
        return box

    def _limit(self, ns: str, dev: str, mbit: float) -> None:
        rate = f"{int(mbit * 1000)}kbit"
        self._ip("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10", ns=ns)
        self._ip(
            "tc",
            "class",
            "add",
            "dev",
            dev,
            "parent",
            "1:",
            "classid",
            "1:10",
            "htb",
            "rate",
            rate,
            "ceil",
            rate,
            ns=ns,
        )

    def popen(
        self, box: Box, cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.Popen:
        """Start `cmd` inside `box`'s namespace, in a session of its own, output appended to `log`."""
        with open(log, "ab") as out:
            p = subprocess.Popen(
                ["ip", "netns", "exec", box.name, *cmd],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        self.procs.append(p)
        return p

    def pids(self, box: Box) -> list[int]:
        r = subprocess.run(["ip", "netns", "pids", box.name], capture_output=True, text=True)
        return [int(x) for x in r.stdout.split()]

    def close(self) -> None:
        """Stop everything started here (SIGTERM, then SIGKILL), then delete the namespaces and links."""
        for p in self.procs:
            _signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for box in self.boxes:
            for pid in self.pids(box):  # anything left in the namespace, whoever started it
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            _signal_group(p.pid, signal.SIGKILL)
        for box in reversed(self.boxes):
            subprocess.run(["ip", "netns", "del", box.name], capture_output=True)
        self.boxes.clear()

    def leftovers(self) -> list[str]:
        """Namespaces of this harness that still exist (none after close)."""
        r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        return [line.split()[0] for line in r.stdout.splitlines() if line.startswith(self.prefix + "-")]


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
