"""An expert's weights as one flat float32 vector with named views, for both model kinds.

SPSA perturbs the flat vector; the ONNX graphs see named tensors. The views are numpy views of the
flat buffer, so feeding a perturbed weight set to ORT copies nothing.

Tensors are stored in ONNX `LSTM` layout: W [1, 4H, in], R [1, 4H, H], B [1, 8H], gates in ONNX order
(i, o, f, c). torch.nn.LSTM orders its gates (i, f, g, o); `to_torch_gates` converts for the reference.
The soma kind's LSTMs are bias-free (no B), its MLP matrices are stored as MatMul operands (x @ W1), and its
gain-only LayerNorms end in ".g". The decoder (head.W/head.b, or the tied E) is always last.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from soma_edge.config import ModelConfig

VOCAB = 256


LSTM_DECODER = ("head.W", "head.b")  # the lstm kind's decoder
TIED_DECODER = ("E",)  # the soma kind's byte matrix: embedding and decoder in one


@dataclass(frozen=True)
class Layout:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    size: int
    decoder: tuple[str, ...]  # the decoder's tensors: always the layout's last entries

    @property
    def body(self) -> int:
        """Length of the body: flat[:body] is everything but the decoder, flat[body:] the decoder.

        Keeping the decoder last makes "perturb the body only" a prefix of the flat vector."""
        return self.offsets[self.names.index(self.decoder[0])]

    def dense(self) -> np.ndarray | None:
        """bool[size], True on norm gains (which sparse probes always touch), or None if there are none."""
        gains = [i for i, n in enumerate(self.names) if n.endswith(".g")]
        if not gains:
            return None
        mask = np.zeros(self.size, dtype=bool)
        for i in gains:
            mask[self.offsets[i] : self.offsets[i] + int(np.prod(self.shapes[i]))] = True
        return mask

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        if flat.shape != (self.size,) or flat.dtype != np.float32:
            raise ValueError(f"expected float32[{self.size}], got {flat.dtype}{list(flat.shape)}")
        return {n: flat[o : o + int(np.prod(s))].reshape(s) for n, s, o in zip(self.names, self.shapes, self.offsets)}


def _lstm_entries(m: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    E, H = m.embed, m.hidden
    entries: list[tuple[str, tuple[int, ...]]] = [("embed", (VOCAB, E))]
    for layer in range(m.layers):
        inp = E if layer == 0 else H
        entries += [
            (f"lstm{layer}.W", (1, 4 * H, inp)),
            (f"lstm{layer}.R", (1, 4 * H, H)),
            (f"lstm{layer}.B", (1, 8 * H)),
        ]
    return entries + [("head.W", (H, VOCAB)), ("head.b", (VOCAB,))]


def _soma_entries(m: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    # Per block: 8d^2 (bias-free LSTM) + 8d^2 (MLP d -> 4d -> d) + 2d gains; 16 D d^2 + (2D + 1) d in all.
    d = m.hidden
    entries: list[tuple[str, tuple[int, ...]]] = []
    for b in range(m.layers):
        entries += [
            (f"block{b}.ln1.g", (d,)),
            (f"block{b}.lstm.W", (1, 4 * d, d)),
            (f"block{b}.lstm.R", (1, 4 * d, d)),
            (f"block{b}.ln2.g", (d,)),
            (f"block{b}.mlp.W1", (d, 4 * d)),
            (f"block{b}.mlp.W2", (4 * d, d)),
        ]
    return entries + [("ln_f.g", (d,)), ("E", (VOCAB, d))]


def layout(m: ModelConfig) -> Layout:
    entries = _soma_entries(m) if m.kind == "soma" else _lstm_entries(m)
    offsets, off = [], 0
    for _, shape in entries:
        offsets.append(off)
        off += int(np.prod(shape))
    return Layout(
        names=tuple(n for n, _ in entries),
        shapes=tuple(s for _, s in entries),
        offsets=tuple(offsets),
        size=off,
        decoder=TIED_DECODER if m.kind == "soma" else LSTM_DECODER,
    )


def count(m: ModelConfig) -> int:
    return layout(m).size


def init(m: ModelConfig, seed: int) -> np.ndarray:
    """Seeded initialization, the same scale rules as torch's defaults (uniform ±1/sqrt(fan_in))."""
    lay = layout(m)
    rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([seed, 0x1417])))
    flat = np.empty(lay.size, dtype=np.float32)
    v = lay.views(flat)
    (_init_soma if m.kind == "soma" else _init_lstm)(m, v, rng)
    return flat


def _init_lstm(m: ModelConfig, v: dict[str, np.ndarray], rng: np.random.Generator) -> None:
    bound = 1.0 / np.sqrt(m.hidden)
    for name, arr in v.items():
        if name == "embed":
            arr[...] = rng.standard_normal(arr.shape, dtype=np.float32)
        else:
            arr[...] = rng.uniform(-bound, bound, arr.shape).astype(np.float32)
    # A stronger input drive makes the untrained LSTM a richer feature map for the delta-rule decoder
    # (docs/ARCHITECTURE.md); the factor applies after drawing, so the random stream is the same for any gain.
    v["lstm0.W"][...] *= np.float32(m.input_gain)
    for layer in range(m.layers):
        # Forget-gate bias of 1 keeps early gradients (and SPSA signal) flowing through time.
        H = m.hidden
        v[f"lstm{layer}.B"][0, 2 * H : 3 * H] = 1.0


def _init_soma(m: ModelConfig, v: dict[str, np.ndarray], rng: np.random.Generator) -> None:
    d = m.hidden
    for name, arr in v.items():
        if name.endswith(".g"):
            arr[...] = 1.0
        elif name == "E":
            # std 1/sqrt(d): the final LN's output has unit entries, so the first logits h E^T have unit scale.
            arr[...] = rng.standard_normal(arr.shape, dtype=np.float32) / np.float32(np.sqrt(d))
        else:
            fan_in = arr.shape[-1] if ".lstm." in name else arr.shape[0]
            bound = 1.0 / np.sqrt(fan_in)
            arr[...] = rng.uniform(-bound, bound, arr.shape).astype(np.float32)


# ONNX gate blocks (i, o, f, c) <-> torch blocks (i, f, g, o).
_ONNX_FROM_TORCH = (0, 3, 1, 2)  # onnx block j is torch block _ONNX_FROM_TORCH[j]


def _reorder(a: np.ndarray, order: tuple[int, ...], hidden: int) -> np.ndarray:
    blocks = [a[i * hidden : (i + 1) * hidden] for i in order]
    return np.concatenate(blocks, axis=0)


def to_torch_gates(onnx_rows: np.ndarray, hidden: int) -> np.ndarray:
    """Reorder the 4H leading rows from ONNX (i, o, f, c) to torch (i, f, g, o)."""
    inverse = tuple(_ONNX_FROM_TORCH.index(t) for t in range(4))
    return _reorder(onnx_rows, inverse, hidden)


def from_torch_gates(torch_rows: np.ndarray, hidden: int) -> np.ndarray:
    return _reorder(torch_rows, _ONNX_FROM_TORCH, hidden)
