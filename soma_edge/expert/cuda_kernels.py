"""The operators ONNX Runtime's CUDA execution provider implements, and a check of a graph against them.

`CUDA_KERNELS` lists the CUDA EP's kernels of onnxruntime-gpu 1.31.1 as (domain, op, opset range, allowed
types per type constraint), and `nodes_without_cuda_kernel(model)` names each node of a graph that none of
them covers: such a node would run on the CPU, with its inputs copied to the host and back on every call.

Source: ONNX Runtime's docs/OperatorKernels.md (generated from the registered kernels by
tools/python/gen_opkernel_doc.py), section "Operators implemented by CUDAExecutionProvider", domain ai.onnx,
as stored at commit 001d12d2623fd411ce0f83d05abb5e82304a3389 of github.com/microsoft/onnxruntime. That is the
version of the file that could be read here; the v1.31.1 tag itself could not be checked out, so this commit
is not proven to be the tag (bench/gpu_check.py checks the real placement on a GPU).

The table is TRIMMED to the ai.onnx ops soma-edge's graphs use or could plausibly use (the expert, router,
population and update graphs, the int8 bundle graphs, and common neighbours such as Gemm, Relu, Where); an
op missing here may still have a CUDA kernel, and a new op in a graph must be added from the doc before the
check passes.
Each listed op keeps every row the doc gives it. The type lists are the doc's, named once (`_STD` ...) where
many rows share one. com.microsoft: the one op of that domain in soma-edge's graphs, DynamicQuantizeLSTM
(the int8 bundle graphs), has no CUDA kernel (nor have DynamicQuantizeMatMul and MatMulIntegerToFloat, the
other dynamic-quantization ops), so no com.microsoft row is listed and every node of that domain is flagged.

What this says about soma-edge's graphs (tests/unit/test_cuda_ops.py checks each claim):
- every node of the expert graphs (graph.build, kinds lstm and soma, modes loss, train, logprobs and
  stream, weights as inputs or initializers) has a CUDA kernel;
- so has every node of the population graph (population_graph.build_population) and of the update graph
  the worker runs on the device (update_graph.build_update, every update rule update_graph.supported
  accepts, both kinds, every noise form, with and without the delta-rule decoder);
- the router featurizer (graph.router_features) does not, by design: its uint64 hashing uses BitShift and
  BitwiseOr, and it uses Unique; it runs on the CPU;
- the int8 graphs that export/bundle.py quantizes (--quantize int8) do not run whole on CUDA either:
  DynamicQuantizeLinear and com.microsoft DynamicQuantizeLSTM have no CUDA kernel, and the CUDA
  MatMulInteger takes int8 activations only, not the uint8 ones DynamicQuantizeLinear makes.

Limits of a static check: the doc lists each type constraint's types separately, while a few kernels are
registered for some combinations only (OneHot: T1/T2/T3 = int64/int64/float, the combination soma-edge
uses, is one of them); subgraphs (If, Loop) are not walked; and ORT may still place a covered node on the
CPU where it judges that cheaper. The one known case, arithmetic on a Shape or Size output (host memory), is
flagged (`HOST_OUTPUT_OPS`); bench/gpu_check.py reads the real placement on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # onnx only in the checker: the table itself loads without it, as on the deploy path
    import onnx  # heavy, and only the checker needs it (see the imports above)

ORT_VERSION = "1.31.1"
SOURCE = (
    "ONNX Runtime docs/OperatorKernels.md, CUDAExecutionProvider, ai.onnx "
    "(microsoft/onnxruntime commit 001d12d2623fd411ce0f83d05abb5e82304a3389), trimmed to soma-edge's ops"
)


# Ops whose CUDA kernels leave their output in host memory (OutputMemoryType CPU): ORT's CUDA EP hands the
# small computations downstream of them to the CPU EP (GetCpuPreferredNodes), so a graph for a CUDA-only session
# must not use them. Stricter than needed where the output only feeds a shape input, which no expert graph does.
HOST_OUTPUT_OPS = frozenset({"Shape", "Size"})


@dataclass(frozen=True)
class CudaKernel:
    """One row of the doc: `op` in `domain` ("" is ai.onnx) for opsets first..last (None: "first+", open)."""

    domain: str
    op: str
    first: int
    last: int | None
    types: tuple[tuple[str, tuple[str, ...]], ...]  # (type constraint, allowed types), as the doc lists them

    def covers(self, since_version: int) -> bool:
        return self.first <= since_version and (self.last is None or since_version <= self.last)

    def allowed(self, constraint: str) -> tuple[str, ...] | None:
        """The types the kernel takes for `constraint`, or None where the doc names no such constraint."""
        return next((types for name, types in self.types if name == constraint), None)


@dataclass(frozen=True)
class UncoveredNode:
    """A node no CUDA kernel covers: its name (or "<op>#<index in the graph>"), domain, op, the model's opset
    for its domain, the type of each input (tensor name, "tensor(float)" ...; "?" where shape inference found
    none), and why."""

    name: str
    domain: str
    op: str
    opset: int
    types: tuple[tuple[str, str], ...]
    reason: str


def nodes_without_cuda_kernel(model: onnx.ModelProto) -> list[UncoveredNode]:
    """The nodes of `model`'s main graph that ONNX Runtime 1.31.1's CUDA EP has no kernel for (`CUDA_KERNELS`).

    A node is covered when a kernel of its domain and op covers the op's schema version at the model's opset
    (the version ORT matches kernels by), and every input and output whose type onnx.shape_inference
    finds lies in the kernel's list for its type constraint. An empty list means the graph can run whole on
    the CUDA EP. For a domain onnx has no schemas for (com.microsoft), only the op and opset are checked.
    """
    from onnx import shape_inference  # heavy, and only the checker needs it (see the imports above)

    inferred = shape_inference.infer_shapes(model)
    types = _tensor_types(inferred.graph)
    opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in inferred.opset_import}
    out = []
    for i, node in enumerate(inferred.graph.node):
        domain = "" if node.domain == "ai.onnx" else node.domain
        opset = opsets.get(domain, 0)
        reason = _uncovered_reason(node, domain, opset, types)
        if reason is not None:
            node_types = tuple((name, types.get(name, "?")) for name in node.input if name)
            name = node.name or f"{node.op_type}#{i}"  # soma-edge's nodes are unnamed: the op and its index
            out.append(UncoveredNode(name, domain, node.op_type, opset, node_types, reason))
    return out


def _tensor_types(graph: onnx.GraphProto) -> dict[str, str]:
    """Every typed tensor of `graph` -> "tensor(<elem type>)", the doc's spelling."""
    out = {t.name: _doc_type(t.data_type) for t in graph.initializer}
    for info in (*graph.input, *graph.value_info, *graph.output):
        if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type:
            out[info.name] = _doc_type(info.type.tensor_type.elem_type)
    return out


