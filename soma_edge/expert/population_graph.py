"""The population graph: an expert's clean forward and its 2K perturbed members in ONE ONNX graph.

SPSA evaluates, per step and minibatch, the clean weights w (member 0) and w + eps z_j, w - eps z_j
(members 2j+1 and 2j+2, j < K). Evaluated one `session.run` each, that is 2K + 1 calls of a few tiny kernels,
every weight fed from the host each time. Here the members sit on a leading axis P = 2K + 1 of every
activation ([P, N, d], N = T*B rows in time-major order, as graph.py's rows), so one call evaluates them all.

The recurrence is unrolled over the fixed T with MatMul, Sigmoid, Tanh, Mul, Add: no Loop or Scan (slow on
the CUDA EP, refused by CUDA graph capture), and no ONNX `LSTM` op, whose weights are one tensor for the
whole batch while members each have their own. It computes what graph.py's ONNX `LSTM` computes: gates
x W^T + h R^T + Wb + Rb in the order i, o, f, c, c' = f c + i tanh(c~), h = o tanh(c'), zero initial states;
the soma kind's LayerNormalization, exact-erf GELU MLP, residuals, final LN and tied head h E^T as graph.py.
Its T step reads and the join of its T outputs go as trees of at most MAX_FANIN (soma_edge.expert.builder): a wider
Concat or Split on the CUDA EP cannot be captured in a CUDA graph either.

Each perturbed tensor's noise crosses in one of four forms (`Noise`), K members' worth per input:
- BITS: one input `bits` uint8 [K, spsa.noise.bits_bytes(n)] for all n perturbed weights (which lead the layout,
  as the Stepper's body): the keyed Philox stream's raw bytes (spsa.noise.noise_bits), one bit a weight. The
  device expands them as the host does (spsa.noise.expand_bits): a Gather of each byte's row of a [256, 8] table
  of ±1.0, so z is the host's bit for bit. The CUDA EP has no BitShift or Bitwise kernels; a table lookup
  needs none, and 1/8 of SIGNS' bytes cross. Dense Rademacher probes take this form.
- SPARSE_BITS: BITS and `keep` uint8 [K, ceil(n / 8)], each probe's mask packed (np.packbits), expanded
  through a table of 1.0 / 0.0 and multiplied in: z = sign * keep, the host's sparse z bit for bit (-0.0
  included). 2 bits a weight cross where SIGNS takes 8. Sparse Rademacher probes (the default) take this.
- SIGNS: `z.<name>` int8 [K, *shape] in {-1, 0, +1}, the host's keyed (sparse) Rademacher noise at one
  byte a weight, cast to float on the device. Member weights are formed as (z eps) + w and w - (z eps), the
  Stepper's float32 arithmetic, so each member's weights equal the host's probe bit for bit.
- GAUSSIAN: `z.<name>` float32 [K, *shape], formed the same way.
- RANK1: a matrix (its shape without size-1 dims is (m, n)) takes `a.<name>` int8 [K, m] and `b.<name>`
  int8 [K, n], z = a b^T. Its members share the base MatMul (all P*B rows through W) and each adds its
  rank-1 term, ±eps (x . b) a^T where the op computes x W^T (LSTM, tied head), ±eps (x . a) b^T where it
  computes x W. A vector (bias, gain) takes full `z.<name>` int8 signs, as under SIGNS.

Rows: every member reads the whole minibatch, or with `split` (spsa.split_rows) direction j's two members read
its own j-th of K equal slices of the batch's rows (x[j B/K : (j + 1) B/K]) and the clean member the first
slice: activations [P, T B/K, d], so a step's 2K probes forward two batches' rows in all. The embedding then
gathers per member (a member's ids offset into its own rows of the [P 256, width] stack).

Outputs: `losses` float [P], each member's mean cross-entropy in nats/byte (graph.py's loss), and with
`decoder_grad` the clean member's delta-rule decoder gradients `grad.<name>`, as graph.py's "train" mode (with
spsa.decoder_from = "probes", their mean over the 2K probes' rows instead: what a split graph must use, its
clean member seeing a slice only).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from soma_edge.config import ModelConfig
from soma_edge.expert.builder import GraphBuilder, decoder_grads, entries, join, pieces
from soma_edge.expert.graph import LN_EPS, OPSET
from soma_edge.expert.params import VOCAB, layout
from soma_edge.spsa.noise import bits_bytes, keep_table, sign_table


class Noise(str, enum.Enum):
    """How a population's perturbations cross to the graph (the module docstring)."""

    BITS = "bits"
    SPARSE_BITS = "sparse_bits"
    SIGNS = "signs"
    GAUSSIAN = "gaussian"
    RANK1 = "rank1"

    @property
    def keyed(self) -> bool:
        """Whether the noise crosses as keyed bits (BITS, SPARSE_BITS) that the graph expands."""
        return self in (Noise.BITS, Noise.SPARSE_BITS)


