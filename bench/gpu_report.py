"""bench/gpu_check.py's records and its report: a check's result, a throughput row, and OUT/gpu_check.md and
OUT/gpu_check.json, rewritten whole (atomically) after every check and every cell, so that a run killed at
any point leaves everything it had measured.

The JSON: {"schema", "device", "machine", "onnxruntime", "deadline_s", "status" (running, complete, or
stopped at the deadline), "ok", "checks": [Check], "throughput": [Row], "throughput_notes", "targets":
[gpu_targets.Verdict], "memory": {"peak_rss_mib", "peak_device_mib"}}.
"""

from __future__ import annotations

import enum
import json
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench import gpu_targets
from bench.common import machine, md_head, md_row
from bench.gpu_memory import Peaks
from soma_edge.checkpoint import atomic_write

SCHEMA = 2  # 2: checks carry "skipped"; rows carry density and priced memory; status and memory peaks


@dataclass
class Check:
    """One correctness check: passed, failed, or `skipped` (its reason, e.g. "time") before it could settle."""

    name: str
    ok: bool
    detail: str
    figures: dict = field(default_factory=dict)
    skipped: str = ""

    @property
    def result(self) -> str:
        return f"skipped: {self.skipped}" if self.skipped else ("pass" if self.ok else "FAIL")


class RowKind(str, enum.Enum):
    """A row of the throughput table: what evaluates the losses."""

    LOOP = "loop"  # one ORT call per evaluation, the weights fed from the host (the trainer's loop)
    LOOP_RESIDENT = "loop_resident"  # the same, its inputs bound on the device once: the loop's best case
    POPULATION = "population"  # one call per step (2K + 1 members), full-rank keyed bits fed from the host
    RESIDENT = "population_resident"  # full-rank: Resident.step, the worker's training path on a device
    CUDA_GRAPH = "population+cuda_graph"  # full-rank, every input at a fixed device address, replayed
    RANK1 = "rank1"  # the population with rank-1 probes
    RANK1_RESIDENT = "rank1_resident"  # Resident.step with rank-1 probes
    CLEAN = "clean_forward"  # the loss graph on one batch of P*B sequences, bound: the rank-1 target's unit
    TORCH = "torch_eager"  # the torch reference expert, one forward per evaluation, in a subprocess


@dataclass
class Row:
    """One cell of the throughput table: `evals_per_s` forward evaluations per second (a population call,
    a resident step and a clean forward of P*B rows each count P = 2K + 1), None when skipped or failed
    (`note` says which); `density` the probes' (full-rank and rank-1 rows); `vs_loop` its ratio to
    loop_resident, `vs_torch` to torch eager; `vs_clean` its time per call or step over the clean forward's
    of the same P*B rows; `host_share` (resident rows) the share of a step outside ORT's run calls; `price`
    the memory it was priced at and `memory` what it took, in MiB (the device's on CUDA, the process's
    resident memory on the CPU EP: its peak during the cell less before it)."""

    name: str
    params: int
    B: int
    K: int | None  # None: a row whose rate does not depend on K (the loop, torch)
    evaluator: RowKind
    density: float | None = None
    evals_per_s: float | None = None
    vs_loop: float | None = None
    vs_torch: float | None = None
    vs_clean: float | None = None
    host_share: float | None = None
    price: int | None = None
    memory: int | None = None
    note: str = ""

    def label(self) -> str:
        dens = "" if self.density is None else f" density={self.density:g}"
        return f"{self.name} B={self.B} K={self.K or '-'} {self.evaluator.value}{dens}"


