"""ONNX graph builders for one expert, with the ONNX `LSTM` op, for both model kinds (config.ModelConfig).

Four heads over one body (the lstm kind's stacked LSTMs, or the soma kind's residual blocks):
- "loss":     (x[B,T], y[B,T]) -> mean cross-entropy in nats/byte, as -mean(LogSoftmax(logits) at y).
              Training feeds the weights as graph inputs, so one ORT session evaluates every perturbed
              weight set.
- "train":    "loss" plus the exact gradient of that loss with respect to the decoder alone (the
              decoder-path delta rule): with h the top layer's output rows and d = (softmax - onehot(y))
              / (B*T), grad.head.W = h^T d and grad.head.b = sum over rows of d; for the tied kind
              grad.E = d^T h (E's role as the embedding is not differentiated). One MatMul and a
              reduction on top of the forward, so a worker needs nothing but ONNX Runtime.
- "logprobs": x[B,T] -> log-probs [B,T,256] (scoring).
- "stream":   (x[B,T], h*/c* [1,B,H] per layer) -> logits [B,T,256] and the new states (generation).
With `weights=None` the weights are graph inputs; with a flat vector they become initializers (deploy).
Every node of these four heads has a kernel in ONNX Runtime's CUDA EP (cuda_ops.py lists them, and
tests/unit/test_cuda_ops.py checks it), so a GPU worker runs them whole on the GPU. (The int8 copies that
export/bundle.py quantizes from "logprobs" and "stream" do not: see cuda_ops.py.)

`router_features` builds the router's featurizer and distances as a graph, for deploy bundles. It runs on
the CPU by design: its uint64 hashing uses BitShift and BitwiseOr, which the CUDA EP lacks.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from soma_edge.config import ModelConfig
from soma_edge.corpus import features
from soma_edge.corpus.router import Router
from soma_edge.expert.builder import GraphBuilder, decoder_grads
from soma_edge.expert.params import VOCAB, layout

OPSET = 17
LN_EPS = 1e-5  # torch.nn.LayerNorm's default, so the torch reference matches
MODES = ("loss", "train", "logprobs", "stream")


def build(m: ModelConfig, mode: str = "loss", weights: np.ndarray | None = None) -> onnx.ModelProto:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    lay = layout(m)
    H = m.hidden
    inputs = [helper.make_tensor_value_info("x", TensorProto.INT64, ["B", "T"])]
    if mode in ("loss", "train"):
        inputs.append(helper.make_tensor_value_info("y", TensorProto.INT64, ["B", "T"]))
    initializers: list[onnx.TensorProto] = []
    if weights is None:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in zip(lay.names, lay.shapes)]
    else:
        initializers += [numpy_helper.from_array(np.ascontiguousarray(a), n) for n, a in lay.views(weights).items()]
    initializers.append(numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"))

    body = _soma_body if m.kind == "soma" else _lstm_body
    nodes, top, consts = body(m, stream=mode == "stream")
    initializers += consts
    outputs = []
    if mode == "stream":
        for layer in range(m.layers):
            for s in ("h", "c"):
                inputs.append(helper.make_tensor_value_info(f"{s}{layer}", TensorProto.FLOAT, [1, "B", H]))
                outputs.append(helper.make_tensor_value_info(f"{s}{layer}_out", TensorProto.FLOAT, [1, "B", H]))

    if mode in ("loss", "train"):
        nodes += [helper.make_node("Reshape", [top, "rows_h"], ["rows"])]
        nodes += _head(m, "rows")
        nodes += [
            helper.make_node("Transpose", ["y"], ["y_tb"], perm=[1, 0]),
            helper.make_node("Reshape", ["y_tb", "flat1"], ["y_flat"]),
        ]
        nodes += _loss_nodes()
        initializers.append(numpy_helper.from_array(np.array([-1, H], dtype=np.int64), "rows_h"))
        initializers.append(numpy_helper.from_array(np.array([-1], dtype=np.int64), "flat1"))
        outputs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])]
        if mode == "train":  # the delta rule's decoder gradients, built as the population graph builds them
            g = GraphBuilder(prefix="decoder_")
            decoder_grads(g, m.kind, "logits", "rows", "y_flat")
            nodes += g.nodes
            initializers += g.inits
            outputs += [
                helper.make_tensor_value_info(f"grad.{n}", TensorProto.FLOAT, list(lay.shapes[lay.names.index(n)]))
                for n in lay.decoder
            ]
    else:
        # Batch-major out: [T,B,H] -> [B,T,H] before the head, so callers index [b, t].
        nodes += [helper.make_node("Transpose", [top], ["top_bt"], perm=[1, 0, 2])]
        nodes += _head(m, "top_bt")
        if mode == "logprobs":
            nodes.append(helper.make_node("LogSoftmax", ["logits"], ["logprobs"], axis=-1))
            outputs = [helper.make_tensor_value_info("logprobs", TensorProto.FLOAT, ["B", "T", VOCAB])]
        else:
            outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "T", VOCAB])] + outputs

    graph = helper.make_graph(nodes, f"soma_expert_{mode}", inputs, outputs, initializers)
    graph.doc_string = f"soma-edge expert, model.kind = {m.kind!r}"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="soma-edge")
    model.ir_version = 8  # readable by every ORT >= 1.10
    onnx.checker.check_model(model)
    return model


def _lstm(layer: int, src: str, W: str, R: str, B: str, out: str, stream: bool, hidden: int) -> list[onnx.NodeProto]:
    """One ONNX LSTM over [T,B,in] -> `out` [T,B,H]; in stream mode it reads and returns h<layer>/c<layer>."""
    ins, outs = [src, W, R, B], [f"y{layer}"]
    if stream:
        ins += ["", f"h{layer}", f"c{layer}"]
        outs += [f"h{layer}_out", f"c{layer}_out"]
    return [
        helper.make_node("LSTM", ins, outs, hidden_size=hidden),
        helper.make_node("Squeeze", [f"y{layer}", "axis1"], [out]),  # [T,1,B,H] -> [T,B,H]
    ]


def _lstm_body(m: ModelConfig, stream: bool) -> tuple[list[onnx.NodeProto], str, list[onnx.TensorProto]]:
    nodes = [
        # Time-major for the LSTM op; transposing the int ids is cheaper than the embeddings.
        helper.make_node("Transpose", ["x"], ["x_tb"], perm=[1, 0]),
        helper.make_node("Gather", ["embed", "x_tb"], ["h_in0"]),
    ]
    for layer in range(m.layers):
        nodes += _lstm(
            layer,
            f"h_in{layer}",
            f"lstm{layer}.W",
            f"lstm{layer}.R",
            f"lstm{layer}.B",
            f"h_in{layer + 1}",
            stream,
            m.hidden,
        )
    return nodes, f"h_in{m.layers}", []


def _soma_body(m: ModelConfig, stream: bool) -> tuple[list[onnx.NodeProto], str, list[onnx.TensorProto]]:
    """Pre-norm residual blocks x += LSTM(LN(x)); x += W2 gelu(LN(x) W1), then the final LN."""
    node = helper.make_node

    def ln(src, g, out):
        return node("LayerNormalization", [src, g], [out], axis=-1, epsilon=LN_EPS)

    nodes = [node("Transpose", ["x"], ["x_tb"], perm=[1, 0]), node("Gather", ["E", "x_tb"], ["r0"])]
    for b in range(m.layers):
        p, r = f"block{b}.", f"r{b}"
        nodes += [ln(r, p + "ln1.g", f"a{b}")]
        nodes += _lstm(b, f"a{b}", p + "lstm.W", p + "lstm.R", "", f"l{b}", stream, m.hidden)  # bias-free
        nodes += [
            node("Add", [r, f"l{b}"], [f"s{b}"]),
            ln(f"s{b}", p + "ln2.g", f"n{b}"),
            node("MatMul", [f"n{b}", p + "mlp.W1"], [f"u{b}"]),
            # exact GELU, 0.5 u (1 + erf(u / sqrt 2)): opset 17 has no Gelu op (ORT fuses this pattern)
            node("Div", [f"u{b}", "sqrt2"], [f"us{b}"]),
            node("Erf", [f"us{b}"], [f"ue{b}"]),
            node("Add", [f"ue{b}", "one"], [f"ua{b}"]),
            node("Mul", [f"u{b}", f"ua{b}"], [f"um{b}"]),
            node("Mul", [f"um{b}", "half"], [f"g{b}"]),
            node("MatMul", [f"g{b}", p + "mlp.W2"], [f"o{b}"]),
            node("Add", [f"s{b}", f"o{b}"], [f"r{b + 1}"]),
        ]
    nodes.append(ln(f"r{m.layers}", "ln_f.g", "top"))

    def f32(name, v):
        return numpy_helper.from_array(np.array(v, dtype=np.float32), name)

    return nodes, "top", [f32("sqrt2", np.sqrt(2.0)), f32("one", 1.0), f32("half", 0.5)]


def _head(m: ModelConfig, src: str) -> list[onnx.NodeProto]:
    """`src` [..., H] -> "logits" [..., 256]: the linear head, or the tied h E^T."""
    if m.kind == "soma":
        return [
            helper.make_node("Transpose", ["E"], ["E_t"], perm=[1, 0]),
            helper.make_node("MatMul", [src, "E_t"], ["logits"]),
        ]
    return [
        helper.make_node("MatMul", [src, "head.W"], ["logits_mm"]),
        helper.make_node("Add", ["logits_mm", "head.b"], ["logits"]),
    ]


def _loss_nodes() -> list[onnx.NodeProto]:
    """ "logits" [N, 256] and "y_flat" [N] -> "loss", the mean cross-entropy -mean_n log_softmax(logits)[n, y_n].

    Spelled with LogSoftmax, GatherElements, ReduceMean and Neg rather than SoftmaxCrossEntropyLoss: the CUDA
    EP of the inference wheel implements these, while its SoftmaxCrossEntropyLoss kernel is among ORT's training
    ops, so that one node would run on the CPU and copy the logits to the host on every call (cuda_ops.py)."""
    node = helper.make_node
    return [
        node("LogSoftmax", ["logits"], ["logp_rows"], axis=-1),
        node("Unsqueeze", ["y_flat", "axis1"], ["y_col"]),  # [N] -> [N, 1], GatherElements' index shape
        node("GatherElements", ["logp_rows", "y_col"], ["logp_y"], axis=1),
        node("ReduceMean", ["logp_y"], ["mean_logp_y"], keepdims=0),  # no axes: over all N rows, to a scalar
        node("Neg", ["mean_logp_y"], ["loss"]),
    ]


def router_features(r: Router) -> onnx.ModelProto:
    """The router's featurizer and distances as ONNX: context uint8[L] (L >= 1) -> distances float32[1, N].

    The same computation as `Router.distances` for one non-empty context, so a deployment can route with
    any ONNX Runtime and no soma-edge code: hash every byte n-gram (n = 1..MAX_N) into 2^bits buckets with
    uint64 multiplicative hashing, weight each present bucket (1 + ln count) * idf, fold the buckets into
    `dim` signed dimensions, normalize, and take each expert's minimum squared distance over its clusters.
    An empty context (a document's first window) has no features: route it on the prior instead.
    """
    if features.FEATURIZER != "byte-ngram-tfidf-sketch-v1" or features.MAX_N != 4:
        raise NotImplementedError(f"no ONNX builder for router featurizer {features.FEATURIZER!r}")
    inits = _router_constants(r)
    hash_nodes, hashes = _ngram_hash_nodes(inits)
    nodes = [helper.make_node("Cast", ["context"], ["b"], to=TensorProto.UINT64)]
    nodes += hash_nodes + _feature_nodes(hashes) + _distance_nodes()
    graph = helper.make_graph(
        nodes,
        "soma_router_features",
        [helper.make_tensor_value_info("context", TensorProto.UINT8, ["L"])],
        [helper.make_tensor_value_info("distances", TensorProto.FLOAT, [1, r.n_experts])],
        inits,
    )
    graph.doc_string = f"{features.FEATURIZER}: {r.n_clusters} clusters, {r.n_experts} experts, dim {r.dim}"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="soma-edge")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _u64(name: str, v: list[int]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(v, dtype=np.uint64), name)


def _i64(name: str, v: list[int]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(v, dtype=np.int64), name)


def _router_constants(r: Router) -> list[onnx.TensorProto]:
    """The featurizer's hash constants and shifts, the router's idf and centroids, and each expert's clusters."""
    bits, dim = r.bucket_bits, r.dim
    members = [np.flatnonzero(r.cluster_expert == e) for e in range(r.n_experts)]
    width = max(len(m) for m in members)
    # Each expert's clusters, padded by repeating one of them (the minimum is unchanged).
    gather = np.array([np.resize(m, width) for m in members], dtype=np.int64)
    return [
        _u64("k_gram", [int(features.H_GRAM)]),
        _u64("k_dim", [int(features.H_DIM)]),
        _u64("k_sign", [int(features.H_SIGN)]),
        _u64("shift8", [8]),
        _u64("shift_bucket", [64 - bits]),
        _u64("shift_dim", [64 - int(dim).bit_length() + 1]),
        _u64("shift_sign", [63]),
        _u64("one_u", [1]),
        _i64("zero", [0]),
        _i64("minus1", [-1]),
        _i64("big", [np.iinfo(np.int64).max]),
        _i64("axis0", [0]),
        _i64("axis2", [2]),
        numpy_helper.from_array(np.asarray(r.idf, dtype=np.float32), "idf"),
        numpy_helper.from_array(np.zeros(dim, dtype=np.float64), "fold0"),
        numpy_helper.from_array(np.array(1.0), "one_d"),
        numpy_helper.from_array(np.array(2.0), "two_d"),
        numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two_f"),
        numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero_f"),
        numpy_helper.from_array(np.ascontiguousarray(np.asarray(r.centroids, dtype=np.float32).T), "centroids_t"),
        numpy_helper.from_array(gather, "expert_clusters"),
    ]


def _ngram_hash_nodes(inits: list[onnx.TensorProto]) -> tuple[list[onnx.NodeProto], list[str]]:
    """Nodes hashing every n-gram of the bytes "b" (n = 1..4) into buckets, and the names of the four
    hash vectors; appends the constants they use to `inits` (in the order the bundle's bytes fix)."""
    node = helper.make_node
    nodes, hashes = [], []
    gram = "b"
    for n in range(1, 5):
        if n > 1:  # gram_n[p] = gram_{n-1}[p] << 8 | b[p + n - 1]: the n bytes at p, big-endian
            inits.append(_i64(f"start{n}", [n - 1]))
            nodes += [
                node("Slice", [gram, "zero", "minus1"], [f"head{n}"]),
                node("BitShift", [f"head{n}", "shift8"], [f"shl{n}"], direction="LEFT"),
                node("Slice", ["b", f"start{n}", "big"], [f"tail{n}"]),
                node("BitwiseOr", [f"shl{n}", f"tail{n}"], [f"gram{n}"]),
            ]
            gram = f"gram{n}"
        inits.append(_u64(f"tag{n}", [n << 32]))
        nodes += [
            node("BitwiseOr", [gram, f"tag{n}"], [f"key{n}"]),
            node("Mul", [f"key{n}", "k_gram"], [f"mix{n}"]),  # wraps mod 2^64, as numpy's uint64 does
            node("BitShift", [f"mix{n}", "shift_bucket"], [f"h{n}"], direction="RIGHT"),
        ]
        hashes.append(f"h{n}")
    return nodes, hashes


def _feature_nodes(hashes: list[str]) -> list[onnx.NodeProto]:
    """Buckets -> the unit feature vector "feat" [1, dim]: tf-idf weights folded into signed dimensions."""
    node = helper.make_node
    return [
        node("Concat", hashes, ["h_all"], axis=0),
        node("Cast", ["h_all"], ["buckets"], to=TensorProto.INT64),
        node("Unique", ["buckets"], ["present", "", "", "counts"], sorted=1),
        # weight (1 + ln count) * idf, in float64 like the numpy featurizer
        node("Cast", ["counts"], ["counts_d"], to=TensorProto.DOUBLE),
        node("Log", ["counts_d"], ["log_counts"]),
        node("Add", ["log_counts", "one_d"], ["tf"]),
        node("Gather", ["idf", "present"], ["idf_p"]),
        node("Cast", ["idf_p"], ["idf_d"], to=TensorProto.DOUBLE),
        node("Mul", ["tf", "idf_d"], ["w_abs"]),
        # bucket -> (dimension, sign) by the router's second hash, on bucket + 1
        node("Cast", ["present"], ["present_u"], to=TensorProto.UINT64),
        node("Add", ["present_u", "one_u"], ["b1"]),
        node("Mul", ["b1", "k_dim"], ["dmix"]),
        node("BitShift", ["dmix", "shift_dim"], ["dim_u"], direction="RIGHT"),
        node("Cast", ["dim_u"], ["dims"], to=TensorProto.INT64),
        node("Mul", ["b1", "k_sign"], ["smix"]),
        node("BitShift", ["smix", "shift_sign"], ["sbit"], direction="RIGHT"),
        node("Cast", ["sbit"], ["sbit_d"], to=TensorProto.DOUBLE),
        node("Mul", ["sbit_d", "two_d"], ["s2"]),
        node("Sub", ["s2", "one_d"], ["sign"]),
        node("Mul", ["w_abs", "sign"], ["w"]),
        node("ScatterElements", ["fold0", "dims", "w"], ["folded"], reduction="add"),
        node("ReduceL2", ["folded"], ["norm"], keepdims=1),
        node("Div", ["folded", "norm"], ["unit_d"]),
        node("Cast", ["unit_d"], ["unit"], to=TensorProto.FLOAT),
        node("Unsqueeze", ["unit", "axis0"], ["feat"]),
    ]


def _distance_nodes() -> list[onnx.NodeProto]:
    """ "feat" -> "distances" [1, N]: each expert's least squared distance over its clusters' unit centroids."""
    node = helper.make_node
    return [
        node("MatMul", ["feat", "centroids_t"], ["dots"]),
        node("Mul", ["dots", "two_f"], ["dots2"]),
        node("Sub", ["two_f", "dots2"], ["d2_raw"]),
        node("Max", ["d2_raw", "zero_f"], ["d2"]),  # [1, C]
        node("Gather", ["d2", "expert_clusters"], ["d2_e"], axis=1),  # [1, N, width]
        node("ReduceMin", ["d2_e", "axis2"], ["distances"], keepdims=0),
    ]
