"""No graph a worker opens joins more than MAX_FANIN tensors in one Concat or cuts one into more than MAX_FANIN
outputs of one Split, as built or after ORT's optimizer: the CUDA EP stages a wider Concat's (or Split's) table
of pointers in host memory and copies it asynchronously, which a CUDA graph (soma_edge.engine.capture) cannot capture.

Checked for both kinds (the demo lstm and a 2-block soma), every mode of graph.build, the population graph in
each noise form as population.for_config builds it at the shipped seq_len (128) and K = 8, and the update graph
resident.py builds beside it; and past the limits the trees exist for (K = 40, 37 perturbed tensors, T > 32^2).
ORT's optimizer fuses Gathers or Slices that together read a whole tensor into one Split of as many outputs
(GatherSliceToSplitFusion): before the trees, T = 128 steps read by 128 Gathers became a 128-way Split on the CPU
EP. The CPU EP's optimizations are what can be checked here; the CUDA EP's fusions are settled on a GPU by
bench/gpu_check.py. The trees give the very bytes of the flat graphs (MAX_FANIN lifted): checked bit for bit."""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from soma_edge.config import Config, DataConfig, ModelConfig, SPSAConfig
from soma_edge.engine.population import graph_noise, perturbed_tensors
from soma_edge.engine.runtime import load_ort, session_options
from soma_edge.expert import builder
from soma_edge.expert.builder import MAX_FANIN, GraphBuilder, entries, join, pieces
from soma_edge.expert.graph import MODES, OPSET, build
from soma_edge.expert.population_graph import build_population
from soma_edge.expert.update_graph import build_update
from worker.doctor import DEMO_MODEL

KINDS = {"lstm": DEMO_MODEL, "soma": ModelConfig(kind="soma", embed=64, hidden=64, layers=2)}
# spsa settings whose noise crosses in each form a worker uses (as bench/gpu_check.py's PROBE_SETTINGS): dense
# and sparse Rademacher bits, Gaussian, rank-1
PROBE_SETTINGS = (
    {"density": 1.0},
    {"density": 0.5},
    {"noise": "gaussian", "density": 1.0},
    {"noise": "rank1", "density": 1.0},
)
K = 8


def _worker_graphs(m: ModelConfig, k: int, seq_len: int) -> dict[str, onnx.ModelProto]:
    """Every graph a worker opens for expert shape m, by label: graph.build's modes, and per noise form the
    population graph (population.for_config's arguments: the body perturbed, the delta rule's decoder
    gradient) and the update graph beside it (resident.py's: k = directions * accumulate)."""
    out = {mode: build(m, mode) for mode in MODES}
    for probes in PROBE_SETTINGS:
        cfg = Config(model=m, spsa=SPSAConfig(directions=k, **probes), data=DataConfig(seq_len=seq_len))
        noise, delta = graph_noise(cfg.spsa), cfg.spsa.decoder == "delta"
        perturbed = perturbed_tensors(cfg)
        out[f"population {noise.value}"] = build_population(m, k, perturbed, noise, delta, cfg.data.seq_len)
        out[f"update {noise.value}"] = build_update(m, cfg.spsa, k * cfg.spsa.accumulate, perturbed, noise, delta)
    return out


@functools.cache
def _shipped(kind: str) -> dict[str, onnx.ModelProto]:
    """The worker's graphs of `kind` at the shipped seq_len and K, built once per process."""
    return _worker_graphs(KINDS[kind], K, Config().data.seq_len)


LABELS = [f"{kind}/{label}" for kind in KINDS for label in _worker_graphs(KINDS[kind], 1, 1)]


def _graphs(g: onnx.GraphProto):
    """g and every subgraph inside it (If, Loop, Scan bodies), recursively."""
    yield g
    for node in g.node:
        for a in node.attribute:
            for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                yield from _graphs(sub)


def too_wide(model: onnx.ModelProto, reads: bool) -> list[str]:
    """Each Concat of more than MAX_FANIN inputs and Split of more than MAX_FANIN outputs (non-empty names) in
    `model` and its subgraphs; with `reads`, also each tensor that more than MAX_FANIN Slices or Gathers at
    constant indices read (what ORT may fuse into a Split that wide, on the CPU and the CUDA EP alike)."""
    out = []
    for g in _graphs(model.graph):
        consts = {i.name for i in g.initializer}
        read = Counter(n.input[0] for n in g.node if n.op_type == "Slice" or _gather_at_constant(n, consts))
        for n in g.node:
            ins, outs = len([i for i in n.input if i]), len([o for o in n.output if o])
            if n.op_type == "Concat" and ins > MAX_FANIN:
                out.append(f"Concat of {ins} inputs ({n.output[0]})")
            if n.op_type == "Split" and outs > MAX_FANIN:
                out.append(f"Split of {outs} outputs (of {n.input[0]})")
        if reads:
            out += [f"{name} read {c} times" for name, c in read.items() if c > MAX_FANIN]
    return out


