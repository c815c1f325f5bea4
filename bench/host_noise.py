"""The host's noise per population step: what a worker draws and sends to its device for K directions.

Two forms of the same keyed Rademacher directions (soma_edge.spsa): int8 signs, one byte a weight, cut from
the float32 z the host expands (what the population graph took before), and the keyed Philox bits, one bit
a weight, with each sparse probe's mask packed beside them (what the trainer sends now; the graph expands
both on the device). Printed per size and density: host milliseconds a step (the Stepper's draw, timed
after one warm-up) and the MiB that cross to the device.

    python -m bench.host_noise [--sizes 124K,S,L] [--k 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import machine
from bench.sizes import SIZES
from soma_edge.config import SPSAConfig
from soma_edge.expert import params
from soma_edge.spsa.stepper import Stepper


def int8_signs(stepper: Stepper, k: int, body: int) -> list[np.ndarray]:
    """The directions as int8 signs cut from the host's float32 z (sparse zeros included)."""
    return [stepper.probes(0, range(k), body).dense(body).astype(np.int8)]


def keyed_bits(stepper: Stepper, k: int, body: int) -> list[np.ndarray]:
    """The directions as the trainer sends them: keyed bits, and packed masks where sparse."""
    probes = stepper.probes(0, range(k), body)
    return [a for a in (probes.bits, probes.keep) if a is not None]


def timed(draw, stepper: Stepper, k: int, body: int, repeats: int) -> tuple[float, float]:
    """(host ms a step, MiB that cross) of `draw`."""
    out = draw(stepper, k, body)
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = draw(stepper, k, body)
    return 1000 * (time.perf_counter() - t0) / repeats, sum(a.nbytes for a in out) / 2**20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.host_noise", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="124K,S,L", help=f"expert sizes, of {','.join(SIZES)}")
    ap.add_argument("--k", type=int, default=8, help="directions per step K")
    ap.add_argument("--repeats", type=int, default=3, help="timed draws per cell, after one warm-up")
    a = ap.parse_args(argv)
    print(f"# {machine()}; K = {a.k}")
    print("| size | body weights | density | form | host ms/step | MiB to the device |")
    print("|---|---|---|---|---|---|")
    for name in a.sizes.split(","):
        body = params.layout(SIZES[name]).body
        for density in (1.0, 0.5):
            stepper = Stepper(SPSAConfig(directions=a.k, density=density), seed=1)
            try:
                for form, draw in (("int8 signs", int8_signs), ("keyed bits", keyed_bits)):
                    ms, mib = timed(draw, stepper, a.k, body, a.repeats)
                    print(f"| {name} | {body:,} | {density:g} | {form} | {ms:.1f} | {mib:.3f} |")
            finally:
                stepper.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
