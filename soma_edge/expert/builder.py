"""Building ONNX graphs node by node: `GraphBuilder` names each output, makes constants and repeated ops once,
and the trees below keep every Concat and Split within MAX_FANIN. Shared by the population graph, the update
graph and the expert graphs' delta rule (`decoder_grads`), which all must stay capturable on the CUDA EP.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from soma_edge.expert.params import VOCAB

# ORT's CUDA Concat passes its table of input pointers to the kernel by value for up to 32 inputs; above
# that it stages the table in pinned host memory and copies it asynchronously, which a CUDA graph does not
# capture (soma_edge.engine.capture captures the training steps), and a Split of more than 32 outputs stages its
# table the same way. So no graph here joins more than MAX_FANIN tensors in one Concat, nor reads one tensor
# in more than MAX_FANIN pieces: ORT's optimizer fuses Gathers or Slices that together read a whole tensor
# into one Split of as many outputs (GatherSliceToSplitFusion). Longer lists go as trees (`join`, `_reads`).
MAX_FANIN = 32


class GraphBuilder:
    """Nodes and constants under construction: `op` names each output; constants and repeated ops on
    weights (a transpose inside the unrolled loop) are made once. `k`: a population's directions (its
    members `p` = 2k + 1), where the graph is one (0 elsewhere)."""

    def __init__(self, k: int = 0, prefix: str = "") -> None:
        self.k = k
        self.p = 2 * k + 1  # members: the clean one, then + and - for each direction
        self.prefix = prefix  # of every name it makes, where its nodes join a graph built otherwise
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.memo: dict[tuple, str] = {}
        self.count = 0

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        if out is None:
            self.count += 1
            out = f"{self.prefix}{op_type.lower()}{self.count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def once(self, op_type: str, *inputs: str, **attrs) -> str:
        key = (op_type, inputs, tuple(sorted((k, str(v)) for k, v in attrs.items())))
        if key not in self.memo:
            self.memo[key] = self.op(op_type, *inputs, **attrs)
        return self.memo[key]

    def const(self, value: np.ndarray) -> str:
        key = ("const", value.dtype.str, value.shape, value.tobytes())
        if key not in self.memo:
            name = f"{self.prefix}c{len(self.inits)}"
            self.inits.append(numpy_helper.from_array(value, name))
            self.memo[key] = name
        return self.memo[key]

    def i64(self, values: Sequence[int] | int) -> str:
        return self.const(np.array(values, dtype=np.int64))

    def f32(self, value: float | np.ndarray) -> str:
        return self.const(np.asarray(value, dtype=np.float32))


def runs(n: int) -> list[range]:
    """0 .. n-1 as at most MAX_FANIN consecutive runs, each of the same power of MAX_FANIN items (the last may
    be shorter), the least power that allows it: single items up to MAX_FANIN, runs of 32 up to 32 * 32."""
    size = 1
    while size * MAX_FANIN < n:
        size *= MAX_FANIN
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


def join(g: GraphBuilder, parts: Sequence[str], axis: int) -> str:
    """Concat of `parts` along `axis` as a tree of Concats of at most MAX_FANIN inputs: the same bytes as one
    Concat, since each Concat only copies."""
    if len(parts) == 1:
        return parts[0]
    if len(parts) <= MAX_FANIN:
        return g.op("Concat", *parts, axis=axis)
    return join(g, [join(g, parts[r.start : r.stop], axis) for r in runs(len(parts))], axis)


def _reads(g: GraphBuilder, x: str, axis: int, cuts: Sequence[int], read: Callable[[str, int, int], str]) -> list[str]:
    """`read(part, start, stop)` of each range [cuts[i], cuts[i + 1]) of x along `axis`, positions relative to
    `part`'s start: more than MAX_FANIN ranges are read from Slices of x holding at most MAX_FANIN runs of
    them (`runs`), each read the same way, so no tensor is read more than MAX_FANIN times."""
    n = len(cuts) - 1
    if n <= MAX_FANIN:
        return [read(x, cuts[i], cuts[i + 1]) for i in range(n)]
    out = []
    for r in runs(n):
        start, stop = cuts[r.start], cuts[r.stop]
        block = g.op("Slice", x, g.i64([start]), g.i64([stop]), g.i64([axis]))
        out += _reads(g, block, axis, [c - start for c in cuts[r.start : r.stop + 1]], read)
    return out


def entries(g: GraphBuilder, x: str, axis: int, n: int) -> list[str]:
    """x's n entries along `axis`, each a Gather of its index (the axis dropped), read as a tree (`_reads`)."""
    return _reads(g, x, axis, range(n + 1), lambda part, i, _: g.op("Gather", part, g.i64(i), axis=axis))


def pieces(g: GraphBuilder, x: str, axis: int, sizes: Sequence[int]) -> list[str]:
    """x cut along `axis` into consecutive Slices of `sizes`, read as a tree (`_reads`)."""
    cuts = np.cumsum([0, *sizes]).tolist()
    return _reads(g, x, axis, cuts, lambda part, a, b: g.op("Slice", part, g.i64([a]), g.i64([b]), g.i64([axis])))


def decoder_grads(g: GraphBuilder, kind: str, logits: str, rows: str, y_flat: str) -> None:
    """The delta rule's decoder gradients `grad.<name>`: d(mean CE)/d(decoder) with the hidden rows held fixed,
    from logits [N, 256], rows [N, H] and targets y_flat [N]: d = (softmax(logits) - onehot(y)) / N, then
    grad.head.W = rows^T d and grad.head.b = sum d (lstm kind), or grad.E = d^T rows (the tied kind)."""
    onehot = g.op("OneHot", y_flat, g.i64(VOCAB), g.f32([0.0, 1.0]), axis=-1)
    delta_sum = g.op("Sub", g.op("Softmax", logits, axis=-1), onehot)
    # The row count as the sum of the one-hot rows (exact in float32 below 2^24 rows), not Shape -> Cast:
    # Shape's output lives in host memory, so ORT would run the Cast on the CPU, which a CUDA-only session
    # refuses.
    delta = g.op("Div", delta_sum, g.op("ReduceSum", onehot, keepdims=0))
    if kind == "soma":
        g.op("MatMul", g.op("Transpose", delta, perm=[1, 0]), rows, out="grad.E")
        return
    g.op("MatMul", g.op("Transpose", rows, perm=[1, 0]), delta, out="grad.head.W")
    g.op("ReduceSum", delta, g.i64([0]), keepdims=0, out="grad.head.b")
