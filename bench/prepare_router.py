"""`soma-coord prepare` on a corpus: time, peak memory, purity, and how well the router routes held-out text.

    .venv/bin/python -m bench.prepare_router [--corpus debian] [--experts 16] [--seed 0] [--ablate]
    .venv/bin/python -m bench.prepare_router --corpus four --experts 4 --ablate

CORPUS is any `prepare` corpus, or `four`: the labelled 4-domain sample of the tests (400 KB each of
Shakespeare, Milton, standard-library Python and pydoc topics from the default corpus, as JSONL). Its test
split is tiny (~0.04 MB), so for `four` the ablations route the default corpus's other documents of those
domains (up to 20 each) and count a window right when it goes to the expert holding most of its domain.

1. Runs `python -m coordinator prepare CORPUS --experts N --json` as a child process; reports its wall
   time and peak resident memory (the child's rusage), purity and balance from prepare.json.
2. Routes the held-out (test split) shards with the fitted router exactly as inference does
   (`Router.route_windows`: window i on window i-1) for several window lengths, and reports how often the
   top-1 expert is the expert whose cluster the text belongs to, and the routing throughput.
3. With --ablate, refits in this process to compare design choices, all on the same corpus and seed:
   the balanced cap (mean + one document, 1.1 x mean, 1.25 x mean) and the routing centroids (mean of
   256-byte windows, as shipped, or mean of whole documents).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import ROOT, md_head, md_row
from coordinator.prepare import purity
from soma_edge.corpus import kmeans, sources
from soma_edge.corpus import router as routing


def _machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    load = os.getloadavg()[0]
    return (
        f"{platform.machine()}, {os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, Python {platform.python_version()}, "
        f"numpy {np.__version__}, load average {load:.1f} at start"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="debian")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--windows", default="64,128,256,512")
    ap.add_argument("--ablate", action="store_true", help="also refit with other caps and centroids (slow)")
    args = ap.parse_args()
    print(f"machine: {_machine()}")

    with tempfile.TemporaryDirectory() as tmp:
        outside = None
        if args.corpus == "four":
            path, outside = _write_four(Path(tmp) / "four.jsonl")
            args.corpus = str(path)
        out = Path(tmp) / "run"
        cmd = [
            sys.executable,
            "-m",
            "coordinator",
            "prepare",
            args.corpus,
            "--experts",
            str(args.experts),
            "--seed",
            str(args.seed),
            "--out",
            str(out),
            "--json",
        ]
        t0 = time.perf_counter()
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        stdout, stderr = child.communicate()
        wall = time.perf_counter() - t0
        if child.returncode != 0:
            print(stderr.decode(), file=sys.stderr)
            return child.returncode
        peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # Linux: KiB
        s = json.loads(stdout)
        sizes = np.array([sum(c["bytes"].values()) for c in s["clusters"]], dtype=float)
        print(f"\n## prepare {args.corpus} --experts {args.experts} --seed {args.seed}\n")
        print(
            md_head(
                [
                    "documents",
                    "MB",
                    "clusters",
                    "purity",
                    "max/mean cluster bytes",
                    "min/mean",
                    "router KiB",
                    "wall s",
                    "peak RSS MiB",
                ]
            )
        )
        print(
            md_row(
                [
                    str(s["documents"]),
                    f"{s['bytes'] / 1e6:.1f}",
                    str(len(s["clusters"])),
                    str(s["purity"]),
                    f"{sizes.max() / sizes.mean():.3f}",
                    f"{sizes.min() / sizes.mean():.3f}",
                    f"{s['router']['bytes'] / 1024:.0f}",
                    f"{wall:.1f}",
                    f"{peak_mib:.0f}",
                ]
            )
        )

        router = routing.load(out / "router.msgpack")
        tests = [(c["expert"], (out / "shards" / f"{c['shards']['test']}.bin").read_bytes()) for c in s["clusters"]]
        print(
            f"\n## routing held-out text (test split, {sum(len(t) for _, t in tests) / 1e6:.2f} MB), "
            f"T = {router.temperature:.4f}\n"
        )
        print(md_head(["window bytes", "windows", "top-1 = own expert", "own expert in top-2", "routing MB/s"]))
        for w in [int(x) for x in args.windows.split(",")]:
            hit1 = hit2 = n = 0
            t0 = time.perf_counter()
            for expert, data in tests:
                if len(data) <= w:
                    continue
                experts, _ = router.route_windows(data, w, 2, router.temperature)
                hit1 += int((experts[1:, 0] == expert).sum())
                hit2 += int((experts[1:] == expert).any(axis=1).sum())
                n += experts.shape[0] - 1
            secs = time.perf_counter() - t0
            mb = sum(len(t) for _, t in tests) / 1e6
            print(md_row([str(w), str(n), f"{hit1 / n:.3f}", f"{hit2 / n:.3f}", f"{mb / secs:.1f}"]))
        if args.ablate:
            ablate(args.corpus, args.experts, args.seed, outside)
    return 0


def _write_four(path: Path, per_domain: int = 400_000) -> tuple[Path, list]:
    """The 4-domain JSONL, and up to 20 documents per domain that are not in it."""
    docs, outside = sources.default_documents(), []
    with open(path, "w") as f:
        for domain in ("shakespeare", "milton", "python", "pydoc"):
            got, ordered = 0, sorted((d for d in docs if d.domain == domain), key=lambda d: d.sha256)
            for i, d in enumerate(ordered):
                if got >= per_domain:
                    outside += ordered[i : i + 20]
                    break
                f.write(json.dumps({"text": d.text.decode("utf-8"), "domain": domain}) + "\n")
                got += len(d.text)
    return path, outside


def _agreement(router: routing.Router, pairs: list[tuple[bytes, int]], window: int) -> float:
    """Top-1 routing agreement: window i (routed on window i-1) goes to its text's expert."""
    hit = n = 0
    for text, expert in pairs:
        if len(text) > window:
            experts, _ = router.route_windows(text, window, 1, router.temperature)
            hit += int((experts[1:, 0] == expert).sum())
            n += experts.shape[0] - 1
    return hit / n