class Report:
    """What the run has settled so far, written to OUT after every change (`save`). Thread-safe: the
    deadline's watchdog writes the last version while the main thread may be adding to it."""

    def __init__(self, out: Path, device: str, ort_package: str, deadline_s: float) -> None:
        self.out, self.device, self.ort_package, self.deadline_s = out, device, ort_package, deadline_s
        self.checks: list[Check] = []
        self.rows: list[Row] = []
        self.notes: list[str] = []
        self.verdicts: list[gpu_targets.Verdict] = []
        self.memory = Peaks()
        self.status = "running"
        self.closed = False  # written for the last time (the deadline's watchdog, or the end): no more changes
        self.current = ""  # what runs now: named by the watchdog if the deadline stops it
        self.running: Row | None = None  # the throughput cell measuring now: a row the watchdog adds
        self.lock = threading.RLock()

    @property
    def ok(self) -> bool:
        """Every correctness check ran and passed (the targets' verdicts do not count)."""
        return all(c.ok and not c.skipped for c in self.checks)

    def exit_code(self) -> int:
        """0 every check passed; 1 one failed; 3 none failed but one was skipped for time."""
        if any(not c.ok and not c.skipped for c in self.checks):
            return 1
        return 3 if any(c.skipped for c in self.checks) else 0

    def add_check(self, check: Check) -> None:
        with self.lock:
            if not self.closed:
                self.checks.append(check)
                self.save()

    def add_row(self, row: Row) -> None:
        """The row of the cell that ran (`running` no more), in one step the watchdog cannot split."""
        with self.lock:
            if self.running is row:
                self.running = None
            if not self.closed:
                self.rows.append(row)
                self.save()

    def close(self, status: str, memory: Peaks) -> None:
        """The last write: the run's status and peaks; nothing changes the report after it."""
        with self.lock:
            if self.closed:
                return
            self.status, self.memory, self.current = status, memory, ""
            self.save()
            self.closed = True

    def save(self) -> None:
        """gpu_check.md and gpu_check.json as they stand, each replaced whole (a reader never sees half)."""
        with self.lock:
            if self.closed:
                return
            self.out.mkdir(parents=True, exist_ok=True)
            # world-readable, as a report is: atomic_write's default is owner-only
            atomic_write(self.out / "gpu_check.md", self.markdown().encode(), 0o644)
            record = json.dumps(self.record(), indent=1, default=float) + "\n"
            atomic_write(self.out / "gpu_check.json", record.encode(), 0o644)

    def record(self) -> dict:
        return {
            "schema": SCHEMA,
            "device": self.device,
            "machine": machine(),
            "onnxruntime": self.ort_package,
            "deadline_s": self.deadline_s,
            "status": self.status,
            "ok": self.ok,
            "checks": [asdict(c) for c in self.checks],
            "throughput": [asdict(r) for r in self.rows],
            "throughput_notes": self.notes,
            "targets": [asdict(v) for v in self.verdicts],
            "memory": asdict(self.memory),
        }

    def markdown(self) -> str:
        md = f"# GPU check on {self.device}\n\n{machine()}; onnxruntime {self.ort_package}; "
        md += f"deadline {self.deadline_s:g} s; status: {self.status}\n\n"
        if self.checks:
            md += md_head(["check", "result", "detail"]) + "\n"
            md += "\n".join(md_row([c.name, c.result, c.detail]) for c in self.checks) + "\n\n"
        md += _memory_line(self.memory)
        if self.verdicts:
            md += targets_md(self.verdicts)
        if self.rows:
            md += throughput_md(self.rows, self.notes)
        return md


def _memory_line(memory: Peaks) -> str:
    rss, dev = memory.peak_rss_mib, memory.peak_device_mib
    if rss is None and dev is None:
        return ""
    parts = [] if rss is None else [f"Peak resident memory of this process: {rss:,} MiB"]
    parts += [] if dev is None else [f"the device's peak used memory {dev:,} MiB (every process's, NVML)"]
    return "; ".join(parts) + ".\n\n"


def targets_md(verdicts: list[gpu_targets.Verdict]) -> str:
    """The GPU targets' verdict lines (bench.gpu_targets), said to be the CPU EP's where it stood in."""
    cpu = any(v.cpu for v in verdicts)
    head = "## GPU targets\n\n" + (
        "Measured on the CPU EP standing in for the GPU: the verdicts are the CPU's, not the GPU targets'.\n\n"
        if cpu
        else ""
    )
    return head + "".join(f"- {v.line()}\n" for v in verdicts) + "\n"


def _fmt(v: float | None, spec: str, unit: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{unit}"


THROUGHPUT_HEAD = (
    "## Throughput\n\nForward evaluations per second (a population call, a resident step and a clean forward "
    "of P*B rows each count P = 2K + 1). density: the probes' (0.5 ships; 1.0 dense). vs loop: against "
    "loop_resident (the loop with its inputs bound on the device once, the GPU targets' baseline) at the same "
    "size and B. vs clean: time per call or step over that of one clean forward of the same P*B rows. host: "
    "the share of a resident step outside ORT's run calls. priced / used MiB: the memory the cell was priced "
    "at before it ran (from its graphs' tensor shapes) and what it took (the device's on CUDA, this process's "
    "resident memory on the CPU EP; torch rows: torch's peak allocated).\n\n"
)


def throughput_md(rows: list[Row], notes: list[str]) -> str:
    cols = ["size", "params", "B", "K", "evaluator", "density", "evals/s", "vs loop", "vs torch", "vs clean"]
    cols += ["host", "priced MiB", "used MiB", "note"]
    lines = [
        md_row(
            [
                r.name,
                f"{r.params:,}",
                str(r.B),
                "-" if r.K is None else str(r.K),
                r.evaluator.value,
                _fmt(r.density, "g"),
                _fmt(r.evals_per_s, ".1f"),
                _fmt(r.vs_loop, ".2f", "x"),
                _fmt(r.vs_torch, ".2f", "x"),
                _fmt(r.vs_clean, ".2f", "x"),
                _fmt(None if r.host_share is None else 100 * r.host_share, ".0f", "%"),
                _fmt(r.price, "d"),
                _fmt(r.memory, "d"),
                r.note,
            ]
        )
        for r in rows
    ]
    tail = "".join(f"\n- {n}" for n in notes)
    return THROUGHPUT_HEAD + md_head(cols) + "\n" + "\n".join(lines) + "\n" + (tail + "\n" if tail else "")