def _doc_type(elem_type: int) -> str:
    from onnx import TensorProto  # heavy, and only the checker needs it (see the imports above)

    return f"tensor({TensorProto.DataType.Name(elem_type).lower()})"  # FLOAT16 -> "tensor(float16)"


def _uncovered_reason(node: onnx.NodeProto, domain: str, opset: int, types: dict[str, str]) -> str | None:
    import onnx  # heavy, and only the checker needs it (see the imports above)

    if domain == "" and node.op_type in HOST_OUTPUT_OPS:
        return (
            "its CUDA kernel writes its output to host memory, so ONNX Runtime runs the nodes computing on it "
            "on the CPU (which a CUDA-only session refuses)"
        )
    kernels = [k for k in CUDA_KERNELS if k.domain == domain and k.op == node.op_type]
    if not kernels:
        return "no CUDA kernel for this op"
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, domain)
    except onnx.defs.SchemaError:
        schema = None  # a domain onnx has no schemas for: match the kernel on the model's opset alone
    version = schema.since_version if schema is not None else opset
    kernel = next((k for k in kernels if k.covers(version)), None)
    if kernel is None:
        spans = ", ".join(f"{k.first}+" if k.last is None else f"{k.first}-{k.last}" for k in kernels)
        return f"CUDA kernels cover opsets {spans}, not this op's version {version}"
    if schema is None:
        return None
    bound = _bind(schema.inputs, node.input) + _bind(schema.outputs, node.output)
    for name, constraint in bound:
        allowed = kernel.allowed(constraint)
        found = types.get(name)
        if allowed is not None and found is not None and found not in allowed:
            return f"{constraint} = {found} ({name}) is not among the CUDA kernel's {constraint} types"
    return None


