"""Device names: `auto | cpu | cuda[:i] | <ONNX Runtime execution provider>`, parsed without onnxruntime.

A config names its device as text; checking that text must not load onnxruntime (the config loads
everywhere, onnxruntime only where something runs). `soma_edge.engine.runtime` turns a parsed Device into
ONNX Runtime's providers list, and resolves `auto` against the providers the installed build has.
`gpus()` says which NVIDIA GPUs the driver reports, also without onnxruntime.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from soma_edge.errors import ConfigError

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
NVIDIA = ("NvTensorRTRTXExecutionProvider", "TensorrtExecutionProvider", CUDA)  # providers that run on an NVIDIA GPU
# ONNX Runtime's `get_all_providers()` (every provider it knows of, built in or not; onnxruntime 1.31), in its
# order: the names a device may give. Whether this build can run one is the session's check (runtime).
EXECUTION_PROVIDERS = (
    *NVIDIA,
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
    `cuda[:i]` and for CUDAExecutionProvider named in full, which is `cuda:0` (any other provider named in
    full runs with its own default options)."""

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
            # The CUDA EP by its full name is `cuda:0`: the same options (use_tf32 = 0) and library checks.
            return Device(name, 0 if name == CUDA else None)
    raise ConfigError(
        f"unknown execution provider {device!r} (use auto, cpu, cuda, cuda:N, or one of: "
        f"{', '.join(EXECUTION_PROVIDERS)})"
    )


@dataclass(frozen=True)
class Gpu:
    """An NVIDIA GPU as its driver reports it; memory None where only /proc/driver/nvidia was readable."""

    name: str
    driver: str
    memory_bytes: int | None


def gpus() -> list[Gpu]:
    """The NVIDIA GPUs here, in CUDA's order: nvidia-smi (no torch on workers), else /proc/driver/nvidia;
    empty when there is no driver."""
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        out = []
        for line in r.stdout.splitlines() if r.returncode == 0 else []:
            name, driver, mib = (f.strip() for f in line.split(","))
            out.append(Gpu(name, driver, int(mib) * (1 << 20)))
        if out:
            return out
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return proc_gpus()


def proc_gpus(root: Path = Path("/proc/driver/nvidia")) -> list[Gpu]:
    """The GPUs the driver lists under /proc (Linux), for a box without nvidia-smi."""
    # /proc/driver/nvidia/version: "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  ...";
    # gpus/<bus id>/information: "Model: \t\t NVIDIA H200" among other lines.
    try:
        m = re.search(r"Kernel Module\s+(\S+)", (root / "version").read_text())
        driver = m.group(1) if m else "?"
        out = []
        for info in sorted((root / "gpus").glob("*/information")):
            model = re.search(r"^Model:\s*(.+)$", info.read_text(), re.M)
            out.append(Gpu(model.group(1).strip() if model else "NVIDIA GPU", driver, None))
        return out
    except OSError:
        return []
