"""Gradient-estimator variance: one shared loss vs separable per-expert losses, against backprop.

    .venv/bin/python -m bench.variance [--params 120000] [--trials 100] [--kind lstm|soma] [--plot PNG] [--json]

At a fixed checkpoint and a fixed batch of real text per expert, the true gradient g comes from torch
autograd (the reference whose loss matches the ORT graph, see tests/test_parity.py). SPSA then probes the
ORT loss along Rademacher directions. From the same probes (the same z, the same loss values) it forms:
- shared:    one scalar loss L = Σ_e L_e, all M parameters perturbed jointly:
             ĝ = (1/K) Σ_k [(L(w+εz_k) - L(w-εz_k)) / 2ε] z_k
- separable: each expert's own loss difference times its own slice of z_k (SOMA).
It reports E‖ĝ-g‖²/‖g‖² and cos(ĝ, g) over `trials`, against the Rademacher theory (M-1)/K (shared) and
(M/N-1)/K (separable, experts of M/N parameters). Total parameter count M is held fixed across N.

With `--kind soma` the experts are the paper's (two residual blocks of width d, d chosen to fit) and M
counts what SPSA perturbs in that recipe: the body, every weight but the tied byte matrix E, which the
delta rule trains instead. The true gradient is still the full one, through both of E's roles.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from bench.common import expert_shape, machine, perturbed, pyplot, savefig, say
from soma_edge import corpus, params
from soma_edge.config import ModelConfig
from soma_edge.runtime import LossEvaluator, cpu_count
from soma_edge.spsa import noise


def true_grads(m: ModelConfig, weights: list[np.ndarray], batches) -> list[np.ndarray]:
    import torch  # optional (the bench extra): only the true gradient needs it

    from bench.torch_ref import reference  # torch, as above

    out = []
    for w, (x, y) in zip(weights, batches):
        model = reference(m, w)
        model(torch.from_numpy(x), torch.from_numpy(y)).backward()
        out.append(model.flat_grad().astype(np.float64)[: perturbed(m)])
    return out


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
) -> dict:
    m = expert_shape(total, n, kind)
    ev = LossEvaluator(m, "cpu", threads=cpu_count(), parallel=1)
    weights = [params.init(m, seed + e) for e in range(n)]
    batches = [corpus.sample_batch(data, batch, seq, corpus.batch_rng(seed, e, 0)) for e in range(n)]
    g = true_grads(m, weights, batches)
    g_norm2 = sum(float(gi @ gi) for gi in g)
    # Check the reference and the ORT graph agree at this checkpoint, or the "true" gradient is not ours.
    from bench.torch_ref import torch_loss  # torch is optional (the bench extra): only this check needs it

    for w, (x, y) in zip(weights, batches[:1]):
        assert abs(ev.loss(w, x, y) - torch_loss(m, w, x, y)) < 1e-4

    kmax, sizes = max(ks), perturbed(m)
    err = {est: {k: [] for k in ks} for est in ("shared", "separable")}
    cos = {est: {k: [] for k in ks} for est in ("shared", "separable")}
    for t in range(trials):
        sums = {est: [np.zeros(sizes) for _ in range(n)] for est in err}
        for k in range(kmax):
            zs = [noise(seed, e, t, k, sizes).astype(np.float64) for e in range(n)]
            d = []
            for e in range(n):
                x, y = batches[e]
                zp = np.zeros(params.count(m), dtype=np.float32)
                zp[:sizes] = eps * zs[e]
                lp = ev.loss(weights[e] + zp, x, y)
                lm = ev.loss(weights[e] - zp, x, y)
                d.append((lp - lm) / (2 * eps))
            shared = sum(d)
            for e in range(n):
                sums["separable"][e] += d[e] * zs[e]
                sums["shared"][e] += shared * zs[e]
            if k + 1 in err["shared"]:
                kk = k + 1
                for est in err:
                    ghat = [s / kk for s in sums[est]]
                    diff = sum(float((gh - gi) @ (gh - gi)) for gh, gi in zip(ghat, g))
                    dot = sum(float(gh @ gi) for gh, gi in zip(ghat, g))
                    nh = np.sqrt(sum(float(gh @ gh) for gh in ghat))
                    err[est][kk].append(diff / g_norm2)
                    cos[est][kk].append(dot / (nh * np.sqrt(g_norm2)))
    rows = []
    M = n * sizes
    for k in ks:
        rows.append(
            {
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
                "theory_shared": (M - 1) / k,
                "theory_separable": (sizes - 1) / k,
            }
        )
    return {"rows": rows}


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
    ap.add_argument("--plot", default=None, help="write a PNG plot here")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    ns, ks = [int(v) for v in args.experts.split(",")], sorted(int(v) for v in args.k.split(","))
    data = corpus.to_stream(corpus.by_split(corpus.default_documents())["train"])
    t0 = time.perf_counter()
    rows = []
    for n in ns:
        say(f"N={n} ...")
        rows += measure(args.params, n, ks, args.trials, args.eps, args.batch, args.seq, data, args.seed, args.kind)[
            "rows"
        ]
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
        plot(rows, args.plot)
    if args.json:
        print(json.dumps(out))
        return out
    print(
        f"kind={args.kind} trials={args.trials} eps={args.eps} batch={args.batch}x{args.seq}; {out['machine']}; "
        f"{out['seconds']:.0f} s"
    )
    hdr = (
        f"{'N':>3} {'K':>3} {'M':>7} {'M/N':>6} {'shared':>9} {'theory':>9} {'separable':>9} {'theory':>9} "
        f"{'ratio':>6} {'1/N':>5} {'cos sh':>6} {'cos sep':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r['N']:>3} {r['K']:>3} {r['M']:>7} {r['expert_params']:>6} {r['shared']:>9.1f} "
            f"{r['theory_shared']:>9.1f} {r['separable']:>9.1f} {r['theory_separable']:>9.1f} "
            f"{r['separable'] / r['shared']:>6.3f} {1 / r['N']:>5.3f} {r['cos_shared']:>6.3f} "
            f"{r['cos_separable']:>7.3f}"
        )
    return out


if __name__ == "__main__":
    main()
