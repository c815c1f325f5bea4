"""`soma-worker`: serve as a federation worker, or train one expert locally."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import typer

from soma_edge import checkpoint, devices
from soma_edge import config as config_mod
from soma_edge.cli import entry, log_level, make_app, path_argument, path_option
from soma_edge.config import MAX_SEED
from soma_edge.corpus import documents, sources
from soma_edge.engine import evaluator as evaluators
from soma_edge.engine import runtime
from soma_edge.engine.evaluator import evaluator_for, mean_loss
from soma_edge.errors import CheckpointError, ConfigError
from soma_edge.expert import params
from soma_edge.processes.launch import flower_env, free_port
from soma_edge.spsa import recipe as recipe_mod
from soma_edge.spsa.optim import OptState, State, plateau
from soma_edge.wire import protocol
from soma_edge.wire.certs import check_private_key, fingerprint, make_worker_key, read_public_key
from soma_edge.wire.protocol import weights_sha256
from worker import doctor, join, probe
from worker.trainer import train as train_loop

app = make_app("soma-edge worker: forward-only SPSA training of LSTM experts on ONNX Runtime.")


@app.command("train")
def train_cmd(
    config: Optional[Path] = path_option(None, help="TOML config ([model], [spsa], [data], seed, device, threads)."),
    steps: int = typer.Option(200, min=1, help="SPSA steps to run."),
    seed: Optional[int] = typer.Option(None, min=0, max=MAX_SEED, help="Override the config's seed."),
    device: Optional[str] = typer.Option(None, help="auto | cpu | cuda[:i] | an ORT execution provider."),
    threads: Optional[int] = typer.Option(
        None, help="ORT intra-op threads (0 = choose: cores / parallel on a CPU, ORT's choice on a GPU)."
    ),
    out: Optional[Path] = path_option(
        None, help="Write the trained weights and optimizer state here (checksummed msgpack)."
    ),
    resume: Optional[Path] = path_option(
        None, help="Continue from a checkpoint that --out wrote (weights, step, optimizer state)."
    ),
    eval_windows: int = typer.Option(128, min=1, help="Held-out windows for the before/after loss."),
    check_steps: int = typer.Option(100, min=1, help="Steps between val checks of the plateau rule (spsa.plateau)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a summary."),
) -> None:
    """Train one expert on the default corpus on this box, and report held-out nats/byte before and after."""
    cfg = config_mod.load(config) if config else config_mod.Config()
    if config and "federation" in config_mod.tables(config):
        print(
            f"warning: {config}: [federation] is read by `soma-coord start`, not by `soma-worker train`; ignored",
            file=sys.stderr,
            flush=True,
        )
    if seed is not None:
        cfg.seed = seed
    if device is not None:
        cfg.device = device
    if threads is not None:
        cfg.threads = threads
    config_mod.validate(cfg)
    runtime.check_device(cfg.device)  # one error line now, not after the corpus loads
    if out is not None and (out.is_dir() or not out.parent.is_dir()):
        raise CheckpointError(f"--out {out}: must be a file path in an existing folder")
    state = _resume(resume, cfg) if resume else State(params.init(cfg.model, cfg.seed))

    splits = documents.by_split(sources.default_documents())
    train_data, test_data = documents.to_stream(splits["train"]), documents.to_stream(splits["test"])
    xt, yt = documents.eval_windows(test_data, cfg.data.seq_len, eval_windows)
    xv, yv = documents.eval_windows(documents.to_stream(splits["val"]), cfg.data.seq_len, eval_windows)
    evaluator = _evaluator(cfg)
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
        checkpoint.save(
            out,
            {"config": cfg.to_dict(), "step": state.step, "weights": state.weights, "opt": state.opt.to_record()},
            "expert",
        )
    summary = {
        "params": int(state.weights.size),
        "steps": done,
        "step": state.step,
        "seconds": round(seconds, 3),
        "steps_per_s": round(done / seconds, 3),
        "forward_evals_per_s": round(evals / seconds, 1),
        "providers": evaluator.providers,
        "evaluator": evaluators.evaluator_kind(evaluator).value,
        "lr_scale": state.opt.lr_scale,
        "test_nats_per_byte_before": before,
        "test_nats_per_byte_after": after,
        "unigram_nats_per_byte": documents.unigram_entropy(train_data, test_data),
        "weights_sha256": weights_sha256(state.weights),
    }
    if as_json:
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            print(f"{k:>28}: {v}")


def _evaluator(cfg):
    """The config's evaluator; with spsa.evaluator = auto on an accelerator, the faster of the loop and the
    population as measured here, as a joined worker's probe chooses (worker/probe.py)."""
    evaluator = evaluator_for(cfg)
    if evaluators.measures_auto(cfg.spsa.evaluator, evaluator.providers):
        evaluator, _ = probe.fastest(cfg, cfg.device, cfg.threads, True, cfg.parallel)
    return evaluator


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


