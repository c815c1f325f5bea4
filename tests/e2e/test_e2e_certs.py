"""Real flower-superlink processes serving `soma-coord certs`' certificates, and `soma-worker join` against
them: a client verifies the SuperLink only with that CA, and each failure to join is one line. The
certificate and CLI checks without processes: tests/unit/test_certs.py."""

from __future__ import annotations

import socket
import ssl

import pytest
from cryptography import x509

from coordinator.launcher import TLS, Launcher
from soma_edge.cli import run as run_cli
from soma_edge.processes.launch import free_port
from soma_edge.wire.certs import files, make_certs


def _handshake(port: int, cafile) -> x509.Certificate:
    ctx = ssl.create_default_context(cafile=str(cafile)) if cafile else ssl.create_default_context()
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            return x509.load_der_x509_certificate(s.getpeercert(binary_form=True))


def test_a_real_superlink_serves_the_certificate_to_clients_with_the_ca(tmp_path):
    f = files(make_certs(tmp_path / "tls", ["127.0.0.1"]).ca.parent)
    launcher = Launcher(tmp_path / "logs", tmp_path / "flwr")
    port = free_port()
    try:
        launcher.superlink("127.0.0.1", port, TLS(f.ca, f.cert, f.key))
        served = _handshake(port, f.ca)
        assert served == x509.load_pem_x509_certificate(f.cert.read_bytes())
        with pytest.raises(ssl.SSLCertVerificationError):
            _handshake(port, None)  # the system's CAs do not know ours
        other = make_certs(tmp_path / "other", ["127.0.0.1"])
        with pytest.raises(ssl.SSLCertVerificationError):
            _handshake(port, other.ca)
    finally:
        launcher.stop_all()


@pytest.fixture(scope="module")
def superlinks(tmp_path_factory):
    """A TLS SuperLink (certificates from `make_certs`) and an insecure one, both real."""
    root = tmp_path_factory.mktemp("links")
    f = make_certs(root / "tls", ["127.0.0.1"])
    launcher = Launcher(root / "logs", root / "flwr")
    tls_port, plain_port = free_port(), free_port()
    try:
        launcher.superlink("127.0.0.1", tls_port, TLS(f.ca, f.cert, f.key))
        launcher.superlink("127.0.0.1", plain_port, None)
        yield {"tls": tls_port, "plain": plain_port, "ca": f.ca, "other": make_certs(root / "other", ["127.0.0.1"]).ca}
    finally:
        launcher.stop_all()


@pytest.mark.xdist_group("e2e_certs_superlinks")  # one pair of SuperLinks for all four, not one per process
@pytest.mark.parametrize(
    "which,ca,fragments",
    [
        ("tls", None, ["TLS:", "uses TLS", "--root-certificates"]),
        ("tls", "other", ["TLS:", "does not verify", "ca.pem"]),
        ("plain", "ca", ["TLS:", "does not speak TLS"]),
        ("closed", None, ["unreachable for 2 s"]),
    ],
)
def test_join_says_what_went_wrong_in_one_line(which, ca, fragments, superlinks, capsys):
    """Each failure in one line within seconds, where Flower would retry forever with the same warning."""
    import time

    from worker.cli import app as worker_app

    port = free_port() if which == "closed" else superlinks[which]
    argv = ["join", "--coordinator", f"127.0.0.1:{port}", "--patience", "2"]  # 2 s: the default 20, shortened
    argv += ["--root-certificates", str(superlinks[ca])] if ca else []
    t0 = time.monotonic()
    rc = run_cli(worker_app, argv, prog="soma-worker")
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert all(f in lines[0] for f in fragments), lines[0]
    assert time.monotonic() - t0 < 20


def test_join_says_the_coordinator_is_gone_when_it_stops_answering(tmp_path):
    """A real SuperLink, a real `soma-worker join` connected to it; the SuperLink is killed. Flower would
    retry forever; join stops its SuperNode and exits 2 with one line, within its --patience."""
    import os
    import subprocess
    import sys
    import time

    launcher = Launcher(tmp_path / "logs", tmp_path / "flwr")
    port = free_port()
    link = launcher.superlink("127.0.0.1", port, None)
    log = tmp_path / "join.log"
    cmd = [
        sys.executable,
        "-m",
        "worker.cli",
        "join",
        "--coordinator",
        f"127.0.0.1:{port}",
        "--patience",
        "5",
        "--cache",
        str(tmp_path / "cache"),
    ]
    with open(log, "wb") as out:
        join = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=out, start_new_session=True)
    try:
        time.sleep(3)  # joined: the SuperNode is polling the SuperLink
        assert join.poll() is None, log.read_text()
        link.stop(timeout=0)
        t0 = time.monotonic()
        rc = join.wait(30)
    finally:
        launcher.stop_all()
        if join.poll() is None:
            os.killpg(join.pid, 9)
    errors = [ln for ln in log.read_text().splitlines() if ln.startswith("error:")]
    assert (
        rc == 2
        and len(errors) == 1
        and errors[0].startswith(f"error: the coordinator at 127.0.0.1:{port} is gone: no answer for ")
    ), errors
    assert errors[0].endswith("s (it stopped, or the network to it is down); start this worker again once it is back")
    assert time.monotonic() - t0 < 15
    assert not any(
        p.isdigit() and b"worker.supernode" in _cmdline(p) and str(tmp_path).encode() in _cmdline(p)
        for p in os.listdir("/proc")
    )  # the SuperNode was stopped too


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
