"""Which recipe a worker trains with: the run's, or one measured to fill its device.

The run's recipe was chosen on CPU cores, where a forward pass costs in proportion to its rows: four
directions on a quarter of the batch each (spsa.split_rows) cost what one costs. On an accelerator a step of
one direction leaves the device waiting: 64 directions, each on the whole batch, in one population call, cost
little more than one (docs/BENCHMARKS.md, "The first GPU run"). So a worker on an accelerator measures its
own probes (`choose`): K = 4 ... 64 directions, each on the whole batch, dense, one population call a step,
and takes the smallest K whose directions/s is within FILL of the best it measured. Past that knee the
device is full: more directions cost steps one for one. Then rank-1 noise at that K, kept where it steps
faster. Only the probes change (spsa.recipe.Probes): the step-size rule, the update and the head stay the
run's, and under Adam a step's size is the lr whatever K (the body bench's lr sweeps found the same best lr
for K = 1 to 16), so the lr stays the run's too.

A worker's `--recipe` (spsa.recipe.Choice): `auto` (the device's own on an accelerator, the run's on the CPU
EP), `run`, `device` (measure even on the CPU), or `device:K` (K dense directions on the whole batch, not
measured: the explicit way to give a node a GPU-sized recipe).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from soma_edge.config import Config, Noise
from soma_edge.devices import CPU
from soma_edge.spsa.recipe import Choice, Probes

CANDIDATES = (4, 8, 16, 32, 64)
FILL = 0.9  # the smallest K within 10% of the best directions/s: the knee where the device is full
RANK1_MARGIN = 1.05  # rank-1 noise where it steps at least 5% faster than dense at the chosen K


@dataclass(frozen=True)
class Measured:
    probes: Probes
    steps_per_s: float

    @property
    def directions_per_s(self) -> float:
        return self.steps_per_s * self.probes.directions


def measured(choice: Choice, providers: list[str]) -> bool:
    """Whether `choice` means measuring this device's probes (`choose`)."""
    if choice.kind == "auto":
        return providers[0] != CPU
    return choice.kind == "device" and choice.directions is None


def dense(directions: int, noise: Noise = Noise.RADEMACHER) -> Probes:
    """K dense directions, each on the whole batch."""
    return Probes(directions, False, str(noise), 1.0)


def choose(cfg: Config, steps_per_s: Callable[[Config], float]) -> tuple[Probes, list[Measured]]:
    """This device's probes for `cfg` and what they were chosen from; `steps_per_s(c)` times whole SPSA
    steps of config `c` on this device's evaluator."""
    table = [Measured(p, steps_per_s(p.apply(cfg))) for p in map(dense, CANDIDATES)]
    best = max(m.directions_per_s for m in table)
    pick = next(m for m in table if m.directions_per_s >= FILL * best)
    rank1 = dense(pick.probes.directions, Noise.RANK1)
    table.append(Measured(rank1, steps_per_s(rank1.apply(cfg))))
    # Rank-1 only where it is clearly faster: a coin flip of timing noise would change what the node learns.
    return (rank1 if table[-1].steps_per_s > RANK1_MARGIN * pick.steps_per_s else pick.probes), table


def probes_for(choice: Choice, cfg: Config, providers: list[str], steps_per_s) -> tuple[Probes, list[Measured]]:
    """The probes a worker with `--recipe choice` trains `cfg` with, and the measurement behind them ([]
    where none was made)."""
    if measured(choice, providers):
        return choose(cfg, steps_per_s)
    if choice.directions is not None:
        return dense(choice.directions), []
    return Probes.of(cfg), []


def summary(probes: Probes, table: list[Measured]) -> str:
    """The join line's account of the choice."""
    if not table:
        return probes.describe()
    seen = ", ".join(
        f"{m.probes.directions}{' rank1' * (m.probes.noise == 'rank1')}: {m.steps_per_s:.1f}" for m in table
    )
    return f"{probes.describe()} (measured steps/s by K: {seen})"
