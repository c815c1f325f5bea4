"""The static CUDA-op check (soma_edge.expert.cuda_kernels): every expert graph, and the update graph a GPU worker runs
(the population graph's check is in test_population.py), has a CUDA kernel for every node, on the CPU alone,
against the table of ONNX Runtime 1.31.1's CUDA EP kernels.

What does not run whole on CUDA, and is asserted so that the claim stays true:
- the router featurizer (graph.router_features) runs on the CPU by design: its uint64 hashing uses BitShift
  and BitwiseOr (and it uses Unique), which the CUDA EP lacks;
- the int8 graphs export/bundle.py writes with --quantize int8 do not run whole on CUDA: the CUDA EP has no
  DynamicQuantizeLinear and no com.microsoft DynamicQuantizeLSTM, and its MatMulInteger takes int8
  activations, not the uint8 that DynamicQuantizeLinear makes. Those bundles are for CPU inference.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from export import bundle
from soma_edge.config import UPDATES, ModelConfig, SPSAConfig
from soma_edge.corpus import router
from soma_edge.expert import cuda_kernels as cuda_ops
from soma_edge.expert import graph, params, update_graph
from soma_edge.expert.population_graph import Noise
from tests.helpers.export_run import domains, make_run
from tests.helpers.old_loss import with_softmax_cross_entropy

ROOT = Path(__file__).resolve().parents[2]
KINDS = [ModelConfig(embed=8, hidden=16, layers=2), ModelConfig(kind="soma", embed=8, hidden=8, layers=2)]
ROUTER_OPS = {"BitShift", "BitwiseOr", "Unique"}  # the featurizer's CPU-only ops
INT8_OPS = {("", "DynamicQuantizeLinear"), ("", "MatMulInteger"), ("com.microsoft", "DynamicQuantizeLSTM")}


def _id(m: ModelConfig) -> str:
    return m.kind


def _ops(nodes: list[cuda_ops.UncoveredNode]) -> set[str]:
    return {n.op for n in nodes}


@pytest.mark.parametrize("m", KINDS, ids=_id)
@pytest.mark.parametrize("mode", graph.MODES)
@pytest.mark.parametrize("weights", ["inputs", "initializers"])
def test_every_expert_graph_runs_whole_on_cuda(m, mode, weights):
    w = None if weights == "inputs" else np.random.default_rng(0).standard_normal(params.count(m)).astype(np.float32)
    model = graph.build(m, mode, w)
    assert cuda_ops.nodes_without_cuda_kernel(model) == []


# Every update rule the update graph takes (update_graph.supported), with and without heavy-ball momentum.
UPDATE_RULES = [
    (u, mu) for u in UPDATES for mu in (0.0, 0.9) if update_graph.supported(SPSAConfig(update=u, momentum=mu)) is None
]


@pytest.mark.parametrize("m", KINDS, ids=_id)
@pytest.mark.parametrize("rule", UPDATE_RULES, ids=lambda r: f"{r[0]}-mu{r[1]}")
def test_the_update_graph_runs_whole_on_cuda(m, rule):
    """The update the worker runs on the device (soma_edge.engine.resident builds it as below), for every noise
    form, the delta-rule decoder or a perturbed one, accumulated minibatches and weight decay."""
    lay = params.layout(m)
    body = [n for n in lay.names if n not in lay.decoder]
    for noise in Noise:
        for decoder, perturbed in (("delta", body), ("spsa", lay.names)):
            cfg = SPSAConfig(
                update=rule[0], momentum=rule[1], weight_decay=0.1, decoder=decoder, directions=2, accumulate=2
            )
            k = cfg.directions * cfg.accumulate
            model = update_graph.build_update(m, cfg, k, perturbed, noise, decoder == "delta")
            assert cuda_ops.nodes_without_cuda_kernel(model) == [], (noise, decoder)
            assert "ConstantOfShape" in {n.op_type for n in model.graph.node}  # the accumulator's zeros


def test_the_update_rules_cover_every_supported_one():
    assert {u for u, _ in UPDATE_RULES} == {u for u in UPDATES if u != "rms"}
    assert update_graph.supported(SPSAConfig(update="rms")) is not None  # the host update, not a graph


@pytest.mark.parametrize("m", KINDS, ids=_id)
@pytest.mark.parametrize("mode", ["loss", "train"])
def test_the_old_softmax_cross_entropy_head_is_flagged(m, mode):
    old = with_softmax_cross_entropy(graph.build(m, mode))
    (bad,) = cuda_ops.nodes_without_cuda_kernel(old)
    assert (bad.domain, bad.op, bad.opset) == ("", "SoftmaxCrossEntropyLoss", graph.OPSET)
    assert dict(bad.types) == {"logits": "tensor(float)", "y_flat": "tensor(int64)"}
    assert "no CUDA kernel" in bad.reason


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """(kind, quantize) -> a bundle directory that export/bundle.py wrote, for both kinds, float and int8."""
    docs = domains()
    out = {}
    for m in KINDS:
        base = tmp_path_factory.mktemp(m.kind)
        make_run(base / "run", m, 2, docs)
        for q in (None, "int8"):
            out[m.kind, q] = base / f"deploy-{q}"
            bundle.write(base / "run", out[m.kind, q], quantize=q)
    return out


def _expert_graphs(deploy) -> list[onnx.ModelProto]:
    manifest = json.loads((deploy / "manifest.json").read_text())
    return [onnx.load(str(deploy / e[kind])) for e in manifest["experts"] for kind in ("score", "stream")]


@pytest.mark.parametrize("kind", ["lstm", "soma"])
def test_the_bundles_float_graphs_run_whole_on_cuda_and_its_router_on_the_cpu(bundles, kind):
    deploy = bundles[kind, None]
    for model in _expert_graphs(deploy):
        assert cuda_ops.nodes_without_cuda_kernel(model) == []
    router = cuda_ops.nodes_without_cuda_kernel(onnx.load(str(deploy / "router_features.onnx")))
    assert _ops(router) == ROUTER_OPS  # on the CPU by design: uint64 hashing (BitShift, BitwiseOr) and Unique


@pytest.mark.parametrize("kind", ["lstm", "soma"])
def test_the_bundles_int8_graphs_do_not_run_whole_on_cuda(bundles, kind):
    """Said plainly, not hidden: --quantize int8 makes graphs for CPU inference (see the module docstring)."""
    for model in _expert_graphs(bundles[kind, "int8"]):
        bad = cuda_ops.nodes_without_cuda_kernel(model)
        assert {(n.domain, n.op) for n in bad} == INT8_OPS
        reasons = [n.reason for n in bad if n.op == "MatMulInteger"]
        assert reasons and all("T1 = tensor(uint8)" in r for r in reasons)


def test_router_features_is_flagged():
    """The featurizer runs on the CPU by design; the check must keep saying so (BitShift, BitwiseOr)."""
    r, _ = router.fit(domains()[:24], 2, seed=0, dim=64)
    bad = cuda_ops.nodes_without_cuda_kernel(graph.router_features(r))
    assert {"BitShift", "BitwiseOr"} <= _ops(bad) and _ops(bad) == ROUTER_OPS


def _one_node(op: str, elem: int, opset: int, **attrs) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", elem, [3])
    y = helper.make_tensor_value_info("y", elem, [3])
    g = helper.make_graph([helper.make_node(op, ["x"], ["y"], name="n", **attrs)], "g", [x], [y])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def test_the_checker_reads_types_and_opset_ranges():
    assert cuda_ops.nodes_without_cuda_kernel(_one_node("Neg", TensorProto.FLOAT, 17)) == []
    # Neg's CUDA kernel takes signed types only
    (bad,) = cuda_ops.nodes_without_cuda_kernel(_one_node("Neg", TensorProto.UINT8, 17))
    assert (bad.name, bad.op, bad.types) == (
        "n",
        "Neg",
        (("x", "tensor(uint8)"),),
    ) and "T = tensor(uint8)" in bad.reason
    # Relu of opset 14 onwards takes bfloat16 on CUDA, the opset-6 one does not
    assert cuda_ops.nodes_without_cuda_kernel(_one_node("Relu", TensorProto.BFLOAT16, 17)) == []
    (bad,) = cuda_ops.nodes_without_cuda_kernel(_one_node("Relu", TensorProto.BFLOAT16, 12))
    assert bad.opset == 12 and "T = tensor(bfloat16)" in bad.reason
    # an op the table does not list at all
    (bad,) = cuda_ops.nodes_without_cuda_kernel(_one_node("BitwiseNot", TensorProto.INT32, 18))
    assert bad.reason == "no CUDA kernel for this op"


def test_shape_arithmetic_is_flagged():
    """Shape's output lives in host memory, and ORT runs what computes on it on the CPU: the train graph once
    counted its rows with Shape -> Cast, which a CUDA-only session would have refused."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2])
    n = helper.make_tensor_value_info("n", TensorProto.FLOAT, [2])
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Cast", ["s"], ["n"], to=TensorProto.FLOAT)]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [n]), opset_imports=[helper.make_opsetid("", 17)])
    (bad,) = cuda_ops.nodes_without_cuda_kernel(model)
    assert bad.op == "Shape" and "host memory" in bad.reason


