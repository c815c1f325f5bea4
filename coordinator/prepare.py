"""`prepare`: fit the router on a corpus and cut it into per-cluster, content-addressed shards.

Output (into a run directory, see soma_edge/rundir/):
- `router.msgpack`: the fitted router (soma_edge.corpus.router);
- `shards/<sha256>.bin`: for each cluster and split, its documents' bytes joined by corpus.documents.SEPARATOR,
  named by the sha256 of those bytes (workers cache shards by that name);
- `prepare.json`: clusters (expert, documents, bytes and shard hash per split, held-out windows cut from
  train documents), the domain-by-cluster table, purity, seconds.

Every cluster gets its quota of text (corpus.holdout): train bytes, and val and test windows. When the
documents split by hash leave some cluster short (many experts on a small corpus), prepare fits again with
the ends of train documents set aside, moves documents to the clusters that lack text, and cuts their
missing held-out windows from those ends. When nothing is short (the demo's 4 experts on the default corpus)
the first fit stands: same router, same shards as before quotas existed.

Everything is built in a temporary directory beside `out` and renamed into place, so an interrupted
prepare leaves nothing half-written. Into an existing run directory, prepare.json is removed first and
moved in last: its presence means a complete prepare.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import numpy as np
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from coordinator import debian_corpus
from soma_edge import cli
from soma_edge.checkpoint import atomic_write
from soma_edge.config import DataConfig
from soma_edge.corpus import documents, holdout, sources
from soma_edge.corpus import router as routing
from soma_edge.errors import ConfigError, CorpusError
from soma_edge.rundir.layout import RunDir
from soma_edge.rundir.state import ClusterShards, PrepareSummary, RouterSummary

SCHEMA = 1
UNLABELLED = "(unlabelled)"


def ensure_debian(progress: bool = False) -> None:
    """Build the `debian` corpus into the cache (as root) unless it is there already."""
    if not (sources.cache_dir() / sources.DEBIAN / "manifest.json").exists():
        debian_corpus.build(progress=progress)


def purity(domains: list[str], labels: np.ndarray, weights: np.ndarray) -> float | None:
    """Byte-weighted cluster purity against domain labels: sum over clusters of their largest domain's
    bytes, over all bytes. None without at least two labelled domains (nothing to measure)."""
    keep = np.array([d not in ("", UNLABELLED) for d in domains], dtype=bool)
    names = sorted({d for d, k in zip(domains, keep) if k})
    if len(names) < 2:
        return None
    idx = np.array([names.index(d) if k else -1 for d, k in zip(domains, keep)])
    table = np.zeros((len(names), int(labels.max()) + 1))
    np.add.at(table, (idx[keep], labels[keep]), weights[keep])
    return float(table.max(axis=0).sum() / table.sum())


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _check_out(out: Path) -> None:
    """Refuse an --out we could not write, before any work is done."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    base = out.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: cannot create it ({base} is not a writable directory)")


def _check_untrained(out: Path, own_lock: bool = False) -> None:
    """Refuse a run directory with trained experts or a live coordinator (other than the caller, with
    `own_lock`): a new router and shards would silently change what those experts are trained on."""
    run = RunDir(out)
    if run.is_locked() and not own_lock:
        raise ConfigError(
            f"--out {out}: a coordinator is running on it (pid {run.lock_holder()}); stop it, or "
            "prepare into a new directory"
        )
    if run.state_path.exists():
        raise ConfigError(f"--out {out}: has trained experts ({run.state_path.name}); prepare into a new directory")


