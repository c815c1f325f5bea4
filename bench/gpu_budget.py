"""What bench/gpu_check.py may spend, and what a cell would cost before it runs: time and memory.

- Clock: seconds left before --deadline. Its watchdog ends the process at the deadline itself, whatever is
  running (an ORT call cannot be interrupted), after writing the report with that item marked "skipped:
  time (stopped at the deadline)".
- Memory: free memory where the cell's tensors will live (MemAvailable for the CPU EP; NVML's free for a
  GPU), the process's peak resident memory (VmHWM, reset at each cell through /proc/self/clear_refs), and
  the device's peak used memory, sampled by a thread through NVML.
- Prices: a graph's memory from its tensor shapes (`graph_mib`): ONNX shape inference at the cell's batch,
  then each tensor live from the node that makes it to its last reader, in the graph's order; the peak of
  that, plus inputs and constants, times the arena factor of its device (ORT's arenas grow by powers of two
  and its order differs from the graph's). Measured against that shape peak: 1.2-1.9x on the CPU EP, 3.4-4.1x
  on the CUDA EP of an H200 (where a cell priced at 2x took 135 GiB and failed with an illegal memory access).
  A session's build time from the seconds per node of the last build of the same graph (`Builds`).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

ARENA_CPU, ARENA_CUDA = 2.0, 5.0  # priced memory over the shape peak, per device (module docstring)
OVERHEAD_MIB = 256  # a session's own memory beside its tensors
FREE_SHARE = 0.9  # of the free memory, what a cell may be priced at: the rest for what is not priced
FIRST_BUILD_S_PER_NODE = 2e-3  # before any build was measured: generous (CPU: ~0.3 ms a node at T = 128)


class Clock:
    """The run's deadline (time.perf_counter seconds) and its watchdog."""

    def __init__(self, seconds: float) -> None:
        self.start = time.perf_counter()
        self.end = self.start + seconds
        self._timer: threading.Timer | None = None

    def left(self) -> float:
        return self.end - time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def watch(self, at_deadline: Callable[[], int]) -> None:
        """At the deadline, call `at_deadline` (it writes the report and says the exit status), then end the
        process with that status: the main thread may be inside an ORT call that nothing can interrupt."""

        def fire() -> None:
            code = 1
            try:
                code = at_deadline()
            finally:
                os._exit(code)

        self._timer = threading.Timer(max(self.left(), 0.0), fire)
        self._timer.daemon = True
        self._timer.start()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


# --- memory ---------------------------------------------------------------------------------------------


def _status_kib(field_name: str) -> int | None:
    try:
        for line in open("/proc/self/status"):
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_mib() -> int | None:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib // 1024


def peak_rss_mib() -> int | None:
    """The process's peak resident memory since the last `reset_peak_rss` (since it started, without it)."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib // 1024


def reset_peak_rss() -> bool:
    """Start VmHWM again from the present resident memory (Linux); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def host_free_mib() -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return None


class Nvml:
    """NVIDIA's management library through ctypes (no package needed): one GPU's used and free memory."""

    class _Memory(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    def __init__(self, index: int) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self.lib.nvmlInit_v2() != 0:
            raise OSError("nvmlInit_v2 failed")
        self.handle = ctypes.c_void_p()
        if self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)) != 0:
            raise OSError(f"no GPU {index} in NVML")

    def memory_mib(self) -> tuple[int, int]:
        """(used, free) MiB of the whole device, every process's."""
        m = self._Memory()
        if self.lib.nvmlDeviceGetMemoryInfo(self.handle, ctypes.byref(m)) != 0:
            raise OSError("nvmlDeviceGetMemoryInfo failed")
        return m.used >> 20, m.free >> 20


