"""`soma-coord`: prepare a corpus, run the federation, report on a run."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, List, Optional

import typer

from coordinator import guard, report, workers
from coordinator import start as start_mod
from coordinator.launcher import APP_DIR, CONNECTION, TLS
from coordinator.prepare import prepare, print_summary
from coordinator.progress import experts_table, summary
from coordinator.progress import watch as watch_run
from soma_edge.cli import absolute, console, entry, make_app, path_argument, path_option
from soma_edge.config import MAX_SEED, DataConfig
from soma_edge.corpus.sources import DEBIAN
from soma_edge.engine import runtime
from soma_edge.errors import CheckpointError, ConfigError, SomaError
from soma_edge.rundir import layout as rundir
from soma_edge.rundir.layout import RunDir
from soma_edge.wire import certs

app = make_app("soma-edge coordinator: prepare data clusters, orchestrate training over Flower.")


def _corpus(value: str | None) -> str | None:
    """A corpus name as it is, a corpus path made absolute (`absolute`): prepare.json keeps it, and with
    --superlink the ServerApp prepares it, in the SuperLink's working directory."""
    return value if value in (None, "default", DEBIAN) else str(absolute(Path(value)))


def _run_path(ctx: typer.Context, value: Path) -> Path:
    """start's --run: absolute (`absolute`), except with --superlink (eager, so parsed before it), where it
    names a directory on the SuperLink's host, which only an absolute path given as such can."""
    if ctx.params.get("superlink") and not value.is_absolute():
        raise ConfigError(
            f"--run {value}: with --superlink, give the absolute path of the run directory on the "
            "SuperLink's host (Flower runs the coordinator there)"
        )
    return absolute(value)


@app.command("prepare")
def prepare_cmd(
    corpus: str = typer.Argument(
        ..., callback=_corpus, help="`default`, `debian` (built as root), a text file or folder, or a .jsonl."
    ),
    experts: int = typer.Option(..., "--experts", min=1, help="Number of experts N."),
    out: Path = path_option(..., "--out", help="Run directory to write router.msgpack, prepare.json, shards/ into."),
    clusters: Optional[int] = typer.Option(None, "--clusters", min=1, help="Clusters C >= N (default N)."),
    seed: int = typer.Option(
        0, "--seed", min=0, max=MAX_SEED, help="Seed of the fit: same corpus and seed, same router and shards."
    ),
    seq_len: int = typer.Option(
        DataConfig.seq_len,
        "--seq-len",
        min=1,
        help="Training window length (data.seq_len): every expert gets 8 val and 8 test windows of it.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print prepare.json instead of the summary table."),
) -> None:
    """Fit the router (hashed byte n-gram tf-idf, balanced k-means) and write per-cluster shards."""
    prep = prepare(corpus, experts, out, seed=seed, clusters=clusters, progress=not as_json, seq_len=seq_len)
    if as_json:
        print(json.dumps(prep))
    else:
        print_summary(prep, out)


LOCAL_DEVICE = typer.Option(
    None,
    "--device",
    help="Device of the --local-workers: auto, cpu, cuda[:i] or an ONNX Runtime EP (config key `device`).",
)
LOCAL_DEVICES = typer.Option(
    None,
    "--local-devices",
    help="A device for each local worker, in a list such as cuda:0,cpu (w0 on the GPU, w1 on the CPU); "
    "a shorter list repeats. Instead of --device.",
)
LOCAL_RECIPES = typer.Option(
    None,
    "--local-recipes",
    help="The recipe of each local worker (the worker's --recipe), in a list such as run,device:16: auto "
    "(the default), run, device or device:K; a shorter list repeats.",
)