def _bind(formals: list[onnx.defs.OpSchema.FormalParameter], names) -> list[tuple[str, str]]:
    """(tensor name, type constraint) for each named input or output; a variadic formal takes the rest."""
    from onnx.defs import OpSchema  # heavy, and only the checker needs it (see the imports above)

    out = []
    for i, name in enumerate(names):
        if not name or not formals:
            continue
        formal = formals[min(i, len(formals) - 1)]
        if i >= len(formals) and formal.option != OpSchema.FormalParameterOption.Variadic:
            continue
        out.append((name, formal.type_str))
    return out


# The doc's type lists, written as the element types inside `tensor(...)`; those many rows share are named once.
def _t(names: str) -> tuple[str, ...]:
    return tuple(f"tensor({n})" for n in names.split())


_STD = _t("bfloat16 bool double float float16 int16 int32 int64 int8 uint16 uint32 uint64 uint8")
_STD_FP8 = _t(
    "bfloat16 bool double float float16 float8e4m3fn float8e4m3fnuz float8e5m2 "
    "float8e5m2fnuz int16 int32 int64 int8 uint16 uint32 uint64 uint8"
)
_NUM = _t("bfloat16 double float float16 int16 int32 int64 int8 uint16 uint32 uint64 uint8")
_NUM_13 = _t("bfloat16 double float float16 int32 int64 uint32 uint64")
_NUM_7 = _t("double float float16 int32 int64 uint32 uint64")
_FLOAT_BF16 = _t("bfloat16 double float float16")
_FLOAT = _t("double float float16")
_INDEX = _t("int32 int64")
_CAST_TO = _t(
    "bfloat16 bool double float float16 float4e2m1 float8e4m3fn float8e5m2 "
    "int16 int32 int64 int8 uint16 uint32 uint64 uint8"
)
_CAST_FROM_19 = _t(
    "bfloat16 bool double float float16 float8e4m3fn float8e5m2 int16 int32 int64 int8 uint16 uint32 uint64 uint8"
)
_CAST_FROM_6 = _t("bool double float float16 int16 int32 int64 int8 uint16 uint32 uint64 uint8")

