"""Processes `soma-coord start` owns: an embedded `flower-superlink`, local `soma-worker join` SuperNodes,
and the `flwr run` submission of the SOMA app.

Every child runs in its own process group (so stopping it also stops what it spawned, like the
ClientApp processes of a SuperNode) and gets SIGTERM from the kernel if `start` dies, even by kill -9
(PR_SET_PDEATHSIG). Flower's own children watch their parent's pid and exit after it. Each child logs
to RUN/logs/<name>.log.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

from soma_edge.checkpoint import atomic_write
from soma_edge.errors import SomaError
from soma_edge.processes.launch import flower_bin, flower_env, session_child

APP_DIR = Path(__file__).resolve().parent / "flower_app"
CONNECTION = "soma"
LOCAL_WORKER_NICE = 5  # `start --local-workers` runs its workers at this niceness (coordinator first)


@dataclass
class TLS:
    """Certificate files passed through to Flower. Server side: ca/cert/key; client side: ca only."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    @property
    def enabled(self) -> bool:
        return self.ca is not None

    def check(self, server: bool) -> None:
        need = {"ca": self.ca, "cert": self.cert, "key": self.key} if server else {"ca": self.ca}
        given = [k for k, v in need.items() if v is not None]
        if given and len(given) != len(need):
            raise SomaError(f"TLS needs all of --ssl-{', --ssl-'.join(need)} (got only --ssl-{', --ssl-'.join(given)})")
        for k, v in need.items():
            if v is not None and not Path(v).is_file():
                raise SomaError(f"--ssl-{k} {v}: no such file")


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def superlink_running(flwr_home: Path) -> bool:
    """Whether a SuperLink that a `start` of this run launched is alive: a flower-superlink process working
    in the run's Flower home (where `Launcher.superlink` starts it). Linux's /proc; elsewhere False."""
    want = str(flwr_home.resolve())
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not pid.isdigit():
            continue
        try:
            if (
                os.readlink(f"/proc/{pid}/cwd") == want
                and b"flower-superlink" in Path(f"/proc/{pid}/cmdline").read_bytes()
            ):
                return True
        except OSError:  # gone meanwhile, or another user's
            continue
    return False