@app.command("start")
def start_cmd(
    run: Path = typer.Option(
        Path("runs/default"), "--run", callback=_run_path, help="Run directory (created, prepared and resumed here)."
    ),
    config: Optional[Path] = path_option(
        None, "--config", help="TOML config: [model] [spsa] [data] [federation], seed."
    ),
    corpus: Optional[str] = typer.Option(
        None, "--corpus", callback=_corpus, help="Corpus to prepare if RUN is not prepared (default: default)."
    ),
    experts: Optional[int] = typer.Option(None, "--experts", min=1, help="Number of experts N."),
    rounds: Optional[int] = typer.Option(
        None, "--rounds", min=0, help="Total rounds (a resumed run trains up to this)."
    ),
    round_seconds: Optional[float] = typer.Option(
        None, "--round-seconds", min=0.1, help="Compute seconds per node per round."
    ),
    local_workers: Optional[int] = typer.Option(
        None, "--local-workers", min=0, help="SuperNodes to start on this box."
    ),
    device: Optional[str] = LOCAL_DEVICE,
    local_devices: Optional[str] = LOCAL_DEVICES,
    local_recipes: Optional[str] = LOCAL_RECIPES,
    min_nodes: Optional[int] = typer.Option(
        None,
        "--min-nodes",
        min=1,
        help="Workers round 1 waits for (then federation.join_grace seconds more for others).",
    ),
    wait_seconds: Optional[float] = typer.Option(
        None,
        "--wait-seconds",
        min=1.0,
        help="How long round 1 waits for --min-nodes workers before it starts with fewer (none: error).",
    ),
    seed: Optional[int] = typer.Option(
        None, "--seed", min=0, max=MAX_SEED, help="Seed of initialization, noise, batches and prepare."
    ),
    superlink: Optional[str] = typer.Option(
        None, "--superlink", is_eager=True, help="HOST:PORT of an existing SuperLink (external mode)."
    ),
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Embedded SuperLink: interface to listen on (0.0.0.0 for other boxes)."
    ),
    port: int = typer.Option(9092, "--port", min=0, max=65535, help="Embedded SuperLink port (0 = a free one)."),
    ssl_ca_certfile: Optional[Path] = path_option(
        None, "--ssl-ca-certfile", help="TLS CA certificate (passed to Flower)."
    ),
    ssl_certfile: Optional[Path] = path_option(
        None, "--ssl-certfile", help="TLS server certificate (embedded SuperLink)."
    ),
    ssl_keyfile: Optional[Path] = path_option(None, "--ssl-keyfile", help="TLS server key (embedded SuperLink)."),
    tls_dir: Optional[Path] = path_option(None, "--tls", help="TLS with the files `soma-coord certs DIR` wrote."),
    auth: bool = typer.Option(
        False, "--auth", help="Admit only workers whose keys `add-worker` registered (needs --tls)."
    ),
    reopen: bool = typer.Option(False, "--reopen", help="Resume with the finished experts training again."),
) -> None:
    """Run or resume federated training: embedded SuperLink (+ local workers), or submit to --superlink."""
    overrides = _given(
        {
            "federation.corpus": corpus,
            "federation.experts": experts,
            "federation.rounds": rounds,
            "federation.round_seconds": round_seconds,
            "federation.local_workers": local_workers,
            "device": device,
            "seed": seed,
            "federation.min_nodes": min_nodes,
            "federation.wait_seconds": wait_seconds,
        }
    )
    if superlink is None:
        runtime.load_ort()  # its ServerApp audits and evaluates on ONNX Runtime: say what to install now
    tls = _tls(ssl_ca_certfile, ssl_certfile, ssl_keyfile, tls_dir)
    lists = (_listed(local_devices), _listed(local_recipes))
    opts = start_mod.Options(run, config, overrides, superlink, host, port, tls, auth, reopen, *lists)  # field order
    raise typer.Exit(start_mod.start(opts))


def _listed(value: str | None) -> list[str] | None:
    """A comma-separated option as a list (None: not given)."""
    return None if value is None else [x.strip() for x in value.split(",")]


def _given(options: dict[str, Any]) -> dict[str, Any]:
    """The config overrides the user gave: options left at None keep the config's value."""
    return {k: v for k, v in options.items() if v is not None}


def _tls(ca: Path | None, cert: Path | None, key: Path | None, folder: Path | None) -> TLS | None:
    """TLS from the --ssl-* files or from --tls DIR (`soma-coord certs DIR`), or None for neither."""
    tls = TLS(ca, cert, key) if ca or cert or key else None
    if folder is not None:
        if tls is not None:
            raise typer.BadParameter("give --tls DIR or the --ssl-* files, not both")
        f = certs.files(folder)
        tls = TLS(f.ca, f.cert, f.key)
    return tls


@app.command("certs")
def certs_cmd(
    out: Path = path_argument(..., help="Folder to write ca.pem, ca.key, server.pem and server.key into."),
    hosts: List[str] = typer.Option(
        ...,
        "--host",
        help="DNS name or IP address workers use to reach the coordinator (repeatable); 127.0.0.1 and "
        "localhost are always added, for the coordinator's own commands.",
    ),
    force: bool = typer.Option(False, help="Replace certificates already in OUT."),
) -> None:
    """A CA and a SuperLink certificate for --host names and IPs: `start --tls OUT`, workers get OUT/ca.pem."""
    f = certs.make_certs(out, hosts, force=force)
    print(
        f"wrote {f.ca} (give it to every worker: soma-worker join --root-certificates ca.pem), {f.cert} and {f.key} "
        f"for {', '.join(hosts)} (and loopback); start the coordinator with --tls {out}"
    )


