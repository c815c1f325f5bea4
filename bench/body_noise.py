"""Where the body's zero-order estimate loses its signal: per tensor, the true gradient's energy against a
minibatch's, by torch autograd at an expert's weights.

    .venv/bin/python -m bench.body_noise [--checkpoint PATH] [--rows 16,1] [--batches 200] [--seed 0]

`PATH` is what `soma-worker train --out` writes (default: the demo expert's init). For each body tensor t it
draws `--batches` minibatches of `rows` rows x 128 bytes from the default corpus's train split and prints the
signal S_t = |E g_t|² (unbiased: the squared mean less its variance's share) and E|g_t|² over minibatches,
whose excess over S_t is the data noise. A central difference measures (z . g_b), so the SPSA estimate's
variance grows with M E|g_b|²: with `rows` = 16 that is one direction on the whole batch, with 1 each of 16
directions on its own row (spsa.split_rows), which cuts the variance only by E|g_16|² / E|g_1|² x 16.

It also prints what per-tensor probe scales s_t could gain in the two progress bounds: for SGD on the
estimate, (Σ s² S)² / (Σ s² n · Σ s² N), and for Adam (which divides each weight's step by the estimate's
RMS, the same for every weight), (Σ s S)² / (M Σ s² N), whose best is Σ S²/N at s_t ∝ S_t / N_t.
"""

from __future__ import annotations

import argparse

import numpy as np

from bench.common import md_head, md_row
from soma_edge import checkpoint
from soma_edge.config import Config
from soma_edge.corpus import documents, sources
from soma_edge.expert import params


def gradients(flat: np.ndarray, cfg: Config, train: np.ndarray, rows: int, batches: int, seed: int):
    """tensor name -> float64 [batches, size]: each minibatch's body gradient, by torch autograd."""
    import torch  # the bench extra: the reference model only

    from bench.torch_ref import reference

    torch.set_num_threads(1)
    model = reference(cfg.model, flat)
    rng = np.random.default_rng(seed)
    seq = cfg.data.seq_len
    out: dict[str, list[np.ndarray]] = {}
    for _ in range(batches):
        starts = rng.integers(0, len(train) - seq - 1, rows)
        x = np.stack([train[s : s + seq] for s in starts]).astype(np.int64)
        y = np.stack([train[s + 1 : s + seq + 1] for s in starts]).astype(np.int64)
        model.zero_grad()
        model(torch.from_numpy(x), torch.from_numpy(y)).backward()
        for name, p in model.named_parameters():
            if not name.startswith("head"):  # the delta rule's part: not SPSA's
                out.setdefault(name, []).append(p.grad.detach().numpy().ravel().astype(np.float64))
    return {name: np.stack(g) for name, g in out.items()}


def energies(grads: dict[str, np.ndarray]) -> dict[str, tuple[int, float, float]]:
    """name -> (size n, signal S = |E g|², E|g|²)."""
    out = {}
    for name, g in grads.items():
        mean = g.mean(axis=0)
        signal = float(mean @ mean) - float(g.var(axis=0).sum()) / len(g)
        out[name] = (g.shape[1], signal, float(np.mean(np.sum(g * g, axis=1))))
    return out


def bounds(e: dict[str, tuple[int, float, float]]) -> tuple[float, float]:
    """The best per-tensor probe scales' gain over uniform probes: (SGD by a coordinate search, Adam exact)."""
    names = list(e)
    n, S, N = (np.array([e[k][i] for k in names]) for i in range(3))

    def sgd(s2):
        return (s2 @ S) ** 2 / ((s2 @ n) * (s2 @ N))

    s2 = np.ones(len(names))
    for _ in range(200):  # a coordinate search over log-scales (the bound is scale-free)
        for i in range(len(names)):
            trial = [s2 * np.where(np.arange(len(names)) == i, f, 1.0) for f in (0.5, 0.8, 1.25, 2.0)]
            s2 = max([s2, *trial], key=sgd)
    adam = float(np.sum(S * S / N) / (S.sum() ** 2 / N.sum()))
    return float(sgd(s2) / sgd(np.ones(len(names)))), adam


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.body_noise", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="weights from `soma-worker train --out` (default: the demo expert's init)")
    p.add_argument("--rows", default="16,1")
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cfg = Config()
    flat = checkpoint.load(args.checkpoint, "expert")["weights"] if args.checkpoint else params.init(cfg.model, 0)
    train = documents.to_stream(documents.by_split(sources.default_documents())["train"])
    for rows in (int(r) for r in args.rows.split(",")):
        e = energies(gradients(flat, cfg, train, rows, args.batches, args.seed))
        print(f"\n{rows} row(s) a minibatch, {args.batches} minibatches\n")
        print(md_head(["tensor", "weights", "signal |E g|²", "E|g|²", "signal share", "S/E|g|²"]))
        total = sum(s for _, s, _ in e.values())
        for name, (size, s, both) in e.items():
            print(md_row([name, f"{size:,}", f"{s:.3e}", f"{both:.3e}", f"{s / total:.2f}", f"{s / both:.3f}"]))
        all_s, all_n = total, sum(b for _, _, b in e.values())
        print(
            md_row(
                [
                    "body",
                    f"{sum(v[0] for v in e.values()):,}",
                    f"{all_s:.3e}",
                    f"{all_n:.3e}",
                    "1",
                    f"{all_s / all_n:.3f}",
                ]
            )
        )
        sgd, adam = bounds(e)
        print(
            f"\nbest per-tensor probe scales, progress bound against uniform probes: SGD x{sgd:.2f}, Adam x{adam:.3f}"
        )


if __name__ == "__main__":
    main()
