"""ONNX Runtime sessions: execution-provider choice, session options, and where ORT placed the nodes.

What a device name (soma_edge.devices) asks ONNX Runtime for:
- `cpu`: the CPU EP.
- `cuda` / `cuda:i` (and `CUDAExecutionProvider` named in full, which is `cuda:0`): the CUDA EP alone, on GPU
  i, with `session.disable_cpu_ep_fallback` set: ORT refuses a graph with a node the CUDA EP cannot run
  rather than run that node on the CPU, copying activations across on every call. Before the session, the
  CUDA and cuDNN libraries are loaded as onnxruntime documents (`onnxruntime.preload_dlls()`: the nvidia-*
  wheels of `soma-edge[cuda]`), or, for an onnxruntime installed elsewhere (`pip install --target`), from the
  CUDA 13 and cuDNN wheels this Python sees (`nvidia_library_folders`: torch's), and one that does not load
  is named. TF32 is off (`use_tf32 = 0`, and NVIDIA_TF32_OVERRIDE=0 for cuDNN's LSTM, which ignores the
  provider option; set whenever a plan lists CUDA, over any inherited value): its rounding error would
  compete with SPSA's epsilon.
- any other EP named in full (`openvino`, `DnnlExecutionProvider`, ...): that EP alone, under the same rule.
  Whoever names an accelerator expects the graph to run there, or to hear why it cannot; running part of it
  on the CPU is the silent fallback this module exists to refuse.
- `auto`: CUDA where the build has it, a GPU is there and its libraries load, with the CPU EP behind it for
  any node CUDA lacks; else the CPU. Only `auto` may fall back to the CPU, and it says so once per process,
  in one plain log line.

Anything that cannot run is a DeviceError: one line naming the missing node, library or package, which the
CLIs print as `error: ...` with exit 2. ORT's own logging (coloured, many lines per failure) stays off, and
its Python-side retry on the CPU (`enable_fallback`) is never used.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.metadata as metadata
import io
import logging
import os
import re
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from soma_edge import devices
from soma_edge.devices import CPU, CUDA
from soma_edge.errors import DeviceError

if TYPE_CHECKING:  # the deploy path creates sessions from bytes and must run without the onnx package
    import onnx

log = logging.getLogger("soma_edge.runtime")

# The one install line for each kind of box (pyproject's extras; from a source checkout: '.[cpu]', '.[cuda]').
INSTALL_CPU = "pip install 'soma-edge[cpu]'"
INSTALL_CUDA = "pip install 'soma-edge[cuda]'"
ORT_PACKAGES = ("onnxruntime", "onnxruntime-gpu")
ORT_SILENT = 4  # ORT's log severity FATAL: we report what fails ourselves, in one line
CPU_FALLBACK_REFUSED = "fallback to CPU EP has been explicitly disabled"  # ORT's refusal under the option
_PLACED = re.compile(r"(?:All nodes|Node\(s\)) placed on \[(\w+)\]\. Number of nodes: (\d+)")
_NODE = re.compile(r"VerifyEachNodeIsAssignedToAnEp\]\s{3}(\w+) \(")


def load_ort():
    """The onnxruntime module, quiet; a DeviceError saying which package to install when there is none."""
    try:
        import onnxruntime  # heavy (~0.3 s, and a GPU build loads CUDA libraries): only where a session is made
    except ImportError as e:
        if e.name == "onnxruntime":
            raise DeviceError(
                f"onnxruntime is not installed: {INSTALL_CPU}, or {INSTALL_CUDA} on a box with NVIDIA GPUs "
                "(from a source checkout: pip install '.[cpu]' or '.[cuda]')"
            ) from None
        raise DeviceError(
            f"onnxruntime does not import ({e}): reinstall it with {INSTALL_CPU} or {INSTALL_CUDA}"
        ) from None
    onnxruntime.set_default_logger_severity(ORT_SILENT)
    return onnxruntime


def ort_packages() -> list[str]:
    """The installed distributions that provide the module onnxruntime, with versions: one, or a broken mix."""

    found = []
    for name in ORT_PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found.append(f"{name} {metadata.version(name)}")
    return found


def ort_package() -> str:
    return " and ".join(ort_packages()) or "onnxruntime (no package metadata)"


def _nvidia_present() -> bool:
    # onnxruntime-gpu lists CUDA as "available" even on machines with no GPU; asking for it there logs an
    # error. For `auto`, look for the driver first.
    return os.name == "nt" or Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia").exists()


@dataclass(frozen=True)
class CudaLibraries:
    """Whether the CUDA EP's libraries load; each field None when it does, else the loader's message."""

    cuda: str | None
    cudnn: str | None

    @property
    def error(self) -> str | None:
        """One line: what does not load, and what to install; None when everything loads."""
        if self.cuda is not None:
            if "libcuda.so" in self.cuda or "nvcuda" in self.cuda:
                return f"no NVIDIA driver ({self.cuda}): install one for CUDA 13 (R580 or newer)"
            return f"the CUDA libraries do not load ({self.cuda}): {INSTALL_CUDA} brings CUDA 13 and cuDNN 9"
        if self.cudnn is not None:
            return f"cuDNN 9 does not load ({self.cudnn}): {INSTALL_CUDA} brings it"
        return None


TF32_OVERRIDE = "NVIDIA_TF32_OVERRIDE"


def tf32_off() -> None:
    """TF32 off in every NVIDIA library of this process: cuDNN's LSTM ignores the provider's use_tf32, and
    its TF32 rounding (a 10-bit mantissa) would compete with SPSA's epsilon.

    Set, not setdefault: NVIDIA's libraries turn TF32 off only for the value "0", so an inherited
    NVIDIA_TF32_OVERRIDE=1 (or any other value) would leave it on where the provider option cannot reach."""
    os.environ[TF32_OVERRIDE] = "0"


@functools.cache
def cuda_libraries() -> CudaLibraries:
    """Load the CUDA and cuDNN libraries the CUDA EP needs, from the nvidia-* wheels or the system, and say
    which does not load: dlopen of the EP's own library names its first missing dependency."""
    tf32_off()  # before any CUDA library is loaded and reads it
    ort = load_ort()
    preload = getattr(ort, "preload_dlls", None)
    if preload is not None:
        # It prints a line per library it misses, and warns when the plugin EP does not register: the
        # loads below name what matters in one line.
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with contextlib.suppress(Exception):
                preload()  # the nvidia/ wheels beside the onnxruntime package (a plain `pip install`)
            # onnxruntime installed elsewhere (`pip install --target DIR`, a PYTHONPATH entry) finds no
            # nvidia/ beside it: load the CUDA and cuDNN wheels from where this Python sees them (torch's),
            # the first folder of each (two copies of one library in a process would each keep their state).
            if not (Path(ort.__file__).parent.parent / "nvidia").is_dir():
                for folder, cuda in nvidia_library_folders():
                    with contextlib.suppress(Exception):
                        preload(cuda=cuda, cudnn=not cuda, directory=str(folder))
    capi = Path(ort.__file__).parent / "capi"
    names = (
        ("onnxruntime_providers_cuda.dll", "cudnn64_9.dll")
        if os.name == "nt"
        else ("libonnxruntime_providers_cuda.so", "libcudnn.so.9")
    )
    return CudaLibraries(_load(str(capi / names[0])), _load(names[1]))


