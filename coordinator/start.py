"""`soma-coord start`: resolve the run's config, prepare if needed, launch Flower, submit, follow, clean up.

Embedded mode (no --superlink): a `flower-superlink` on this box with FLWR_HOME in RUN/flwr, plus
`--local-workers` SuperNodes (`soma-worker join`), all stopped when `start` ends or is interrupted.
External mode (--superlink HOST:PORT): only the submission, and progress read from the SuperLink;
Flower runs the ServerApp on the SuperLink's host, where RUN lives (`coordinator.remote`).

`start` is the whole sequence, top to bottom; `coordinator.runconfig` (the config and the prepared RUN),
`coordinator.launcher` (processes) and `coordinator.remote` (the external request) are the helpers it calls.
Starting again on the same RUN resumes from its last committed round.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator import finish, launcher, records, remote, runconfig
from coordinator import workers as workers_mod
from coordinator.progress import Follower
from soma_edge import checkpoint, devices
from soma_edge.config import Config, local_worker_threads
from soma_edge.engine import runtime
from soma_edge.errors import ConfigError, SomaError
from soma_edge.processes import logs
from soma_edge.processes.launch import free_port
from soma_edge.processes.pids import pid_alive
from soma_edge.rundir import metrics
from soma_edge.rundir.layout import RunDir, RunLockedError
from soma_edge.spsa import recipe
from soma_edge.wire.certs import WORKER_KEY, WORKER_PUB, make_worker_key

STATUS_GRACE = 240.0  # seconds for the ServerApp to appear (Flower starts it, it waits for the run lock)


@dataclass
class Options:
    run: Path
    config: Path | None = None
    overrides: dict[str, Any] | None = None  # dotted keys, e.g. {"federation.rounds": 5, "seed": 1}
    superlink: str | None = None
    host: str = "127.0.0.1"
    port: int = 9092
    tls: launcher.TLS | None = None
    auth: bool = False  # only workers whose keys the run registered may join (needs tls)
    reopen: bool = False  # train the run's finished experts again (coordinator.finish)
    local_devices: list[str] | None = None  # per local worker, repeating (None: the config's `device` for all)
    local_recipes: list[str] | None = None  # per local worker, repeating: its `join --recipe` (None: auto)


def start(opts: Options) -> int:
    """The whole of `soma-coord start`: check the options, then run embedded or submit to --superlink."""
    check_options(opts)
    if opts.reopen:  # first: it edits the run's last commit, and a path with none is a mistake to say at once
        reopen_finished(RunDir(opts.run))
    if opts.superlink:
        return start_external(opts)
    run = RunDir(opts.run)
    made = first_missing(run.root)
    run.root.mkdir(parents=True, exist_ok=True)
    if run.is_locked():
        raise RunLockedError(f"{run.root} is in use by a running coordinator (pid {run.lock_holder()}); stop it first")
    try:
        cfg = runconfig.configure(run, opts.config, opts.overrides or {}, check=check_local_device)
    except BaseException:  # a config or corpus refused, an interrupted prepare: leave no empty run behind
        remove_made(run, made)
        raise
    state = run.read_state()
    if state and state.round >= cfg.federation.rounds:
        print(f"{run.root}: all {cfg.federation.rounds} rounds are done (raise --rounds to train on)")
        Follower(run).final()
        return 0

    procs = launcher.Launcher(logs=run.logs, flwr_home=run.flwr_home)
    try:
        workers = cfg.federation.local_workers
        keys = _local_worker_keys(run, workers) if opts.auth else {}
        address = _launch_superlink(procs, run, opts)
        if opts.auth:
            _register_workers(run, address, opts.tls)
        launch_workers(procs, run, opts, address, keys, workers, opts.local_devices or [cfg.device])
        t_submit = time.time()
        run_id = launcher.submit(run.flwr_home, run.root, address, opts.tls)
        checkpoint.atomic_write(
            _flwr_run_path(run), json.dumps({"run_id": run_id, "address": address, "time": t_submit}).encode()
        )
        print(f"submitted Flower run {run_id} to {address}", flush=True)
        return follow(run, procs, run_id, t_submit)
    except KeyboardInterrupt:
        print(f"\ninterrupted: stopping; resume with `soma-coord start --run {run.root}`", flush=True)
        return 130
    finally:
        procs.stop_all()


def reopen_finished(run: RunDir) -> list[int]:
    """Train a resumed run's finished experts again (`--reopen`), committed before any round runs; the experts
    reopened. A path that holds no committed run on this box is a ConfigError, and is left as it was."""
    if not (run.state_path.exists() or run.prev_state_path.exists()):
        raise ConfigError(f"--reopen: {run.root} holds no committed run on this box (nothing to reopen)")
    with run.lock(wait=5.0):
        state = run.read_state()
        opened = [e for e in state.expert_ids() if finish.reopen(state.expert(e))] if state else []
        if opened:
            run.save_state(state.to_dict())
    print(
        f"reopened {len(opened)} finished expert(s): {logs.expert_set(opened)}" if opened else "no expert is finished",
        flush=True,
    )
    return opened


def first_missing(path: Path) -> Path | None:
    """The topmost folder of `path` that does not exist yet (what mkdir(parents=True) creates), or None."""
    missing = None
    for p in (path, *path.parents):
        if p.exists():
            break
        missing = p
    return missing


def remove_made(run: RunDir, made: Path | None) -> None:
    """Undo the folders a first `start` made (`made`: `first_missing` before it), when it failed before any
    commit: a run directory that existed before, or holds a commit, is never removed."""
    if made is None or run.state_path.exists() or run.prev_state_path.exists():
        return
    shutil.rmtree(run.root, ignore_errors=True)
    for p in run.root.parents:  # the parents it made too, unless something else went into them since
        if not p.is_relative_to(made):
            break
        try:
            p.rmdir()
        except OSError:
            break


def check_options(opts: Options) -> None:
    """What the options alone can tell is wrong, before anything starts or is read."""
    if opts.tls:
        opts.tls.check(server=opts.superlink is None)
    _check_local_lists(opts)
    if not opts.superlink:
        if opts.auth and not (opts.tls and opts.tls.enabled):
            raise ConfigError("--auth needs --tls DIR: Flower authenticates workers over TLS only")
        return
    if not Path(opts.run).is_absolute():
        raise ConfigError(
            f"--run {opts.run}: with --superlink, give the absolute path of the run directory on the "
            "SuperLink's host (Flower runs the coordinator there)"
        )
    if (opts.overrides or {}).get("federation.local_workers"):
        raise ConfigError("--local-workers needs the embedded SuperLink; start workers with `soma-worker join`")
    if opts.auth:
        raise ConfigError(
            "--auth registers worker keys with the embedded SuperLink; with --superlink, register "
            "them there (`flwr supernode register KEY.pub`)"
        )


def _check_local_lists(opts: Options) -> None:
    """--local-devices and --local-recipes: each entry one a worker takes, and only for local workers."""
    if (opts.local_devices or opts.local_recipes) and opts.superlink:
        raise ConfigError(
            "--local-devices and --local-recipes are for --local-workers, which need the embedded SuperLink"
        )
    if opts.local_devices and "device" in (opts.overrides or {}):
        raise ConfigError("give --device (every local worker) or --local-devices (one each), not both")
    for d in opts.local_devices or []:
        try:
            devices.parse(d)
        except ConfigError as e:
            raise ConfigError(f"--local-devices: {e}") from None
        runtime.check_device(d)  # here: not one worker of W that dies after the run has started
    for r in opts.local_recipes or []:
        try:
            recipe.parse(r)
        except ValueError as e:
            raise ConfigError(f"--local-recipes {e}") from None


def check_local_device(cfg: Config) -> None:
    """The --local-workers' device can run here: one error line before preparing, not W workers that each die."""
    if cfg.federation.local_workers:
        runtime.check_device(cfg.device)


