"""The first run on an NVIDIA box, in one short call, installing nothing:

    python -m bench.gpu_check [--device cuda:0] [--deadline 240] [--out runs/gpu_check] [--steps 100]
                              [--audit-steps 8] [--only-throughput | --no-throughput] [--seconds 2]
                              [--sizes 124K,L,S] [--batches 16,64] [--ks 8,64] [--seq-len 128]

It settles, in this order, what a worker on the device depends on (bench/gpu_checks.py says how each is
judged): the libraries (onnxruntime-gpu's CUDA EP, the driver, CUDA 13 and cuDNN 9; what is missing is
named in one `error:` line each, exit 2); placement of every graph a worker opens, all on the device; the
CPU EP against the device within δ; the coordinator's audit, on the CPU, of a log the device trained; the
update graph's bits; CUDA graph capture (losses within δ of plain steps, the captured log replayed bit for
bit). Then the GPU targets' rows (bench/gpu_cells.py), at 124K first and then at the L size (7.9M): the
resident training step at density 0.5 (as shipped) and 1.0 against loop_resident (speed) and with its host
share (host wait), rank-1 against a clean forward; their verdicts (bench/gpu_targets.py); then the rest of the
throughput table while time is left.

--deadline SECONDS stops the run itself: every check is time-boxed and every cell priced (its session builds
included) before it starts; what would end late is a "skipped: time" row, and a watchdog ends the process at
the deadline whatever runs then. Each cell is also priced in memory, from its graphs' tensor shapes, and one
over its device's free memory is a "skipped: memory" row; a cell's sessions are released before the next.
OUT/gpu_check.md and OUT/gpu_check.json are rewritten after every check and cell (bench/gpu_report.py), so a
run killed at any point leaves everything it measured; the peak resident memory of the run (and on CUDA the
device's peak used memory) is recorded.

Exit status: 0 every correctness check passed; 1 one failed; 2 a library is missing; 3 none failed but one
was skipped for time. The targets' verdicts never change it. `--device cpu` runs everything with the CPU EP
standing in for the GPU (its figures then say nothing about a GPU): the tests run it so, to keep this script
working on boxes without one.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from bench import gpu_cells, gpu_targets
from bench.common import say
from bench.gpu_checks import (
    capture_check,
    corpus_bytes,
    log_round_check,
    missing_libraries,
    numerics_check,
    placement_check,
    update_check,
)
from bench.gpu_clock import Clock
from bench.gpu_memory import Memory
from bench.gpu_prices import Builds
from bench.gpu_report import Check, Report
from bench.sizes import SIZES, Shape
from soma_edge import devices
from soma_edge.engine import runtime

CHECKS = ("placement", "numerics", "log round", "update bits", "capture")
THROUGHPUT_SHARE = 0.25  # of the deadline, kept from the checks for the throughput (unless --no-throughput)


@dataclass
class Args:
    device: str
    out: Path
    deadline: float
    steps: int
    audit_steps: int
    seconds: float
    only_throughput: bool
    no_throughput: bool
    sizes: list[str]
    batches: list[int]
    ks: list[int]
    seq_len: int


def run_checks(a: Args, report: Report, clock: Clock) -> None:
    """The correctness checks in order, each time-boxed to leave the throughput its share of the deadline."""
    data = corpus_bytes()
    until = clock.end - (0.0 if a.no_throughput else THROUGHPUT_SHARE * a.deadline)
    on_device = True
    for name in CHECKS:
        report.current = name
        say(f"{name} ...")
        t0 = clock.elapsed()
        if name == "placement":
            check = placement_check(a.device, until)
        elif name == "numerics":
            check = numerics_check(a.device, data, until)
        elif name == "log round":
            check = log_round_check(a.device, data, a.steps, a.audit_steps, until)
        elif name == "update bits":
            check = update_check(a.device, data, a.seconds, until)
            on_device = check.figures.get("on_device", True)
        else:
            check = capture_check(a.device, data, a.seconds, until, on_device)
        report.add_check(check)
        say(f"{name}: {check.result} ({clock.elapsed() - t0:.1f} s): {check.detail}")


def run_throughput(a: Args, report: Report, clock: Clock, memory: Memory) -> None:
    target_b = gpu_targets.TARGET_B if gpu_targets.TARGET_B in a.batches else a.batches[0]
    cells = gpu_cells.Cells(a.device, report, clock, memory, a.seq_len, a.seconds, target_b, Builds())
    gpu_cells.warm_up(a.device)  # the device's context and libraries load here, not in the first cell's price
    say("throughput: the GPU targets' rows ...")
    gpu_cells.targets(cells, a.sizes, a.ks)
    say("throughput: the rest of the table ...")
    gpu_cells.table(cells, a.sizes, a.ks, a.batches)
    for v in report.verdicts:
        say(f"target: {v.line()}")


def at_deadline(report: Report, memory: Memory, pending: list[str]) -> int:
    """The watchdog's last write: what was running and every check not yet run, skipped for time. Said as
    an error where a correctness check is left unsettled (exit 3, or 1 where one failed), else a warning."""
    with report.lock:
        if report.closed:  # the run finished as the timer fired
            return report.exit_code()
        status = f"stopped at the deadline ({report.deadline_s:g} s) during {report.current or 'start-up'}"
        done = {c.name for c in report.checks}
        for name in [n for n in pending if n not in done]:
            report.checks.append(Check(name, False, "stopped at the deadline before it settled", {}, "time"))
        if report.running is not None:  # the cell measuring now: its row says so
            report.running.note = "skipped: time (stopped at the deadline while it ran)"
            report.rows.append(report.running)
        report.close(status, memory.peaks())
        print(report.markdown(), end="", flush=True)
    code = report.exit_code()
    say(f"{'error' if code else 'warning'}: {status}")
    return code


def parse(argv: list[str] | None) -> Args:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0", help="cuda:i, or cpu to dry-run on the CPU EP")
    ap.add_argument("--deadline", type=float, default=240.0, help="seconds from the start at which the run stops")
    ap.add_argument("--steps", type=int, default=100, help="most SPSA steps of the log round")
    ap.add_argument("--audit-steps", type=int, default=8, help="steps the coordinator's audit recomputes")
    ap.add_argument("--out", default="runs/gpu_check", help="where gpu_check.md and gpu_check.json go")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--only-throughput", action="store_true", help="the throughput table alone")
    which.add_argument("--no-throughput", action="store_true", help="the correctness checks alone")
    ap.add_argument("--seconds", type=float, default=2.0, help="measuring time per cell (and per capture arm)")
    ap.add_argument("--sizes", default="124K,L,S", help=f"throughput sizes in order, of {','.join(SIZES)}")
    ap.add_argument("--batches", default="16,64", help="throughput batch sizes B (the targets: 16)")
    ap.add_argument("--ks", default="8,64", help="throughput directions per step K (the targets: 8 and 64)")
    ap.add_argument("--seq-len", type=int, default=Shape.seq_len, help="throughput sequence length T")
    ns = ap.parse_args(argv)
    unknown = [s for s in ns.sizes.split(",") if s not in SIZES]
    if unknown:
        ap.error(f"unknown sizes {unknown}: use {', '.join(SIZES)}")
    if devices.parse(ns.device).auto:  # prices and memory differ by device: name the one to check
        ap.error("--device auto: name the device to check, cuda:i or cpu")
    return Args(
        ns.device,
        Path(ns.out),
        ns.deadline,
        ns.steps,
        ns.audit_steps,
        ns.seconds,
        ns.only_throughput,
        ns.no_throughput,
        ns.sizes.split(","),
        [int(b) for b in ns.batches.split(",")],
        [int(k) for k in ns.ks.split(",")],
        ns.seq_len,
    )


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    clock = Clock(a.deadline)
    missing = missing_libraries(a.device)
    if missing:
        for line in missing:
            print(f"error: {line}", file=sys.stderr)
        return 2
    report = Report(a.out, a.device, runtime.ort_package(), a.deadline)
    memory = Memory.for_device(devices.parse(a.device).cuda_id)
    memory.sample()
    pending = [] if a.only_throughput else list(CHECKS)
    clock.watch(lambda: at_deadline(report, memory, pending))
    report.save()
    if not a.only_throughput:
        run_checks(a, report, clock)
    if not a.no_throughput:
        run_throughput(a, report, clock, memory)
    clock.stop()
    report.close("complete", memory.peaks())  # a timer that fired meanwhile finds the report closed
    say(f"done in {clock.elapsed():.0f} s of a {a.deadline:g} s deadline")
    print(report.markdown(), end="")
    return report.exit_code()


if __name__ == "__main__":
    sys.exit(main())