@app.command("add-worker")
def add_worker_cmd(
    run: Path = path_argument(..., help="Run directory."),
    public_key: Path = path_argument(..., help="The worker's public key (`soma-worker keygen` writes worker.pub)."),
    name: Optional[str] = typer.Option(None, help="The worker's name in the registry (default: the key file's stem)."),
) -> None:
    """Trust a worker's key for RUN's `start --auth`; on a live run it takes effect at once."""
    rd = RunDir(run)
    if rd.root.exists() and not rd.root.is_dir():
        raise ConfigError(f"{run}: not a directory")
    rd.root.mkdir(parents=True, exist_ok=True)  # keys may be registered before the run's first start
    w = workers.add(rd, public_key, name)
    where = "registered with the run"
    if workers.live(rd):
        (w,) = workers.register_all(rd, CONNECTION, only=w.fingerprint)
        where += " and with the live SuperLink" + (f" as node {w.node_id}" if w.node_id is not None else "")
    print(f"worker {w.name!r} (key {w.fingerprint}) {where}")


@app.command("workers")
def workers_cmd(
    run: Path = path_argument(..., help="Run directory."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """The workers whose keys RUN trusts."""
    rd = rundir.existing(run)
    rows = workers.load(rd)
    state = rd.read_state() if rd.state_path.exists() or rd.prev_state_path.exists() else None
    _warn_fallback(rd)
    strikes = state.strikes if state is not None else {}
    limit = rd.load_config().federation.max_strikes if rd.has_config() else 0
    count = {w.fingerprint: guard.count(strikes, guard.key_identity(w.fingerprint)) for w in rows}
    if as_json:
        print(
            json.dumps(
                {
                    "workers": [dataclasses.asdict(w) | {"strikes": count[w.fingerprint]} for w in rows],
                    "max_strikes": limit,
                }
            )
        )
        return
    print(f"{'name':<16} {'key':<16} {'node id (last start)':>22} {'strikes':>8}")
    for w in rows:
        mark = " excluded" if guard.excluded(strikes, guard.key_identity(w.fingerprint), limit) else ""
        print(f"{w.name:<16} {w.fingerprint:<16} {str(w.node_id or '-'):>22} {count[w.fingerprint]:>8}{mark}")
    print(f"{len(rows)} worker key(s) in {rd.registry_path}")


@app.command("status")
def status_cmd(
    run: Path = path_argument(..., help="Run directory."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
    watch: bool = typer.Option(
        False,
        "--watch",
        help="Follow the running coordinator (events and live table, as `start` shows them) until it stops.",
    ),
    every: float = typer.Option(1.0, "--every", min=0.1, help="With --watch: seconds between redraws."),
    every_expert: bool = typer.Option(
        False, "--all", help="A row for every expert (beyond 16, the table shows the 5 best and 5 worst)."
    ),
) -> None:
    """The experts table of a run, from its checkpoint (no server needed)."""
    rd = rundir.existing(run)
    committed = rd.state_path.exists() or rd.prev_state_path.exists()
    if not committed and not (watch and rd.is_locked()):
        raise CheckpointError(f"{run}: no state.msgpack, so no training has started in this directory")
    if watch:
        if as_json:
            raise ConfigError("--watch draws a live table: it does not go with --json")
        watch_run(rd, every)
        return
    s = summary(rd)
    _warn_fallback(rd)  # the table is the commit before, whole
    if as_json:
        print(json.dumps(s, default=str))
    else:
        console().print(experts_table(s, every=every_expert))


def _warn_fallback(rd: RunDir) -> None:
    """One line when what was just read is the commit before state.msgpack, and why."""
    if rd.fallback:
        print(f"warning: {rd.fallback}", file=sys.stderr, flush=True)


@app.command("report")
def report_cmd(
    run: Path = path_argument(..., help="Run directory."),
    out: Optional[Path] = path_option(None, "--out", help="Folder for report.html and its PNGs (default: RUN/report)."),
) -> None:
    """One HTML page about RUN: loss curves, a node timeline, throughput per node, the experts table."""
    r = report.write(rundir.existing(run), out)
    print(f"report: {r.html}")


@app.command("stop")
def stop_cmd(
    run: Path = path_argument(..., help="Run directory of a running coordinator."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait until the coordinator has stopped."),
) -> None:
    """Stop RUN's coordinator once the round in progress has committed; `start --run RUN` resumes it."""
    rd = rundir.existing(run)
    if not rd.is_locked():
        raise SomaError(f"{run}: no coordinator is running on it, so there is nothing to stop")
    rd.request_stop()
    print(
        f"stop requested: the coordinator of {rd.root} (pid {rd.lock_holder()}) stops once the round in "
        "progress has committed",
        flush=True,
    )
    if not wait:
        return
    while rd.is_locked():
        time.sleep(0.5)
    rounds = rd.load_config().federation.rounds
    print(f"stopped after round {rd.read_state().round} of {rounds}; `soma-coord start --run {run}` resumes it")


@app.command("app-path")
def app_path_cmd() -> None:
    """Print the path of the Flower app directory, for `flwr run "$(soma-coord app-path)" ...`."""
    print(APP_DIR)


main = entry(app, "soma-coord")

if __name__ == "__main__":
    main()
