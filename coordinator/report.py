"""`soma-coord report`: one HTML page about a run, its plots (PNG, matplotlib) embedded as data URIs.

    losses.png      train and val loss per expert, and the routed mixture's val loss, per round
    timeline.png    which node held which expert in each round; missed deadlines and refusals marked
    throughput.png  forward evaluations per second of each node, per round
    and the final experts table (`soma-coord status`).

Everything comes from RUN/metrics.jsonl and state.msgpack, so a report can be made during a run or long
after it. The PNGs are also written next to the page. matplotlib is the `report` extra, not the base
install: a worker does not need it.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.progress import EXPERT_COLUMNS, expert_rows, summary
from soma_edge import checkpoint
from soma_edge.errors import CheckpointError, ConfigError
from soma_edge.rundir import metrics
from soma_edge.rundir.layout import RunDir
from soma_edge.rundir.metrics import Line


@dataclass
class Report:
    html: Path
    images: list[Path]


def _pyplot():
    try:  # matplotlib (the optional `report` extra, slow to load) only for `soma-coord report`
        import matplotlib
    except ImportError:
        raise ConfigError(
            "soma-coord report draws with matplotlib, which is not installed: pip install 'soma-edge[report]'"
        ) from None
    matplotlib.use("Agg")  # before pyplot loads: no display here
    import matplotlib.pyplot as plt

    return plt


def _losses(plt, lines: list[Line]):
    fig, ax = plt.subplots(figsize=(8, 4.5))
    experts = metrics.expert_lines(lines)
    for e in sorted({m.expert for m in experts}):
        got = [m for m in experts if m.expert == e and m.accepted]
        (line,) = ax.plot([m.round for m in got], [m.val_loss for m in got], marker="o", ms=3, label=f"expert {e} val")
        ax.plot([m.round for m in got], [m.train_loss for m in got], ls=":", color=line.get_color(), lw=1)
    mix = [m for m in metrics.round_lines(lines) if m.mixture_val_loss is not None]
    if mix:
        ax.plot(
            [m.round for m in mix],
            [m.mixture_val_loss for m in mix],
            color="black",
            lw=2.5,
            label="routed mixture val",
        )
    ax.set_xticks(sorted({m.round for m in experts}))
    ax.set(xlabel="round", ylabel="nats/byte", title="Loss (solid: val, dotted: train)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return fig


def _timeline(plt, lines: list[Line]):
    experts = metrics.expert_lines(lines)
    nodes = sorted({m.node for m in experts if m.node})
    rounds = sorted({m.round for m in experts})
    ids = sorted({m.expert for m in experts})
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(ids) + 1.6))
    colors = plt.get_cmap("tab10")
    for m in experts:
        y, c = ids.index(m.expert), colors(nodes.index(m.node) % 10) if m.node in nodes else "lightgrey"
        ax.barh(y, 0.9, left=m.round - 0.45, color=c, alpha=1.0 if m.accepted else 0.35)
        why = str(m.reason or "")
        if "deadline" in why or "gone" in why:
            ax.plot(m.round, y, marker="x", color="black", ms=9, mew=2)
        elif not m.accepted and (why.startswith("rejected") or "refused" in why):
            ax.plot(m.round, y, marker="o", mfc="none", color="red", ms=10, mew=2)
    for i, n in enumerate(nodes):
        ax.barh(0, 0, color=colors(i % 10), label=n)
    ax.plot([], [], marker="x", color="black", ls="", label="missed deadline / node gone")
    ax.plot([], [], marker="o", mfc="none", color="red", ls="", label="refused")
    ax.set_yticks(range(len(ids)), [f"expert {e}" for e in ids])
    ax.set_xticks(rounds)
    ax.set(xlabel="round", title="Who trained what (faded: not accepted)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def _throughput(plt, lines: list[Line]):
    fig, ax = plt.subplots(figsize=(8, 4))
    per: dict[str, dict[int, list[float]]] = {}
    for m in metrics.expert_lines(lines):
        if m.accepted and m.seconds:
            evals, secs = per.setdefault(m.node, {}).setdefault(m.round, [0.0, 0.0]), float(m.seconds)
            evals[0] += float(m.forward_evals or 0)
            evals[1] += secs
    for node, by_round in sorted(per.items()):
        rs = sorted(by_round)
        ax.plot(rs, [by_round[r][0] / by_round[r][1] for r in rs], marker="o", label=node)
    ax.set_xticks(sorted({r for by_round in per.values() for r in by_round}))
    ax.set(xlabel="round", ylabel="forward evaluations / s", title="Throughput per node (accepted work)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _png(fig, path: Path) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    data = buf.getvalue()
    checkpoint.atomic_write(path, data, mode=0o644)
    return data


def _table(s: dict[str, Any]) -> str:
    head = "".join(f"<th>{c}</th>" for c in EXPERT_COLUMNS)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in expert_rows(s))
    return f"<table><tr>{head}</tr>{rows}</table>"


def _shares(s: dict[str, Any]) -> str:
    """The compute share of each round's span (plan to next plan), counted by when the training happened."""
    shares = s.get("compute_shares") or {}
    if not shares:
        return ""
    cells = "".join(f"<tr><td>{r}</td><td>{100 * v:.1f}%</td></tr>" for r, v in shares.items())
    return (
        "<h2>Compute share</h2><p>Training on the planned nodes that fell inside each round's span, from its "
        "plan to the next round's (the last round's, to its commit), over the nodes times the span.</p>"
        f"<table><tr><th>round</th><th>compute share</th></tr>{cells}</table>"
    )


