"""Routed top-k inference throughput: does routed scoring cost depend on k and not on N?

    .venv/bin/python -m bench.routed_inference [--bytes 65536] [--threads 1] [--experts 1,4,16,64] [--top-k 1,2,4]

Three tables, all measured in one run through the real deploy path (soma_edge.corpus.router fitted on the default
corpus, `soma-export onnx` bundles, export.infer sessions):
1. fixed per-expert size: bytes/s of scoring held-out text with top-k routing, against all N experts (dense);
2. fixed total parameter count (the preprint's setting: more, smaller experts), the same grid;
3. per-byte streaming latency of generation (routing, state, mixing, sampling) against a bare ORT session
   looping the same streaming graph.
The weights are untrained (seeded init): throughput does not depend on their values. Session creation and
a first run are excluded from every timing; cells are measured round-robin, best of --repeats rounds.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime

from export import bundle
from export.infer import Deployment, generate
from soma_edge import checkpoint
from soma_edge.config import Config, DataConfig, ModelConfig
from soma_edge.corpus import documents, router, sources
from soma_edge.engine.runtime import cpu_count, make_session
from soma_edge.expert import params

SEQ_LEN = 128
PER_EXPERT = ModelConfig(embed=32, hidden=128, layers=1)  # 124K params
# With one intra-op thread ORT runs in the calling thread, so that thread's CPU time is all the work and
# leaves out time lost to the neighbours on a shared box; with more threads only wall time is honest.
CLOCKS = {time.thread_time: "CPU time of the calling thread", time.perf_counter: "wall time"}
STREAM_S = ModelConfig(embed=64, hidden=416, layers=1)  # the "S" expert of docs/BENCHMARKS.md, 0.92M params


def hidden_for(n_params: int, embed: int) -> int:
    """The hidden size whose one-layer expert has about n_params parameters."""
    # count = 256E + 4H(E+H) + 8H + 256H + 256  ->  4H^2 + (4E + 264)H + (256E + 256 - n) = 0
    a, b, c = 4.0, 4.0 * embed + 264.0, 256.0 * embed + 256.0 - n_params
    return max(4, int(round((-b + np.sqrt(b * b - 4 * a * c)) / (2 * a))))


def fixed_total(n: int, total: int) -> ModelConfig:
    per = total // n
    embed = 16 if per < 60_000 else 32 if per < 400_000 else 64
    return ModelConfig(embed=embed, hidden=hidden_for(per, embed), layers=1)


def write_run(root: Path, m: ModelConfig, r: router.Router) -> None:
    cfg = Config(model=m, data=DataConfig(seq_len=SEQ_LEN), device="cpu")
    checkpoint.atomic_write(root / "router.msgpack", r.to_bytes())
    experts = {}
    for e in range(r.n_experts):
        w = params.init(m, e)
        sha = hashlib.sha256(w.tobytes()).hexdigest()
        rel = f"experts/{e}/v1.msgpack"
        body = {
            "expert": e,
            "version": 1,
            "sha256": sha,
            "config": cfg.to_dict(),
            "step": 0,
            "weights": w,
            "val_loss": None,
        }
        checkpoint.save(root / rel, body, "expert")
        experts[str(e)] = {"version": 1, "sha256": sha, "path": rel}
    checkpoint.save(root / "state.msgpack", {"round": 0, "experts": experts}, "run_state")


def heldout(docs: list[documents.Document], n_bytes: int) -> np.ndarray:
    """n_bytes of test text in 4 KiB pieces from documents spread over the split (so routing moves)."""
    piece = 4096
    picks = np.linspace(0, len(docs) - 1, max(1, n_bytes // piece)).astype(int)
    return np.frombuffer(b"".join(docs[i].text[:piece] for i in picks)[:n_bytes], dtype=np.uint8)


def deploy_for(tmp: Path, name: str, m: ModelConfig, r: router.Router, threads: int, data: np.ndarray) -> Deployment:
    write_run(tmp / name, m, r)
    bundle.write(tmp / name, tmp / f"{name}.deploy")
    dep = Deployment(tmp / f"{name}.deploy", device="cpu", threads=threads)
    dep.score(data[: 8 * SEQ_LEN], r.n_experts)  # warm-up: every session created and run once
    return dep


def grid(
    title: str,
    tag: str,
    models: dict[int, ModelConfig],
    routers: dict[int, router.Router],
    tmp: Path,
    data: np.ndarray,
    ks: list[int],
    threads: int,
    repeats: int,
) -> None:
    """Every cell measured once per round, round-robin, best of `repeats` rounds: the box is shared and
    noisy, and a burst of load then hits all cells alike instead of one row."""
    deps = {n: deploy_for(tmp, f"{tag}-{n}", m, routers[n], threads, data) for n, m in models.items()}
    cells = [(n, k) for n in deps for k in sorted({k for k in ks if k <= n} | {n})]  # k = n is dense
    best = dict.fromkeys(cells, 0.0)
    clock = time.thread_time if threads == 1 else time.perf_counter
    for _ in range(repeats):
        for n, k in cells:
            t0 = clock()
            r = deps[n].score(data, k)
            best[n, k] = max(best[n, k], r.bytes / (clock() - t0))
    print(
        f"\n{title} ({data.size} held-out bytes, seq_len {SEQ_LEN}, {threads} thread(s) per session, best of "
        f"{repeats}, {CLOCKS[clock]})"
    )
    head = f"{'N':>4} {'expert':>10} {'params/expert':>13} {'total':>10} " + " ".join(
        f"{f'top-{k} B/s':>10}" for k in ks
    )
    print(head + f" {'dense B/s':>10} " + " ".join(f"{f'top-{k}/dense':>11}" for k in ks))
    for n, m in models.items():
        dense = best[n, n]
        rates = " ".join(f"{best[n, k]:>10.0f}" if k <= n else f"{'-':>10}" for k in ks)
        ratios = " ".join(f"{best[n, k] / dense:>11.2f}" if k <= n else f"{'-':>11}" for k in ks)
        p = params.count(m)
        print(f"{n:>4} {f'E{m.embed}/H{m.hidden}':>10} {p:>13,} {n * p:>10,} {rates} {dense:>10.0f} {ratios}")
    if len(set(map(params.count, models.values()))) == 1:  # same expert everywhere: does N matter?
        for k in ks:
            row = [best[n, k] for n in models if k <= n and n > 1]
            if len(row) > 1:
                print(f"top-{k} across N > 1: max/min = {max(row) / min(row):.2f}")


def streaming(dep: Deployment, n_bytes: int, ks: list[int], repeats: int) -> None:
    """µs per generated byte: our generate() against a bare ORT loop on one expert's streaming graph,
    measured round-robin (best of `repeats`)."""
    e0 = dep.bundle.experts[0]
    sess = make_session(dep.bundle.read_verified(e0.stream), "cpu", 1)
    H = int(e0.model["hidden"])
    rng = np.random.default_rng(0)

    def bare(sample: bool) -> None:
        feeds = {
            "x": np.array([[32]], dtype=np.int64),
            "h0": np.zeros((1, 1, H), np.float32),
            "c0": np.zeros((1, 1, H), np.float32),
        }
        for _ in range(n_bytes):
            logits, h, c = sess.run(None, feeds)
            b = 32
            if sample:  # the least work any sampler must do per byte: softmax and one draw
                z = logits[0, -1].astype(np.float64)
                p = np.exp(z - z.max())
                cdf = np.cumsum(p)
                b = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), 255)
            feeds = {"x": np.array([[b]], dtype=np.int64), "h0": h, "c0": c}

    paths = {
        "bare ORT session.run loop (no sampling)": lambda: bare(False),
        "bare ORT loop + softmax sample": lambda: bare(True),
    }
    for k in ks:
        paths[f"soma-export generate path, top-{k}"] = lambda k=k: [
            None for _ in generate(dep, b"The ", n_bytes, k, seed=1)
        ]
    best = dict.fromkeys(paths, float("inf"))
    for fn in paths.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in paths.items():
            t0 = time.thread_time()
            fn()
            best[name] = min(best[name], (time.thread_time() - t0) / n_bytes * 1e6)
    ref, ref_s = best["bare ORT session.run loop (no sampling)"], best["bare ORT loop + softmax sample"]
    print(
        f"\nstreaming generation, µs per byte ({n_bytes} bytes, 1 thread, N={dep.n_experts} experts of "
        f"E{e0.model['embed']}/H{H}, routed every {SEQ_LEN} bytes, best of {repeats}, {CLOCKS[time.thread_time]})"
    )
    print(f"{'path':<42} {'µs/byte':>8} {'/ bare run':>10} {'/ bare+sample':>14}")
    for name, t in best.items():
        print(f"{name:<42} {t:>8.1f} {t / ref:>10.2f} {t / ref_s:>14.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=int, default=65536, help="held-out bytes scored per measurement")
    ap.add_argument("--experts", default="1,4,16,64")
    ap.add_argument("--top-k", default="1,2,4")
    ap.add_argument("--total-params", type=int, default=2_000_000, help="the fixed total of table 2")
    ap.add_argument("--threads", type=int, default=1, help="ORT intra-op threads per session")
    ap.add_argument("--repeats", type=int, default=3, help="best of this many rounds per cell")
    ap.add_argument("--stream-bytes", type=int, default=2000)
    args = ap.parse_args()
    ns = [int(v) for v in args.experts.split(",")]
    ks = [int(v) for v in args.top_k.split(",")]
    print(
        f"machine: {platform.machine()}, {cpu_count()} cores, {platform.platform()},"
        f" python {platform.python_version()}, "
        f"onnxruntime {onnxruntime.__version__}, numpy {np.__version__}"
    )
    t_start = time.perf_counter()
    docs = documents.by_split(sources.default_documents())
    train = [d.text for d in docs["train"]]
    data = heldout(docs["test"], args.bytes)
    routers = {n: router.fit(train, n, seed=0)[0] for n in ns}
    with tempfile.TemporaryDirectory(prefix="soma-bench-") as tmp:
        tmp = Path(tmp)
        grid(
            "fixed per-expert size",
            "fixed",
            {n: PER_EXPERT for n in ns},
            routers,
            tmp,
            data,
            ks,
            args.threads,
            args.repeats,
        )
        grid(
            f"fixed total of ~{args.total_params:,} params",
            "total",
            {n: fixed_total(n, args.total_params) for n in ns},
            routers,
            tmp,
            data,
            ks,
            args.threads,
            args.repeats,
        )
        n_stream = 16 if 16 in ns else ns[-1]
        stream_ks = [k for k in ks if k <= n_stream][:2]
        dep = Deployment(tmp / f"fixed-{n_stream}.deploy", device="cpu", threads=1)
        streaming(dep, args.stream_bytes, stream_ks, args.repeats)
        # The "S" expert (0.92M params): the same fixed per-byte overhead weighs less
        r = routers.get(n_stream) or router.fit(train, n_stream, seed=0)[0]
        dep = deploy_for(tmp, "stream-S", STREAM_S, r, 1, data)
        streaming(dep, args.stream_bytes, stream_ks, args.repeats)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