def _make_tmp(out: Path) -> Path:
    """An empty directory beside `out` (same filesystem, so the final rename is atomic)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        tmp.mkdir()
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write beside it ({e.strerror})") from None
    return tmp


def _install(tmp: Path, out: Path) -> None:
    """Move the finished files from tmp into out (a rename if out does not exist yet)."""
    if not out.exists():
        os.rename(tmp, out)
        return
    (out / "shards").mkdir(exist_ok=True)
    (out / "prepare.json").unlink(missing_ok=True)  # until the new one lands, out is "not prepared"
    for f in sorted((tmp / "shards").iterdir()):
        os.replace(f, out / "shards" / f.name)
    os.replace(tmp / "router.msgpack", out / "router.msgpack")
    os.replace(tmp / "prepare.json", out / "prepare.json")


def prepare(
    corpus: str,
    experts: int,
    out: Path,
    seed: int = 0,
    clusters: int | None = None,
    progress: bool = True,
    own_lock: bool = False,
    seq_len: int = DataConfig.seq_len,
) -> dict:
    """Fit the router and write router.msgpack, prepare.json and shards/ into `out`; returns prepare.json.

    `seq_len`: the training windows' length, which sizes the held-out windows every cluster is given."""
    t0 = time.perf_counter()
    out = Path(out)
    if experts < 1:
        raise ConfigError(f"--experts must be >= 1, got {experts}")
    if clusters is not None and clusters < experts:
        raise ConfigError(f"--clusters ({clusters}) must be >= --experts ({experts}): every expert needs a cluster")
    _check_out(out)
    _check_untrained(out, own_lock)
    n_clusters = clusters or experts

    if corpus == sources.DEBIAN:
        ensure_debian(progress)  # before our bar: the recipe reports its own steps

    bar = _progress_bar() if progress else None
    with bar or nullcontext():
        task = bar.add_task("loading corpus", total=None) if bar else None
        docs = sources.load_documents(corpus)

        def report(phase: str, done: int, total: int) -> None:
            if bar:
                bar.update(task, description=phase, completed=done, total=total)

        quota = holdout.Quota(seq_len)
        _check_size(corpus, docs, experts, n_clusters, quota)
        router, labels, cuts = _fit(docs, experts, n_clusters, seed, quota, report)
        report("writing shards", 0, n_clusters)
        tmp = _make_tmp(out)
        try:

            def on_cluster(k):
                return report("writing shards", k, n_clusters)

            summary = _write(tmp, corpus, seed, experts, docs, router, labels, cuts, quota.window, on_cluster)
            summary.seq_len = seq_len
            summary.seconds = round(time.perf_counter() - t0, 3)
            atomic_write(tmp / "prepare.json", (json.dumps(summary.to_dict(), indent=1) + "\n").encode())
            _check_untrained(out, own_lock)  # again: a coordinator may have started while the router was fitted
            _install(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return summary.to_dict()


def _check_size(corpus: str, docs: list[documents.Document], experts: int, clusters: int, quota: holdout.Quota) -> None:
    """Refuse a corpus too small for the experts asked for, naming the most it supports."""
    total = sum(len(d.text) for d in docs)
    train = sum(1 for d in docs if d.split == "train")
    most = min(total // quota.per_expert, train)
    supports = f"it supports at most {most} experts" if most else "it is too small for one expert"
    what = f"--experts {experts}" if clusters == experts else f"--clusters {clusters}"
    if clusters > train:
        raise CorpusError(
            f"corpus {corpus} has {_n(train, 'training document')} (of {len(docs)}, texts cut into pieces of "
            f"at most {documents.CHUNK // 1024} KiB), fewer than {what}: {supports}"
        )
    if total < clusters * quota.per_expert:
        raise CorpusError(
            f"corpus {corpus} has {total:,} bytes, fewer than {what} x {quota.per_expert:,} (each expert's "
            f"{quota.train_bytes:,} train bytes and {2 * holdout.HELD_OUT_WINDOWS} held-out windows of "
            f"{quota.window} bytes): {supports}"
        )


def _fit(
    docs: list[documents.Document], experts: int, clusters: int, seed: int, quota: holdout.Quota, report
) -> tuple[routing.Router, np.ndarray, list[holdout.Cut]]:
    """The router, every document's cluster, and the held-out windows cut from within documents.

    The router learns from train documents only. If that leaves a cluster short of its quota, fit again on
    train documents without the ends they set aside, moving documents to the clusters that lack text. Val
    documents that outweigh a quarter of their cluster's train text join it (`holdout.heavy_val`)."""
    texts = [d.text for d in docs]
    train = [i for i, d in enumerate(docs) if d.split == "train"]  # held-out text never shapes the router
    router, labels = routing.fit(texts, experts, clusters, seed, fit_on=train, progress=report)
    lengths, splits = [len(t) for t in texts], [d.split for d in docs]
    plain = holdout.Docs.of(lengths, splits, None)
    if not holdout.shortfall(plain, labels, clusters, quota).short.any():
        return router, labels, holdout.heavy_val(plain, labels, clusters, quota)
    aside = holdout.Docs.of(lengths, splits, quota)
    fit_texts = [t[: len(t) - int(r) * quota.window] for t, r in zip(texts, aside.reserved.tolist())]

    def rebalance(labels: np.ndarray, d2: np.ndarray) -> np.ndarray:
        return holdout.rebalance(aside, labels, d2, quota)

    router, labels = routing.fit(fit_texts, experts, clusters, seed, fit_on=train, progress=report, adjust=rebalance)
    cuts = holdout.cut(aside, labels, clusters, quota)
    cuts += holdout.heavy_val(aside, labels, clusters, quota)
    return router, labels, sorted(cuts, key=lambda c: c.doc)


def _cluster_texts(
    docs: list[documents.Document], members: list[int], cuts: dict[int, holdout.Cut], window: int
) -> dict[str, list[bytes]]:
    """A cluster's texts per split, in document order; a cut train document gives its end to val and test."""
    out: dict[str, list[bytes]] = {split: [] for split in documents.SPLITS}
    for i in members:
        text = docs[i].text
        c = cuts.get(i)
        if c is None:
            out[docs[i].split].append(text)
            continue
        start = len(text) - c.windows * window
        mid = start + c.val * window
        out["train"].append(text[:start])
        for split, piece in (("val", text[start:mid]), ("test", text[mid:])):
            if piece:
                out[split].append(piece)
    return out


def _write(
    tmp: Path,
    corpus: str,
    seed: int,
    experts: int,
    docs: list[documents.Document],
    router: routing.Router,
    labels: np.ndarray,
    cuts: list[holdout.Cut],
    window: int,
    on_cluster: Callable[[int], None],
) -> PrepareSummary:
    router_bytes = router.to_bytes()
    atomic_write(tmp / "router.msgpack", router_bytes)
    (tmp / "shards").mkdir()
    sizes = np.array([len(d.text) for d in docs], dtype=np.float64)
    by_doc = {c.doc: c for c in cuts}
    clusters = []
    for k in range(router.n_clusters):
        members = np.flatnonzero(labels == k).tolist()
        entry = ClusterShards(id=k, expert=int(router.cluster_expert[k]), docs=len(members), bytes={}, shards={})
        texts = _cluster_texts(docs, members, by_doc, window)
        mine = [by_doc[i] for i in members if i in by_doc]
        if mine:  # windows this cluster's train documents gave to its held-out splits
            entry.cut = {"val": sum(c.val for c in mine), "test": sum(c.windows - c.val for c in mine)}
        for split in documents.SPLITS:
            data = documents.SEPARATOR.join(texts[split])
            digest = hashlib.sha256(data).hexdigest()
            path = tmp / "shards" / f"{digest}.bin"
            if not path.exists():
                atomic_write(path, data)
            entry.bytes[split], entry.shards[split] = len(data), digest
        clusters.append(entry)
        on_cluster(k + 1)
    domains: dict[str, dict[str, int]] = {}
    for d, k in zip(docs, labels.tolist()):
        row = domains.setdefault(d.domain or UNLABELLED, {})
        row[str(k)] = row.get(str(k), 0) + len(d.text)
    domains = {name: dict(sorted(row.items(), key=lambda kv: int(kv[0]))) for name, row in sorted(domains.items())}
    p = purity([d.domain for d in docs], labels, sizes)
    return PrepareSummary(
        schema=SCHEMA,
        corpus=corpus,
        seed=seed,
        experts=experts,
        documents=len(docs),
        bytes=int(sizes.sum()),
        separator=documents.SEPARATOR.decode(),
        router=RouterSummary(
            sha256=hashlib.sha256(router_bytes).hexdigest(),
            bytes=len(router_bytes),
            clusters=router.n_clusters,
            dim=router.dim,
            temperature=router.temperature,
            prior=[round(float(x), 6) for x in router.prior],
        ),
        clusters=clusters,
        purity=None if p is None else round(p, 6),
        domains=domains,
    )


def _progress_bar():
    console = cli.console(stderr=True)
    # Transient, and off when stderr is not a terminal: logs and error output stay one clean line each.
    return Progress(
        TextColumn("{task.description:<16}"),
        BarColumn(),
        TextColumn("{task.percentage:>5.1f}%"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f}"


TABLE_ROWS = 16  # a prepare of more clusters prints their spread, not a row each


def print_summary(summary: dict, out: Path) -> None:
    """A short table of clusters on stdout: expert, documents, MB per split, largest domain; beyond TABLE_ROWS
    clusters, the smallest, median and largest of each column instead (prepare.json has every cluster)."""
    table = _cluster_table(summary) if len(summary["clusters"]) <= TABLE_ROWS else _spread_table(summary)
    console = cli.console()
    console.print(table)
    purity = "n/a (unlabelled)" if summary["purity"] is None else f"{summary['purity']:.3f}"
    cut = [c for c in summary["clusters"] if c.get("cut")]
    if cut:
        windows = sum(sum(c["cut"].values()) for c in cut)
        console.print(
            f"{len(cut)} of {len(summary['clusters'])} clusters had too few held-out documents, or val documents "
            f"heavier than a quarter of their train text: {windows} windows of {summary['seq_len'] + 1} bytes were "
            "cut from the ends of their documents",
            highlight=False,
        )
    console.print(
        f"{summary['documents']} documents, {_mb(summary['bytes'])} MB, purity {purity}, "
        f"router {summary['router']['bytes'] / 1024:.0f} KiB, {summary['seconds']:.1f} s -> {out}",
        highlight=False,
    )


def _title(summary: dict) -> str:
    return f"prepare {summary['corpus']}: {summary['experts']} experts, seed {summary['seed']}"


def _cluster_table(summary: dict) -> Table:
    top: dict[int, tuple[str, float]] = {}
    for k in range(len(summary["clusters"])):
        col = {name: row.get(str(k), 0) for name, row in summary["domains"].items()}
        total = sum(col.values())
        name = max(sorted(col), key=lambda n: col[n])
        top[k] = (name, col[name] / total if total else 0.0)
    table = Table(title=_title(summary))
    for col in ("cluster", "expert", "docs", "train MB", "val MB", "test MB", "top domain"):
        table.add_column(col, justify="left" if col == "top domain" else "right")
    for c in summary["clusters"]:
        b = c["bytes"]
        name, share = top[c["id"]]
        table.add_row(
            str(c["id"]),
            str(c["expert"]),
            str(c["docs"]),
            _mb(b["train"]),
            _mb(b["val"]),
            _mb(b["test"]),
            f"{name} ({share:.0%})",
        )
    return table


def _spread_table(summary: dict) -> Table:
    table = Table(title=f"{_title(summary)}: {len(summary['clusters'])} clusters")
    for col in ("per cluster", "smallest", "median", "largest"):
        table.add_column(col, justify="left" if col == "per cluster" else "right")
    columns = {
        "documents": ([c["docs"] for c in summary["clusters"]], str),
        **{
            f"{split} KB": ([c["bytes"][split] for c in summary["clusters"]], lambda n: f"{n / 1e3:.1f}")
            for split in ("train", "val", "test")
        },
    }
    for name, (values, fmt) in columns.items():
        v = np.sort(np.asarray(values))
        table.add_row(name, fmt(int(v[0])), fmt(int(v[v.size // 2])), fmt(int(v[-1])))
    return table
