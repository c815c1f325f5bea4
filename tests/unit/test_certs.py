"""`soma-coord certs`: a CA and a SuperLink certificate from the `cryptography` package, which a real
flower-superlink serves, and which a client verifies only with that CA. With real SuperLinks:
tests/e2e/test_e2e_certs.py."""

from __future__ import annotations

import stat
import subprocess
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature

from coordinator import launcher
from coordinator import workers as workers_mod
from coordinator.cli import app
from coordinator.launcher import TLS
from soma_edge.cli import run as run_cli
from soma_edge.rundir.layout import RunDir
from soma_edge.wire.certs import make_certs


def test_certs_chain_hosts_and_key_permissions(tmp_path):
    f = make_certs(tmp_path / "tls", ["127.0.0.1", "coord.example", "::1"])
    ca = x509.load_pem_x509_certificate(f.ca.read_bytes())
    server = x509.load_pem_x509_certificate(f.cert.read_bytes())
    server.verify_directly_issued_by(ca)  # raises unless the CA signed it
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "::1"]
    assert san.get_values_for_type(x509.DNSName) == ["coord.example", "localhost"]
    only = make_certs(tmp_path / "only", ["coord.example"])  # start's own loopback dial is always named
    san = x509.load_pem_x509_certificate(only.cert.read_bytes()).extensions
    san = san.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert san.get_values_for_type(x509.DNSName) == ["coord.example", "localhost"]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for key in (f.key, tmp_path / "tls" / "ca.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600  # private keys: owner only
    assert stat.S_IMODE(f.ca.stat().st_mode) == 0o644
    other = make_certs(tmp_path / "other", ["127.0.0.1"])
    with pytest.raises((ValueError, InvalidSignature)):  # a name mismatch, or a signature by another key
        server.verify_directly_issued_by(x509.load_pem_x509_certificate(other.ca.read_bytes()))


@pytest.mark.parametrize(
    "argv,fragments",
    [
        (["certs", "{tls}", "--host", "127.0.0.1"], ["already holds", "--force"]),
        (["certs", "{new}", "--host", "bad host"], ["--host", "not a DNS name"]),
        (["start", "--run", "{tmp}/run", "--tls", "{tmp}/nowhere"], ["--tls", "ca.pem", "soma-coord certs"]),
    ],
)
def test_certs_bad_input_one_line_exit_2(argv, fragments, tmp_path, capsys):
    make_certs(tmp_path / "tls", ["127.0.0.1"])
    rc = run_cli(
        app, [a.format(tls=tmp_path / "tls", new=tmp_path / "new", tmp=tmp_path) for a in argv], prog="soma-coord"
    )
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert all(f in lines[0] for f in fragments), lines[0]
    assert not (tmp_path / "new").exists()


def test_worker_keys_register_once_and_list(tmp_path, capsys):
    from coordinator import workers
    from soma_edge.rundir.layout import RunDir
    from soma_edge.wire.certs import make_worker_key, read_public_key

    key, pub = make_worker_key(tmp_path / "k")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and read_public_key(pub).startswith("ecdsa-sha2-nistp384 ")
    rc = run_cli(app, ["add-worker", str(tmp_path / "run"), str(pub), "--name", "box1"], prog="soma-coord")
    assert rc == 0 and "box1" in capsys.readouterr().out
    rows = workers.load(RunDir(tmp_path / "run"))
    assert [(w.name, w.public_key) for w in rows] == [("box1", read_public_key(pub))]
    assert run_cli(app, ["workers", str(tmp_path / "run"), "--json"], prog="soma-coord") == 0
    assert '"box1"' in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,fragments",
    [
        (["add-worker", "{run}", "{pub}"], ["already registered", "'box1'"]),
        (["add-worker", "{run}", "{other}", "--name", "box1"], ["--name 'box1'", "another key"]),
        (["add-worker", "{run}", "{ca}"], ["ca.pem", "not an OpenSSH public key"]),
        (["start", "--run", "{run}", "--auth"], ["--auth needs --tls"]),
    ],
)
def test_worker_key_bad_input_one_line_exit_2(argv, fragments, tmp_path, capsys):
    from soma_edge.wire.certs import make_worker_key

    _, pub = make_worker_key(tmp_path / "k")
    _, other = make_worker_key(tmp_path / "k2")
    ca = make_certs(tmp_path / "tls", ["127.0.0.1"]).ca
    assert run_cli(app, ["add-worker", str(tmp_path / "run"), str(pub), "--name", "box1"], prog="soma-coord") == 0
    capsys.readouterr()
    args = [a.format(run=tmp_path / "run", pub=pub, other=other, ca=ca) for a in argv]
    rc = run_cli(app, args, prog="soma-coord")
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert all(f in lines[0] for f in fragments), lines[0]


@pytest.mark.parametrize(
    "extra,fragments",
    [
        (["--auth-key", "{key}"], ["--auth-key needs --root-certificates"]),
        (
            ["--auth-key", "{ca}", "--root-certificates", "{ca}"],
            ["--auth-key", "not an unencrypted OpenSSH private key"],
        ),
    ],
)
def test_join_auth_key_bad_input(extra, fragments, tmp_path, capsys):
    from soma_edge.wire.certs import make_worker_key
    from worker.cli import app as worker_app

    key, _ = make_worker_key(tmp_path / "k")
    ca = make_certs(tmp_path / "tls", ["127.0.0.1"]).ca
    argv = ["join", "--coordinator", "127.0.0.1:9", *[a.format(key=key, ca=ca) for a in extra]]
    rc = run_cli(worker_app, argv, prog="soma-worker")
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert all(f in lines[0] for f in fragments), lines[0]


@pytest.mark.parametrize(
    "host,tls,auth,warned",
    [
        ("0.0.0.0", False, False, "without TLS (--tls) and worker authentication (--auth)"),
        ("0.0.0.0", True, False, "without worker authentication (--auth)"),
        ("0.0.0.0", True, True, None),
        ("127.0.0.1", False, False, None),
    ],
)
def test_listening_beyond_loopback_unprotected_warns(host, tls, auth, warned, tmp_path, capsys):
    from coordinator.start import Options, _warn_if_open

    t = TLS(tmp_path / "ca.pem", tmp_path / "s.pem", tmp_path / "s.key") if tls else None
    _warn_if_open(Options(run=tmp_path, host=host, tls=t, auth=auth))
    err = capsys.readouterr().err
    assert (warned in err and err.startswith("warning: ")) if warned else err == ""


def test_a_run_is_live_for_add_worker_from_its_superlinks_start(tmp_path):
    """add-worker registers a key with the SuperLink as soon as `start` launched it (a process named
    flower-superlink working in RUN/flwr), not only once the ServerApp holds the run."""
    run = RunDir(tmp_path / "run")
    run.flwr_home.mkdir(parents=True)
    (run.flwr_home / "config.toml").write_text("")
    assert not workers_mod.live(run)
    fake = subprocess.Popen(["bash", "-c", "exec -a flower-superlink sleep 60"], cwd=run.flwr_home)
    try:
        # Wait for the exec: bash's own command line names flower-superlink too, and while it turns into
        # `sleep` its /proc entry reads empty for a moment (a busy box once caught the test in between).
        cmdline, deadline = Path(f"/proc/{fake.pid}/cmdline"), time.monotonic() + 10
        while not cmdline.read_bytes().startswith(b"flower-superlink\0") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert workers_mod.live(run)
        assert not launcher.superlink_running(tmp_path)  # another folder's: not this run's
    finally:
        fake.kill()
        fake.wait()
    assert not workers_mod.live(run)
