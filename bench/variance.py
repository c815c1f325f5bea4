"""Gradient-estimator variance: one shared loss vs separable per-expert losses, against backprop.

    .venv/bin/python -m bench.variance [--params 120000] [--trials 100] [--kind lstm|soma]
        [--noise rademacher,gaussian,sparse,rank1] [--plot PNG] [--json]

At a fixed checkpoint and a fixed batch of real text per expert, the true gradient g comes from torch
autograd (the reference whose loss matches the ORT graph, see tests/test_parity.py). SPSA then probes the
ORT loss along Rademacher directions. From the same probes (the same z, the same loss values) it forms:
- shared:    one scalar loss L = Σ_e L_e, all M parameters perturbed jointly:
             ĝ = (1/K) Σ_k [(L(w+εz_k) - L(w-εz_k)) / 2ε] z_k
- separable: each expert's own loss difference times its own slice of z_k (SOMA).
It reports E‖ĝ-g‖²/‖g‖² and cos(ĝ, g) over `trials`, against the Rademacher theory (M-1)/K (shared) and
(M/N-1)/K (separable, experts of M/N parameters). Total parameter count M is held fixed across N.

`--noise` gives rows for each probe kind: rademacher (the default), gaussian, sparse (density 0.5, norm
gains dense, the estimate scaled by 1/density so it stays unbiased) and rank1 (each matrix a·bᵀ, as
`spsa.noise = "rank1"`), each against its own theory: rank-1 has Rademacher's second moment, so the same
(M-1)/K. The kinds share keys, so rank-1's signs are a prefix of Rademacher's stream: compare them in
expectation, not trial by trial.

With `--kind soma` the experts are the paper's (two residual blocks of width d, d chosen to fit) and M
counts what SPSA perturbs in that recipe: the body, every weight but the tied byte matrix E, which the
delta rule trains instead. The true gradient is still the full one, through both of E's roles.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import expert_shape, machine, perturbed, pyplot, savefig, say
from soma_edge.config import ModelConfig
from soma_edge.corpus import documents, sources
from soma_edge.engine.evaluator import LossEvaluator
from soma_edge.engine.runtime import cpu_count
from soma_edge.expert import params
from soma_edge.spsa.noise import body_shapes, noise, probe_mask, rank1_probe


def true_grads(m: ModelConfig, weights: list[np.ndarray], batches) -> list[np.ndarray]:
    import torch  # optional (the bench extra): only the true gradient needs it

    from bench.torch_ref import reference  # torch, as above

    out = []
    for w, (x, y) in zip(weights, batches):
        model = reference(m, w)
        model(torch.from_numpy(x), torch.from_numpy(y)).backward()
        out.append(model.flat_grad().astype(np.float64)[: perturbed(m)])
    return out


PROBES = ("rademacher", "gaussian", "sparse", "rank1")
SPARSE_DENSITY = 0.5  # the `sparse` rows: spsa.density's default


@dataclass
class Probes:
    """How one row's directions are drawn: `kind` (PROBES), over the expert's first `size` weights."""

    kind: str
    size: int
    shapes: tuple[tuple[int, ...], ...]  # the tensors of those weights (rank-1 probes need them)
    keep_scale: np.ndarray | None  # sparse: 1 / P(weight probed), so the estimate stays unbiased

    def draw(self, seed: int, expert: int, t: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(z, v): the probe w ± εz and the vector the loss difference multiplies (v = z but for sparse)."""
        if self.kind == "rank1":
            z = rank1_probe(seed, expert, t, k, self.shapes).astype(np.float64)
        elif self.kind == "sparse":
            z = noise(seed, expert, t, k, self.size).astype(np.float64)
            keep = probe_mask(seed, expert, t, k, self.size, SPARSE_DENSITY)
            if self.keep_scale is not None:
                keep |= self.keep_scale == 1
            z *= keep
            return z, z * (self.keep_scale if self.keep_scale is not None else 1 / SPARSE_DENSITY)
        else:
            z = noise(seed, expert, t, k, self.size, self.kind).astype(np.float64)
        return z, z

    def theory(self, size: int) -> float:
        """E‖(gᵀv) v - g‖² / ‖g‖² of one direction over `size` weights (isotropic g for sparse)."""
        if self.kind == "gaussian":
            return size + 1.0  # E[(gᵀz)² ‖z‖²] = (size + 2)‖g‖², less ‖g‖²
        if self.kind == "sparse":
            return size - 2 + 1 / SPARSE_DENSITY  # E‖(gᵀv) v‖² = (1/p + size - 1)‖g‖², less ‖g‖²
        return size - 1.0  # Rademacher, and rank-1: E[z zᵀ] = I and ‖z‖² = size, the same second moment


