"""`soma-coord start`: resolve the run's config, prepare if needed, launch Flower, submit, follow, clean up.

Embedded mode (no --superlink): a `flower-superlink` on this box with FLWR_HOME in RUN/flwr, plus
`--local-workers` SuperNodes (`soma-worker join`), all stopped when `start` ends or is interrupted.
External mode (--superlink HOST:PORT, `coordinator.remote`): only the submission, and progress read from
the SuperLink; Flower runs the ServerApp on the SuperLink's host, where RUN lives.

Starting again on the same RUN resumes from its last committed round.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator import launcher
from coordinator import workers as workers_mod
from coordinator.progress import Follower
from soma_edge import checkpoint
from soma_edge import config as config_mod
from soma_edge.config import Config
from soma_edge.errors import ConfigError, SomaError
from soma_edge.procs import free_port
from soma_edge.rundir import RunDir, RunLockedError

IMMUTABLE = ("model", "data", "seed", "federation.experts", "federation.corpus", "federation.seed_steps")
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
    worker_device: str = "cpu"


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj.__dict__ if hasattr(obj, "__dataclass_fields__") else obj


def _set(cfg: Config, dotted: str, value: Any) -> None:
    *path, last = dotted.split(".")
    obj: Any = cfg
    for part in path:
        obj = getattr(obj, part)
    setattr(obj, last, value)


def resolve_config(run: RunDir, config_path: Path | None, overrides: dict[str, Any]) -> Config:
    """The run's config: run.toml when resuming, else --config or the defaults; then the CLI overrides.

    A resumed run may change rounds, round length, workers and SPSA settings, but not what its
    checkpoints depend on (model, data, seed, experts, corpus, the seed run's length)."""
    given = config_mod.load(config_path) if config_path else None
    if run.has_config():
        cfg = run.load_config()
        explicit = _explicit_keys(config_path) if config_path else set()
        changed = [(k, _get(given, k)) for k in IMMUTABLE if k in explicit and _get(given, k) != _get(cfg, k)]
        changed += [(k, v) for k, v in overrides.items() if k in IMMUTABLE and v != _get(cfg, k)]
        if changed:
            key, new = changed[0]
            raise ConfigError(
                f"{run.root} was started with {key} = {_get(cfg, key)!r}; it cannot change to {new!r} "
                "on resume (use a new --run directory)"
            )
        if given is not None:  # a resumed run takes the file's SPSA and federation settings, not its identity
            keep = (cfg.federation.experts, cfg.federation.corpus, cfg.federation.seed_steps)
            cfg.spsa, cfg.federation = given.spsa, given.federation
            cfg.federation.experts, cfg.federation.corpus, cfg.federation.seed_steps = keep
    else:
        cfg = given or Config()
    for k, v in overrides.items():
        _set(cfg, k, v)
    fed = cfg.federation
    if fed.local_workers > 0 and fed.min_nodes < fed.local_workers:
        fed.min_nodes = fed.local_workers
    return config_mod.validate(cfg)


def _explicit_keys(path: Path) -> set[str]:
    """Which IMMUTABLE keys the TOML file itself sets (defaults filled in by Config do not count)."""
    import tomllib

    raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    out = {k for k in ("model", "data", "seed") if k in raw}
    fed = raw.get("federation") or {}
    return out | {f"federation.{k}" for k in ("experts", "corpus", "seed_steps") if k in fed}


def _same_corpus(a: str, b: str) -> bool:
    """Corpus names are equal, or both name the same existing path (`data/` vs `./data`)."""
    if a == b:
        return True
    pa, pb = Path(a), Path(b)
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def ensure_prepared(
    run: RunDir, cfg: Config, given: set[str] | frozenset[str] = frozenset(), own_lock: bool = False
) -> None:
    """Prepare RUN unless it is; a prepared RUN must match the experts, and the corpus and seed when the
    user gave them (`given`: dotted keys set on the command line or in --config), else training would
    silently run on another corpus than the one asked for."""
    if run.is_prepared():
        prep = run.load_prepare()
        if int(prep.get("experts", -1)) != cfg.federation.experts:
            raise ConfigError(f"{run.root} is prepared for {prep.get('experts')} experts, not {cfg.federation.experts}")
        if "federation.corpus" in given and not _same_corpus(cfg.federation.corpus, str(prep.get("corpus"))):
            raise ConfigError(
                f"{run.root} is prepared from corpus {prep.get('corpus')!r}, not "
                f"{cfg.federation.corpus!r} (use a new --run directory)"
            )
        if "seed" in given and prep.get("seed") != cfg.seed:
            raise ConfigError(
                f"{run.root} is prepared with seed {prep.get('seed')!r}, not {cfg.seed!r} (use a new --run directory)"
            )
        return
    from coordinator.prepare import prepare

    print(f"preparing {cfg.federation.corpus} into {run.root} ({cfg.federation.experts} experts)", flush=True)
    prepare(cfg.federation.corpus, cfg.federation.experts, run.root, seed=cfg.seed, progress=True, own_lock=own_lock)


def _local_worker_keys(run: RunDir, n: int) -> dict[str, Path]:
    """Keys for the local workers w0..w{n-1} (made once, kept in RUN/workers/<name>/key), in the registry."""
    from soma_edge.certs import WORKER_KEY, WORKER_PUB, make_worker_key

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


def start(opts: Options) -> int:
    if opts.tls:
        opts.tls.check(server=opts.superlink is None)
    if opts.superlink:
        from coordinator import remote

        return remote.start(opts)
    if opts.auth and not (opts.tls and opts.tls.enabled):
        raise ConfigError("--auth needs --tls DIR: Flower authenticates workers over TLS only")
    run = RunDir(opts.run)
    run.root.mkdir(parents=True, exist_ok=True)
    if run.is_locked():
        raise RunLockedError(f"{run.root} is in use by a running coordinator (pid {run.lock_holder()}); stop it first")
    cfg = resolve_config(run, opts.config, opts.overrides or {})
    given = set(opts.overrides or {}) | (_explicit_keys(opts.config) if opts.config else set())
    ensure_prepared(run, cfg, given)
    run.save_config(cfg)
    state = run.load_state()
    if state and state["round"] >= cfg.federation.rounds:
        print(f"{run.root}: all {cfg.federation.rounds} rounds are done (raise --rounds to train on)")
        Follower(run).final()
        return 0

    procs = launcher.Launcher(logs=run.logs, flwr_home=run.flwr_home)
    try:
        port = opts.port or free_port()
        w = cfg.federation.local_workers
        keys = _local_worker_keys(run, w) if opts.auth else {}
        procs.superlink(opts.host, port, opts.tls, auth=opts.auth)
        address = f"127.0.0.1:{port}" if opts.host in ("0.0.0.0", "", "127.0.0.1") else f"{opts.host}:{port}"
        where = f"{opts.host}:{port}" + (
            "" if opts.host != "127.0.0.1" else " (loopback only; --host 0.0.0.0 for other boxes)"
        )
        print(f"SuperLink listening on {where}; logs in {run.logs}", flush=True)
        _warn_if_open(opts)
        if opts.auth:
            launcher.write_connection(run.flwr_home, address, opts.tls)
            registered = workers_mod.register_all(run, launcher.CONNECTION)
            print(
                f"registered {len(registered)} worker key(s): {', '.join(x.name for x in registered) or 'none'}"
                " (add more with `soma-coord add-worker`)",
                flush=True,
            )
        threads = 0 if w == 1 else max(1, (os.cpu_count() or 1) // max(w, 1))  # workers split the cores
        for i in range(w):
            procs.worker(
                f"w{i}",
                address,
                run.root / "workers" / f"w{i}" / "cache",
                threads=threads,
                device=opts.worker_device,
                spin=w == 1,
                parallel=0 if w == 1 else 1,
                tls=opts.tls,
                auth_key=keys.get(f"w{i}"),
            )
        if w:
            print(f"started {w} local worker(s), {threads} thread(s) each", flush=True)
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


def follow(run: RunDir, procs: launcher.Launcher, run_id: str, t_submit: float) -> int:
    """Draw progress until the ServerApp reports done; 1 if it (or the embedded SuperLink) dies first."""
    last_check = 0.0
    with Follower(run) as view:
        while True:
            status = run.read_status()
            fresh = status is not None and float(status.get("time", 0)) >= t_submit - 1
            view.update(status if fresh else None)
            if fresh and status.get("phase") == "done":
                break
            if fresh and status.get("phase") == "failed":
                why = f"the coordinator (ServerApp) failed: {status.get('message')}; see {run.logs / 'coordinator.log'}"
                raise SomaError(why) if status.get("user_error") else RuntimeError(why)
            for p in procs.procs:
                if p.name == "superlink" and not p.alive():
                    raise SomaError(f"the SuperLink exited (code {p.popen.returncode}); see {p.log}")
            now = time.time()
            alive = fresh and _pid_alive(int(status.get("pid", 0)))
            if not alive and now - last_check > 15 and now - t_submit > 10:
                last_check = now
                st = launcher.run_status(run.flwr_home, run_id)
                if st and st.startswith("finished") and not (run.read_status() or {}).get("phase") == "done":
                    _fail(run, f"the Flower run {run_id} ended as {st}")
                if not fresh and now - t_submit > STATUS_GRACE:
                    _fail(run, f"the ServerApp did not start within {STATUS_GRACE:.0f} s")
            time.sleep(1.0)
    view.final()
    if status.get("stopped"):
        print(
            f"stopped after round {status.get('round')} of {status.get('rounds')} (soma-coord stop); "
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


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
