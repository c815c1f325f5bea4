"""A step's recipe: every setting its replay and its audit depend on, as one typed record.

A worker's update log carries the recipe its steps ran with (soma_edge.spsa.log.UpdateLog.recipe); the
coordinator checks it against the recipe the node was to train with before it replays or audits a step
(`check`), so a log is never replayed under settings other than its own. What is left out changes how a
step is evaluated, never what it computes (spsa.evaluator, threads), or acts only between rounds through
the lr scale that the log carries beside it (the plateau rule's settings).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from soma_edge.config import Config, Noise, validate
from soma_edge.errors import ConfigError

# spsa.* settings a replay needs: the directions and their noise, the step-size rule, the update, the shaping.
SPSA_FIELDS = (
    "directions",
    "accumulate",
    "split_rows",
    "noise",
    "density",
    "eps",
    "eps_min",
    "tie_eps_to_lr",
    "lr",
    "lr_min_frac",
    "warmup_steps",
    "total_steps",
    "update",
    "momentum",
    "beta1",
    "beta2",
    "adam_eps",
    "weight_decay",
    "shaping",
    "decoder",
    "decoder_lr",
    "decoder_from",
)


@dataclass(frozen=True)
class Recipe:
    """The spsa settings of `SPSA_FIELDS` (as `spsa`, field -> value), and the minibatch's shape: `batch`
    rows of `seq_len` bytes, of which each direction's probes see `rows` (batch, or batch / directions
    with split_rows)."""

    spsa: tuple[tuple[str, Any], ...]
    batch: int
    seq_len: int

    @property
    def rows(self) -> int:
        s = dict(self.spsa)
        return self.batch // s["directions"] if s["split_rows"] else self.batch

    @classmethod
    def of(cls, cfg: Config) -> "Recipe":
        spsa = tuple((name, _plain(getattr(cfg.spsa, name))) for name in SPSA_FIELDS)
        return cls(spsa, cfg.data.batch, cfg.data.seq_len)

    def to_record(self) -> dict[str, Any]:
        return {"spsa": dict(self.spsa), "batch": self.batch, "seq_len": self.seq_len}

    def apply(self, cfg: Config) -> Config:
        """`cfg` (a copy) with this recipe's settings: what a replay or an audit of a log of it runs with."""
        out = copy.deepcopy(cfg)
        for name, value in self.spsa:
            setattr(out.spsa, name, type(getattr(out.spsa, name))(value))
        out.data.batch, out.data.seq_len = self.batch, self.seq_len
        return out

    @classmethod
    def from_record(cls, rec: Any, where: str = "recipe") -> "Recipe":
        """A recipe record, checked field by field as a config would be; ValueError naming what is wrong."""
        if not isinstance(rec, dict) or set(rec) != {"spsa", "batch", "seq_len"} or not isinstance(rec["spsa"], dict):
            raise ValueError(f"{where}: not a recipe record (spsa, batch, seq_len)")
        if set(rec["spsa"]) != set(SPSA_FIELDS):
            raise ValueError(f"{where}: its spsa settings are not {', '.join(SPSA_FIELDS)}")
        cfg = Config()
        for name in SPSA_FIELDS:
            value, default = rec["spsa"][name], getattr(cfg.spsa, name)
            if type(value) is not type(_plain(default)) and not (isinstance(default, float) and type(value) is int):
                raise ValueError(
                    f"{where}: spsa.{name} is {type(value).__name__}, not {type(_plain(default)).__name__}"
                )
            setattr(cfg.spsa, name, value)
        for name in ("batch", "seq_len"):
            if type(rec[name]) is not int:
                raise ValueError(f"{where}: {name} is not an integer")
            setattr(cfg.data, name, rec[name])
        try:
            validate(cfg)
        except ConfigError as e:
            raise ValueError(f"{where}: {e}") from None
        return cls.of(cfg)

    def probes(self) -> "Probes":
        """The four settings of this recipe a node chooses."""
        s = dict(self.spsa)
        return Probes(s["directions"], s["split_rows"], str(s["noise"]), s["density"])

    def differences(self, other: "Recipe") -> list[str]:
        """'name: ours vs theirs' for each setting where the two differ."""
        ours, theirs = self.to_record(), other.to_record()
        out = [f"spsa.{k}: {v!r} vs {theirs['spsa'][k]!r}" for k, v in ours["spsa"].items() if theirs["spsa"][k] != v]
        return out + [f"data.{k}: {ours[k]!r} vs {theirs[k]!r}" for k in ("batch", "seq_len") if ours[k] != theirs[k]]