CUDA_KERNELS: tuple[CudaKernel, ...] = (
    CudaKernel("", "Add", 14, None, (("T", _NUM),)),
    CudaKernel("", "Add", 13, 13, (("T", _NUM_13),)),
    CudaKernel("", "Add", 7, 12, (("T", _NUM_7),)),
    CudaKernel("", "Cast", 23, None, (("T1", _CAST_TO), ("T2", _CAST_TO))),
    CudaKernel("", "Cast", 21, 22, (("T1", _CAST_FROM_19), ("T2", _CAST_TO))),
    CudaKernel("", "Cast", 19, 20, (("T1", _CAST_FROM_19), ("T2", _CAST_TO))),
    CudaKernel("", "Cast", 13, 18, (("T1", _STD), ("T2", _CAST_TO))),
    CudaKernel("", "Cast", 9, 12, (("T1", _CAST_FROM_6), ("T2", _CAST_TO))),
    CudaKernel("", "Cast", 6, 8, (("T1", _CAST_FROM_6), ("T2", _CAST_TO))),
    CudaKernel("", "Concat", 13, None, (("T", _STD),)),
    CudaKernel("", "Concat", 11, 12, (("T", _STD),)),
    CudaKernel("", "Concat", 4, 10, (("T", _STD),)),
    # Its shape input is read on the host (the kernel's InputMemoryType CPU); the update graph feeds it an
    # initializer, so nothing computed on the device crosses over. Its output is on the device.
    CudaKernel("", "ConstantOfShape", 9, None, (("T1", _t("int64")), ("T2", _STD))),
    CudaKernel(
        "",
        "DequantizeLinear",
        21,
        None,
        (("T1", _t("float8e4m3fn float8e5m2 int4 int8 uint4 uint8")), ("T2", _t("float float16"))),
    ),
    CudaKernel(
        "", "DequantizeLinear", 19, 20, (("T1", _t("float8e4m3fn float8e5m2 int8 uint8")), ("T2", _t("float float16")))
    ),
    CudaKernel("", "DequantizeLinear", 13, 18, (("T", _t("int8 uint8")),)),
    CudaKernel("", "DequantizeLinear", 10, 12, (("T", _t("int8 uint8")),)),
    CudaKernel("", "Div", 14, None, (("T", _NUM),)),
    CudaKernel("", "Div", 13, 13, (("T", _NUM_13),)),
    CudaKernel("", "Div", 7, 12, (("T", _NUM_7),)),
    CudaKernel("", "Erf", 13, None, (("T", _FLOAT_BF16),)),
    CudaKernel("", "Erf", 9, 12, (("T", _FLOAT),)),
    CudaKernel("", "Exp", 13, None, (("T", _FLOAT_BF16),)),
    CudaKernel("", "Exp", 6, 12, (("T", _FLOAT),)),
    CudaKernel("", "Expand", 13, None, (("T", _STD),)),
    CudaKernel("", "Expand", 8, 12, (("T", _STD),)),
    CudaKernel("", "Gather", 13, None, (("T", _STD), ("Tind", _INDEX))),
    CudaKernel("", "Gather", 11, 12, (("T", _STD), ("Tind", _INDEX))),
    CudaKernel("", "Gather", 1, 10, (("T", _STD), ("Tind", _INDEX))),
    CudaKernel("", "GatherElements", 13, None, (("T", _STD), ("Tind", _INDEX))),
    CudaKernel("", "GatherElements", 11, 12, (("T", _STD), ("Tind", _INDEX))),
    CudaKernel("", "Gelu", 20, None, (("T", _FLOAT_BF16),)),
    CudaKernel("", "Gemm", 13, None, (("T", _FLOAT_BF16),)),
    CudaKernel("", "Gemm", 11, 12, (("T", _FLOAT),)),
    CudaKernel("", "Gemm", 9, 10, (("T", _FLOAT),)),
    CudaKernel("", "Gemm", 7, 8, (("T", _FLOAT),)),
    CudaKernel("", "LSTM", 14, None, (("T", _FLOAT), ("T1", _t("int32")))),
    CudaKernel("", "LSTM", 7, 13, (("T", _FLOAT), ("T1", _t("int32")))),
    CudaKernel("", "LayerNormalization", 17, None, (("T", _FLOAT_BF16), ("U", _t("float")))),
    CudaKernel("", "LayerNormalization", 1, 16, (("T", _FLOAT_BF16), ("U", _t("double float")), ("V", _FLOAT_BF16))),
    CudaKernel("", "Log", 13, None, (("T", _FLOAT),)),
    CudaKernel("", "Log", 6, 12, (("T", _FLOAT),)),
    CudaKernel("", "LogSoftmax", 13, None, (("T", _FLOAT),)),
    CudaKernel("", "LogSoftmax", 11, 12, (("T", _FLOAT),)),
    CudaKernel("", "LogSoftmax", 1, 10, (("T", _FLOAT),)),
    CudaKernel("", "MatMul", 13, None, (("T", _FLOAT_BF16),)),
    CudaKernel("", "MatMul", 9, 12, (("T", _FLOAT),)),
    CudaKernel("", "MatMul", 1, 8, (("T", _FLOAT),)),
    CudaKernel("", "MatMulInteger", 10, None, (("T1", _t("int8")), ("T2", _t("int8")), ("T3", _t("int32")))),
    CudaKernel("", "Max", 13, None, (("T", _NUM_13),)),
    CudaKernel("", "Max", 12, 12, (("T", _NUM_13),)),
    CudaKernel("", "Max", 6, 11, (("T", _FLOAT_BF16),)),
    CudaKernel("", "Min", 13, None, (("T", _NUM_13),)),
    CudaKernel("", "Min", 12, 12, (("T", _NUM_13),)),
    CudaKernel("", "Min", 6, 11, (("T", _FLOAT_BF16),)),
    CudaKernel("", "Mul", 14, None, (("T", _NUM),)),
    CudaKernel("", "Mul", 13, 13, (("T", _NUM_13),)),
    CudaKernel("", "Mul", 7, 12, (("T", _NUM_7),)),
    CudaKernel("", "Neg", 13, None, (("T", _t("bfloat16 double float float16 int16 int32 int64 int8")),)),
    CudaKernel("", "Neg", 6, 12, (("T", _t("double float float16 int16 int32 int64 int8")),)),
    CudaKernel("", "OneHot", 11, None, (("T1", _INDEX), ("T2", _INDEX), ("T3", _t("float float16 int64")))),
    CudaKernel("", "ReduceL2", 18, None, (("T", _t("double float float16 int32")),)),
    CudaKernel("", "ReduceL2", 1, 17, (("T", _t("double float float16 int32")),)),
    CudaKernel("", "ReduceMax", 18, None, (("T", _t("double float float16 int32 int64")),)),
    CudaKernel("", "ReduceMax", 1, 17, (("T", _t("double float float16 int32 int64")),)),
    CudaKernel("", "ReduceMean", 18, None, (("T", _t("double float float16 int32")),)),
    CudaKernel("", "ReduceMean", 1, 17, (("T", _t("double float float16 int32")),)),
    CudaKernel("", "ReduceMin", 18, None, (("T", _t("double float float16 int32 int64 int8 uint8")),)),
    CudaKernel("", "ReduceMin", 1, 17, (("T", _t("double float float16 int32 int64 int8 uint8")),)),
    CudaKernel("", "ReduceSum", 13, None, (("T", _t("bfloat16 double float float16 int32 int64")),)),
    CudaKernel("", "ReduceSum", 1, 12, (("T", _t("double float float16 int32 int64")),)),
    CudaKernel("", "Relu", 14, None, (("T", _FLOAT_BF16),)),
    CudaKernel("", "Relu", 13, 13, (("T", _FLOAT_BF16),)),
    CudaKernel("", "Relu", 6, 12, (("T", _FLOAT),)),
    CudaKernel("", "Reshape", 23, None, (("T", _STD_FP8), ("shape", _t("int64")))),
    CudaKernel("", "Reshape", 21, 22, (("T", _STD_FP8), ("shape", _t("int64")))),
    CudaKernel("", "Reshape", 19, 20, (("T", _STD_FP8), ("shape", _t("int64")))),
    CudaKernel("", "Reshape", 14, 18, (("T", _STD), ("shape", _t("int64")))),
    CudaKernel("", "Reshape", 13, 13, (("T", _STD), ("shape", _t("int64")))),
    CudaKernel("", "Reshape", 5, 12, (("T", _STD), ("shape", _t("int64")))),
    CudaKernel("", "Reshape", 1, 4, (("T", _STD),)),
    CudaKernel("", "ScatterElements", 18, None, (("T", _STD), ("Tind", _INDEX))),
    CudaKernel("", "ScatterElements", 16, 17, (("T", _STD), ("Tind", _INDEX))),
    CudaKernel("", "ScatterElements", 13, 15, (("T", _STD), ("Tind", _INDEX))),
    CudaKernel("", "ScatterElements", 11, 12, (("T", _STD), ("Tind", _INDEX))),
    CudaKernel("", "Shape", 23, None, (("T", _STD_FP8), ("T1", _t("int64")))),
    CudaKernel("", "Shape", 21, 22, (("T", _STD_FP8), ("T1", _t("int64")))),
    CudaKernel("", "Shape", 19, 20, (("T", _STD_FP8), ("T1", _t("int64")))),
    CudaKernel("", "Shape", 15, 18, (("T", _STD), ("T1", _t("int64")))),
    CudaKernel("", "Shape", 13, 14, (("T", _STD), ("T1", _t("int64")))),
    CudaKernel("", "Shape", 1, 12, (("T", _STD), ("T1", _t("int64")))),
    CudaKernel("", "Sigmoid", 13, None, (("T", _FLOAT_BF16),)),
    CudaKernel("", "Sigmoid", 6, 12, (("T", _FLOAT),)),
    CudaKernel("", "Slice", 13, None, (("T", _STD), ("Tind", _INDEX))),
    CudaKernel("", "Slice", 11, 12, (("T", _STD), ("Tind", _INDEX))),
    CudaKernel("", "Slice", 10, 10, (("T", _STD), ("Tind", _INDEX))),
    CudaKernel("", "Slice", 1, 9, (("T", _STD),)),
    CudaKernel("", "Softmax", 13, None, (("T", _FLOAT_BF16),)),
    CudaKernel("", "Softmax", 11, 12, (("T", _FLOAT),)),
    CudaKernel("", "Softmax", 1, 10, (("T", _FLOAT),)),
    CudaKernel("", "Sqrt", 13, None, (("T", _FLOAT_BF16),)),
    CudaKernel("", "Sqrt", 6, 12, (("T", _FLOAT),)),
    CudaKernel("", "Squeeze", 23, None, (("T", _STD),)),
    CudaKernel("", "Squeeze", 21, 22, (("T", _STD),)),
    CudaKernel("", "Squeeze", 13, 20, (("T", _STD),)),
    CudaKernel("", "Squeeze", 11, 12, (("T", _STD),)),
    CudaKernel("", "Squeeze", 1, 10, (("T", _STD),)),
    CudaKernel("", "Sub", 14, None, (("T", _NUM),)),
    CudaKernel("", "Sub", 13, 13, (("T", _NUM_13),)),
    CudaKernel("", "Sub", 7, 12, (("T", _NUM_7),)),
    CudaKernel("", "Tanh", 13, None, (("T", _FLOAT_BF16),)),
    CudaKernel("", "Tanh", 6, 12, (("T", _FLOAT),)),
    CudaKernel("", "Transpose", 23, None, (("T", _STD),)),
    CudaKernel("", "Transpose", 21, 22, (("T", _STD),)),
    CudaKernel("", "Transpose", 13, 20, (("T", _STD),)),
    CudaKernel("", "Transpose", 1, 12, (("T", _STD),)),
    CudaKernel("", "Unsqueeze", 23, None, (("T", _STD),)),
    CudaKernel("", "Unsqueeze", 21, 22, (("T", _STD),)),
    CudaKernel("", "Unsqueeze", 13, 20, (("T", _STD),)),
    CudaKernel("", "Unsqueeze", 11, 12, (("T", _STD),)),
    CudaKernel("", "Unsqueeze", 1, 10, (("T", _STD),)),
    CudaKernel(
        "", "Where", 16, None, (("B", _t("bool")), ("T", _t("bfloat16 double float float16 int32 int64 uint8")))
    ),
    CudaKernel("", "Where", 9, 15, (("B", _t("bool")), ("T", _t("double float float16 int32 int64 uint8")))),
)