@dataclass(frozen=True)
class NoiseInput:
    """One noise input of a population graph: its name, numpy dtype and shape."""

    name: str
    dtype: type
    shape: tuple[int, ...]


def core_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape the ops use: the ONNX LSTM layout's leading 1 dropped (W [1, 4H, in] -> (4H, in))."""
    shape = tuple(shape)
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


def is_matrix(shape: Sequence[int]) -> bool:
    """Whether a tensor takes rank-1 noise: its shape without size-1 dims is (m, n)."""
    return len([s for s in shape if s != 1]) == 2 and len(core_shape(shape)) == 2


def perturbed_size(m: ModelConfig, perturbed: Sequence[str]) -> int:
    """Weights in the tensors `perturbed`, which must lead the layout (the Stepper's body): BITS covers
    them as one run of bits from offset 0."""
    lay = layout(m)
    lead = lay.names[: len(perturbed)]
    if sorted(lead) != sorted(perturbed):
        raise ValueError(f"bits noise needs the perturbed tensors to lead the layout: {list(perturbed)}")
    return sum(int(np.prod(lay.shapes[i])) for i in range(len(perturbed)))


def noise_inputs(m: ModelConfig, k: int, perturbed: Sequence[str], noise: Noise | str) -> list[NoiseInput]:
    """The noise inputs a population graph of `k` directions takes, in graph order."""
    noise, lay = Noise(noise), layout(m)
    if noise.keyed:
        n = perturbed_size(m, perturbed)
        out = [NoiseInput("bits", np.uint8, (k, bits_bytes(n)))]
        return out + ([NoiseInput("keep", np.uint8, (k, (n + 7) // 8))] if noise is Noise.SPARSE_BITS else [])
    out = []
    for name in perturbed:
        shape = lay.shapes[lay.names.index(name)]
        if noise is Noise.RANK1 and is_matrix(shape):
            rows, cols = core_shape(shape)
            out += [NoiseInput(f"a.{name}", np.int8, (k, rows)), NoiseInput(f"b.{name}", np.int8, (k, cols))]
        else:
            out.append(NoiseInput(f"z.{name}", np.float32 if noise is Noise.GAUSSIAN else np.int8, (k, *shape)))
    return out


@dataclass(frozen=True)
class _Weight:
    """One weight tensor as the members see it. `base` is the shared tensor in its core shape; `members`,
    where set, its per-member copies [P, *core] (full-rank noise); `a` and `b`, where set, the rank-1 factors
    per member: a [P, m] carrying the member's ±eps (0 for the clean member), b [P, n]."""

    base: str
    members: str | None = None
    a: str | None = None
    b: str | None = None


def _interleave(g: GraphBuilder, plus: str, minus: str, core: tuple[int, ...], first: str) -> str:
    """[K, *core] + and - halves -> [P, *core]: `first` [1, *core], then +_0, -_0, +_1, -_1, ..."""
    pair = g.op("Concat", g.op("Unsqueeze", plus, g.i64([1])), g.op("Unsqueeze", minus, g.i64([1])), axis=1)
    return g.op("Concat", first, g.op("Reshape", pair, g.i64([2 * g.k, *core])), axis=0)


def _expand(g: GraphBuilder, packed: str, table: np.ndarray, n: int, lead: Sequence[int]) -> str:
    """`packed` uint8 [*lead, bytes] -> float32 [*lead, n]: each byte's row of `table` [256, 8] (Gather; its
    indices int32), rows joined in order, cut to n."""
    rows = g.op("Gather", g.const(table), g.op("Cast", packed, to=TensorProto.INT32), axis=0)
    flat = g.op("Reshape", rows, g.i64([*lead, -1]))
    return g.op("Slice", flat, g.i64([0]), g.i64([n]), g.i64([-1]))


def expand_bits(g: GraphBuilder, bits: str, keep: str | None, n: int, lead: Sequence[int]) -> str:
    """`bits` uint8 [*lead, bits_bytes(n)] (and a sparse probe's packed mask `keep`) -> z float32 [*lead, n],
    as the host's spsa.noise.expand_bits (times its mask: 1.0 or 0.0, exact)."""
    z = _expand(g, bits, sign_table(), n, lead)
    return z if keep is None else g.op("Mul", z, _expand(g, keep, keep_table(), n, lead))


def bits_slices(
    g: GraphBuilder, m: ModelConfig, signs: str, perturbed: Sequence[str], lead: Sequence[int]
) -> dict[str, str]:
    """Each perturbed tensor's z [*lead, *shape] from expanded signs [*lead, n]: its layout range along the
    last axis (the perturbed tensors lead the layout, so the ranges follow one another from 0)."""
    lay = layout(m)
    shapes = {n: s for n, s in zip(lay.names, lay.shapes) if n in perturbed}  # layout order
    parts = pieces(g, signs, -1, [int(np.prod(s)) for s in shapes.values()])
    return {n: g.op("Reshape", part, g.i64([*lead, *s])) for (n, s), part in zip(shapes.items(), parts)}


def _bits_z(g: GraphBuilder, m: ModelConfig, perturbed: Sequence[str], noise: Noise) -> dict[str, str]:
    """Each perturbed tensor's z float32 [K, *shape], expanded on the device from the `bits` input."""
    keep = "keep" if noise is Noise.SPARSE_BITS else None
    signs = expand_bits(g, "bits", keep, perturbed_size(m, perturbed), [g.k])
    return bits_slices(g, m, signs, perturbed, [g.k])


def _weight(g: GraphBuilder, name: str, shape: tuple[int, ...], noise: Noise | None, z: str | None = None) -> _Weight:
    """The graph's view of weight input `name`: shared (noise None), full-rank members, or rank-1. `z`: the
    tensor's float z [K, *shape] where BITS made it (else its own noise input is cast)."""
    core = core_shape(shape)
    base = name if core == shape else g.op("Reshape", name, g.i64(list(core)))
    if noise is None:
        return _Weight(base)
    if noise is Noise.RANK1 and is_matrix(shape):
        ea = g.op("Mul", g.op("Cast", f"a.{name}", to=TensorProto.FLOAT), "eps")
        b = g.op("Cast", f"b.{name}", to=TensorProto.FLOAT)
        a_p = _interleave(g, ea, g.op("Neg", ea), core[:1], g.f32(np.zeros((1, core[0]))))
        b_p = _interleave(g, b, b, core[1:], g.f32(np.zeros((1, core[1]))))
        return _Weight(base, a=a_p, b=b_p)
    if z is None:
        z = f"z.{name}" if noise is Noise.GAUSSIAN else g.op("Cast", f"z.{name}", to=TensorProto.FLOAT)
    # (z eps) + w and w - (z eps): the Stepper's probe arithmetic, so the members' weights are the host's bits
    ez = g.op("Mul", g.op("Reshape", z, g.i64([g.k, *core])), "eps")
    plus, minus = g.op("Add", base, ez), g.op("Sub", base, ez)
    return _Weight(base, members=_interleave(g, plus, minus, core, g.op("Unsqueeze", base, g.i64([0]))))


def _linear(g: GraphBuilder, x: str, w: _Weight, transposed: bool) -> str:
    """x [P, N, in] times a matrix: x W^T when `transposed` (W stored (out, in): the LSTM's W and R, the tied
    head's E), else x W (W stored (in, out): MatMul operands) -> [P, N, out]."""
    if w.members is not None:
        return g.op("MatMul", x, g.once("Transpose", w.members, perm=[0, 2, 1]) if transposed else w.members)
    y = g.op("MatMul", x, g.once("Transpose", w.base, perm=[1, 0]) if transposed else w.base)
    if w.a is None:
        return y
    # W_p = W + (±eps a) b^T: x W_p^T = x W^T + (x . b)(±eps a)^T, and x W_p = x W + (x . ±eps a) b^T
    inner, outer = (w.b, w.a) if transposed else (w.a, w.b)
    proj = g.op("MatMul", x, g.once("Unsqueeze", inner, g.i64([2])))  # [P, N, 1]
    return g.op("Add", y, g.op("MatMul", proj, g.once("Unsqueeze", outer, g.i64([1]))))


def _vector(g: GraphBuilder, w: _Weight) -> str:
    """A vector weight, broadcastable against [P, N, n]: shared [n], or the members' [P, 1, n]."""
    return w.base if w.members is None else g.once("Unsqueeze", w.members, g.i64([1]))


@dataclass(frozen=True)
class _Rows:
    """The minibatch as the members read it: ids and targets [T, B] shared by every member, or with `split`
    [P, T, B/K], each member its own rows (the module docstring)."""

    x: str
    y: str
    split: bool


def _rows(g: GraphBuilder, split: bool, seq_len: int) -> _Rows:
    """x, y [B, T] -> the members' rows in time-major order, as graph.py's (`_Rows`)."""
    if not split:
        return _Rows(g.op("Transpose", "x", perm=[1, 0]), g.op("Transpose", "y", perm=[1, 0]), False)
    owner = g.i64([0] + [j for j in range(g.k) for _ in "+-"])  # each member's slice: clean 0, then j, j

    def own(v: str) -> str:
        slices = g.op("Reshape", v, g.i64([g.k, -1, seq_len]))  # [K, B/K, T]: slice j is rows j B/K ..
        return g.op("Transpose", g.op("Gather", slices, owner, axis=0), perm=[0, 2, 1])  # [P, T, B/K]

    return _Rows(own("x"), own("y"), True)


def _own(g: GraphBuilder, table: str, ids: str, rows: int) -> str:
    """Each member's rows of its own table: table [P, rows, ...] at ids [P, T, b] -> [P, T, b, ...] (one
    Gather over the [P rows, ...] stack, member p's ids offset by p rows)."""
    offsets = g.i64(np.arange(g.p, dtype=np.int64).reshape(-1, 1, 1) * rows)
    stacked = g.op("Reshape", table, g.i64([g.p * rows, -1]))
    return g.op("Gather", stacked, g.once("Add", ids, offsets), axis=0)


def _embed(g: GraphBuilder, rows: _Rows, w: _Weight, width: int) -> str:
    """Rows of the byte matrix w [256, width] at the members' ids -> [P, N, width]."""
    ids = rows.x
    if w.members is not None:
        own = _own(g, w.members, ids, VOCAB) if rows.split else g.op("Gather", w.members, ids, axis=1)
        return g.op("Reshape", own, g.i64([0, -1, width]))
    if rows.split:  # [P, T, b, width]: the shared rows at each member's own ids
        base = g.op("Reshape", g.op("Gather", w.base, ids), g.i64([g.p, -1, width]))
    else:
        base = g.op("Expand", g.op("Reshape", g.op("Gather", w.base, ids), g.i64([1, -1, width])), g.i64([g.p, 1, 1]))
    if w.a is None:
        return base
    # (W + (±eps a) b^T)[x] = W[x] + (±eps a[x]) b^T
    a_x = _own(g, w.a, ids, VOCAB) if rows.split else g.op("Gather", w.a, ids, axis=1)
    ax = g.op("Reshape", a_x, g.i64([g.p, -1, 1]))
    return g.op("Add", base, g.op("Mul", ax, g.once("Unsqueeze", w.b, g.i64([1]))))


def _layer_norm(g: GraphBuilder, x: str, gain: _Weight, width: int) -> str:
    """graph.py's gain-only LayerNormalization over the last axis; per-member gains multiply a unit-gain LN
    (LayerNormalization's scale is one vector for the whole input)."""
    if gain.members is None:
        return g.op("LayerNormalization", x, gain.base, axis=-1, epsilon=LN_EPS)
    unit = g.op("LayerNormalization", x, g.f32(np.ones(width)), axis=-1, epsilon=LN_EPS)
    return g.op("Mul", unit, _vector(g, gain))


def _lstm(g: GraphBuilder, x: str, W: _Weight, R: _Weight, B: _Weight | None, hidden: int, seq_len: int) -> str:
    """One ONNX-semantics LSTM layer, unrolled: x [P, N, in] (rows in (t, b) order) -> h [P, N, hidden]."""
    H = hidden
    proj = _linear(g, x, W, transposed=True)  # every step's x W^T in one MatMul
    if B is not None:  # ONNX B = [Wb, Rb]
        wb = g.op("Slice", _vector(g, B), g.i64([0]), g.i64([4 * H]), g.i64([-1]))
        rb = g.op("Slice", _vector(g, B), g.i64([4 * H]), g.i64([8 * H]), g.i64([-1]))
        proj = g.op("Add", proj, g.op("Add", wb, rb))
    steps = g.op("Reshape", proj, g.i64([0, seq_len, -1, 4 * H]))  # [P, T, B, 4H]
    h = c = None
    hs = []
    for gates in entries(g, steps, 1, seq_len):  # step t's [P, B, 4H]
        if h is not None:  # the zero initial state adds nothing at t = 0
            gates = g.op("Add", gates, _linear(g, h, R, transposed=True))
        i, o, f, cand = (g.op("Slice", gates, g.i64([j * H]), g.i64([(j + 1) * H]), g.i64([-1])) for j in range(4))
        i, o, f, cand = g.op("Sigmoid", i), g.op("Sigmoid", o), g.op("Sigmoid", f), g.op("Tanh", cand)
        ic = g.op("Mul", i, cand)
        c = ic if c is None else g.op("Add", g.op("Mul", f, c), ic)
        h = g.op("Mul", o, g.op("Tanh", c))
        hs.append(h)
    return join(g, hs, axis=1)


def _lstm_body(g: GraphBuilder, m: ModelConfig, w: dict[str, _Weight], rows: _Rows, seq_len: int) -> str:
    h = _embed(g, rows, w["embed"], m.embed)
    for layer in range(m.layers):
        p = f"lstm{layer}."
        h = _lstm(g, h, w[p + "W"], w[p + "R"], w[p + "B"], m.hidden, seq_len)
    return h


def _soma_body(g: GraphBuilder, m: ModelConfig, w: dict[str, _Weight], rows: _Rows, seq_len: int) -> str:
    """graph.py's pre-norm residual blocks r += LSTM(LN(r)); r += W2 gelu(LN(r) W1), then the final LN."""
    d = m.hidden
    r = _embed(g, rows, w["E"], d)
    for b in range(m.layers):
        p = f"block{b}."
        a = _layer_norm(g, r, w[p + "ln1.g"], d)
        s = g.op("Add", r, _lstm(g, a, w[p + "lstm.W"], w[p + "lstm.R"], None, d, seq_len))
        u = _linear(g, _layer_norm(g, s, w[p + "ln2.g"], d), w[p + "mlp.W1"], transposed=False)
        # exact GELU, 0.5 u (1 + erf(u / sqrt 2)), spelled as graph.py spells it
        ue = g.op("Erf", g.op("Div", u, g.f32(np.sqrt(2.0))))
        gelu = g.op("Mul", g.op("Mul", u, g.op("Add", ue, g.f32(1.0))), g.f32(0.5))
        r = g.op("Add", s, _linear(g, gelu, w[p + "mlp.W2"], transposed=False))
    return _layer_norm(g, r, w["ln_f.g"], d)


def _head(g: GraphBuilder, m: ModelConfig, w: dict[str, _Weight], rows: str) -> str:
    """rows [P, N, H] -> logits [P, N, 256]: the tied h E^T, or h head.W + head.b."""
    if m.kind == "soma":
        return _linear(g, rows, w["E"], transposed=True)
    return g.op("Add", _linear(g, rows, w["head.W"], transposed=False), _vector(g, w["head.b"]))


def _losses(g: GraphBuilder, logits: str, rows: _Rows) -> str:
    """Each member's -mean log_softmax(logits)[n, y_n] -> "losses" [P], with graph.py's ops."""
    if rows.split:
        y_col = g.op("Reshape", rows.y, g.i64([g.p, -1, 1]))  # [P, N, 1]
    else:
        y_col = g.op("Expand", g.op("Reshape", rows.y, g.i64([1, -1, 1])), g.i64([g.p, 1, 1]))
    logp = g.op("LogSoftmax", logits, axis=-1)
    logp_y = g.op("GatherElements", logp, y_col, axis=2)
    return g.op("Neg", g.op("ReduceMean", logp_y, axes=[1, 2], keepdims=0), out="losses")


def _decoder_grads(g: GraphBuilder, m: ModelConfig, logits: str, hidden: str, rows: _Rows, decoder_from: str) -> None:
    """The delta rule's decoder gradients: the clean member's (member 0), or the mean over the probes' rows
    (members 1..P-1 as one batch of (P-1) N rows: each member's mean gradient, averaged)."""
    if decoder_from == "clean" and rows.split:
        raise ValueError("a split graph's clean member sees one slice of the rows: its decoder gradient is the probes'")
    if decoder_from == "clean":
        logits0, rows0 = g.op("Gather", logits, g.i64(0), axis=0), g.op("Gather", hidden, g.i64(0), axis=0)
        decoder_grads(g, m.kind, logits0, rows0, g.op("Reshape", rows.y, g.i64([-1])))
        return
    if decoder_from != "probes":
        raise ValueError(f"decoder_from must be 'clean' or 'probes', got {decoder_from!r}")

    def probes(t: str, last: int) -> str:
        return g.op("Reshape", g.op("Slice", t, g.i64([1]), g.i64([g.p]), g.i64([0])), g.i64([-1, last]))

    if rows.split:  # each member's own targets, in the members' order as their logits
        y_probes = g.op("Reshape", probes(rows.y, 1), g.i64([-1]))
    else:
        y_probes = g.op("Expand", g.op("Reshape", rows.y, g.i64([1, -1])), g.i64([g.p - 1, 1]))
        y_probes = g.op("Reshape", y_probes, g.i64([-1]))
    decoder_grads(g, m.kind, probes(logits, VOCAB), probes(hidden, m.hidden), y_probes)


def build_population(
    m: ModelConfig,
    k: int,
    perturbed: Sequence[str],
    noise: Noise | str,
    decoder_grad: bool,
    seq_len: int,
    decoder_from: str = "clean",
    split: bool = False,
) -> onnx.ModelProto:
    """The population graph of `k` directions over the tensors `perturbed`, for batches x, y int64 [B, seq_len]
    (the module docstring). Inputs: x, y, every weight by its layout name, `eps` float32 [], the noise. The
    decoder gradients are the clean member's, or with `decoder_from` = "probes" the mean over the 2K probes'
    rows (spsa.decoder_from). With `split` each direction's members read their own B/k rows (B a multiple of k;
    spsa.split_rows), and the decoder gradients must be the probes'."""
    noise, lay = Noise(noise), layout(m)
    unknown = sorted(set(perturbed) - set(lay.names))
    if k < 1 or seq_len < 1 or not perturbed or unknown or len(set(perturbed)) != len(perturbed):
        raise ValueError(f"need k >= 1, seq_len >= 1 and distinct layout tensors to perturb (unknown: {unknown})")
    g = GraphBuilder(k)
    zs = _bits_z(g, m, perturbed, noise) if noise.keyed else {}
    weights = {
        n: _weight(g, n, s, noise if n in perturbed else None, zs.get(n)) for n, s in zip(lay.names, lay.shapes)
    }  # in layout order, so the graph's nodes do not depend on the order of `perturbed`
    rows = _rows(g, split, seq_len)
    body = _soma_body if m.kind == "soma" else _lstm_body
    hidden = body(g, m, weights, rows, seq_len)
    logits = _head(g, m, weights, hidden)
    _losses(g, logits, rows)
    outputs = [helper.make_tensor_value_info("losses", TensorProto.FLOAT, [g.p])]
    if decoder_grad:
        _decoder_grads(g, m, logits, hidden, rows, decoder_from)
        outputs += [
            helper.make_tensor_value_info(f"grad.{n}", TensorProto.FLOAT, list(lay.shapes[lay.names.index(n)]))
            for n in lay.decoder
        ]
    ordered = [n for n in lay.names if n in perturbed]
    inputs = [helper.make_tensor_value_info(v, TensorProto.INT64, ["B", seq_len]) for v in ("x", "y")]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in zip(lay.names, lay.shapes)]
    inputs.append(helper.make_tensor_value_info("eps", TensorProto.FLOAT, []))
    inputs += [
        helper.make_tensor_value_info(i.name, helper.np_dtype_to_tensor_dtype(np.dtype(i.dtype)), list(i.shape))
        for i in noise_inputs(m, k, ordered, noise)
    ]
    graph = helper.make_graph(g.nodes, "soma_expert_population", inputs, outputs, g.inits)
    graph.doc_string = (
        f"soma-edge population: kind {m.kind!r}, K = {k}, noise {noise.value!r}, T = {seq_len}, split rows {split}"
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="soma-edge")
    model.ir_version = 8  # as graph.py's
    onnx.checker.check_model(model)
    return model