def start_external(opts: Options) -> int:
    """Submit to the external SuperLink, the config along, and follow the run there until it finishes."""
    request = remote.encode_request(remote.read_config_text(opts.config), opts.overrides or {})
    home = remote.flwr_home()
    run_id = launcher.submit(home, Path(opts.run), opts.superlink, opts.tls, extra={remote.START_KEY: request})
    print(
        f"submitted Flower run {run_id} to {opts.superlink}; following it through the SuperLink "
        "(Flower delivers the coordinator's log in batches)",
        flush=True,
    )
    return remote.follow(home, run_id)


def _local_worker_keys(run: RunDir, n: int) -> dict[str, Path]:
    """Keys for the local workers w0..w{n-1} (made once, kept in RUN/workers/<name>/key), in the registry."""
    out, known = {}, {x.name for x in workers_mod.load(run)}
    for i in range(n):
        name, folder = f"w{i}", run.root / "workers" / f"w{i}" / "key"
        if not (folder / WORKER_KEY).is_file():
            make_worker_key(folder, force=True)
        if name not in known:
            workers_mod.add(run, folder / WORKER_PUB, name)
        out[name] = folder / WORKER_KEY
    return out


def _warn_if_open(opts: Options) -> None:
    if opts.host in ("127.0.0.1", "localhost", "::1"):
        return
    missing = [
        what
        for what, on in (("TLS (--tls)", opts.tls and opts.tls.enabled), ("worker authentication (--auth)", opts.auth))
        if not on
    ]
    if missing:
        print(
            f"warning: listening on {opts.host} without {' and '.join(missing)}: anyone who can reach this port "
            "can join and train experts",
            file=sys.stderr,
            flush=True,
        )


def _flwr_run_path(run: RunDir) -> Path:
    return run.root / "flwr_run.json"


