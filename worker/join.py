"""`soma-worker join` at run time: a Flower SuperNode, supervised.

Flower's SuperNode retries a lost SuperLink forever with one generic line, and prints several lines per
message. The supervisor here tells the cases apart (unreachable, TLS on one side only, key refused,
coordinator gone, run ended), each in one line, and passes on only what a person needs from the
SuperNode's output unless asked for all of it.
"""

from __future__ import annotations

import hashlib
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from soma_edge.errors import ConfigError, LinkError
from soma_edge.processes.launch import session_child
from soma_edge.wire.protocol import RUN_ENDED

# How long the coordinator may not answer before `join` gives up (Flower itself would retry forever).
PATIENCE = 20.0
REJOIN_SECONDS = 75.0  # Flower's two 30 s heartbeats of patience for a stale session, plus slack
CHECK_SECONDS = 2.0
CONNECT_SECONDS = 5.0
# A connect that only times out may be a saturated slow link (its queue can hold seconds of data), not a
# coordinator gone: that verdict waits this much longer than for a refused or unreachable port.
SLOW_LINK_SECONDS = 120.0
END_ANSWER_SECONDS = 5.0  # after the run's end, how long the SuperNode may take to send our answer
# ... and how long it stays up after that: the SuperLink answers every message to a node that signed off
# with NODE_UNAVAILABLE, our answer included, until the coordinator (polling every 0.5 s) has pulled it.
END_LINGER_SECONDS = 3.0


@dataclass
class Join:
    name: str
    host: str
    port: int
    cmd: list[str]  # the SuperNode's command line
    env: dict[str, str]
    patience: float = PATIENCE
    marker: Path | None = None  # exists once this key was accepted by this coordinator
    stay: bool = False  # after the run ends (or the coordinator goes), wait for the next run
    log_level: str = "info"  # debug: all of the SuperNode's output | info | warning

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def say(self, what: str) -> None:
        print(f"soma-worker {self.name}: {what}", flush=True)


class _Stopped(Exception):
    """SIGTERM or SIGINT while no SuperNode runs (waiting for a coordinator, with --stay)."""


def _stopped(_sig, _frame) -> None:
    raise _Stopped


def serve(j: Join) -> int:
    """Run SuperNodes until the run ends (exit 0), the user stops us, or a failure raises; the exit code."""
    signal.signal(signal.SIGTERM, _stopped)
    signal.signal(signal.SIGINT, _stopped)
    try:
        return _serve(j)
    except _Stopped:
        j.say("stopped")
        return 0


def _serve(j: Join) -> int:
    first_refusal = None
    while True:
        code, relay = _serve_once(j)
        if relay.stopped:
            return 0
        if relay.ended is not None and not j.stay:
            j.say(f"the run ended ({relay.ended}); exiting")
            return 0
        if code == _GONE:  # only with --stay; without, supervise's LinkError ends `join`
            j.say(f"the coordinator at {j.address} is gone; waiting for it to come back (--stay)")
            preflight(j.host, j.port, None, wait=float("inf"), tls_check=False)
            continue
        if not relay.refused:
            return 0 if code in (0, -signal.SIGTERM, -signal.SIGINT) else code
        # Flower refuses a key that it still sees online, for up to two 30 s heartbeats after a session
        # that ended without signing off (a crash, kill -9): when this key was accepted here before, wait.
        first_refusal = first_refusal or time.monotonic()
        if j.marker is None or not j.marker.exists() or time.monotonic() - first_refusal > REJOIN_SECONDS:
            raise ConfigError(
                f"the coordinator at {j.address} refused this worker's key: register its public key "
                "there (`soma-coord add-worker RUN worker.pub`), or check --auth-key"
            )
        j.say("the coordinator still holds this worker's previous session (Flower frees it within 60 s); joining again")
        time.sleep(5.0)


_GONE = -1000  # _serve_once: we stopped the SuperNode because the coordinator was gone