NO_SPECULATE = typer.Option(
    False,
    "--no-speculate",
    help="Do not train experts on while their reply is in flight (the next request takes those steps "
    "when it asks for the same experts from the versions just sent).",
)
RECIPE = typer.Option(
    "auto",
    help="The probes it trains with: auto (measured for the device on an accelerator, the run's on a CPU), "
    "run, device (measure even on a CPU), or device:K (K dense directions on the whole batch each).",
)


@app.command("join")
def join_cmd(
    coordinator: str = typer.Option(..., "--coordinator", help="HOST:PORT of the coordinator's SuperLink."),
    name: Optional[str] = typer.Option(
        None, help="This worker's name in the coordinator's table (default: host name)."
    ),
    cache: Optional[Path] = path_option(
        None, help="Cache for shards, weights and the probe (default: $SOMA_CACHE/worker)."
    ),
    device: str = typer.Option("auto", help="auto | cpu | cuda[:i] | an ORT execution provider."),
    threads: int = typer.Option(
        0, min=0, help="ORT intra-op threads (0 = choose: cores / --parallel on a CPU, ORT's choice on a GPU)."
    ),
    no_spin: bool = typer.Option(False, "--no-spin", help="No ORT spin-waiting (for workers sharing cores)."),
    no_speculate: bool = NO_SPECULATE,
    parallel: int = typer.Option(
        0, min=0, max=2, help="Concurrent loss evaluations (0 = auto; 1 when workers share a box)."
    ),
    port: int = typer.Option(0, min=0, max=65535, help="Local port of the SuperNode's runtime API (0 = a free one)."),
    cache_mb: int = typer.Option(2048, min=16, help="Bound on the cache size; least recently used entries go first."),
    root_certificates: Optional[Path] = path_option(
        None,
        "--root-certificates",
        help="CA certificate (PEM) of the SuperLink: connect with TLS instead of insecure.",
    ),
    probe_seconds: float = typer.Option(1.5, min=0.05, help="How long the throughput probe measures."),
    recipe: str = RECIPE,
    auth_key: Optional[Path] = path_option(
        None,
        "--auth-key",
        help="This worker's private key (`keygen` writes worker.key), for a coordinator started with --auth.",
    ),
    patience: float = typer.Option(
        join.PATIENCE,
        min=1.0,
        help="Seconds the coordinator may not answer, before this "
        "worker joins or after, until it gives up with an error.",
    ),
    stay: bool = typer.Option(
        False, "--stay", help="When the run ends, or the coordinator goes, wait for the next run instead of exiting."
    ),
    heartbeat: str = typer.Option(
        "auto",
        help="Seconds between this worker's liveness reports to Flower (10 to "
        "1800); the coordinator notices a dead worker within twice that. auto: what the "
        "coordinator advises, 10 on a fast link, 30 on a slow one or until it has measured.",
    ),
) -> None:
    """Serve as a worker: start a Flower SuperNode whose ClientApp is the SOMA worker, until the run ends.
    With --log-level info (the default) it prints its own lines and Flower's warnings; debug adds Flower's
    per-message lines; warning or error keeps warnings and errors only."""
    host, link_port = _check_join(coordinator, heartbeat, device, root_certificates, auth_key, recipe)
    name, cache = _node_values(name, cache, device)
    join.preflight(host, link_port, root_certificates, wait=patience)
    if port == 0:
        port = free_port()
    node_config = (
        f"name='{name}' cache='{cache}' device='{device}' threads={threads} spin={0 if no_spin else 1} parallel="
        f"{parallel} cache-mb={cache_mb} probe-seconds={probe_seconds} speculate={0 if no_speculate else 1} "
        f"recipe='{recipe}'"
    )
    cmd = _supernode_cmd(heartbeat, cache, coordinator, port, node_config, root_certificates, auth_key)
    env = flower_env(cache / "flwr", SOMA_BLOCK_TORCH="1")
    marker = join.accepted_marker(cache, auth_key, coordinator) if auth_key else None
    j = join.Join(
        name=name,
        host=host,
        port=link_port,
        cmd=cmd,
        env=env,
        patience=patience,
        marker=marker,
        stay=stay,
        log_level="warning" if log_level() == "error" else log_level(),
    )
    j.say(f"joining {coordinator} (device {device}, threads {threads}, cache {cache})")
    raise typer.Exit(join.serve(j))


