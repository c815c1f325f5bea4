"""`soma-worker`: serve as a federation worker, or train one expert locally."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import numpy as np
import typer

from soma_edge import checkpoint, corpus, params
from soma_edge import config as config_mod
from soma_edge.cli import entry, make_app
from soma_edge.config import MAX_SEED
from soma_edge.errors import CheckpointError, ConfigError, LinkError
from soma_edge.procs import die_with_parent, flower_bin, flower_env, free_port
from soma_edge.protocol import weights_sha256
from soma_edge.runtime import evaluator_for, mean_loss
from soma_edge.spsa import OptState, State, plateau
from worker.trainer import train as train_loop

# How long the coordinator may not answer before `join` gives up (Flower itself would retry forever).
PATIENCE = 20.0

app = make_app("soma-edge worker: forward-only SPSA training of LSTM experts on ONNX Runtime.")


@app.callback()
def _root() -> None:
    """soma-edge worker."""


@app.command("train")
def train_cmd(
    config: Optional[Path] = typer.Option(None, help="TOML config ([model], [spsa], [data], seed, device, threads)."),
    steps: int = typer.Option(200, min=1, help="SPSA steps to run."),
    seed: Optional[int] = typer.Option(None, min=0, max=MAX_SEED, help="Override the config's seed."),
    device: Optional[str] = typer.Option(None, help="auto | cpu | cuda[:i] | an ORT execution provider."),
    threads: Optional[int] = typer.Option(None, help="ORT intra-op threads (0 = ORT decides)."),
    out: Optional[Path] = typer.Option(None, help="Write the trained weights and optimizer state here (checksummed msgpack)."),
    resume: Optional[Path] = typer.Option(None, help="Continue from a checkpoint that --out wrote (weights, step, optimizer state)."),
    eval_windows: int = typer.Option(128, min=1, help="Held-out windows for the before/after loss."),
    check_steps: int = typer.Option(100, min=1, help="Steps between val checks of the plateau rule (spsa.plateau)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a summary."),
) -> None:
    """Train one expert on the default corpus on this box, and report held-out nats/byte before and after."""
    cfg = config_mod.load(config) if config else config_mod.Config()
    if seed is not None:
        cfg.seed = seed
    if device is not None:
        cfg.device = device
    if threads is not None:
        cfg.threads = threads
    config_mod.validate(cfg)
    if out is not None and (out.is_dir() or not out.parent.is_dir()):
        raise CheckpointError(f"--out {out}: must be a file path in an existing folder")
    state = _resume(resume, cfg) if resume else State(params.init(cfg.model, cfg.seed))

    splits = corpus.by_split(corpus.default_documents())
    train_data, test_data = corpus.to_stream(splits["train"]), corpus.to_stream(splits["test"])
    xt, yt = corpus.eval_windows(test_data, cfg.data.seq_len, eval_windows)
    xv, yv = corpus.eval_windows(corpus.to_stream(splits["val"]), cfg.data.seq_len, eval_windows)
    evaluator = evaluator_for(cfg)
    before = mean_loss(evaluator, state.weights, xt, yt)
    t0, done, evals = time.perf_counter(), 0, 0
    while done < steps:
        # The plateau rule looks at the val loss between chunks, as the coordinator does between rounds.
        chunk = min(steps - done, check_steps) if cfg.spsa.plateau else steps - done
        rep = train_loop(state, train_data, cfg, evaluator, steps=chunk)
        done, evals = done + rep.steps, evals + rep.forward_evals
        if cfg.spsa.plateau:
            plateau(cfg.spsa, state.opt, mean_loss(evaluator, state.weights, xv, yv), state.step)
    seconds = time.perf_counter() - t0
    after = mean_loss(evaluator, state.weights, xt, yt)
    if out is not None:
        checkpoint.save(out, {"config": cfg.to_dict(), "step": state.step, "weights": state.weights,
                              "opt": state.opt.to_record()}, "expert")  # fmt: skip
    summary = {
        "params": int(state.weights.size),
        "steps": done,
        "step": state.step,
        "seconds": round(seconds, 3),
        "steps_per_s": round(done / seconds, 3),
        "forward_evals_per_s": round(evals / seconds, 1),
        "providers": evaluator.providers,
        "lr_scale": state.opt.lr_scale,
        "test_nats_per_byte_before": before,
        "test_nats_per_byte_after": after,
        "unigram_nats_per_byte": corpus.unigram_entropy(train_data, test_data),
        "weights_sha256": weights_sha256(state.weights),
    }
    if as_json:
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            print(f"{k:>28}: {v}")


def _resume(path: Path, cfg: config_mod.Config) -> State:
    """The state a `train --out` checkpoint holds, checked against this config's model."""
    body = checkpoint.load(path, "expert")
    size = params.count(cfg.model)
    w = body.get("weights") if isinstance(body, dict) else None
    if not isinstance(w, np.ndarray) or w.dtype != np.float32 or w.shape != (size,):
        got = f"{w.dtype}{list(w.shape)}" if isinstance(w, np.ndarray) else type(w).__name__
        raise CheckpointError(f"--resume {path}: weights are {got}, this config's model needs float32[{size}]")
    if not np.isfinite(w).all():
        raise CheckpointError(f"--resume {path}: weights contain NaN or infinity")
    step = body.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"--resume {path}: step {step!r} is not a step count")
    opt = OptState.from_record(body.get("opt"), size, f"--resume {path}: optimizer state")
    return State(np.array(w), step=step, opt=opt)