def _recipes(s: dict[str, Any]) -> str:
    """Each node's recipe: the run's settings with the probes its last accepted version was made with."""
    recipes = s.get("node_recipes") or {}
    if not recipes:
        return ""
    cells = "".join(f"<tr><td>{html.escape(n)}</td><td>{html.escape(r)}</td></tr>" for n, r in sorted(recipes.items()))
    return (
        "<h2>Recipes</h2><p>What each node probes with; every other setting is the run's.</p>"
        f"<table><tr><th>node</th><th>probes</th></tr>{cells}</table>"
    )


def _finished(s: dict[str, Any]) -> str:
    """The finished experts (coordinator.finish) and the rule that finished each."""
    done = [(e, x["finished"]) for e, x in s["experts"].items() if x.get("finished")]
    if not done:
        return ""
    cells = "".join(f"<tr><td>{html.escape(str(e))}</td><td>{html.escape(why)}</td></tr>" for e, why in done)
    return (
        "<h2>Finished experts</h2><p>Experts that could no longer improve: they left the plans, and export "
        f"takes their best versions.</p><table><tr><th>expert</th><th>why</th></tr>{cells}</table>"
    )


def write(run: RunDir, out: Path | None = None) -> Report:
    """Write OUT/report.html (default RUN/report/) and its PNGs; returns their paths."""
    lines = metrics.read_lines(run)
    if not run.state_path.exists() or not metrics.round_lines(lines):
        raise CheckpointError(f"{run.root}: no committed round yet, so nothing to report")
    plt = _pyplot()
    out = out or run.root / "report"
    out.mkdir(parents=True, exist_ok=True)
    s = summary(run)
    parts, images = [], []
    for name, draw, caption in (
        ("losses", _losses, "Loss per expert and of the routed mixture"),
        ("timeline", _timeline, "Node timeline"),
        ("throughput", _throughput, "Throughput per node"),
    ):
        fig = draw(plt, lines)
        path = out / f"{name}.png"
        data = _png(fig, path)
        plt.close(fig)
        images.append(path)
        uri = "data:image/png;base64," + base64.b64encode(data).decode()
        parts.append(f"<h2>{caption}</h2><img alt='{name}' src='{uri}'>")
    mix = s.get("mixture_val_loss")
    title = f"{s['run']}: round {s['round']} of {s['rounds']}" + (f", routed val {mix:.4f} nats/byte" if mix else "")
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>"
        "body{font-family:sans-serif;max-width:60em;margin:2em auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}img{max-width:100%}</style></head>"
        f"<body><h1>{html.escape(title)}</h1>{''.join(parts)}{_shares(s)}{_recipes(s)}<h2>Experts</h2>{_table(s)}{_finished(s)}</body></html>"
    )
    page_path = out / "report.html"
    checkpoint.atomic_write(page_path, page.encode(), mode=0o644)
    return Report(page_path, images)