def _pairs(router: routing.Router, docs: list, labels: np.ndarray, outside: list | None) -> list:
    if outside is None:  # test documents, to the expert of their cluster
        return [(d.text, int(router.cluster_expert[k])) for d, k in zip(docs, labels.tolist()) if d.split == "test"]
    majority = {}
    for domain in {d.domain for d in docs}:
        experts = [router.cluster_expert[k] for d, k in zip(docs, labels.tolist()) if d.domain == domain]
        majority[domain] = int(np.bincount(experts).argmax())
    return [(d.text, majority[d.domain]) for d in outside]


def ablate(corpus_spec: str, experts: int, seed: int, outside: list | None) -> None:
    docs = sources.load_documents(corpus_spec)
    texts, train = [d.text for d in docs], [i for i, d in enumerate(docs) if d.split == "train"]
    sizes = np.array([len(t) for t in texts], dtype=float)
    where = "test documents" if outside is None else f"{len(outside)} documents outside the sample"
    print(f"\n## ablations ({experts} experts, seed {seed}; top-1 routing agreement on {where})\n")
    print(md_head(["cap", "routing centroids", "purity", "max/mean", "128-byte windows", "512-byte windows", "fit s"]))
    shipped = kmeans.SLACK
    try:
        for slack in (1.0, 1.1, 1.25):
            kmeans.SLACK = slack
            t0 = time.perf_counter()
            router, labels = routing.fit(texts, experts, seed=seed, fit_on=train)
            secs = time.perf_counter() - t0
            per, pairs = np.bincount(labels, weights=sizes), _pairs(router, docs, labels, outside)
            pur = purity([d.domain for d in docs], labels, sizes)
            cap = "mean + 1 doc" if slack == 1.0 else f"{slack} x mean"
            cells = [f"{pur:.3f}", f"{per.max() / per.mean():.2f}"]
            print(
                md_row(
                    [
                        cap,
                        "256-byte windows",
                        *cells,
                        f"{_agreement(router, pairs, 128):.3f}",
                        f"{_agreement(router, pairs, 512):.3f}",
                        f"{secs:.1f}",
                    ]
                )
            )
            if slack == 1.0:  # the same clusters, routed by whole-document centroids instead
                feats, lab = router.features([texts[i] for i in train]), labels[train]
                cent = np.stack([feats[lab == k].sum(axis=0, dtype=np.float64) for k in range(router.n_clusters)])
                router.centroids = (cent / np.linalg.norm(cent, axis=1, keepdims=True)).astype(np.float32)
                print(
                    md_row(
                        [
                            cap,
                            "whole documents",
                            *cells,
                            f"{_agreement(router, pairs, 128):.3f}",
                            f"{_agreement(router, pairs, 512):.3f}",
                            "",
                        ]
                    )
                )
    finally:
        kmeans.SLACK = shipped


if __name__ == "__main__":
    sys.exit(main())