def _gather_at_constant(node: onnx.NodeProto, consts: set[str]) -> bool:
    return node.op_type == "Gather" and node.input[1] in consts


def _options(path: Path | None = None):
    """A worker's session options (ORT_ENABLE_ALL), one thread. Without memory reuse: ORT's planner takes time
    quadratic in these unrolled graphs (~10 s for soma's population graph at T = 128) and runs after the
    optimized graph is saved, so the saved graph and every kernel's output are the same."""
    so = session_options(threads=1, spin=False)
    so.enable_mem_reuse = False
    if path is not None:
        so.optimized_model_filepath = str(path)
    return so


def optimized(model: onnx.ModelProto, tmp_path: Path) -> onnx.ModelProto:
    """`model` as ORT's optimizer leaves it on the CPU EP, at the level a worker's sessions use."""
    path = tmp_path / "optimized.onnx"
    load_ort().InferenceSession(model.SerializeToString(), _options(path), providers=["CPUExecutionProvider"])
    return onnx.load(str(path))


@pytest.mark.parametrize("label", LABELS)
def test_worker_graphs_stay_within_the_fanin(label, tmp_path):
    kind, name = label.split("/", 1)
    model = _shipped(kind)[name]
    assert too_wide(model, reads=True) == [], "as built"
    assert too_wide(optimized(model, tmp_path), reads=False) == [], "as ORT's CPU EP optimizes it"


def test_wide_k_and_many_tensors_stay_within_the_fanin(tmp_path):
    """Past the limits: K = 40 directions (the update graph reads g and the noise an entry per direction) and
    a 12-layer lstm's 37 perturbed tensors (keyed bits are cut into one piece per tensor)."""
    deep = ModelConfig(embed=8, hidden=8, layers=12)
    assert len(perturbed_tensors(Config(model=deep))) > MAX_FANIN
    for m in (DEMO_MODEL, deep):
        for label, model in _worker_graphs(m, 40, 4).items():
            assert too_wide(model, reads=True) == [], label
            # ORT's optimizer where the trees cut what it could fuse: the demo's update graphs (K = 40 reads),
            # and the deep model's keyed bits below; the deep model's K = 40 update graphs are large (rank-1:
            # 12k nodes, ~8 s to optimize) and cut as the demo's are
            if m is DEMO_MODEL and label.startswith("update"):
                assert too_wide(optimized(model, tmp_path), reads=False) == [], label
    # The deep model's keyed bits (37 pieces) optimized at K = 8: each direction's bits are cut as at K = 40,
    # whose 40 reads the demo's update graphs check, and at K = 8 its bits graphs optimize in ~0.6 s, not ~2 s.
    for label, model in _worker_graphs(deep, K, 4).items():
        if label.endswith("bits"):
            assert too_wide(optimized(model, tmp_path), reads=False) == [], label


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    model = helper.make_model(
        helper.make_graph(nodes, "t", inputs, outputs, list(inits)), opset_imports=[helper.make_opsetid("", OPSET)]
    )
    model.ir_version = 8
    return model


def test_the_checker_sees_a_wide_concat_and_a_fused_split(tmp_path):
    """So the checks above cannot pass vacuously: a 33-input Concat is caught, and 33 Gathers that read one
    tensor whole are caught as built and, fused by ORT into a 33-way Split, as optimized."""
    n = MAX_FANIN + 1
    vec = helper.make_tensor_value_info
    concat = _model(
        [helper.make_node("Concat", ["x"] * n, ["y"], axis=0)],
        [vec("x", TensorProto.FLOAT, [2])],
        [vec("y", TensorProto.FLOAT, [2 * n])],
    )
    assert too_wide(concat, reads=False) == [f"Concat of {n} inputs (y)"]
    g = GraphBuilder(1)
    parts = [g.op("Gather", "x", g.i64(i), axis=0) for i in range(n)]
    g.op("Concat", *[g.op("Unsqueeze", p, g.i64([0])) for p in parts[:MAX_FANIN]], axis=0, out="y")
    g.op("Sum", *parts[MAX_FANIN:], out="z")
    gathers = _model(
        g.nodes,
        [vec("x", TensorProto.FLOAT, [n, 3])],
        [vec("y", TensorProto.FLOAT, [MAX_FANIN, 3]), vec("z", TensorProto.FLOAT, [3])],
        g.inits,
    )
    assert too_wide(gathers, reads=True) == [f"x read {n} times"]
    assert too_wide(optimized(gathers, tmp_path), reads=False) == [f"Split of {n} outputs (of x)"]


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = load_ort().InferenceSession(model.SerializeToString(), _options(), providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})