CUDA_MAJOR = 13  # onnxruntime-gpu 1.31.1 is built for CUDA 13.0 (its build_and_package_info.cuda_version)


def nvidia_library_folders(paths: list[str] | None = None) -> list[tuple[Path, bool]]:
    """(folder, True for CUDA / False for cuDNN): the first CUDA 13 and the first cuDNN library folder of
    NVIDIA's wheels on `paths` (default sys.path), CUDA's first: `nvidia/cu13/lib` and `nvidia/cudnn/lib`,
    the layout of the CUDA 13 wheels that onnxruntime-gpu's extras and torch's CUDA 13 builds install."""
    out: dict[bool, Path] = {}
    for entry in sys.path if paths is None else paths:
        if not entry:  # the current directory: not where a library is loaded from
            continue
        root = Path(entry) / "nvidia"
        for sub, cuda in ((f"cu{CUDA_MAJOR}", True), ("cudnn", False)):
            folder = root / sub / "lib"
            if cuda not in out and folder.is_dir():
                out[cuda] = folder
    return [(folder, cuda) for cuda, folder in sorted(out.items(), reverse=True)]


def _load(path: str) -> str | None:
    try:
        ctypes.CDLL(path)
    except OSError as e:
        return str(e)
    return None


@dataclass(frozen=True)
class Plan:
    """What a session asks ONNX Runtime for: its providers in order, whether the CPU EP may take nodes the
    first one cannot run, and (auto only) why it runs on the CPU."""

    providers: list[Any]
    strict: bool
    why_cpu: str | None = None

    @property
    def names(self) -> list[str]:
        """The providers' names, without their options."""
        return [p[0] if isinstance(p, tuple) else p for p in self.providers]

    @property
    def first(self) -> str:
        return self.names[0]


