"""Real federations on 127.0.0.1 for the e2e tests: `soma-coord start` (a real flower-superlink, real
SuperNodes, Flower's ServerApp and ClientApp processes) started, waited for and looked into.

`fed` is a dict: root (cwd and start.log), run (the run directory), corpus, config (a TOML file) and env
(the environment of every process, with SOMA_CACHE under root: nothing of the user's cache is touched)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from soma_edge import checkpoint
from soma_edge.corpus import documents
from soma_edge.engine.evaluator import LossEvaluator, mean_loss
from soma_edge.processes.pids import pid_alive
from soma_edge.rundir.layout import RunDir
from soma_edge.wire import protocol
from tests.helpers.corpus import write_stdlib_corpus

START_TIMEOUT = 240


def start_coordinator(fed, *extra: str, relative: bool = False) -> subprocess.Popen:
    """`soma-coord start` in fed["root"]; `relative`: --run, --config and --corpus as paths from there."""
    where = (lambda p: os.path.relpath(p, fed["root"])) if relative else str
    cmd = [
        sys.executable,
        "-m",
        "coordinator",
        "start",
        "--run",
        where(fed["run"]),
        "--config",
        where(fed["config"]),
        "--corpus",
        where(fed["corpus"]),
        "--port",
        "0",
        *extra,
    ]
    log = open(fed["root"] / "start.log", "ab")
    # SIGINT back to its default: a test run started from a background job inherits it ignored, and then
    # the Ctrl-C test would see a coordinator that cannot be interrupted.
    return subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=fed["env"],
        cwd=fed["root"],
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def finish(fed, proc: subprocess.Popen) -> None:
    try:
        code = proc.wait(START_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"start did not finish within {START_TIMEOUT} s" + log_tails(fed)) from None
    assert code == 0, f"start exited {code}" + log_tails(fed, 3000)


def wait_until(cond, timeout: float, what: str, fed=None) -> None:
    """Poll `cond` until it holds; on a timeout with `fed`, the message carries the tails of the run's logs
    (a hang seen once in a whole-suite run left nothing else to go on)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}" + (log_tails(fed) if fed else ""))


def log_tails(fed, chars: int = 1500) -> str:
    logs = [fed["root"] / "start.log", *sorted((fed["run"] / "logs").glob("*.log"))]
    return "".join(f"\n--- {p.name} (end) ---\n{p.read_text(errors='replace')[-chars:]}" for p in logs if p.exists())


def val_loss(rd: RunDir, expert: int, version: int) -> float:
    """Expert `expert`'s val loss at `version`, recomputed here from its checkpoint on its val shards (all
    experts' where its own are too small to measure)."""
    cfg = rd.load_config()
    body = checkpoint.load(rd.root / f"experts/{expert}/v{version}.msgpack", "expert")
    prep = rd.read_prepare()
    data = b"".join(rd.shard(h) for h in prep.shards(expert, "val"))
    if len(data) < 2000:
        experts = range(cfg.federation.experts)
        data = documents.SEPARATOR.join(rd.shard(h) for e in experts for h in prep.shards(e, "val"))
    x, y = documents.eval_windows(np.frombuffer(data, dtype=np.uint8), cfg.data.seq_len, 64)
    ev = LossEvaluator(cfg.model, "cpu", 1)
    return mean_loss(ev, protocol.decode_weights(body["weights"]), x, y)


def metric_lines(rd: RunDir, kind: str) -> list[dict]:
    return [m for m in rd.read_metrics() if m["type"] == kind]


def leftovers(run: Path) -> list[str]:
    """Processes of this run still alive: anything whose command line names RUN or that runs inside it
    (the SuperLink and the ServerApp run in RUN/flwr; workers name their cache under RUN)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if pid_alive(int(pid)) and (str(run) in cmd or cwd.startswith(str(run))):
            out.append(f"{pid} {cmd[:120]}")
    return out


def cli(root: Path, env: dict, *argv: str) -> subprocess.CompletedProcess:
    """`python -m ARGV...` in `root`, its output captured."""
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, env=env, cwd=root, timeout=120)


def secure_federation(
    tmp_path: Path, config: str, *workers: str, hold: bool = True
) -> tuple[dict, subprocess.Popen, str]:
    """A run over TLS with --auth on 127.0.0.1: certificates, key pairs for `workers` (not yet trusted),
    `soma-coord start --tls --auth` that has registered its keys and, with `hold`, whose ServerApp holds
    the run; (fed, start, port). Every
    command runs in tmp_path and names its files relative to it, as the README's secure setup does (the
    SuperLink runs in RUN/flwr, the worker's SuperNode in another process)."""
    src = write_stdlib_corpus(tmp_path / "corpus")
    (tmp_path / "fed.toml").write_text(config)
    env = dict(os.environ, SOMA_CACHE=str(tmp_path / "cache"))
    fed = {"root": tmp_path, "run": tmp_path / "run", "corpus": src, "config": tmp_path / "fed.toml", "env": env}
    for argv in [("coordinator", "certs", "tls/", "--host", "127.0.0.1")] + [
        ("worker.cli", "keygen", w) for w in workers
    ]:
        r = cli(tmp_path, env, *argv)
        assert r.returncode == 0, r.stderr
    proc = start_coordinator(fed, "--tls", "tls/", "--auth", relative=True)
    log = tmp_path / "start.log"

    def registered() -> bool:
        return "registered" in log.read_text(errors="replace")

    wait_until(lambda: registered() or proc.poll() is not None, START_TIMEOUT, "the local workers' keys", fed)
    assert registered(), f"start exited {proc.poll()}" + log_tails(fed)
    port = re.search(r"SuperLink listening on 127\.0\.0\.1:(\d+)", log.read_text()).group(1)
    if hold:
        wait_until(lambda: RunDir(fed["run"]).is_locked(), START_TIMEOUT, "the ServerApp to hold the run", fed)
    return fed, proc, port


def secure_join(port: str, name: str) -> list[str]:
    """`soma-worker join` for worker `name` of a `secure_federation`, to run in its tmp_path: its key in
    NAME/, the CA in tls/, its cache in NAME-cache/, all relative."""
    return [
        sys.executable,
        "-m",
        "worker.cli",
        "join",
        "--coordinator",
        f"127.0.0.1:{port}",
        "--name",
        name,
        "--root-certificates",
        "tls/ca.pem",
        "--auth-key",
        f"{name}/worker.key",
        "--cache",
        f"{name}-cache",
        "--threads",
        "1",
        "--no-spin",
        "--parallel",
        "1",
    ]
