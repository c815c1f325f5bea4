"""`soma-coord prepare` on a corpus: time, peak memory, purity, and how well the router routes held-out text.

    .venv/bin/python bench/prepare_router.py [--corpus debian] [--experts 16] [--seed 0]

1. Runs `python -m coordinator prepare CORPUS --experts N --json` as a child process; reports its wall
   time and peak resident memory (the child's rusage), purity and balance from prepare.json.
2. Routes the held-out (test split) shards with the fitted router exactly as inference does
   (`Router.route_windows`: window i on window i-1) for several window lengths, and reports how often the
   top-1 expert is the expert whose cluster the text belongs to, and the routing throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from soma_edge import router as router_mod  # noqa: E402


def _machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    load = os.getloadavg()[0]
    return (f"{platform.machine()}, {os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, Python {platform.python_version()}, "
            f"numpy {np.__version__}, load average {load:.1f} at start")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="debian")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--windows", default="64,128,256,512")
    args = ap.parse_args()
    print(f"machine: {_machine()}")

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "coordinator", "prepare", args.corpus, "--experts", str(args.experts),
               "--seed", str(args.seed), "--out", str(out), "--json"]  # fmt: skip
        t0 = time.perf_counter()
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        stdout, stderr = child.communicate()
        wall = time.perf_counter() - t0
        if child.returncode != 0:
            print(stderr.decode(), file=sys.stderr)
            return child.returncode
        import resource

        peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # Linux: KiB
        s = json.loads(stdout)
        sizes = np.array([sum(c["bytes"].values()) for c in s["clusters"]], dtype=float)
        print(f"\n## prepare {args.corpus} --experts {args.experts} --seed {args.seed}\n")
        print("| documents | MB | clusters | purity | max/mean cluster bytes | min/mean | router KiB | wall s | peak RSS MiB |")
        print("|---|---|---|---|---|---|---|---|---|")
        print(f"| {s['documents']} | {s['bytes'] / 1e6:.1f} | {len(s['clusters'])} | {s['purity']} | "
              f"{sizes.max() / sizes.mean():.3f} | {sizes.min() / sizes.mean():.3f} | {s['router']['bytes'] / 1024:.0f} | "
              f"{wall:.1f} | {peak_mib:.0f} |")  # fmt: skip

        router = router_mod.load(out / "router.msgpack")
        tests = [(c["expert"], (out / "shards" / f"{c['shards']['test']}.bin").read_bytes()) for c in s["clusters"]]
        print(f"\n## routing held-out text (test split, {sum(len(t) for _, t in tests) / 1e6:.2f} MB), "
              f"T = {router.temperature:.4f}\n")  # fmt: skip
        print("| window bytes | windows | top-1 = own expert | own expert in top-2 | routing MB/s |")
        print("|---|---|---|---|---|")
        for w in [int(x) for x in args.windows.split(",")]:
            hit1 = hit2 = n = 0
            t0 = time.perf_counter()
            for expert, data in tests:
                if len(data) <= w:
                    continue
                experts, _ = router.route_windows(data, w, 2, router.temperature)
                hit1 += int((experts[1:, 0] == expert).sum())
                hit2 += int((experts[1:] == expert).any(axis=1).sum())
                n += experts.shape[0] - 1
            secs = time.perf_counter() - t0
            mb = sum(len(t) for _, t in tests) / 1e6
            print(f"| {w} | {n} | {hit1 / n:.3f} | {hit2 / n:.3f} | {mb / secs:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