def cuda_options(device_id: int) -> dict[str, Any]:
    return {"device_id": device_id, "use_tf32": 0}


def no_cuda_ep() -> str:
    """Why `auto` cannot use the GPU of a box whose onnxruntime is the CPU build, and what to install."""
    return f"this onnxruntime ({ort_package()}) has no CUDA EP: {INSTALL_CUDA} in a fresh environment to use the GPU"


@functools.cache
def _auto() -> Plan:
    if not _nvidia_present():
        why = "no NVIDIA GPU found"
    elif CUDA not in load_ort().get_available_providers():
        why = no_cuda_ep()
    else:
        why = cuda_libraries().error
    if why is not None:
        return Plan([CPU], strict=False, why_cpu=why)
    return Plan([(CUDA, cuda_options(0)), CPU], strict=False)


@functools.cache
def _say_cpu(why: str) -> None:
    """Once per process and reason: `auto` runs on the CPU. A warning where a GPU is there but unusable."""
    level = logging.WARNING if _nvidia_present() else logging.INFO
    log.log(level, "device auto runs on the CPU: %s", why)


def plan(device: str) -> Plan:
    """The providers a session on `device` asks for. A named EP must be in this build, and CUDA's libraries
    must load (DeviceError otherwise); `auto` resolves against this box. Where the plan lists the CUDA EP,
    TF32 is turned off (`tf32_off`) before its session is made."""
    p = _resolve(device)
    if CUDA in p.names:
        # Each time, not only when cuda_libraries() first runs (it is cached): no CUDA session of this
        # process starts with another value, whatever the environment held or was given since.
        tf32_off()
    return p


def _resolve(device: str) -> Plan:
    d = devices.parse(device)
    ort = load_ort()  # first: whatever the device, a missing onnxruntime is what to say
    if d.auto:
        return _auto()
    if d.provider == CPU:
        return Plan([CPU], strict=False)
    available = ort.get_available_providers()
    if d.provider not in available:
        hint = f": pip uninstall onnxruntime, then {INSTALL_CUDA}" if d.cuda_id is not None else ""
        raise DeviceError(
            f"device {device!r}: this onnxruntime ({ort_package()}) has no {d.provider} "
            f"(it has {', '.join(available)}){hint}"
        )
    if d.cuda_id is None:
        return Plan([d.provider], strict=True)
    why = cuda_libraries().error
    if why is not None:
        raise DeviceError(f"device {device!r}: {why}")
    return Plan([(CUDA, cuda_options(d.cuda_id))], strict=True)


def check_device(device: str) -> None:
    """Fail early (DeviceError) when `device` cannot run here, before a command does anything else."""
    plan(device)


def session_options(threads: int = 0, spin: bool = True, strict: bool = False, log_severity: int = ORT_SILENT):
    ort = load_ort()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = log_severity
    if not spin:
        # Workers sharing a box must not burn each other's cores spinning between ops.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if strict:
        # A node the named EP cannot run makes ORT refuse the graph, instead of running it on the CPU.
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    return so