def _node_values(name: str | None, cache: Path | None, device: str) -> tuple[str, Path]:
    """The worker's name and its cache folder (made here), as they go into the SuperNode's node config."""
    name = name or socket.gethostname()
    cache = (cache or sources.cache_dir() / "worker").resolve()
    for what, v in (("--name", name), ("--cache", str(cache)), ("--device", device)):
        if "'" in v or "\\" in v:  # the node config is a string of key='value' pairs
            raise ConfigError(f"{what} {v!r}: must not contain quotes or backslashes")
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--cache {cache}: cannot create ({e.strerror or e})") from None
    return name, cache


def _check_join(
    coordinator: str,
    heartbeat: str,
    device: str,
    root_certificates: Path | None,
    auth_key: Path | None,
    recipe: str = "auto",
) -> tuple[str, int]:
    """join's options that can be checked before anything starts; returns the coordinator's host and port."""
    try:
        recipe_mod.parse(recipe)
    except ValueError as e:
        raise ConfigError(f"--recipe {e}") from None
    host, sep, port_s = coordinator.rpartition(":")
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ConfigError(f"--coordinator {coordinator!r}: expected HOST:PORT, for example 10.0.0.5:9092")
    lo, hi = protocol.HEARTBEAT_MIN, protocol.HEARTBEAT_MAX
    if heartbeat != "auto" and not (heartbeat.replace(".", "", 1).isdigit() and lo <= float(heartbeat) <= hi):
        raise ConfigError(f"--heartbeat {heartbeat!r}: expected auto, or seconds from {lo:g} to {hi:g}")
    try:
        devices.parse(device)
    except ConfigError as e:
        raise ConfigError(f"--device: {e}") from None
    runtime.check_device(device)  # here, not in the ClientApp of a SuperNode already connected
    if root_certificates is not None and not root_certificates.is_file():
        raise ConfigError(f"--root-certificates {root_certificates}: no such file")
    if auth_key is not None:
        if root_certificates is None:
            raise ConfigError("--auth-key needs --root-certificates: Flower authenticates workers over TLS only")
        check_private_key(auth_key)
    return host, int(port_s)


def _supernode_cmd(
    heartbeat: str,
    cache: Path,
    coordinator: str,
    port: int,
    node_config: str,
    root_certificates: Path | None,
    auth_key: Path | None,
) -> list[str]:
    """The SuperNode's command line: `worker.supernode` (Flower's, with our heartbeat) for this worker."""
    cmd = [
        sys.executable,
        "-m",
        "worker.supernode",
        heartbeat,
        str(cache),
        "--superlink",
        coordinator,
        "--port",
        str(port),
        "--node-config",
        node_config,
    ]
    cmd += ["--root-certificates", str(root_certificates)] if root_certificates else ["--insecure"]
    cmd += ["--auth-supernode-private-key", str(auth_key)] if auth_key else []
    return cmd


@app.command("doctor")
def doctor_cmd(
    device: str = typer.Option("auto", help="auto | cpu | cuda[:i] | an ORT execution provider: the one to check."),
    seconds: float = typer.Option(doctor.STEP_SECONDS, min=0.05, help="How long the steps/s measurement runs."),
) -> None:
    """The first command on a new box: the onnxruntime build, GPUs, CUDA libraries, where each expert graph
    runs, and steps/s for the demo expert; one line for anything missing, saying what to install."""
    doctor.report(device, seconds)


@app.command("keygen")
def keygen_cmd(
    out: Path = path_argument(..., help="Folder to write worker.key (private) and worker.pub into."),
    force: bool = typer.Option(False, help="Replace a key pair already in OUT."),
) -> None:
    """This worker's key pair: give worker.pub to the coordinator (`soma-coord add-worker RUN worker.pub`)."""
    key, pub = make_worker_key(out, force=force)
    print(
        f"wrote {key} (keep it here: soma-worker join --auth-key {key}) and {pub} (key "
        f"{fingerprint(read_public_key(pub))}: soma-coord add-worker RUN {pub.name})"
    )


main = entry(app, "soma-worker")

if __name__ == "__main__":
    main()
