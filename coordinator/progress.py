"""What a person watching a run sees: the experts table and the round progress.

The ServerApp runs inside Flower (next to the SuperLink), and Flower's own log streaming arrives in
batches 45-60 s late, so the ServerApp writes RUN/status.json and RUN/metrics.jsonl and we read those.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from coordinator import finish, records
from soma_edge import cli
from soma_edge.config import expert_config
from soma_edge.rundir import metrics
from soma_edge.rundir.layout import RunDir
from soma_edge.rundir.metrics import ExpertLine, Line, RoundLine, Status
from soma_edge.spsa.recipe import Probes
from soma_edge.wire import compute_share


def last_expert_lines(lines: list[Line]) -> dict[int, ExpertLine]:
    """Each expert's last accepted line."""
    return {int(m.expert): m for m in metrics.expert_lines(lines) if m.accepted}


def last_round(lines: list[Line]) -> RoundLine | None:
    rounds = metrics.round_lines(lines)
    return rounds[-1] if rounds else None


def node_recipes(lines: list[Line]) -> dict[str, str]:
    """Each node's recipe, as its last accepted version records it: the run's, or its own probes
    (soma_edge.spsa.recipe.Probes), described."""
    out: dict[str, str] = {}
    for m in metrics.expert_lines(lines):
        if m.accepted and m.node and isinstance(m.recipe, dict):
            try:
                out[m.node] = Probes(**m.recipe).describe()
            except TypeError:  # a line of another version's making: its node's recipe is not shown
                continue
    return out


def summary(run: RunDir) -> dict[str, Any]:
    """Everything `soma-coord status` reports, from the checkpoint alone (no server needed): the JSON of
    `soma-coord status --json`."""
    state = run.read_state()
    # Metrics of rounds after the state's are not its own: a round that crashed before it committed, or
    # the rounds of a state.msgpack that did not read and fell back to the commit before it.
    lines = [m for m in metrics.read_lines(run) if m.round <= (state.round if state else 0)]
    cfg = run.load_config() if run.has_config() else None
    last = last_expert_lines(lines)
    lr = last_round(lines)
    prep = run.read_prepare() if cfg is not None and run.prepare_json.exists() else None
    experts = {}
    for e in state.expert_ids() if state else []:
        m, x = last.get(e), state.expert(e)
        seeding = state.phase == "seed"
        experts[str(e)] = {
            **x.to_dict(),
            "steps_per_s": m.steps_per_s if m else None,
            "last_round": m.round if m else None,
            # its train text read how many times over (the seed's: every expert's text)
            "epochs": records.epochs(cfg if seeding else expert_config(cfg), prep, e, x.step) if prep else None,
        }
    return {
        "run": str(run.root),
        "round": state.round if state else 0,
        "rounds": cfg.federation.rounds if cfg else None,
        "experts": experts,
        "mixture_val_loss": lr.mixture_val_loss if lr else None,
        "val_loss_mean": lr.val_loss_mean if lr else None,
        "compute_share": lr.compute_share if lr else None,
        # by when the training happened, per round (soma_edge.wire.compute_share); the last one's span is
        # still open while the run goes on
        "compute_shares": {str(r): v for r, v in compute_share.shares(metrics.round_lines(lines)).items()},
        "running": run.is_locked(),
        "node_recipes": node_recipes(lines),  # node -> the probes its last accepted version was made with
        "phase": state.phase if state else "experts",  # "seed" while the seed run trains
        # the finished seed's version, once the experts started from it
        "seed": state.seed.to_dict() if state and state.seed else None,
    }


def _f(v: Any, digits: int = 4) -> str:
    return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


TABLE_ROWS = 16  # more experts than this: the table shows the best and worst (`status --all`: every one)
EDGE_ROWS = 5  # ... this many of each


def experts_table(s: dict[str, Any], status: Status | None = None, every: bool = False) -> Table:
    """The experts table of a `summary`; beyond TABLE_ROWS experts (unless `every`), the EDGE_ROWS lowest
    and highest val losses only."""
    title = f"{s['run']}: round {s['round']}/{s['rounds'] or '?'}"
    if s.get("phase") == "seed":
        title += ", seed run (the experts start from it)"
    elif s.get("mixture_val_loss") is not None:
        title += f", routed val {s['mixture_val_loss']:.4f} nats/byte"
    left_out = {int(e): x["cannot_train"] for e, x in s["experts"].items() if x.get("cannot_train")}
    notes = [f"left out, cannot train: {records.reasons(left_out)}"] if left_out else []
    done = {int(e): finish.rule_of(x["finished"]) for e, x in s["experts"].items() if x.get("finished")}
    if done:
        notes.append(f"finished (federation.finish_*), on their best versions: {records.reasons(done)}")
    recipes = s.get("node_recipes") or {}
    if len(set(recipes.values())) > 1:  # mixed recipes: which node trains with which
        notes.append("recipes: " + "; ".join(f"{n}: {r}" for n, r in sorted(recipes.items())))
    rows = expert_rows(s, status)
    shown = rows if every or len(rows) <= TABLE_ROWS else _edges(s, rows)
    if len(shown) < len(rows):
        title += f"; {len(rows)} experts, the {EDGE_ROWS} lowest and {EDGE_ROWS} highest val losses"
        notes.append(f"every expert: soma-coord status {s['run']} --all")
    t = Table(title=title, title_justify="left", caption="\n".join(notes) or None, caption_justify="left")
    for col in EXPERT_COLUMNS:
        t.add_column(col, justify="left" if col in ("sha256", "node") else "right", no_wrap=col == "sha256")
    for row in shown:
        t.add_row(*row)
    return t


