"""Many experts on a few workers: N = 8, 64 and 256 tiny experts, the same run otherwise.

    .venv/bin/python -m bench.scale [--experts 8,64,256,256:5] [--workers 4] [--rounds 5] [--round-seconds 60]
        [--embed 16] [--hidden 64] [--kind lstm] [--layers 1] [--seed 0] [--paper] [--top-k 4] [--json]

For each N: `soma-coord start --local-workers W` on 127.0.0.1 (a real SuperLink, W SuperNodes, the
ServerApp and ClientApps), on the default corpus, at the shipped settings but the model size; then
`soma-export onnx` and `soma-export eval` on every cluster's test shard. An arm `N:S` also sets
`federation.min_expert_seconds = S` (a round trains the experts the workers can give S seconds each, in
turn); an arm `N@ExH` trains experts of embed E and hidden H (`8@64x513`: 8 experts with as many
parameters in all as 256 of the tiny ones). Per arm it prints:

- experts advanced per round, and those never advanced (still at version 0 at the end);
- failed tasks (experts planned but not advanced, for any reason but the guard) and honest guard refusals
  (there is no liar), with how many of those were judged on a zero standard error;
- compute share over rounds 2-4, counted by when the training happened (soma_edge.wire.compute_share);
- worker steps/s: all SPSA steps over all worker training seconds, and its ratio to the first N's;
- the coordinator's settle seconds per round (last reply in to the commit: checks, guard, mixture), as a
  share of round_seconds, and the ServerApp's peak RSS (VmHWM, polled while it runs);
- the run directory's bytes, and the routed held-out nats/byte of the exported model (top-2).

and a long-run table: each round's compute share, the guard's refusals and the strikes and exclusions
they cost, the finished experts by rule (coordinator.finish), the mean val loss and routed val after the
last round. `--kind soma` trains the preprint's expert (embed = hidden); `--paper` runs examples/paper.toml
(its model, seed run and frozen E) with these experts, rounds and round seconds.

Then a second table, routed inference: every arm's exported model on the same held-out text (up to 256 KiB in
4 KiB pieces spread over the test documents of the corpus's hash split, which no arm trains on whatever its
N), top-k routed: its nats/byte, and its bytes/s (the CPU time of the scoring thread, one ORT thread per
session, best of 3), beside the arm's worker training seconds (the same budget for every arm: workers x
rounds x round_seconds).

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

import numpy as np

from bench import routed_inference
from bench.common import ROOT, md_head, md_row, platform_line, say
from export.infer import Deployment
from soma_edge.config import ModelConfig
from soma_edge.corpus import documents, sources
from soma_edge.expert import params
from soma_edge.rundir import metrics
from soma_edge.rundir.layout import RunDir
from soma_edge.wire import compute_share

HELDOUT_BYTES = 256 << 10


@dataclass(frozen=True)
class Arm:
    experts: int
    min_expert_seconds: float | None = None
    embed: int | None = None  # None: --embed, --hidden
    hidden: int | None = None

    @property
    def name(self) -> str:
        least = "" if self.min_expert_seconds is None else f":{self.min_expert_seconds:g}"
        size = "" if self.embed is None else f"@{self.embed}x{self.hidden}"
        return f"{self.experts}{least}{size}"


@dataclass
class Result:
    experts: int
    min_expert_seconds: float | None = None
    arm: str = ""
    params_per_expert: int = 0
    train_seconds: float = 0.0  # worker training seconds of the accepted versions
    routed_nats_per_byte: float | None = None  # on the common held-out text, top-k
    routed_bytes_per_s: float | None = None
    advanced: list[int] = field(default_factory=list)  # per round
    never_advanced: int = 0
    failed: int = 0
    guard_refusals: int = 0
    shares: list[float] = field(default_factory=list)  # compute share per round, by when the training happened
    strikes: dict[str, int] = field(default_factory=dict)  # node -> strikes at the end
    excluded: list[str] = field(default_factory=list)
    finished: dict[str, int] = field(default_factory=dict)  # rule -> experts it finished
    val_mean: float | None = None  # mean val loss after the last round
    routed_val: float | None = None  # the routed mixture's val loss after the last round
    refusals_on_zero_error: int = 0
    compute_share_2_4: float = 0.0
    steps_per_s: float = 0.0
    settle_seconds: list[float] = field(default_factory=list)
    peak_rss_mb: float = 0.0
    run_bytes: int = 0
    heldout_nats_per_byte: float | None = None
    seconds: float = 0.0


def model_of(arm: Arm, args) -> ModelConfig:
    return ModelConfig(embed=arm.embed or args.embed, hidden=arm.hidden or args.hidden)


def config(arm: Arm, args) -> str:
    m = model_of(arm, args)
    fed = f"[federation]\nexperts = {arm.experts}\nrounds = {args.rounds}\nround_seconds = {args.round_seconds}\n" + (
        "" if arm.min_expert_seconds is None else f"min_expert_seconds = {arm.min_expert_seconds}\n"
    )
    if args.paper:  # the example's model, seed run and E; these experts, rounds and round seconds
        keep, rest = (ROOT / "examples" / "paper.toml").read_text().split("[federation]", 1)
        seed_steps = [ln for ln in rest.splitlines() if ln.startswith("seed_steps")]
        return keep + fed + "\n".join(seed_steps) + "\n"
    spsa = "" if args.lr is None else f"[spsa]\nlr = {args.lr}\n"
    return (
        f'seed = {args.seed}\n[model]\nkind = "{args.kind}"\nembed = {m.embed}\nhidden = {m.hidden}\n'
        f"layers = {args.layers}\n" + spsa + fed
    )


def arms(text: str) -> list[Arm]:
    """ "8,256:5,8@64x513" -> the arms: N, N with min_expert_seconds S, N with experts of embed E, hidden H."""
    out = []
    for item in text.split(","):
        item, _, size = item.partition("@")
        n, _, least = item.partition(":")
        embed, _, hidden = size.partition("x")
        out.append(
            Arm(int(n), float(least) if least else None, int(embed) if size else None, int(hidden) if size else None)
        )
    return out


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


def train(arm: Arm, args, work: Path) -> tuple[Path, float]:
    """Start the run and wait for it, polling the ServerApp's peak RSS; (run dir, peak MB)."""
    tag = arm.name.replace(":", "-").replace("@", "-")
    run, cfg = work / f"run-{tag}", work / f"n{tag}.toml"
    cfg.write_text(config(arm, args))
    cmd = [sys.executable, "-m", "coordinator", "start", "--run", str(run), "--config", str(cfg)]
    cmd += ["--local-workers", str(args.workers), "--port", "0"]
    peak = 0.0
    with open(work / f"start-{tag}.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        while proc.poll() is None:
            peak = max(peak, serverapp_hwm(run))
            time.sleep(1.0)
    if proc.returncode != 0:
        raise SystemExit(f"N = {arm.name}: start exited {proc.returncode}; see {work / f'start-{tag}.log'}")
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


def routed(run: Path, data: np.ndarray, top_k: int) -> tuple[float, float]:
    """The exported model's routed top-k nats/byte on `data`, and its bytes/s (scoring thread's CPU time,
    one ORT thread per session, best of 3)."""
    dep = Deployment(run / "deploy", device="cpu", threads=1)
    k = min(top_k, dep.bundle.n_experts)
    dep.score(data[: 8 * 128], k)  # warm-up: sessions made and run once
    best, nats = 0.0, None
    for _ in range(3):
        t0 = time.thread_time()
        got = dep.score(data, k)
        best, nats = max(best, got.bytes / (time.thread_time() - t0)), got.nats_per_byte
    return float(nats), best


def measure(arm: Arm, args, work: Path, data: np.ndarray) -> Result:
    n, least = arm.experts, arm.min_expert_seconds
    t0 = time.perf_counter()
    run, peak = train(arm, args, work)
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
    result = Result(
        experts=n,
        min_expert_seconds=least,
        advanced=[r.accepted for r in rounds],
        never_advanced=sum(1 for e in state.expert_ids() if state.expert(e).version == 0),
        failed=len(failed),
        guard_refusals=len(refused),
        refusals_on_zero_error=sum(1 for x in refused if x.reason.endswith(" 0.0000")),
        shares=[share for _, share in sorted(compute_share.shares(rounds).items())],
        strikes={x["name"]: int(x["count"]) for x in state.strikes.values()},
        excluded=[n for r in rounds for n in r.excluded],
        finished=_finished_by_rule(state),
        val_mean=rounds[-1].val_loss_mean if rounds else None,
        routed_val=rounds[-1].mixture_val_loss if rounds else None,
        compute_share_2_4=sum(mid) / max(len(mid), 1),
        steps_per_s=steps / secs if secs else 0.0,
        settle_seconds=[r.settle_seconds or 0.0 for r in rounds],
        peak_rss_mb=peak,
        run_bytes=size,
        heldout_nats_per_byte=heldout(run),
        seconds=time.perf_counter() - t0,
        arm=arm.name,
        params_per_expert=params.count(model_of(arm, args)),
        train_seconds=secs,
    )
    result.routed_nats_per_byte, result.routed_bytes_per_s = routed(run, data, args.top_k)
    return result


def _finished_by_rule(state) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in state.expert_ids():
        why = state.expert(e).finished
        if why:
            rule = why.split(":", 1)[0]
            out[rule] = out.get(rule, 0) + 1
    return out


def long_table(results: list[Result]) -> str:
    heads = ["arm", "compute share per round", "guard refusals", "strikes at the end", "excluded"]
    heads += ["finished (rule: experts)", "mean val", "routed val"]
    rows = [md_head(heads)]
    for r in results:
        rows.append(
            md_row(
                [
                    r.arm,
                    ", ".join(f"{100 * x:.0f}" for x in r.shares),
                    str(r.guard_refusals),
                    ", ".join(f"{k} {v}" for k, v in sorted(r.strikes.items())) or "none",
                    ", ".join(r.excluded) or "none",
                    ", ".join(f"{k}: {v}" for k, v in sorted(r.finished.items())) or "none",
                    "-" if r.val_mean is None else f"{r.val_mean:.4f}",
                    "-" if r.routed_val is None else f"{r.routed_val:.4f}",
                ]
            )
        )
    return "\n".join(rows)


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
                    r.arm,
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


def inference_table(results: list[Result], top_k: int, n_bytes: int) -> str:
    heads = ["arm", "params/expert", "total params", "worker train s", f"held-out nats/byte (top-{top_k})"]
    heads += [f"top-{top_k} B/s", "vs first arm"]
    rows, base = [md_head(heads)], results[0].routed_bytes_per_s or 1.0
    for r in results:
        rows.append(
            md_row(
                [
                    r.arm,
                    f"{r.params_per_expert:,}",
                    f"{r.experts * r.params_per_expert:,}",
                    f"{r.train_seconds:.0f}",
                    f"{r.routed_nats_per_byte:.4f}",
                    f"{r.routed_bytes_per_s:,.0f}",
                    f"{r.routed_bytes_per_s / base:.2f}",
                ]
            )
        )
    return f"routed inference on {n_bytes:,} held-out bytes\n" + "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--experts", default="8,64,256,256:5", help="arms: N, N:S (min_expert_seconds S), N@ExH (embed E, hidden H)"
    )
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--round-seconds", type=float, default=60.0)
    ap.add_argument("--embed", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--kind", default="lstm", choices=("lstm", "soma"), help="model.kind (soma: embed = hidden)")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--paper", action="store_true", help="examples/paper.toml's model, seed run and E")
    ap.add_argument("--lr", type=float, default=None, help="spsa.lr (default: the shipped one; not with --paper)")
    ap.add_argument("--top-k", type=int, default=4, help="experts mixed per window in the routed-inference table")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="soma-scale-"))
    say(
        f"{platform_line()}; {a.workers} local workers, {a.rounds} rounds of {a.round_seconds:g} s, "
        + ("examples/paper.toml's experts" if a.paper else f"{a.kind} experts embed {a.embed} hidden {a.hidden}")
        + f", seed {a.seed}, default corpus; work in {work}"
    )
    docs = documents.by_split(sources.default_documents())
    data = routed_inference.heldout(docs["test"], HELDOUT_BYTES)  # one text for every arm: no arm trained on it
    results = []
    for arm in arms(a.experts):
        results.append(measure(arm, a, work, data))
        say(f"  N = {arm.name}: {results[-1].seconds:.0f} s")
    print(table(results, a.round_seconds))
    print(inference_table(results, a.top_k, data.size))
    print(long_table(results))
    if a.json:
        print(json.dumps({"results": [asdict(r) for r in results]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
