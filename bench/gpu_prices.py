"""What a bench/gpu_check.py cell would cost before it runs.

- Memory (`graph_mib`): ONNX shape inference at the cell's batch, then each tensor live from the node that
  makes it to its last reader, in the graph's order; the peak of that, plus inputs and constants, times the
  arena factor of its device (ORT's arenas grow by powers of two and its order differs from the graph's).
  Measured against that shape peak: 1.2-1.9x on the CPU EP, 3.4-4.1x on the CUDA EP of an H200 (where a
  cell priced at 2x took 135 GiB and failed with an illegal memory access).
- A session's build (`Builds`): at the seconds per node of the last build of the same graph, or at
  FIRST_BUILD_S_PER_NODE for a graph not built yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

ARENA_CPU, ARENA_CUDA = 2.0, 5.0  # priced memory over the shape peak, per device (module docstring)
OVERHEAD_MIB = 256  # a session's own memory beside its tensors
FREE_SHARE = 0.9  # of the free memory, what a cell may be priced at: the rest for what is not priced
FIRST_BUILD_S_PER_NODE = 2e-3  # a graph not built yet: generous (CPU EP: 0.3-0.8 ms a node at T = 128)


def graph_mib(model, batch: int, seq_len: int, arena: float = ARENA_CPU) -> int:
    """The priced memory of one session on `model` with its free dims "B" and "T" set to `batch` and
    `seq_len` (module docstring): `arena` x the peak of live tensors in the graph's order, plus inputs and
    constants."""
    import onnx  # heavy; the checks that price import it anyway
    from onnx import helper, shape_inference

    m = onnx.ModelProto()
    m.CopyFrom(model)
    for value in m.graph.input:
        for d in value.type.tensor_type.shape.dim:
            if d.dim_param in ("B", "T"):
                d.dim_value = batch if d.dim_param == "B" else seq_len
    g = shape_inference.infer_shapes(m).graph
    size: dict[str, int] = {}
    for value in [*g.value_info, *g.input, *g.output]:
        t = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in t.shape.dim]
        size[value.name] = int(np.prod(dims)) * helper.tensor_dtype_to_np_dtype(t.elem_type).itemsize
    fixed = sum(size.get(v.name, 0) for v in g.input) + sum(
        int(np.prod(c.dims)) * helper.tensor_dtype_to_np_dtype(c.data_type).itemsize for c in g.initializer
    )
    last = {name: i for i, node in enumerate(g.node) for name in node.input}
    kept = {v.name for v in [*g.input, *g.output]}
    live = peak = 0
    for i, node in enumerate(g.node):
        live += sum(size.get(o, 0) for o in node.output)
        peak = max(peak, live)
        live -= sum(size.get(n, 0) for n in set(node.input) if last.get(n) == i and n not in kept)
    return int(arena * (fixed + peak) / (1 << 20)) + OVERHEAD_MIB


@dataclass
class Builds:
    """Seconds per node of the last session built on each graph (by its name): the price of the next build
    of that graph; a graph not built yet is priced at FIRST_BUILD_S_PER_NODE (a loss graph's rate, the
    first one measured, is ten times below a population graph's)."""

    per_node: dict[str, float] = field(default_factory=dict)

    def price(self, graphs: list) -> float:
        return sum(len(g.graph.node) * self.per_node.get(g.graph.name, FIRST_BUILD_S_PER_NODE) for g in graphs)

    def record(self, graphs: list, seconds: float) -> None:
        """A cell built `graphs` in `seconds` (together): each one's share by its node count."""
        nodes = sum(len(g.graph.node) for g in graphs)
        for g in graphs:
            self.per_node[g.graph.name] = seconds / max(nodes, 1)

    @property
    def measured(self) -> bool:
        return bool(self.per_node)