def wait_port(host: str, port: int, timeout: float, proc: "Proc | None" = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_open(host, port):
            return
        if proc is not None and proc.popen.poll() is not None:
            raise SomaError(f"{proc.name} exited with code {proc.popen.returncode}; see {proc.log}")
        time.sleep(0.2)
    raise SomaError(f"nothing listens on {host}:{port} after {timeout:.0f} s" + (f"; see {proc.log}" if proc else ""))


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the whole process group, then SIGKILL whatever is left after `timeout`."""
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.popen.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.popen.wait(wait)
                # the leader is gone; make sure nothing of its group lingers
                os.killpg(self.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                return
            except subprocess.TimeoutExpired:
                continue
            return


def spawn(name: str, cmd: list[str], log: Path, env: dict[str, str], cwd: Path | None = None) -> Proc:
    log.parent.mkdir(parents=True, exist_ok=True)
    f = open(log, "ab")  # children append; a restart keeps earlier logs
    f.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
    f.flush()
    try:
        p = subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=session_child,
        )
    finally:
        f.close()
    return Proc(name=name, popen=p, log=log)


@dataclass
class Launcher:
    """Starts and (always) stops the processes of one `soma-coord start`."""

    logs: Path
    flwr_home: Path
    procs: list[Proc] = field(default_factory=list)

    def superlink(self, host: str, port: int, tls: TLS | None = None, auth: bool = False) -> Proc:
        if port_open("127.0.0.1" if host in ("0.0.0.0", "") else host, port):
            raise SomaError(f"port {port} is already in use on {host}: pick another with --port")
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        cmd = [
            flower_bin("flower-superlink"),
            "--host",
            host,
            "--port",
            str(port),
            "--disable-runtime-dependency-installation",
        ]
        cmd += _tls_server_args(tls)
        cmd += ["--enable-supernode-auth"] if auth else []  # only registered SuperNode keys may connect
        p = spawn("superlink", cmd, self.logs / "superlink.log", flower_env(self.flwr_home), cwd=self.flwr_home)
        self.procs.append(p)
        wait_port("127.0.0.1" if host in ("0.0.0.0", "") else host, port, 60, p)
        return p

    def worker(
        self,
        name: str,
        coordinator: str,
        cache: Path,
        threads: int,
        device: str = "cpu",
        spin: bool = False,
        parallel: int = 0,
        tls: TLS | None = None,
        auth_key: Path | None = None,
        recipe: str = "auto",
    ) -> Proc:
        cmd = [
            sys.executable,
            "-m",
            "worker.cli",
            "join",
            "--coordinator",
            coordinator,
            "--name",
            name,
            "--cache",
            str(cache),
            "--threads",
            str(threads),
            "--device",
            device,
            "--parallel",
            str(parallel),
            "--recipe",
            recipe,
        ]
        cmd += [] if spin else ["--no-spin"]
        cmd += ["--root-certificates", str(tls.ca)] if tls and tls.enabled else []
        cmd += ["--auth-key", str(auth_key)] if auth_key else []
        # A local worker yields to the coordinator beside it: where they share too few cores, the round's
        # checks (its commit) would otherwise wait behind the workers' training of the next round. Its
        # SuperNode's session keeps the niceness (processes.launch.session_child).
        cmd = ["nice", "-n", str(LOCAL_WORKER_NICE), *cmd] if shutil.which("nice") else cmd
        p = spawn(name, cmd, self.logs / f"{name}.log", flower_env(self.flwr_home))
        self.procs.append(p)
        return p

    def stop_all(self) -> None:
        for p in self.procs:  # signal everything at once, then wait for each
            try:
                os.killpg(p.popen.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()


def _tls_server_args(tls: TLS | None) -> list[str]:
    if tls is None or not tls.enabled:
        return ["--insecure"]
    return ["--ssl-ca-certfile", str(tls.ca), "--ssl-certfile", str(tls.cert), "--ssl-keyfile", str(tls.key)]


def write_connection(flwr_home: Path, address: str, tls: TLS | None = None) -> None:
    """The `flwr` CLI reads connections from $FLWR_HOME/config.toml (not from the app's pyproject)."""
    conn: dict[str, object] = {"address": address}
    if tls is not None and tls.enabled:
        conn["root-certificates"] = str(Path(tls.ca).resolve())
    else:
        conn["insecure"] = True
    cfg = {"superlink": {"default": CONNECTION, CONNECTION: conn}}
    atomic_write(flwr_home / "config.toml", tomli_w.dumps(cfg).encode())


def submit(
    flwr_home: Path,
    run_dir: Path,
    address: str,
    tls: TLS | None = None,
    app_dir: Path = APP_DIR,
    extra: dict[str, str] | None = None,
) -> str:
    """`flwr run` the SOMA app against the SuperLink at `address` (`extra`: more run-config strings, free
    of quotes and backslashes); returns Flower's run id."""
    if "'" in str(run_dir) or "\\" in str(run_dir):
        raise SomaError(f"{run_dir}: the run directory path must not contain quotes or backslashes")
    write_connection(flwr_home, address, tls)
    pairs = [f"run-dir='{run_dir}'"] + [f"{k}='{v}'" for k, v in (extra or {}).items()]
    cmd = [flower_bin("flwr"), "run", str(app_dir), CONNECTION, "--run-config", " ".join(pairs), "--format", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=flower_env(flwr_home), timeout=120)
    try:
        out = json.loads(r.stdout[r.stdout.index("{") :])
    except ValueError:
        out = {}
    if r.returncode != 0 or not out.get("success"):
        detail = (out.get("error-message") or r.stderr.strip() or r.stdout.strip()).splitlines()[-3:]
        raise SomaError(f"`flwr run` against {address} failed: {' '.join(detail)}")
    return str(out["run-id"])


def run_status(flwr_home: Path, run_id: str) -> str | None:
    """Flower's status string for a run ('running', 'finished:completed', 'finished:failed', ...), or None."""
    try:
        r = subprocess.run(
            [flower_bin("flwr"), "ls", CONNECTION, "--run-id", run_id, "--format", "json"],
            capture_output=True,
            text=True,
            env=flower_env(flwr_home),
            timeout=60,
        )
        out = json.loads(r.stdout[r.stdout.index("{") :])
        runs = out.get("runs") or []
        return str(runs[0].get("status")) if runs else None
    except (subprocess.SubprocessError, OSError, ValueError, KeyError, IndexError, AttributeError):
        return None
