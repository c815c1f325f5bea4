"""ONNX Runtime sessions: execution-provider choice, and the expert loss evaluator SPSA calls.

onnxruntime-gpu asked for CUDA on a machine without it logs an error and silently runs on CPU; we
check `get_providers()` after creating every session and say so loudly.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from soma_edge import devices
from soma_edge.config import Config, ModelConfig
from soma_edge.devices import CPU, CUDA
from soma_edge.errors import DeviceError
from soma_edge.params import layout

if TYPE_CHECKING:  # the deploy path creates sessions from bytes and must run without the onnx package
    import onnx

log = logging.getLogger("soma_edge.runtime")


def _ort():
    import onnxruntime  # heavy (~0.3 s, and a GPU build loads CUDA libraries): only where a session is made

    return onnxruntime


def _nvidia_present() -> bool:
    # onnxruntime-gpu lists CUDA as "available" even on machines with no GPU; asking for it there logs an
    # error. For `auto`, look for the driver first.
    return os.name == "nt" or Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia").exists()


def parse_device(device: str) -> list[Any]:
    """Map `auto | cpu | cuda[:i] | <EP name>` to an ORT providers list (CPU always last, as fallback)."""
    d = devices.parse(device)
    if d.auto:
        if CUDA in _ort().get_available_providers() and _nvidia_present():
            return [(CUDA, {"device_id": 0}), CPU]
        return [CPU]
    if d.cuda_id is not None:
        return [(CUDA, {"device_id": d.cuda_id}), CPU]
    return [d.provider] if d.provider == CPU else [d.provider, CPU]


def session_options(threads: int = 0, spin: bool = True):
    ort = _ort()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    if not spin:
        # Workers sharing a box must not burn each other's cores spinning between ops.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


def make_session(model: onnx.ModelProto | bytes, device: str = "auto", threads: int = 0, spin: bool = True):
    """Create an InferenceSession and report, loudly, when the requested EP is not the one in use."""
    ort = _ort()
    providers = parse_device(device)
    data = model if isinstance(model, bytes) else model.SerializeToString()
    wanted = providers[0][0] if isinstance(providers[0], tuple) else providers[0]
    available = ort.get_available_providers()
    if wanted not in available:
        raise DeviceError(
            f"execution provider {wanted} is not available in this onnxruntime build "
            f"(available: {', '.join(available)})"
        )
    try:
        sess = ort.InferenceSession(data, sess_options=session_options(threads, spin), providers=providers)
    except Exception as e:  # ORT raises plain RuntimeError/Fail for a provider that cannot start
        raise DeviceError(f"cannot create an ONNX Runtime session on {device!r}: {e}") from None
    in_use = sess.get_providers()
    if in_use[0] != wanted:
        log.warning(
            "requested %s (device=%r) but ONNX Runtime is running on %s: it fell back, so this runs on the CPU",
            wanted,
            device,
            in_use[0],
        )
    return sess


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def plan_concurrency(device: str, threads: int = 0, parallel: int = 0) -> tuple[int, int]:
    """Resolve (intra-op threads, concurrent evaluations); 0 means choose.

    On CPU, two single-thread runs side by side beat one two-thread run (ORT's LSTM op scales poorly
    across threads at batch 16), so auto splits the cores between two concurrent evaluations. On an
    accelerator one evaluation at a time keeps the device busy.
    """
    first = parse_device(device)[0]
    on_cpu = first == CPU
    cores = cpu_count()
    if not on_cpu:
        return threads, parallel or 1
    if parallel == 0:
        parallel = 1 if cores < 2 or (threads and threads * 2 > cores) else 2
    if threads == 0:
        threads = max(1, cores // parallel)
    return threads, parallel


@dataclass
class LossEvaluator:
    """One ORT session per expert shape; evaluates L(w) for any flat weight vector w of that shape.

    `session.run` is thread-safe, so `parallel` evaluations may run at once on the one session. With
    `decoder_grad`, a second session on the "train" graph gives the clean forward: the loss and the exact
    decoder-path gradient at w.
    """

    model: ModelConfig
    device: str = "auto"
    threads: int = 0
    spin: bool = True
    parallel: int = 0
    decoder_grad: bool = False

    def __post_init__(self) -> None:
        from soma_edge.graph import build  # graph imports onnx, which the deploy path (export.infer) must not need

        self.threads, self.parallel = plan_concurrency(self.device, self.threads, self.parallel)
        self.layout = layout(self.model)
        self.session = make_session(build(self.model, "loss"), self.device, self.threads, self.spin)
        self.providers: list[str] = self.session.get_providers()
        self.train_session = None
        if self.decoder_grad:
            self.train_session = make_session(build(self.model, "train"), self.device, self.threads, self.spin)

    def _feeds(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
        feeds: dict[str, np.ndarray] = {"x": x, "y": y}
        feeds.update(self.layout.views(flat))
        return feeds

    def loss(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
        (out,) = self.session.run(["loss"], self._feeds(flat, x, y))
        return float(out)

    def clean(self, flat: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
        """(loss, gradient of the loss with respect to the decoder) at `flat`; the gradient is float32 in
        the layout's order, the length of flat[layout.body:]."""
        if self.train_session is None:
            raise RuntimeError("this evaluator was built without decoder_grad")
        names = ["loss"] + [f"grad.{n}" for n in self.layout.decoder]
        loss, *grads = self.train_session.run(names, self._feeds(flat, x, y))
        return float(loss), np.concatenate([g.reshape(-1) for g in grads])


def evaluator_for(
    cfg: Config, device: str | None = None, threads: int | None = None, spin: bool = True, parallel: int | None = None
) -> LossEvaluator:
    """The evaluator a config trains with: its model, and the clean-forward session when the decoder
    learns by the delta rule. Arguments left None come from the config."""
    return LossEvaluator(
        cfg.model,
        cfg.device if device is None else device,
        cfg.threads if threads is None else threads,
        spin,
        cfg.parallel if parallel is None else parallel,
        decoder_grad=cfg.spsa.decoder == "delta",
    )


def mean_loss(evaluator: LossEvaluator, flat: np.ndarray, x: np.ndarray, y: np.ndarray, batch: int = 64) -> float:
    """Mean nats/byte over all windows (x, y), evaluated in batches of `batch` windows."""
    total, count = 0.0, 0
    for i in range(0, len(x), batch):
        xb, yb = x[i : i + batch], y[i : i + batch]
        total += evaluator.loss(flat, xb, yb) * xb.size
        count += xb.size
    return total / max(count, 1)