def make_session(
    model: onnx.ModelProto | bytes, device: str = "auto", threads: int = 0, spin: bool = True, cuda_graph: bool = False
):
    """An InferenceSession on `device`: the named EP alone or a DeviceError that says why, in one line.
    `cuda_graph`: on CUDA, the EP's enable_cuda_graph (every run then must bind fixed device buffers:
    soma_edge.engine.capture); elsewhere it changes nothing."""
    ort = load_ort()
    p = plan(device)
    data = model if isinstance(model, bytes) else model.SerializeToString()
    so = session_options(threads, spin, p.strict)
    providers = p.providers
    if cuda_graph:
        providers = [(n, {**o, "enable_cuda_graph": "1"}) if n == CUDA else (n, o) for n, o in _named(providers)]
    try:
        with warnings.catch_warnings():  # ORT warns of a provider it lacks; the error below says it in one line
            warnings.simplefilter("ignore")
            sess = ort.InferenceSession(data, sess_options=so, providers=providers, enable_fallback=0)
    except Exception as e:  # ORT raises plain RuntimeError/Fail for a provider that cannot start
        if p.strict and CPU_FALLBACK_REFUSED in str(e):
            raise DeviceError(f"device {device!r}: {_refusal(data, p)}") from None
        raise DeviceError(f"cannot create an ONNX Runtime session on {device!r}: {' '.join(str(e).split())}") from None
    if p.why_cpu is not None:
        _say_cpu(p.why_cpu)
    elif sess.get_providers()[0] != p.first:
        if p.strict:  # a named device never runs on another: refused here too, whatever ORT let through
            raise DeviceError(
                f"device {device!r}: ONNX Runtime made the session on {sess.get_providers()[0]}, not {p.first} "
                "(`soma-worker doctor` says why)"
            )
        _say_cpu(f"{p.first} did not start (`soma-worker doctor` says why)")
    return sess


def _named(providers: list[Any]) -> list[tuple[str, dict]]:
    """Providers as (name, options) pairs, whichever form each was given in."""
    return [(p, {}) if isinstance(p, str) else (p[0], dict(p[1])) for p in providers]


def _refusal(data: bytes, p: Plan) -> str:
    """Why ORT refused a strict session: the ops it would have put on the CPU, or the EP that did not start."""
    placed = placement(data, p.providers + [CPU])
    if set(placed) == {CPU}:
        return f"{p.first} did not start, so every node would run on the CPU (`soma-worker doctor` says why)"
    ops = ", ".join(sorted(set(placed[CPU].ops))) if CPU in placed else "unnamed"
    return (
        f"{p.first} has no kernel for the ops {ops} of this graph, and a named device does not fall back to "
        "the CPU (device auto would run them there)"
    )


@dataclass
class Placed:
    """The nodes ORT assigned to one EP: how many, and their op types where its report lists them (it lists
    none when one EP takes the whole graph)."""

    count: int
    ops: list[str]


def placement(model: onnx.ModelProto | bytes, providers: list[Any], threads: int = 1) -> dict[str, Placed]:
    """Where ORT puts each node of `model` with `providers` (CPU fallback allowed, so that every node lands
    somewhere), read from ORT's own verbose report. A diagnostic: while the session is made it redirects the
    process's stderr, where ORT writes its log. Empty when no session can be made."""
    ort = load_ort()
    data = model if isinstance(model, bytes) else model.SerializeToString()
    so = session_options(threads, log_severity=0)
    with tempfile.TemporaryFile("w+b") as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            with contextlib.suppress(Exception), warnings.catch_warnings():  # no placement to report
                warnings.simplefilter("ignore")
                ort.InferenceSession(data, sess_options=so, providers=providers, enable_fallback=0)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        return parse_placement(f.read().decode("utf-8", "replace"))


def parse_placement(log_text: str) -> dict[str, Placed]:
    """ORT's "Node placements" report (session_state.cc, VerifyEachNodeIsAssignedToAnEp) by EP."""
    out: dict[str, Placed] = {}
    current = None
    for line in log_text.splitlines():
        m = _PLACED.search(line)
        if m:
            current = m.group(1)
            out[current] = Placed(int(m.group(2)), [])
            continue
        n = _NODE.search(line)
        if n and current is not None:
            out[current].ops.append(n.group(1))
    return out


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
