"""Device names: `auto | cpu | cuda[:i] | <ONNX Runtime execution provider>`, parsed without onnxruntime.

A config names its device as text; checking that text must not load onnxruntime (the config loads
everywhere, onnxruntime only where something runs). `soma_edge.runtime` turns a parsed Device into
ONNX Runtime's providers list, and resolves `auto` against the providers the installed build has.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from soma_edge.errors import ConfigError

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
# ONNX Runtime's `get_all_providers()` (every provider it knows of, built in or not; onnxruntime 1.31), in its
# order: the names a device may give. Whether this build can run one is the session's check (runtime).
EXECUTION_PROVIDERS = (
    "NvTensorRTRTXExecutionProvider",
    "TensorrtExecutionProvider",
    CUDA,
    "MIGraphXExecutionProvider",
    "OpenVINOExecutionProvider",
    "DnnlExecutionProvider",
    "VitisAIExecutionProvider",
    "QNNExecutionProvider",
    "NnapiExecutionProvider",
    "VSINPUExecutionProvider",
    "JsExecutionProvider",
    "CoreMLExecutionProvider",
    "ACLExecutionProvider",
    "DmlExecutionProvider",
    "RknpuExecutionProvider",
    "WebNNExecutionProvider",
    "WebGpuExecutionProvider",
    "XnnpackExecutionProvider",
    "CANNExecutionProvider",
    "AzureExecutionProvider",
    CPU,
)
_CUDA_RE = re.compile(r"^cuda(?::(\d+))?$")


@dataclass(frozen=True)
class Device:
    """A parsed device: `provider` None means auto (CUDA where a GPU is, else CPU); `cuda_id` is set for
    `cuda[:i]` (a provider named in full runs with its own default options)."""

    provider: str | None
    cuda_id: int | None = None

    @property
    def auto(self) -> bool:
        return self.provider is None


def parse(device: str) -> Device:
    """`auto | cpu | cuda[:i] | <EP name>` (case-insensitive; an EP name with or without its
    `ExecutionProvider` suffix); ConfigError for anything else."""
    low = device.strip().lower()
    if low == "auto":
        return Device(None)
    if low == "cpu":
        return Device(CPU)
    m = _CUDA_RE.match(low)
    if m:
        return Device(CUDA, int(m.group(1) or 0))
    for name in EXECUTION_PROVIDERS:
        if low in (name.lower(), name.lower().removesuffix("executionprovider")):
            return Device(name)
    raise ConfigError(
        f"unknown execution provider {device!r} (use auto, cpu, cuda, cuda:N, or one of: "
        f"{', '.join(EXECUTION_PROVIDERS)})"
    )
