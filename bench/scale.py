"""Many experts on a few workers: N = 8, 64 and 256 tiny experts, the same run otherwise.

    .venv/bin/python -m bench.scale [--experts 8,64,256,256:5] [--workers 4] [--rounds 5] [--round-seconds 60]
        [--embed 16] [--hidden 64] [--json]

For each N: `soma-coord start --local-workers W` on 127.0.0.1 (a real SuperLink, W SuperNodes, the
ServerApp and ClientApps), on the default corpus, at the shipped settings but the model size; then
`soma-export onnx` and `soma-export eval` on every cluster's test shard. An arm `N:S` also sets
`federation.min_expert_seconds = S` (a round trains the experts the workers can give S seconds each, in
turn). Per arm it prints:

- experts advanced per round, and those never advanced (still at version 0 at the end);
- failed tasks (experts planned but not advanced, for any reason but the guard) and honest guard refusals
  (there is no liar), with how many of those were judged on a zero standard error;
- compute share over rounds 2-4, counted by when the training happened (soma_edge.wire.compute_share);
- worker steps/s: all SPSA steps over all worker training seconds, and its ratio to the first N's;
- the coordinator's settle seconds per round (last reply in to the commit: checks, guard, mixture), as a
  share of round_seconds, and the ServerApp's peak RSS (VmHWM, polled while it runs);
- the run directory's bytes, and the routed held-out nats/byte of the exported model (top-2).

The targets at N = 256 are in docs/BENCHMARKS.md, "Many experts".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common import ROOT, md_head, md_row, platform_line, say
from soma_edge.rundir import metrics
from soma_edge.rundir.layout import RunDir
from soma_edge.wire import compute_share


@dataclass
class Result:
    experts: int
    min_expert_seconds: float | None = None
    advanced: list[int] = field(default_factory=list)  # per round
    never_advanced: int = 0
    failed: int = 0
    guard_refusals: int = 0
    refusals_on_zero_error: int = 0
    compute_share_2_4: float = 0.0
    steps_per_s: float = 0.0
    settle_seconds: list[float] = field(default_factory=list)
    peak_rss_mb: float = 0.0
    run_bytes: int = 0
    heldout_nats_per_byte: float | None = None
    seconds: float = 0.0


def config(n: int, least: float | None, args) -> str:
    return (
        f"[model]\nembed = {args.embed}\nhidden = {args.hidden}\n"
        f"[federation]\nexperts = {n}\nrounds = {args.rounds}\nround_seconds = {args.round_seconds}\n"
        + ("" if least is None else f"min_expert_seconds = {least}\n")
    )


def arms(text: str) -> list[tuple[int, float | None]]:
    """ "8,256:5" -> [(8, None), (256, 5.0)]."""
    out = []
    for item in text.split(","):
        n, _, least = item.partition(":")
        out.append((int(n), float(least) if least else None))
    return out


def name(n: int, least: float | None) -> str:
    return str(n) if least is None else f"{n}:{least:g}"


def serverapp_hwm(run: Path) -> float:
    """The largest VmHWM (MB) of a live ServerApp process of this run (0 if none is up)."""
    best = 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"serverapp" not in cmd.lower():  # flwr-serverapp, or a ServerApp named otherwise
                continue
            if str(run).encode() not in cmd and not os.readlink(f"/proc/{pid}/cwd").startswith(str(run)):
                continue
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    best = max(best, int(line.split()[1]) / 1024)
        except OSError:
            continue
    return best


def train(n: int, least: float | None, args, work: Path) -> tuple[Path, float]:
    """Start the run and wait for it, polling the ServerApp's peak RSS; (run dir, peak MB)."""
    arm = name(n, least).replace(":", "-")
    run, cfg = work / f"run-{arm}", work / f"n{arm}.toml"
    cfg.write_text(config(n, least, args))
    cmd = [sys.executable, "-m", "coordinator", "start", "--run", str(run), "--config", str(cfg)]
    cmd += ["--local-workers", str(args.workers), "--port", "0"]
    peak = 0.0
    with open(work / f"start-{arm}.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        while proc.poll() is None:
            peak = max(peak, serverapp_hwm(run))
            time.sleep(1.0)
    if proc.returncode != 0:
        raise SystemExit(f"N = {arm}: start exited {proc.returncode}; see {work / f'start-{arm}.log'}")
    return run, peak


def heldout(run: Path) -> float:
    """Routed held-out nats/byte of the exported model on every cluster's test shard."""
    deploy = run / "deploy"
    cmd = [sys.executable, "-m", "export.cli", "onnx", str(run), "--out", str(deploy), "--force"]
    subprocess.run(cmd, check=True, capture_output=True)
    prep = RunDir(run).read_prepare()
    data = [f"--data={run}/shards/{c.shards['test']}.bin" for c in prep.clusters if c.bytes["test"]]
    out = subprocess.run(
        [sys.executable, "-m", "export.cli", "eval", str(deploy), *data, "--json"],
        check=True,
        capture_output=True,
        text=True,
    )
    return float(json.loads(out.stdout)["nats_per_byte"])


def measure(n: int, least: float | None, args, work: Path) -> Result:
    t0 = time.perf_counter()
    run, peak = train(n, least, args, work)
    lines = metrics.read_lines(RunDir(run))
    rounds = metrics.round_lines(lines)
    experts = metrics.expert_lines(lines)
    state = RunDir(run).read_state()
    refused = [x for r in rounds for x in r.rejected if x.guard]
    # Failed: planned, not advanced, and neither refused by the guard nor trained (in a round planned ahead of
    # the last one's checks) from a version the guard then refused.
    lost = [m for m in experts if not m.accepted]
    failed = [
        m for m in lost if not (m.reason or "").startswith("rejected:") and "which was refused" not in (m.reason or "")
    ]
    steps = sum(m.steps or 0 for m in experts if m.accepted)
    secs = sum(m.seconds or 0.0 for m in experts if m.accepted)
    mid = [share for r, share in compute_share.shares(rounds).items() if 2 <= r <= 4]
    size = sum(p.stat().st_size for p in run.rglob("*") if p.is_file() and "deploy" not in p.parts)
    return Result(
        experts=n,
        min_expert_seconds=least,
        advanced=[r.accepted for r in rounds],
        never_advanced=sum(1 for e in state.expert_ids() if state.expert(e).version == 0),
        failed=len(failed),
        guard_refusals=len(refused),
        refusals_on_zero_error=sum(1 for x in refused if x.reason.endswith(" 0.0000")),
        compute_share_2_4=sum(mid) / max(len(mid), 1),
        steps_per_s=steps / secs if secs else 0.0,
        settle_seconds=[r.settle_seconds or 0.0 for r in rounds],
        peak_rss_mb=peak,
        run_bytes=size,
        heldout_nats_per_byte=heldout(run),
        seconds=time.perf_counter() - t0,
    )


def table(results: list[Result], round_seconds: float) -> str:
    heads = ["N", "advanced per round", "never advanced", "failed tasks", "honest guard refusals"]
    heads += ["compute share r2-4", "worker steps/s", "vs first N", "settle s per round (max % of round)"]
    heads += ["ServerApp peak RSS", "run dir", "held-out nats/byte"]
    rows, base = [md_head(heads)], results[0].steps_per_s or 1.0
    for r in results:
        settle = ", ".join(f"{s:.1f}" for s in r.settle_seconds)
        rows.append(
            md_row(
                [
                    name(r.experts, r.min_expert_seconds),
                    ", ".join(map(str, r.advanced)),
                    str(r.never_advanced),
                    str(r.failed),
                    f"{r.guard_refusals} ({r.refusals_on_zero_error} on a zero error)",
                    f"{100 * r.compute_share_2_4:.1f}%",
                    f"{r.steps_per_s:.1f}",
                    f"{r.steps_per_s / base:.2f}",
                    f"{settle} ({100 * max(r.settle_seconds, default=0) / round_seconds:.0f}%)",
                    f"{r.peak_rss_mb:.0f} MB",
                    f"{r.run_bytes / 1e6:.1f} MB",
                    "-" if r.heldout_nats_per_byte is None else f"{r.heldout_nats_per_byte:.4f}",
                ]
            )
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", default="8,64,256,256:5", help="arms: N, or N:S (min_expert_seconds S)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--round-seconds", type=float, default=60.0)
    ap.add_argument("--embed", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="soma-scale-"))
    say(
        f"{platform_line()}; {a.workers} local workers, {a.rounds} rounds of {a.round_seconds:g} s, "
        f"experts embed {a.embed} hidden {a.hidden}, default corpus; work in {work}"
    )
    results = []
    for n, least in arms(a.experts):
        results.append(measure(n, least, a, work))
        say(f"  N = {name(n, least)}: {results[-1].seconds:.0f} s")
    print(table(results, a.round_seconds))
    if a.json:
        print(json.dumps({"results": [asdict(r) for r in results]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
