"""`soma-export`: write a deploy bundle from a run, evaluate it, and generate from it.

`eval` and `generate` import only onnxruntime, numpy, msgpack and typer (no onnx, flwr or torch), so they
run on a deployment box without the training stack. `onnx` needs the onnx package, imported on use.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, List, Optional

import typer

from export.bundle import write
from export.infer import Deployment, EvalReport, evaluate, generate
from soma_edge.cli import entry, make_app, path_argument, path_option
from soma_edge.corpus.mixture import check_protocol
from soma_edge.engine.runtime import check_device

app = make_app("soma-edge export: ONNX deploy bundles with routed top-k eval and generation.")

DEVICE_HELP = "auto | cpu | cuda[:i] | an ORT execution provider."


@app.command("onnx")
def onnx_cmd(
    run: Path = path_argument(..., help="Run directory written by `soma-coord start`."),
    out: Path = path_option(..., "--out", help="Deploy bundle directory to write."),
    quantize: Optional[str] = typer.Option(None, help="int8: dynamic int8 quantization of the weights."),
    force: bool = typer.Option(False, help="Replace an existing bundle at --out."),
    version: str = typer.Option(
        "best", help="Each expert's best version (lowest val loss) or its latest accepted one: best | latest."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as one JSON object."),
) -> None:
    """Export every expert of RUN as ONNX (scoring + streaming), plus the router and a manifest."""
    manifest = write(run, out, quantize=quantize, force=force, version=version)
    if as_json:
        print(json.dumps(manifest))
        return
    files = manifest["files"]
    total = sum(f["bytes"] for f in files.values())
    print(
        f"{'expert':>6} {'version':>7} {'step':>7} {'val_loss':>9} {'params':>9} {'score.onnx':>11} {'stream.onnx':>11}"
    )
    for e in manifest["experts"]:
        val = "-" if e["val_loss"] is None else f"{e['val_loss']:.4f}"
        print(
            f"{e['id']:>6} {e['version']:>7} {e['step']:>7} {val:>9} {e['params']:>9} "
            f"{_size(files[e['score']]['bytes']):>11} {_size(files[e['stream']]['bytes']):>11}"
        )
    q = f", {manifest['quantize']}" if manifest["quantize"] else ""
    print(f"wrote {out} ({len(files)} files, {_size(total)}{q})")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _top_k(dep, top_k: Optional[int], protocol: str = "stream") -> int:
    k = dep.default_top_k(protocol) if top_k is None else top_k
    dep.check_top_k(k)
    return k


@app.command("eval")
def eval_cmd(
    deploy: Path = path_argument(..., help="Deploy bundle written by `soma-export onnx`."),
    data: List[Path] = path_option(..., "--data", help="Text or binary file, or a directory of them (repeatable)."),
    protocol: str = typer.Option(
        "stream",
        help="stream: every byte, each seq_len window routed on the one before | "
        "paper: 1,025-byte windows routed on their first 256 bytes, last 768 targets scored.",
    ),
    top_k: Optional[int] = typer.Option(
        None, "--top-k", help="Experts mixed per window (default: min(2, N); paper: min(4, N))."
    ),
    router_temperature: Optional[float] = typer.Option(
        None, help="Router softmax temperature (default: the bundle's)."
    ),
    uniform: Optional[bool] = typer.Option(
        None,
        "--uniform/--weighted",
        help="Weight the top-k experts equally, or by router distance (default: weighted; paper: uniform).",
    ),
    compare: bool = typer.Option(
        False, help="With --protocol paper: also score the stream protocol on the same bytes."
    ),
    device: str = typer.Option("cpu", help=DEVICE_HELP),
    threads: int = typer.Option(
        1, min=0, help="ORT intra-op threads per session (0 = ORT decides; 1 was fastest here)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Nats/byte of the routed top-k mixture on each data file and in all; held-out where every file is a test
    shard of the bundle's run (RUN/shards/). The router never sees a byte it helps score."""
    check_protocol(protocol)  # before the bundle loads
    check_device(device)  # sessions are made on first use: say now, in one line, if the device cannot run
    dep = Deployment(deploy, device=device, threads=threads)
    k = _top_k(dep, top_k, protocol)
    uniform = protocol == "paper" if uniform is None else uniform
    report = evaluate(dep, data, k, router_temperature, uniform, protocol, compare)
    if report.repeated:
        print(f"warning: {report.repeated} data file(s) named more than once; each is scored once", file=sys.stderr)
    experts = _expert_rows(dep, report)
    if as_json:
        out = {
            "nats_per_byte": report.nats_per_byte,
            "bits_per_byte": report.nats_per_byte / math.log(2),
            "bytes": report.bytes,
            "top_k": k,
            "uniform": uniform,
            "protocol": protocol,
            "stream_same_bytes": report.compared,
            "held_out": report.held_out,
            "n_experts": dep.n_experts,
            "seq_len": dep.seq_len,
            "seconds": report.seconds,
            "files": [vars(f) for f in report.files],
            "experts": experts,
        }
        print(json.dumps(out))
        return
    _print_eval(dep, report, experts, k, uniform, protocol)