def test_the_table_names_its_source_and_its_rows_do_not_overlap():
    assert "docs/OperatorKernels.md" in cuda_ops.SOURCE and "CUDAExecutionProvider" in cuda_ops.SOURCE
    assert cuda_ops.ORT_VERSION == "1.31.1"
    by_op: dict[tuple[str, str], list[cuda_ops.CudaKernel]] = {}
    for k in cuda_ops.CUDA_KERNELS:
        by_op.setdefault((k.domain, k.op), []).append(k)
        assert k.types and all(t.startswith("tensor(") for _, ts in k.types for t in ts)
    for rows in by_op.values():
        spans = sorted((k.first, k.last if k.last is not None else 10**9) for k in rows)
        assert all(a[1] < b[0] for a, b in zip(spans, spans[1:])), rows
        assert sum(k.last is None for k in rows) == 1  # the newest row is open-ended, as the doc's "N+"
    # every op the expert graphs use is listed
    used = {n.op_type for m in KINDS for mode in graph.MODES for n in graph.build(m, mode).graph.node}
    assert used <= {op for _, op in by_op}


def test_the_table_loads_without_onnx():
    """Doctor and the deploy path may read the table where onnx is absent; only the checker needs onnx."""
    code = "import sys; sys.modules['onnx'] = None; from soma_edge.expert import cuda_kernels as k; "
    code += "print(len(k.CUDA_KERNELS))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == len(cuda_ops.CUDA_KERNELS)
