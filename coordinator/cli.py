"""`soma-coord`: prepare a corpus, run the federation, report on a run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from soma_edge.cli import entry, make_app

app = make_app("soma-edge coordinator: prepare data clusters, orchestrate training over Flower.")


@app.callback()
def _root() -> None:
    """soma-edge coordinator."""


@app.command("prepare")
def prepare_cmd(
    corpus: str = typer.Argument(..., help="`default`, `debian` (built as root), a text file or folder, or a .jsonl."),
    experts: int = typer.Option(..., "--experts", min=1, help="Number of experts N."),
    out: Path = typer.Option(..., "--out", help="Run directory to write router.msgpack, prepare.json, shards/ into."),
    clusters: Optional[int] = typer.Option(None, "--clusters", min=1, help="Clusters C >= N (default N)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the fit: same corpus and seed, same router and shards."),
    as_json: bool = typer.Option(False, "--json", help="Print prepare.json instead of the summary table."),
) -> None:
    """Fit the router (hashed byte n-gram tf-idf, balanced k-means) and write per-cluster shards."""
    from coordinator.prepare import prepare, print_summary

    summary = prepare(corpus, experts, out, seed=seed, clusters=clusters, progress=not as_json)
    if as_json:
        print(json.dumps(summary))
    else:
        print_summary(summary, out)


main = entry(app, "soma-coord")

if __name__ == "__main__":
    main()
