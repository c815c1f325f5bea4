"""The loss head graph.build wrote before issue 22, rebuilt for the tests: one SoftmaxCrossEntropyLoss node
in place of the nodes that now compute "loss" from "logits" and "y_flat". It lives only here, so that the
parity test and the CUDA-op check compare against it without it living on in the product."""

from __future__ import annotations

import onnx
from onnx import helper


def with_softmax_cross_entropy(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of a "loss" or "train" graph whose "loss" is SoftmaxCrossEntropyLoss(logits, y_flat), as before."""
    nodes = list(model.graph.node)
    inputs_of = _ancestors(nodes, {"logits", "y_flat"})
    loss_nodes = _ancestors(nodes, {"loss"}) - inputs_of  # the nodes between logits/y_flat and loss
    assert loss_nodes, "no loss nodes between logits, y_flat and loss"
    at = min(loss_nodes)
    sce = helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y_flat"], ["loss"], reduction="mean")
    kept = [n for i, n in enumerate(nodes) if i not in loss_nodes]
    old = onnx.ModelProto()
    old.CopyFrom(model)
    del old.graph.node[:]
    old.graph.node.extend(kept[:at] + [sce] + kept[at:])
    onnx.checker.check_model(old)  # fails if a kept node still read a removed node's output
    return old


def _ancestors(nodes: list[onnx.NodeProto], names: set[str]) -> set[int]:
    """Indices of the nodes that produce `names` or anything they are computed from."""
    producer = {out: i for i, n in enumerate(nodes) for out in n.output}
    todo, seen = [producer[n] for n in names if n in producer], set()
    while todo:
        i = todo.pop()
        if i not in seen:
            seen.add(i)
            todo += [producer[x] for x in nodes[i].input if x in producer]
    return seen
