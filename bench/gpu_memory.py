"""Memory for bench/gpu_check.py: free memory where a cell's tensors will live (MemAvailable for the CPU EP;
NVML's free for a GPU), the process's peak resident memory (VmHWM, reset at each cell through
/proc/self/clear_refs), and the device's used memory sampled by a thread through NVML (libnvidia-ml through
ctypes: no package needed), each cell's peak and the run's."""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Peaks:
    """The run's peaks in MiB: this process's resident memory, and the device's used memory (CUDA only)."""

    peak_rss_mib: int | None = None
    peak_device_mib: int | None = None


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
    """Where a cell's tensors live: the host (CPU EP) or one GPU (its NVML handle); the peaks seen. The
    sampler thread and the cells read and write the peaks under one lock."""

    nvml: Nvml | None = None
    peak_device: int | None = None  # the run's
    cell_peak: int | None = None  # since the last cell_start (CUDA)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

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
        """The baseline of a cell's memory, its peak measured from here; None where no peak can be told
        apart (the kernel refuses to reset VmHWM: the peak would be the process's since it started)."""
        if self.nvml is None and not reset_peak_rss():
            return None
        base = self.used_mib()
        with self._lock:
            self.cell_peak = base
        return base

    def cell_used(self, base: int | None) -> int | None:
        """What the cell took: its peak less the baseline (resident memory on the CPU EP, VmHWM; on CUDA the
        device's used memory, sampled while the cell ran and read once more now)."""
        if self.nvml is None:
            now = peak_rss_mib()
        else:
            self._seen(self.used_mib())
            with self._lock:
                now = self.cell_peak
        return None if now is None or base is None else max(now - base, 0)

    def _seen(self, used: int) -> None:
        with self._lock:
            self.peak_device = max(self.peak_device or 0, used)
            self.cell_peak = max(self.cell_peak or 0, used)

    def sample(self, every: float = 0.05) -> None:
        """Keep the peaks up to date from a daemon thread (CUDA only), for the life of the process."""
        if self.nvml is None:
            return

        def loop() -> None:
            while True:
                time.sleep(every)
                self._seen(self.nvml.memory_mib()[0])

        threading.Thread(target=loop, daemon=True).start()

    def peaks(self) -> Peaks:
        with self._lock:
            return Peaks(peak_rss_mib(), self.peak_device)