def test_trees_nest_past_32_squared_and_keep_every_byte():
    """entries, pieces and join over more than 32 * 32 items (three levels): no node wider than MAX_FANIN, and
    the joined reads give the tensor back exactly. 1030 pieces of 1 or 2 entries: just past 32 * 32 of each,
    since ORT takes the longer to open the session the more entries there are (~1.7 s for 2,200)."""
    sizes = np.random.default_rng(0).integers(1, 3, 1030).tolist()
    n = sum(sizes)
    g = GraphBuilder(1)
    rows = join(g, [g.op("Unsqueeze", e, g.i64([0])) for e in entries(g, "x", 0, n)], axis=0)
    g.op("Identity", rows, out="rows")
    g.op("Identity", join(g, pieces(g, "x", 0, sizes), axis=0), out="cut")
    vec = helper.make_tensor_value_info
    model = _model(
        g.nodes, [vec("x", TensorProto.FLOAT, [n])], [vec(o, TensorProto.FLOAT, [n]) for o in ("rows", "cut")], g.inits
    )
    assert too_wide(model, reads=True) == []
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    rows, cut = _run(model, {"x": x})
    assert rows.tobytes() == x.tobytes() and cut.tobytes() == x.tobytes()


def _draw(rng: np.random.Generator, elem_type: int, shape: list[int]) -> np.ndarray:
    """Random input values: bytes for int64 ids, signs for int8, any byte for uint8, floats in (0.01, 0.5)
    (positive, so that the update's second moments stay so)."""
    if elem_type == TensorProto.INT64:
        return rng.integers(0, 256, shape)
    if elem_type == TensorProto.INT8:
        return rng.integers(-1, 2, shape).astype(np.int8)
    if elem_type == TensorProto.UINT8:
        return rng.integers(0, 256, shape).astype(np.uint8)
    return rng.uniform(0.01, 0.5, shape).astype(np.float32)


def _feeds(model: onnx.ModelProto, seed: int) -> dict[str, np.ndarray]:
    """Random values for every input of `model`, its symbolic dims 2."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in model.graph.input:
        t = i.type.tensor_type
        out[i.name] = _draw(rng, t.elem_type, [d.dim_value if d.HasField("dim_value") else 2 for d in t.shape.dim])
    return out


SMALL = {
    "lstm": ModelConfig(embed=8, hidden=16, layers=2),
    "soma": ModelConfig(kind="soma", embed=16, hidden=16, layers=2),
}


@pytest.mark.parametrize("probes", PROBE_SETTINGS, ids=lambda p: graph_noise(SPSAConfig(**p)).value)
@pytest.mark.parametrize("kind", list(SMALL))
def test_trees_give_the_flat_graphs_bytes(kind, probes, monkeypatch):
    """The population graph at T = 70 (blocks of 32, 32 and 6 steps) and the update graph at K = 40 give bit for
    bit what they give built flat (MAX_FANIN lifted: one Gather a step, one Concat of all T, as before)."""
    m, cfg = SMALL[kind], Config(model=SMALL[kind], spsa=SPSAConfig(directions=40, **probes))
    noise, perturbed = graph_noise(cfg.spsa), perturbed_tensors(cfg)

    def graphs():
        return build_population(m, 2, perturbed, noise, True, 70), build_update(m, cfg.spsa, 40, perturbed, noise, True)

    trees = graphs()
    monkeypatch.setattr(builder, "MAX_FANIN", 10**9)
    flats = graphs()
    assert too_wide(flats[0], reads=True) and too_wide(flats[1], reads=True)  # what the trees are for
    for tree, flat in zip(trees, flats):
        feeds = _feeds(tree, seed=5)
        got, want = _run(tree, feeds), _run(flat, feeds)
        assert all(np.isfinite(a).all() for a in got)  # NaNs would compare equal as bytes
        assert [a.tobytes() for a in got] == [b.tobytes() for b in want]
