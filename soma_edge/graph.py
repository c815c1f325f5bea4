"""ONNX graph builders for one expert, with the ONNX `LSTM` op.

Three heads over one body:
- "loss":     (x[B,T], y[B,T]) -> mean cross-entropy in nats/byte. Training feeds the weights as
              graph inputs, so one ORT session evaluates every perturbed weight set.
- "logprobs": x[B,T] -> log-probs [B,T,256] (scoring).
- "stream":   (x[B,T], h*/c* [1,B,H] per layer) -> logits [B,T,256] and the new states (generation).
With `weights=None` the weights are graph inputs; with a flat vector they become initializers (deploy).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from soma_edge.config import ModelConfig
from soma_edge.params import VOCAB, layout

OPSET = 17
MODES = ("loss", "logprobs", "stream")


def build(m: ModelConfig, mode: str = "loss", weights: np.ndarray | None = None) -> onnx.ModelProto:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    lay = layout(m)
    H = m.hidden
    inputs = [helper.make_tensor_value_info("x", TensorProto.INT64, ["B", "T"])]
    if mode == "loss":
        inputs.append(helper.make_tensor_value_info("y", TensorProto.INT64, ["B", "T"]))
    initializers: list[onnx.TensorProto] = []
    if weights is None:
        inputs += [
            helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in zip(lay.names, lay.shapes)
        ]
    else:
        initializers += [numpy_helper.from_array(np.ascontiguousarray(a), n) for n, a in lay.views(weights).items()]
    initializers.append(numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"))

    nodes = [
        # Time-major for the LSTM op; transposing the int ids is cheaper than the embeddings.
        helper.make_node("Transpose", ["x"], ["x_tb"], perm=[1, 0]),
        helper.make_node("Gather", ["embed", "x_tb"], ["h_in0"]),
    ]
    outputs = []
    for layer in range(m.layers):
        lstm_inputs = [f"h_in{layer}", f"lstm{layer}.W", f"lstm{layer}.R", f"lstm{layer}.B"]
        lstm_outputs = [f"y{layer}"]
        if mode == "stream":
            inputs += [
                helper.make_tensor_value_info(f"h{layer}", TensorProto.FLOAT, [1, "B", H]),
                helper.make_tensor_value_info(f"c{layer}", TensorProto.FLOAT, [1, "B", H]),
            ]
            lstm_inputs += ["", f"h{layer}", f"c{layer}"]
            lstm_outputs += [f"h{layer}_out", f"c{layer}_out"]
            outputs += [
                helper.make_tensor_value_info(f"h{layer}_out", TensorProto.FLOAT, [1, "B", H]),
                helper.make_tensor_value_info(f"c{layer}_out", TensorProto.FLOAT, [1, "B", H]),
            ]
        nodes += [
            helper.make_node("LSTM", lstm_inputs, lstm_outputs, hidden_size=H),
            helper.make_node("Squeeze", [f"y{layer}", "axis1"], [f"h_in{layer + 1}"]),  # [T,1,B,H] -> [T,B,H]
        ]
    top = f"h_in{m.layers}"

    if mode == "loss":
        nodes += [
            helper.make_node("Reshape", [top, "rows_h"], ["rows"]),
            helper.make_node("MatMul", ["rows", "head.W"], ["logits_mm"]),
            helper.make_node("Add", ["logits_mm", "head.b"], ["logits"]),
            helper.make_node("Transpose", ["y"], ["y_tb"], perm=[1, 0]),
            helper.make_node("Reshape", ["y_tb", "flat1"], ["y_flat"]),
            helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y_flat"], ["loss"], reduction="mean"),
        ]
        initializers.append(numpy_helper.from_array(np.array([-1, H], dtype=np.int64), "rows_h"))
        initializers.append(numpy_helper.from_array(np.array([-1], dtype=np.int64), "flat1"))
        outputs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])]
    else:
        # Batch-major out: [T,B,H] -> [B,T,H] before the head, so callers index [b, t].
        nodes += [
            helper.make_node("Transpose", [top], ["top_bt"], perm=[1, 0, 2]),
            helper.make_node("MatMul", ["top_bt", "head.W"], ["logits_mm"]),
            helper.make_node("Add", ["logits_mm", "head.b"], ["logits"]),
        ]
        if mode == "logprobs":
            nodes.append(helper.make_node("LogSoftmax", ["logits"], ["logprobs"], axis=-1))
            outputs = [helper.make_tensor_value_info("logprobs", TensorProto.FLOAT, ["B", "T", VOCAB])]
        else:
            outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "T", VOCAB])] + outputs

    graph = helper.make_graph(nodes, f"soma_expert_{mode}", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="soma-edge")
    model.ir_version = 8  # readable by every ORT >= 1.10
    onnx.checker.check_model(model)
    return model