def _expert_rows(dep: Deployment, report: EvalReport) -> list[dict[str, Any]]:
    """Each expert's part in an evaluation: windows, weight, bytes it scored and its own nats/byte there."""
    return [
        {
            "id": e.id,
            "version": e.version,
            "windows": report.expert_windows.get(e.id, 0),
            "weight": report.expert_weight.get(e.id, 0.0),
            "bytes": report.expert_bytes.get(e.id, 0),
            "nats_per_byte_alone": (
                report.expert_nats_sum[e.id] / report.expert_bytes[e.id] if report.expert_bytes.get(e.id) else None
            ),
            "val_loss": e.val_loss,
        }
        for e in dep.bundle.experts
    ]


def _print_eval(
    dep: Deployment, report: EvalReport, experts: list[dict[str, Any]], k: int, uniform: bool, protocol: str
) -> None:
    """An evaluation as tables: per expert, per file (and which split of the bundle's run it is, where it is
    one of its shards), then the mixture's nats/byte over all files: held-out only where that is known."""
    windows = sum(report.expert_windows.values()) / k
    print(f"{'expert':>6} {'version':>7} {'windows':>8} {'share':>7} {'nats/byte alone':>16} {'val_loss':>9}")
    for e in experts:
        share = e["weight"] / windows if windows else 0.0
        alone = "-" if e["nats_per_byte_alone"] is None else f"{e['nats_per_byte_alone']:.4f}"
        val = "-" if e["val_loss"] is None else f"{e['val_loss']:.4f}"
        print(f"{e['id']:>6} {e['version']:>7} {e['windows']:>8} {share:>7.1%} {alone:>16} {val:>9}")
    print()
    width = max([len("file")] + [len(f.path) for f in report.files])
    print(f"{'file':<{width}} {'split':>6} {'bytes':>10} {'nats/byte':>10} {'bits/byte':>10} {'bytes/s':>10}")
    for f in report.files:
        rate = f.bytes / f.seconds if f.seconds > 0 else float("inf")
        print(
            f"{f.path:<{width}} {f.split or '-':>6} {f.bytes:>10} {f.nats_per_byte:>10.4f}"
            f" {f.nats_per_byte / math.log(2):>10.4f} {rate:>10.0f}"
        )
    if report.compared is not None:
        print(
            f"stream protocol (top-{dep.default_top_k()} weighted) on the same bytes: {report.compared:.4f} nats/byte"
        )
    mode = "" if k == 1 else " uniform" if uniform else " routed"
    # `make demo` passes the run's test shards: its last line is held-out, and says so. Of other files the
    # tool cannot know that, so it names them instead.
    what = "held-out nats/byte" if report.held_out else f"nats/byte of {_files(report)}"
    print(
        f"top-{k}{mode} mixture of {dep.n_experts} experts, {protocol} protocol, {what}: "
        f"{report.nats_per_byte:.4f} over {report.bytes} bytes"
    )


def _files(report: EvalReport) -> str:
    names = [Path(f.path).name for f in report.files if f.bytes]
    return names[0] if len(names) == 1 else f"{len(names)} files"


@app.command("generate")
def generate_cmd(
    deploy: Path = path_argument(..., help="Deploy bundle written by `soma-export onnx`."),
    prompt: str = typer.Option(..., help="Text to continue (UTF-8; at least one byte)."),
    n_bytes: int = typer.Option(256, "--bytes", min=0, help="Bytes to sample."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Experts mixed per window (default: min(2, N))."),
    temperature: float = typer.Option(1.0, min=0.0, help="Sampling temperature; 0 is greedy."),
    seed: int = typer.Option(0, min=0, help="Sampling seed."),
    router_temperature: Optional[float] = typer.Option(
        None, help="Router softmax temperature (default: the bundle's)."
    ),
    echo: bool = typer.Option(True, help="Write the prompt before the sampled bytes."),
    device: str = typer.Option("cpu", help=DEVICE_HELP),
    threads: int = typer.Option(1, min=0, help="ORT intra-op threads per session (one byte at a time: 1 is best)."),
) -> None:
    """Stream sampled bytes to stdout with the streaming graphs, routing each window on the one before."""
    check_device(device)  # before the prompt is echoed: sessions are made on first use
    dep = Deployment(deploy, device=device, threads=threads)
    k = _top_k(dep, top_k)
    text = prompt.encode("utf-8", "surrogateescape")  # argv bytes that are not UTF-8 come back as they were
    stream = generate(dep, text, n_bytes, k, temperature, seed, router_temperature)
    out = sys.stdout.buffer
    if echo:
        out.write(text)
    for b, _ in stream:
        out.write(bytes([b]))
        if b == 10:
            out.flush()
    out.write(b"\n")
    out.flush()


main = entry(app, "soma-export")

if __name__ == "__main__":
    main()