def _edges(s: dict[str, Any], rows: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """The rows of the EDGE_ROWS lowest and highest val losses (experts without one count as highest)."""
    ids = list(s["experts"])
    val = [s["experts"][e].get("val_loss") for e in ids]
    order = sorted(range(len(ids)), key=lambda i: (val[i] is None, val[i] if val[i] is not None else 0.0, i))
    keep = order[:EDGE_ROWS] + [i for i in order[-EDGE_ROWS:] if i not in order[:EDGE_ROWS]]
    return [rows[i] for i in keep]


EXPERT_COLUMNS = ("expert", "version", "sha256", "step", "epochs", "train loss", "val loss", "node", "steps/s")


def expert_rows(s: dict[str, Any], status: Status | None = None) -> list[tuple[str, ...]]:
    """The experts table's cells (`EXPERT_COLUMNS`) of a `summary`; the node is the live assignment's
    where a running round has one."""
    live_nodes = (status.assignment if status else None) or {}
    return [
        (
            f"{e} (seed)" if s.get("phase") == "seed" else e,
            str(x["version"]),
            x["sha256"][:12],
            str(x.get("step", "-")),
            _f(x.get("epochs"), 1),
            _f(x.get("train_loss")),
            _f(x.get("val_loss")),
            "finished" if x.get("finished") else live_nodes.get(e) or x.get("node") or "-",
            _f(x.get("steps_per_s"), 2),
        )
        for e, x in s["experts"].items()
    ]


class Events:
    """The coordinator's events as they happen (joins, leaves, plans, deadline misses, rejections): the
    INFO and higher lines that the ServerApp appends to RUN/logs/coordinator.log after we started."""

    def __init__(self, path: Path, level: str = "info") -> None:
        self.path, self.shown = path, _LEVELS[_LEVELS.index(level.upper()) :]
        try:
            self.offset = path.stat().st_size
        except OSError:
            self.offset = 0
        self.partial = b""

    def new(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                if f.seek(0, 2) < self.offset:  # a new file (another run dir state): start over
                    self.offset = 0
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        return [x for x in (_event(line, self.shown) for line in lines) if x]


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _event(line: bytes, shown: tuple[str, ...] = _LEVELS[1:]) -> str | None:
    """'2026-12-01 10:53:05,960 soma.coord WARNING msg' -> '10:53:05 warning: msg'; None for other levels."""
    parts = line.decode("utf-8", "replace").split(" ", 4)
    if len(parts) < 5 or parts[2] != "soma.coord" or parts[3] not in shown:
        return None
    level = "" if parts[3] == "INFO" else f"{parts[3].lower()}: "
    return f"{parts[1].split(',')[0]} {level}{parts[4]}"


class Follower:
    """The coordinator's events, one line each as they happen (each round's commit among them), and on a
    terminal a live experts table (status.json, metrics.jsonl) under them."""

    def __init__(self, run: RunDir, console: Console | None = None):
        self.run = run
        self.events = Events(run.logs / "coordinator.log", cli.log_level())
        self.console = console or cli.console()
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=self.console,
        )
        self.task = self.progress.add_task("rounds", total=None)
        self.rtask = self.progress.add_task("round compute", total=None)
        self.live = None

    def __enter__(self) -> "Follower":
        if self.console.is_terminal:
            self.live = Live(console=self.console, refresh_per_second=2, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def update(self, status: Status | None) -> None:
        for line in self.events.new():
            (self.live.console if self.live is not None else self.console).print(line, markup=False, highlight=False)
        if self.live is not None:
            s = summary(self.run)
            self.progress.update(self.task, completed=s["round"], total=s["rounds"])
            if status and status.phase == "round" and status.started:
                total = float(status.round_seconds or 1)
                done = min(total, time.time() - float(status.started))
                self.progress.update(
                    self.rtask,
                    completed=round(done),
                    total=round(total),
                    description=f"round {status.round} compute (s)",
                )
            phase = status.phase if status else "starting"
            msg = (status.message if status else None) or ""
            self.live.update(Group(experts_table(s, status), self.progress, f"[dim]{msg or phase}[/dim]"))

    def final(self) -> None:
        s = summary(self.run)
        if self.live is None:
            self.console.print(experts_table(s))


def watch(run: RunDir, every: float = 1.0) -> None:
    """Follow a run from another terminal: `start`'s event lines and live table, until its coordinator
    stops (or Ctrl-C); then the experts table."""
    if not run.is_locked():
        print(f"no coordinator is running on {run.root}; its last checkpoint:")
    else:
        try:
            with Follower(run) as view:
                while True:
                    view.update(metrics.read_status(run))
                    if not run.is_locked():
                        break
                    time.sleep(every)
        except KeyboardInterrupt:
            pass
        status = metrics.read_status(run)
        if status is not None and status.phase == "done" and not run.is_locked():
            print("the coordinator has stopped; its last checkpoint:")
    Follower(run).final()