@app.command("join")
def join_cmd(
    coordinator: str = typer.Option(..., "--coordinator", help="HOST:PORT of the coordinator's SuperLink."),
    name: Optional[str] = typer.Option(None, help="This worker's name in the coordinator's table (default: host name)."),
    cache: Optional[Path] = typer.Option(None, help="Cache for shards, weights and the probe (default: $SOMA_CACHE/worker)."),
    device: str = typer.Option("auto", help="auto | cpu | cuda[:i] | an ORT execution provider."),
    threads: int = typer.Option(0, min=0, help="ORT intra-op threads (0 = ORT decides; 1 when workers share a box)."),
    no_spin: bool = typer.Option(False, "--no-spin", help="No ORT spin-waiting (for workers sharing cores)."),
    parallel: int = typer.Option(0, min=0, max=2, help="Concurrent loss evaluations (0 = auto; 1 when workers share a box)."),
    port: int = typer.Option(0, min=0, max=65535, help="Local port of the SuperNode's runtime API (0 = a free one)."),
    cache_mb: int = typer.Option(2048, min=16, help="Bound on the cache size; least recently used entries go first."),
    root_certificates: Optional[Path] = typer.Option(
        None, "--root-certificates", help="CA certificate (PEM) of the SuperLink: connect with TLS instead of insecure."
    ),
    probe_seconds: float = typer.Option(1.5, min=0.05, help="How long the throughput probe measures."),
    auth_key: Optional[Path] = typer.Option(None, "--auth-key", help="This worker's private key (`keygen` writes "
                                            "worker.key), for a coordinator started with --auth."),
    patience: float = typer.Option(PATIENCE, min=1.0, help="Seconds the coordinator may not answer, before this "
                                   "worker joins or after, until it gives up with an error."),
) -> None:
    """Serve as a worker: start a Flower SuperNode whose ClientApp is the SOMA worker, until stopped."""
    import signal
    import socket

    from soma_edge.runtime import parse_device

    host, sep, port_s = coordinator.rpartition(":")
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ConfigError(f"--coordinator {coordinator!r}: expected HOST:PORT, for example 10.0.0.5:9092")
    try:
        parse_device(device)
    except ConfigError as e:
        raise ConfigError(f"--device: {e}") from None
    if root_certificates is not None and not root_certificates.is_file():
        raise ConfigError(f"--root-certificates {root_certificates}: no such file")
    if auth_key is not None:
        from soma_edge.certs import check_private_key

        if root_certificates is None:
            raise ConfigError("--auth-key needs --root-certificates: Flower authenticates workers over TLS only")
        check_private_key(auth_key)
    name = name or socket.gethostname()
    cache = (cache or corpus.cache_dir() / "worker").resolve()
    for what, v in (("--name", name), ("--cache", str(cache)), ("--device", device)):
        if "'" in v or "\\" in v:
            raise ConfigError(f"{what} {v!r}: must not contain quotes or backslashes")
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--cache {cache}: cannot create ({e.strerror or e})") from None
    preflight(host, int(port_s), root_certificates, wait=patience)
    if port == 0:
        port = free_port()
    node_config = (f"name='{name}' cache='{cache}' device='{device}' threads={threads} spin={0 if no_spin else 1} "
                   f"parallel={parallel} cache-mb={cache_mb} probe-seconds={probe_seconds}")  # fmt: skip
    cmd = [flower_bin("flower-supernode"), "--superlink", coordinator, "--port", str(port),
           "--node-config", node_config]  # fmt: skip
    cmd += ["--root-certificates", str(root_certificates)] if root_certificates else ["--insecure"]
    cmd += ["--auth-supernode-private-key", str(auth_key.resolve())] if auth_key else []
    env = flower_env(cache / "flwr", SOMA_BLOCK_TORCH="1")
    print(f"soma-worker {name}: joining {coordinator} (device {device}, threads {threads}, cache {cache})", flush=True)
    marker = _accepted_marker(cache, auth_key, coordinator) if auth_key else None
    first_refusal = None
    while True:
        code, relay = _serve(cmd, env, host, int(port_s), patience, marker)
        if code == 0 or not relay.refused:
            break
        # Flower refuses a key that it still sees online, for up to two 30 s heartbeats after a session
        # that ended without signing off (a crash, kill -9): when this key was accepted here before, wait.
        first_refusal = first_refusal or time.monotonic()
        if marker is None or not marker.exists() or time.monotonic() - first_refusal > REJOIN_SECONDS:
            raise ConfigError(f"the coordinator at {coordinator} refused this worker's key: register its public key "
                              "there (`soma-coord add-worker RUN worker.pub`), or check --auth-key")  # fmt: skip
        if relay.stopped:
            break
        print(f"soma-worker {name}: the coordinator still holds this worker's previous session (Flower frees it "
              f"within 60 s); joining again", flush=True)  # fmt: skip
        time.sleep(5.0)
    raise typer.Exit(0 if code in (0, -signal.SIGTERM, -signal.SIGINT) else code)