def probes(kind: str, m: ModelConfig) -> Probes:
    lay, size = params.layout(m), perturbed(m)
    dense = lay.dense()
    scale = None if dense is None else np.where(dense[:size], 1.0, 1 / SPARSE_DENSITY)
    return Probes(kind, size, body_shapes(lay.shapes, size), scale)


def measure(
    total: int,
    n: int,
    ks: list[int],
    trials: int,
    eps: float,
    batch: int,
    seq: int,
    data: np.ndarray,
    seed: int,
    kind: str = "lstm",
    noises: tuple[str, ...] = ("rademacher",),
) -> dict:
    m = expert_shape(total, n, kind)
    ev = LossEvaluator(m, "cpu", threads=cpu_count(), parallel=1)
    weights = [params.init(m, seed + e) for e in range(n)]
    batches = [documents.sample_batch(data, batch, seq, documents.batch_rng(seed, e, 0)) for e in range(n)]
    g = true_grads(m, weights, batches)
    # Check the reference and the ORT graph agree at this checkpoint, or the "true" gradient is not ours.
    from bench.torch_ref import torch_loss  # torch is optional (the bench extra): only this check needs it

    for w, (x, y) in zip(weights, batches[:1]):
        assert abs(ev.loss(w, x, y) - torch_loss(m, w, x, y)) < 1e-4
    rows = []
    for noise_kind in noises:
        say(f"  {noise_kind} ...")
        pr = probes(noise_kind, m)
        err, cos = _trials(ev, m, pr, weights, batches, g, ks, trials, eps, seed)
        rows += _rows(pr, n, m, ks, trials, err, cos)
    return {"rows": rows}


def _trials(ev, m, pr: Probes, weights, batches, g, ks, trials, eps, seed) -> tuple[dict, dict]:
    """Per estimator and K: each trial's E‖ĝ-g‖²/‖g‖² and cos(ĝ, g), from the same probes for both."""
    n, kmax, sizes = len(weights), max(ks), pr.size
    g_norm2 = sum(float(gi @ gi) for gi in g)
    err = {est: {k: [] for k in ks} for est in ("shared", "separable")}
    cos = {est: {k: [] for k in ks} for est in ("shared", "separable")}
    for t in range(trials):
        sums = {est: [np.zeros(sizes) for _ in range(n)] for est in err}
        for k in range(kmax):
            drawn = [pr.draw(seed, e, t, k) for e in range(n)]
            d = []
            for e in range(n):
                x, y = batches[e]
                zp = np.zeros(params.count(m), dtype=np.float32)
                zp[:sizes] = eps * drawn[e][0]
                lp = ev.loss(weights[e] + zp, x, y)
                lm = ev.loss(weights[e] - zp, x, y)
                d.append((lp - lm) / (2 * eps))
            shared = sum(d)
            for e in range(n):
                sums["separable"][e] += d[e] * drawn[e][1]
                sums["shared"][e] += shared * drawn[e][1]
            if k + 1 in err["shared"]:
                kk = k + 1
                for est in err:
                    ghat = [s / kk for s in sums[est]]
                    diff = sum(float((gh - gi) @ (gh - gi)) for gh, gi in zip(ghat, g))
                    dot = sum(float(gh @ gi) for gh, gi in zip(ghat, g))
                    nh = np.sqrt(sum(float(gh @ gh) for gh in ghat))
                    err[est][kk].append(diff / g_norm2)
                    cos[est][kk].append(dot / (nh * np.sqrt(g_norm2)))
    return err, cos