# The settings a node chooses for its device (`Probes`); every other one is the run's, on every node.
NODE_FIELDS = ("directions", "split_rows", "noise", "density")
# The most directions a node may take: its audit costs the coordinator 2K forward passes a sampled step,
# and a GPU's device recipe is measured up to 64 (worker.device_recipe).
MAX_NODE_DIRECTIONS = 256


@dataclass(frozen=True)
class Probes:
    """How a node probes: K directions, each on the whole batch or on its own batch / K rows, and their
    noise. A CPU node keeps the run's; an accelerator measures its own (worker.device_recipe), so that one
    step fills the device. A node's recipe is the run's with these four settings replaced (`apply`): the
    step-size rule, the update, the head and the batch stay the run's, so an expert's weights and Adam
    moments mean the same on every node and carry over as they are when it moves."""

    directions: int
    split_rows: bool
    noise: str
    density: float

    @classmethod
    def of(cls, cfg: Config) -> "Probes":
        s = cfg.spsa
        return cls(s.directions, s.split_rows, str(s.noise), s.density)

    def apply(self, cfg: Config) -> Config:
        """`cfg` with this node's probes (a copy; ValueError if they do not fit its batch)."""
        out = copy.deepcopy(cfg)
        out.spsa.directions, out.spsa.split_rows = self.directions, self.split_rows
        out.spsa.noise, out.spsa.density = Noise(self.noise), self.density
        try:
            validate(out)
        except ConfigError as e:
            raise ValueError(str(e)) from None
        return out

    def to_record(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in NODE_FIELDS}

    @classmethod
    def from_record(cls, rec: Any, cfg: Config, where: str = "probes") -> "Probes":
        """A node's probes as its capability reply gave them, checked against the run's `cfg`: ValueError
        naming what is wrong (a field of the wrong type, or probes the run's batch cannot take)."""
        if not isinstance(rec, dict) or set(rec) != set(NODE_FIELDS):
            raise ValueError(f"{where}: not a probes record ({', '.join(NODE_FIELDS)})")
        k, split, noise, density = (rec[name] for name in NODE_FIELDS)
        if type(k) is not int or type(split) is not bool or not isinstance(noise, str):
            raise ValueError(f"{where}: directions, split_rows and noise must be an int, a bool and a string")
        if not 1 <= k <= MAX_NODE_DIRECTIONS:
            raise ValueError(f"{where}: {k} directions, where a node may take 1 to {MAX_NODE_DIRECTIONS}")
        if type(density) not in (int, float) or noise not in {n.value for n in Noise}:
            raise ValueError(f"{where}: density must be a number and noise one of {', '.join(n.value for n in Noise)}")
        out = cls(k, split, noise, float(density))
        try:
            out.apply(cfg)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        return out

    def describe(self) -> str:
        """One line, as the worker's join line, `status` and the report show a node's recipe."""
        rows = "its own batch/K rows each" if self.split_rows else "the whole batch each"
        sparse = "" if self.density == 1 else f", density {self.density:g}"
        return f"K={self.directions} {self.noise} directions on {rows}{sparse}"


CHOICES = "auto, run, device or device:K"


@dataclass(frozen=True)
class Choice:
    """A worker's `--recipe` (worker.device_recipe), parsed: which recipe (`kind`: auto | run | device)
    and, for device:K, its K."""

    kind: str
    directions: int | None = None

    def __str__(self) -> str:
        return self.kind if self.directions is None else f"{self.kind}:{self.directions}"


def parse(text: str) -> Choice:
    """A `--recipe` as given; ValueError naming what it takes (the caller names the option)."""
    kind, colon, k = str(text).strip().partition(":")
    if kind in ("auto", "run", "device") and not colon:
        return Choice(kind)
    if kind == "device" and k.isdigit() and 1 <= int(k) <= MAX_NODE_DIRECTIONS:
        return Choice(kind, int(k))
    raise ValueError(f"{text!r}: expected {CHOICES} (K a whole number from 1 to {MAX_NODE_DIRECTIONS})")


def _plain(value: Any) -> Any:
    """A setting as msgpack carries it: str enums as their strings."""
    return str(value) if isinstance(value, str) else value


def check(recipe: Recipe | None, cfg: Config, what: str = "the log") -> None:
    """ValueError when `what` ran a recipe other than `cfg`'s, the config of the node that ran it (None: a
    log from before recipes, which ran the run's own)."""
    if recipe is None:
        return
    diff = recipe.differences(Recipe.of(cfg))
    if diff:
        raise ValueError(f"{what} ran another recipe than its node's ({'; '.join(diff[:3])}, the node's second)")