@dataclass
class Memory:
    """Where a cell's tensors live: the host (CPU EP) or one GPU (its NVML handle), and the peaks seen."""

    nvml: Nvml | None = None
    peak_device: int | None = None  # the run's
    cell_peak: int | None = None  # since the last cell_start (CUDA)
    _sampler: threading.Thread | None = field(default=None, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)

    @classmethod
    def for_device(cls, cuda_id: int | None) -> Memory:
        if cuda_id is None:
            return cls()
        try:
            return cls(Nvml(cuda_id))
        except OSError:
            return cls()  # no NVML: device memory goes unmeasured, cells unpriced against it

    def free_mib(self) -> int | None:
        if self.nvml is None:
            return host_free_mib()
        return self.nvml.memory_mib()[1]

    def used_mib(self) -> int | None:
        """The device's used memory (CUDA) or this process's resident memory (CPU EP)."""
        return rss_mib() if self.nvml is None else self.nvml.memory_mib()[0]

    def cell_start(self) -> int | None:
        """The baseline of a cell's memory: its peak is measured from here."""
        if self.nvml is None:
            reset_peak_rss()
        base = self.used_mib()
        self.cell_peak = base
        return base

    def cell_used(self, base: int | None) -> int | None:
        """What the cell took: its peak less the baseline (resident memory on the CPU EP, VmHWM; on CUDA the
        device's used memory, sampled while the cell ran and read once more now)."""
        if self.nvml is None:
            now = peak_rss_mib()
        else:
            self._seen(self.used_mib())
            now = self.cell_peak
        return None if now is None or base is None else max(now - base, 0)

    def _seen(self, used: int) -> None:
        self.peak_device = max(self.peak_device or 0, used)
        self.cell_peak = max(self.cell_peak or 0, used)

    def sample(self, every: float = 0.05) -> None:
        """Keep `peak_device` up to date from a thread (CUDA only)."""
        if self.nvml is None:
            return

        def loop() -> None:
            while not self._stop.wait(every):
                self._seen(self.nvml.memory_mib()[0])

        self._sampler = threading.Thread(target=loop, daemon=True)
        self._sampler.start()

    def peaks(self) -> dict[str, int | None]:
        return {"peak_rss_mib": peak_rss_mib(), "peak_device_mib": self.peak_device}


# --- prices ---------------------------------------------------------------------------------------------


def graph_mib(model, batch: int, seq_len: int, arena: float = ARENA_CPU) -> int:
    """The priced memory of one session on `model` with its free dims "B" and "T" set to `batch` and
    `seq_len` (module docstring): `arena` x the peak of live tensors in the graph's order, plus inputs and
    constants."""
    import onnx  # heavy; the checks that price import it anyway
    from onnx import helper, shape_inference

    m = onnx.ModelProto()
    m.CopyFrom(model)
    for value in m.graph.input:
        for d in value.type.tensor_type.shape.dim:
            if d.dim_param in ("B", "T"):
                d.dim_value = batch if d.dim_param == "B" else seq_len
    g = shape_inference.infer_shapes(m).graph
    size: dict[str, int] = {}
    for value in [*g.value_info, *g.input, *g.output]:
        t = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in t.shape.dim]
        size[value.name] = int(np.prod(dims)) * helper.tensor_dtype_to_np_dtype(t.elem_type).itemsize
    fixed = sum(size.get(v.name, 0) for v in g.input) + sum(
        int(np.prod(c.dims)) * helper.tensor_dtype_to_np_dtype(c.data_type).itemsize for c in g.initializer
    )
    last = {name: i for i, node in enumerate(g.node) for name in node.input}
    kept = {v.name for v in [*g.input, *g.output]}
    live = peak = 0
    for i, node in enumerate(g.node):
        live += sum(size.get(o, 0) for o in node.output)
        peak = max(peak, live)
        live -= sum(size.get(n, 0) for n in set(node.input) if last.get(n) == i and n not in kept)
    return int(arena * (fixed + peak) / (1 << 20)) + OVERHEAD_MIB


@dataclass
class Builds:
    """Seconds per node of the last session built on each graph (by its name): the price of the next build
    of that graph; a graph not built yet is priced at the slowest rate seen, or FIRST_BUILD_S_PER_NODE."""

    per_node: dict[str, float] = field(default_factory=dict)

    def price(self, graphs: list) -> float:
        return sum(len(g.graph.node) * self._rate(g.graph.name) for g in graphs)

    def _rate(self, name: str) -> float:
        return self.per_node.get(name, max(self.per_node.values(), default=FIRST_BUILD_S_PER_NODE))

    def record(self, graphs: list, seconds: float) -> None:
        """A cell built `graphs` in `seconds` (together): each one's share by its node count."""
        nodes = sum(len(g.graph.node) for g in graphs)
        for g in graphs:
            self.per_node[g.graph.name] = seconds / max(nodes, 1)

    @property
    def measured(self) -> bool:
        return bool(self.per_node)