REJOIN_SECONDS = 75.0  # Flower's two 30 s heartbeats of patience, plus slack


def _accepted_marker(cache: Path, key: Path, coordinator: str) -> Path:
    """A file that says this key was once accepted by this coordinator (so a refusal may be a stale session)."""
    import hashlib

    tag = hashlib.sha256(key.resolve().read_bytes() + coordinator.encode()).hexdigest()[:16]
    return cache / "accepted" / tag


def _serve(cmd: list[str], env: dict[str, str], host: str, port: int, patience: float,
           marker: Path | None) -> tuple[int, "_Relay"]:  # fmt: skip
    """Run one SuperNode until it exits; its exit code and what its output said."""
    import signal
    import subprocess

    try:
        # Its own session: a Ctrl-C or a group kill reaches `join` alone, which passes it on once. Flower
        # signs the node off on the first signal but dies at once on a second, and a node that did not sign
        # off is refused for up to a minute when it joins again.
        proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    except OSError as e:
        raise ConfigError(f"cannot start flower-supernode ({e.strerror}): is flwr installed in this environment?") from None
    relay = _Relay(proc, marker)

    def forward(sig, _frame):
        relay.stopped = True
        if proc.poll() is None:
            proc.send_signal(sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        return supervise(proc, host, port, gone_after=patience), relay
    finally:
        relay.join()


class _Relay:
    """Copies the SuperNode's output to ours, line by line, noting Flower's "unknown key" exit (its process
    exit status is 1 for every error; the code is only in the message) and the first sign that the
    coordinator accepted the node (our ClientApp's own log line), which it records in `marker`."""

    REFUSED = b"Exit Code: 305"
    ACCEPTED = b"soma.worker INFO"

    def __init__(self, proc, marker: Path | None = None) -> None:
        import threading

        self.refused = self.stopped = False
        self._marker = marker
        self._thread = threading.Thread(target=self._run, args=(proc.stdout,), daemon=True)
        self._thread.start()

    def _run(self, stream) -> None:
        import sys

        for line in iter(stream.readline, b""):
            self.refused |= self.REFUSED in line
            if self._marker is not None and self.ACCEPTED in line:
                self._marker.parent.mkdir(parents=True, exist_ok=True)
                self._marker.touch()
                self._marker = None
            sys.stdout.buffer.write(line)
            sys.stdout.flush()

    def join(self) -> None:
        self._thread.join(timeout=5)


CHECK_SECONDS = 2.0
CONNECT_SECONDS = 5.0
# A connect that only times out may be a saturated slow link (its queue can hold seconds of data), not a
# coordinator gone: that verdict waits this much longer than for a refused or unreachable port.
SLOW_LINK_SECONDS = 120.0


def supervise(proc, host: str, port: int, gone_after: float = PATIENCE) -> int:
    """Wait for the SuperNode to exit, checking that the coordinator's port still answers. When it has
    refused us (or been unreachable) for `gone_after` seconds, or not answered at all for
    max(gone_after, SLOW_LINK_SECONDS), stop the SuperNode and raise LinkError: one line instead of
    Flower's endless "Connection attempt failed, retrying"."""
    import socket
    import subprocess

    last_seen = last_answer = time.monotonic()
    while True:
        try:
            return proc.wait(CHECK_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        try:
            socket.create_connection((host, port), timeout=CONNECT_SECONDS).close()
            last_seen = last_answer = time.monotonic()
        except (ConnectionRefusedError, ConnectionResetError):
            last_answer = time.monotonic()  # the box answered: nothing listens there any more
        except OSError:
            pass  # a timeout, or the network is unreachable: maybe only slow
        now = time.monotonic()
        if now - last_seen >= max(gone_after, SLOW_LINK_SECONDS) or (now - last_seen >= gone_after and last_answer > last_seen):
            break
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    raise LinkError(f"the coordinator at {host}:{port} is gone: no answer for {now - last_seen:.0f} s (it stopped, "
                    "or the network to it is down); start this worker again once it is back")  # fmt: skip


def preflight(host: str, port: int, ca: Optional[Path], wait: float = PATIENCE) -> None:
    """Tell the common failures apart before Flower would retry them forever with one generic line: the
    coordinator unreachable (after `wait` seconds of trying, so workers may start first), TLS on one side
    only, or a certificate that the given CA does not sign."""
    import socket
    import ssl

    deadline = time.monotonic() + wait
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5)
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConfigError(f"--coordinator {host}:{port}: unreachable for {wait:.0f} s ({e.strerror or e}); is "
                                  "`soma-coord start` running there, and the port open to this box?") from None  # fmt: skip
            time.sleep(1.0)
    if ca:
        ctx = ssl.create_default_context(cafile=str(ca))
    else:  # only to learn whether the other side speaks TLS at all
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        with ctx.wrap_socket(sock, server_hostname=host):
            speaks_tls = True
    except ssl.SSLCertVerificationError as e:
        raise ConfigError(f"TLS: the coordinator's certificate does not verify with --root-certificates {ca} "
                          f"({e.verify_message}); use the ca.pem that `soma-coord certs` wrote for it, with a "
                          f"--host that names {host}") from None  # fmt: skip
    except (ssl.SSLError, OSError):
        speaks_tls = False
    finally:
        sock.close()
    if ca and not speaks_tls:
        raise ConfigError(f"TLS: the coordinator at {host}:{port} does not speak TLS; drop --root-certificates, "
                          "or start it with --tls")  # fmt: skip
    if not ca and speaks_tls:
        raise ConfigError(f"TLS: the coordinator at {host}:{port} uses TLS; pass --root-certificates ca.pem (the "
                          "CA that `soma-coord certs` wrote)")  # fmt: skip


@app.command("keygen")
def keygen_cmd(
    out: Path = typer.Argument(..., help="Folder to write worker.key (private) and worker.pub into."),
    force: bool = typer.Option(False, help="Replace a key pair already in OUT."),
) -> None:
    """This worker's key pair: give worker.pub to the coordinator (`soma-coord add-worker RUN worker.pub`)."""
    from soma_edge.certs import fingerprint, make_worker_key, read_public_key

    key, pub = make_worker_key(out, force=force)
    print(f"wrote {key} (keep it here: soma-worker join --auth-key {key}) and {pub} (key "
          f"{fingerprint(read_public_key(pub))}: soma-coord add-worker RUN {pub.name})")


main = entry(app, "soma-worker")

if __name__ == "__main__":
    main()