def _serve_once(j: Join) -> tuple[int, "Relay"]:
    """Run one SuperNode until it exits, the run ends, or the coordinator is gone; its exit code and what
    its output said."""
    try:
        # Its own session: a Ctrl-C or a group kill reaches `join` alone, which passes it on once. Flower
        # signs the node off on the first signal but dies at once on a second, and a node that did not sign
        # off is refused for up to a minute when it joins again.
        proc = subprocess.Popen(
            j.cmd,
            env=j.env,
            preexec_fn=session_child,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as e:
        raise ConfigError(
            f"cannot start the Flower SuperNode ({e.strerror}): is flwr installed in this environment?"
        ) from None
    relay = Relay(proc, j)

    def forward(sig, _frame):
        relay.stopped = True
        if proc.poll() is None:
            proc.send_signal(sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        return supervise(proc, j.host, j.port, gone_after=j.patience, stop_when=None if j.stay else relay.done), relay
    except LinkError:
        if not j.stay:
            raise
        return _GONE, relay
    finally:
        signal.signal(signal.SIGTERM, _stopped)
        signal.signal(signal.SIGINT, _stopped)
        relay.join()


_ANSI = re.compile(rb"\x1b\[[0-9;]*m")
_LEVEL = re.compile(rb"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) ?:\s*(.*)$")  # Flower's and uvicorn's line format
_NODE_ID = re.compile(rb"^SuperNode ID: (\d+)")


class Relay:
    """Copies the SuperNode's output to ours, line by line, and notes what it says: Flower's "unknown key"
    exit (its exit status is 1 for every error; the code is only in the message), the first sign that
    the coordinator accepted the node (our ClientApp's own log line, recorded in `j.marker`), and the
    run's end (our ClientApp's RUN_ENDED line).

    At log level debug every line passes. At info, Flower's and uvicorn's INFO lines (several per
    message) do not; their warnings and errors, our ClientApp's lines and anything else (tracebacks) do.
    At warning, our ClientApp's INFO lines do not either. Colour codes are dropped when our output is not
    a terminal."""

    REFUSED = b"Exit Code: 305"
    OURS = b"soma.worker "
    ACCEPTED = b"soma.worker INFO"
    ENDED = ACCEPTED + b" " + RUN_ENDED.encode()
    SENT = b"Sent successfully"  # Flower's line once a reply is out

    def __init__(self, proc, j: Join) -> None:
        self.refused = self.stopped = False
        self.ended: str | None = None  # the coordinator's summary, once it ended the run
        self.ended_at, self.answered_at = 0.0, None  # when; when Flower had sent our answer (None: not yet)
        self._j, self._marker = j, j.marker
        self._colour = sys.stdout.isatty()
        self._thread = threading.Thread(target=self._run, args=(proc.stdout,), daemon=True)
        self._thread.start()

    def _run(self, stream) -> None:
        for line in iter(stream.readline, b""):
            plain = _ANSI.sub(b"", line)
            self.refused |= self.REFUSED in plain
            if self._marker is not None and self.ACCEPTED in plain:
                self._marker.parent.mkdir(parents=True, exist_ok=True)
                self._marker.touch()
                self._marker = None
            if self.ended is not None and self.answered_at is None and self.SENT in plain:
                self.answered_at = time.monotonic()
            if self.ENDED in plain:
                self.ended = plain.split(self.ENDED, 1)[1].strip().decode("utf-8", "replace")
                self.ended_at = time.monotonic()
                if self._j.stay:
                    self._j.say(f"the run ended ({self.ended}); waiting for the next run (--stay)")
            out = self._shown(line, plain)
            if out is not None:
                sys.stdout.buffer.write(out)
                sys.stdout.flush()

    def done(self, now: float | None = None) -> bool:
        """The run ended and our answer went out END_LINGER_SECONDS ago (or it never did, in
        END_ANSWER_SECONDS): the SuperNode may stop."""
        now = time.monotonic() if now is None else now
        if self.ended is None:
            return False
        if self.answered_at is not None:
            return now - self.answered_at >= END_LINGER_SECONDS
        return now - self.ended_at > END_ANSWER_SECONDS

    def _shown(self, line: bytes, plain: bytes) -> bytes | None:
        if self._j.log_level == "debug":
            return line if self._colour else plain
        if self.ended is not None and not self._j.stay and self.OURS not in plain:  # Flower signing off
            return None
        if self._j.log_level == "warning" and self.ACCEPTED in plain:
            return None
        m = _LEVEL.match(plain.strip())
        if m and m.group(1) in (b"DEBUG", b"INFO"):
            node = _NODE_ID.match(m.group(2))
            if node and self._j.log_level == "info":  # the one Flower INFO line that matters: we are in
                self._j.say(f"connected as node {node.group(1).decode()}")
            return None
        if not plain.strip() or plain.startswith(b"Successfully installed"):  # flwr-clientapp's app install
            return None
        return line if self._colour else plain

    def join(self) -> None:
        self._thread.join(timeout=5)


def supervise(
    proc, host: str, port: int, gone_after: float = PATIENCE, stop_when: Optional[Callable[[], bool]] = None
) -> int:
    """Wait for the SuperNode to exit, checking that the coordinator's port still answers; stop it and
    return 0 once `stop_when()` holds. When the coordinator has refused us (or been unreachable) for
    `gone_after` seconds, or not answered at all for max(gone_after, SLOW_LINK_SECONDS), stop the
    SuperNode and raise LinkError."""
    last_seen = last_answer = time.monotonic()
    while True:
        try:
            return proc.wait(CHECK_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        if stop_when is not None and stop_when():
            _stop(proc)
            return 0
        try:
            socket.create_connection((host, port), timeout=CONNECT_SECONDS).close()
            last_seen = last_answer = time.monotonic()
        except (ConnectionRefusedError, ConnectionResetError):
            last_answer = time.monotonic()  # the box answered: nothing listens there any more
        except OSError:
            pass  # a timeout, or the network is unreachable: maybe only slow
        now = time.monotonic()
        if now - last_seen >= max(gone_after, SLOW_LINK_SECONDS) or (
            now - last_seen >= gone_after and last_answer > last_seen
        ):
            break
    _stop(proc)
    raise LinkError(
        f"the coordinator at {host}:{port} is gone: no answer for {now - last_seen:.0f} s (it stopped, "
        "or the network to it is down); start this worker again once it is back"
    )


def _stop(proc) -> None:
    """SIGTERM (Flower signs the node off), then SIGKILL if it hangs."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def accepted_marker(cache: Path, key: Path, coordinator: str) -> Path:
    """A file that says this key was once accepted by this coordinator (so a refusal may be a stale session)."""
    tag = hashlib.sha256(key.resolve().read_bytes() + coordinator.encode()).hexdigest()[:16]
    return cache / "accepted" / tag


def preflight(host: str, port: int, ca: Optional[Path], wait: float = PATIENCE, tls_check: bool = True) -> None:
    """Tell the common failures apart before Flower would retry them forever with one generic line: the
    coordinator unreachable (after `wait` seconds of trying, so workers may start first), TLS on one side
    only, or a certificate that the given CA does not sign."""
    deadline = time.monotonic() + wait
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5)
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"--coordinator {host}:{port}: unreachable for {wait:.0f} s ({e.strerror or e}); is "
                    "`soma-coord start` running there, and the port open to this box?"
                ) from None
            time.sleep(1.0)
    if not tls_check:
        sock.close()
        return
    if ca:
        ctx = ssl.create_default_context(cafile=str(ca))
    else:  # only to learn whether the other side speaks TLS at all
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        with ctx.wrap_socket(sock, server_hostname=host):
            speaks_tls = True
    except ssl.SSLCertVerificationError as e:
        raise ConfigError(
            f"TLS: the coordinator's certificate does not verify with --root-certificates {ca} "
            f"({e.verify_message}); use the ca.pem that `soma-coord certs` wrote for it, with a "
            f"--host that names {host}"
        ) from None
    except (ssl.SSLError, OSError):
        speaks_tls = False
    finally:
        sock.close()
    if ca and not speaks_tls:
        raise ConfigError(
            f"TLS: the coordinator at {host}:{port} does not speak TLS; drop --root-certificates, "
            "or start it with --tls"
        )
    if not ca and speaks_tls:
        raise ConfigError(
            f"TLS: the coordinator at {host}:{port} uses TLS; pass --root-certificates ca.pem (the "
            "CA that `soma-coord certs` wrote)"
        )