def _launch_superlink(procs: launcher.Launcher, run: RunDir, opts: Options) -> str:
    """Start the embedded SuperLink; returns the address this box's workers and `flwr run` reach it at."""
    port = opts.port or free_port()
    procs.superlink(opts.host, port, opts.tls, auth=opts.auth)
    address = f"127.0.0.1:{port}" if opts.host in ("0.0.0.0", "", "127.0.0.1") else f"{opts.host}:{port}"
    where = f"{opts.host}:{port}" + (
        "" if opts.host != "127.0.0.1" else " (loopback only; --host 0.0.0.0 for other boxes)"
    )
    print(f"SuperLink listening on {where}; logs in {run.logs}", flush=True)
    _warn_if_open(opts)
    return address


def _register_workers(run: RunDir, address: str, tls: launcher.TLS | None) -> None:
    """Register every key in RUN's registry with the live SuperLink (--auth)."""
    launcher.write_connection(run.flwr_home, address, tls)
    registered = workers_mod.register_all(run, launcher.CONNECTION)
    print(
        f"registered {len(registered)} worker key(s): {', '.join(x.name for x in registered) or 'none'}"
        " (add more with `soma-coord add-worker`)",
        flush=True,
    )


def launch_workers(
    procs: launcher.Launcher,
    run: RunDir,
    opts: Options,
    address: str,
    keys: dict[str, Path],
    n: int,
    on: list[str],
) -> None:
    """Start the --local-workers SuperNodes w0..w{n-1}, worker i on device on[i] and with --local-recipes' i-th
    recipe (each list repeating). On the CPU they split this box's cores; on one GPU each holds its own
    session and the GPU interleaves their kernels."""
    threads, recipes = local_worker_threads(n), opts.local_recipes or ["auto"]
    each = [(on[i % len(on)], recipes[i % len(recipes)]) for i in range(n)]  # (device, recipe), lists repeating
    for i, (device, recipe_) in enumerate(each):
        procs.worker(
            f"w{i}",
            address,
            run.root / "workers" / f"w{i}" / "cache",
            threads=threads,
            device=device,
            recipe=recipe_,
            spin=n == 1,
            parallel=0 if n == 1 else 1,
            tls=opts.tls,
            auth_key=keys.get(f"w{i}"),
        )
    if n:
        said = ", ".join(f"w{i} on {device} ({recipe_})" for i, (device, recipe_) in enumerate(each))
        print(f"started {n} local worker(s), {threads or 'auto'} thread(s) each: {said}", flush=True)


def follow(run: RunDir, procs: launcher.Launcher, run_id: str, t_submit: float) -> int:
    """Draw progress until the ServerApp reports done; 1 if it (or the embedded SuperLink) dies first."""
    last_check = 0.0
    with Follower(run) as view:
        while True:
            status = metrics.read_status(run)
            fresh = status is not None and float(status.time or 0) >= t_submit - 1
            view.update(status if fresh else None)
            if fresh and status.phase == "done":
                break
            if fresh and status.phase == "failed":
                why = f"the coordinator (ServerApp) failed: {status.message}; see {run.logs / 'coordinator.log'}"
                if status.user_error:
                    raise SomaError(why)
                print(f"error: {why}", file=sys.stderr, flush=True)  # an internal failure: one line, exit 1
                return 1
            for p in procs.procs:
                if p.name == "superlink" and not p.alive():
                    raise SomaError(f"the SuperLink exited (code {p.popen.returncode}); see {p.log}")
            now = time.time()
            alive = fresh and pid_alive(int(status.pid or 0))
            if not alive and now - last_check > 15 and now - t_submit > 10:
                last_check = now
                st = launcher.run_status(run.flwr_home, run_id)
                last = metrics.read_status(run)
                if st and st.startswith("finished") and not (last is not None and last.phase == "done"):
                    _fail(run, f"the Flower run {run_id} ended as {st}")
                if not fresh and now - t_submit > STATUS_GRACE:
                    _fail(run, f"the ServerApp did not start within {STATUS_GRACE:.0f} s")
            time.sleep(1.0)
    view.final()
    if status.never_advanced:
        print(
            f"warning: {len(status.never_advanced)} of {len(status.experts)} experts never advanced in this run: "
            + records.reasons({int(e): why for e, why in status.never_advanced.items()}),
            flush=True,
        )
    if status.stopped:
        print(
            f"stopped after round {status.round} of {status.rounds} (soma-coord stop); "
            f"`soma-coord start --run {run.root}` resumes it",
            flush=True,
        )
    return 0


def _fail(run: RunDir, why: str) -> None:
    lines = []
    log = run.logs / "coordinator.log"
    try:
        lines = log.read_text(errors="replace").splitlines()[-8:]
    except OSError:
        pass
    detail = ("\n  " + "\n  ".join(lines)) if lines else ""
    raise RuntimeError(f"{why}; see {log}{detail}")