def _rows(pr: Probes, n: int, m: ModelConfig, ks, trials, err, cos) -> list[dict]:
    sizes = pr.size
    M = n * sizes
    return [
        {
            "noise": pr.kind,
            "N": n,
            "K": k,
            "M": M,
            "expert_params": sizes,
            "hidden": m.hidden,
            "shared": float(np.mean(err["shared"][k])),
            "separable": float(np.mean(err["separable"][k])),
            "shared_sem": float(np.std(err["shared"][k]) / np.sqrt(trials)),
            "separable_sem": float(np.std(err["separable"][k]) / np.sqrt(trials)),
            "cos_shared": float(np.mean(cos["shared"][k])),
            "cos_separable": float(np.mean(cos["separable"][k])),
            "cos_shared_sem": float(np.std(cos["shared"][k]) / np.sqrt(trials)),
            "cos_separable_sem": float(np.std(cos["separable"][k]) / np.sqrt(trials)),
            "theory_shared": pr.theory(M) / k,
            "theory_separable": pr.theory(sizes) / k,
        }
        for k in ks
    ]


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ns = sorted({r["N"] for r in rows})
    colors = plt.cm.viridis(np.linspace(0, 0.85, len(ns)))
    ax = axes[0]
    for n, c in zip(ns, colors):
        rs = [r for r in rows if r["N"] == n]
        ks = [r["K"] for r in rs]
        ax.loglog(ks, [r["separable"] for r in rs], "o-", color=c, label=f"separable N={n}")
        ax.loglog(ks, [r["theory_separable"] for r in rs], ":", color=c)
    rs = [r for r in rows if r["N"] == ns[-1]]
    ax.loglog([r["K"] for r in rs], [r["shared"] for r in rs], "ks--", label="shared (any N)")
    ax.set_xlabel("K directions")
    ax.set_ylabel("E‖ĝ−g‖² / ‖g‖²")
    ax.set_title("relative variance (dotted: theory)")
    ax.legend(fontsize=8)
    ax = axes[1]
    for k in sorted({r["K"] for r in rows}):
        rs = [r for r in rows if r["K"] == k]
        ax.loglog([r["N"] for r in rs], [r["separable"] / r["shared"] for r in rs], "o-", label=f"K={k}")
    ax.loglog(ns, [1 / n for n in ns], "k:", label="1/N")
    ax.minorticks_off()
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_yticks([1 / n for n in ns], ["1" if n == 1 else f"1/{n}" for n in ns])
    ax.set_xlabel("N experts (fixed total M)")
    ax.set_ylabel("separable / shared variance")
    ax.set_title("variance ratio")
    ax.legend(fontsize=8)
    fig.tight_layout()
    savefig(fig, Path(path), dpi=90)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=120_000, help="total parameter count M, fixed across N")
    ap.add_argument("--experts", default="1,2,4,8")
    ap.add_argument("--k", default="1,4,16,64")
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--eps", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kind", default="lstm", choices=["lstm", "soma"], help="model.kind of the experts")
    ap.add_argument(
        "--noise", default="rademacher", help=f"comma-separated probe kinds, rows for each: {', '.join(PROBES)}"
    )
    ap.add_argument("--plot", default=None, help="write a PNG plot here")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    ns, ks = [int(v) for v in args.experts.split(",")], sorted(int(v) for v in args.k.split(","))
    noises = tuple(args.noise.split(","))
    if not set(noises) <= set(PROBES):
        ap.error(f"--noise: {args.noise!r} is not a list of {', '.join(PROBES)}")
    data = documents.to_stream(documents.by_split(sources.default_documents())["train"])
    t0 = time.perf_counter()
    rows = []
    for n in ns:
        say(f"N={n} ...")
        rows += measure(
            args.params, n, ks, args.trials, args.eps, args.batch, args.seq, data, args.seed, args.kind, noises
        )["rows"]
    for r in rows:
        if r["N"] == 1:  # one expert: the shared and separable estimators are the same numbers
            assert abs(r["shared"] - r["separable"]) <= 1e-9 * max(1.0, r["shared"]), r
    out = {
        "machine": machine(),
        "seconds": time.perf_counter() - t0,
        "trials": args.trials,
        "eps": args.eps,
        "kind": args.kind,
        "rows": rows,
    }
    if args.plot:
        plot([r for r in rows if r["noise"] == noises[0]], args.plot)
    if args.json:
        print(json.dumps(out))
        return out
    print(
        f"kind={args.kind} trials={args.trials} eps={args.eps} batch={args.batch}x{args.seq}; {out['machine']}; "
        f"{out['seconds']:.0f} s"
    )
    hdr = (
        f"{'noise':>10} {'N':>3} {'K':>3} {'M':>7} {'M/N':>6} {'shared':>9} {'theory':>9} {'separable':>9} "
        f"{'theory':>9} {'ratio':>6} {'1/N':>5} {'cos sh':>6} {'cos sep':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r['noise']:>10} {r['N']:>3} {r['K']:>3} {r['M']:>7} {r['expert_params']:>6} {r['shared']:>9.1f} "
            f"{r['theory_shared']:>9.1f} {r['separable']:>9.1f} {r['theory_separable']:>9.1f} "
            f"{r['separable'] / r['shared']:>6.3f} {1 / r['N']:>5.3f} {r['cos_shared']:>6.3f} "
            f"{r['cos_separable']:>7.3f}"
        )
    return out


if __name__ == "__main__":
    main()
