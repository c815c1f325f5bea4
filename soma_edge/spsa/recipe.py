"""A step's recipe: every setting its replay and its audit depend on, as one typed record.

A worker's update log carries the recipe its steps ran with (soma_edge.spsa.log.UpdateLog.recipe); the
coordinator checks it against the recipe the node was to train with before it replays or audits a step
(`check`), so a log is never replayed under settings other than its own. What is left out changes how a
step is evaluated, never what it computes (spsa.evaluator, threads), or acts only between rounds through
the lr scale that the log carries beside it (the plateau rule's settings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from soma_edge.config import Config, validate
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

    def differences(self, other: "Recipe") -> list[str]:
        """'name: ours vs theirs' for each setting where the two differ."""
        ours, theirs = self.to_record(), other.to_record()
        out = [f"spsa.{k}: {v!r} vs {theirs['spsa'][k]!r}" for k, v in ours["spsa"].items() if theirs["spsa"][k] != v]
        return out + [f"data.{k}: {ours[k]!r} vs {theirs[k]!r}" for k in ("batch", "seq_len") if ours[k] != theirs[k]]


def _plain(value: Any) -> Any:
    """A setting as msgpack carries it: str enums as their strings."""
    return str(value) if isinstance(value, str) else value


def check(recipe: Recipe | None, cfg: Config, what: str = "the log") -> None:
    """ValueError when `what` ran a recipe other than `cfg`'s (None: a log from before recipes, which ran
    the run's own)."""
    if recipe is None:
        return
    diff = recipe.differences(Recipe.of(cfg))
    if diff:
        raise ValueError(f"{what} ran another recipe than this run's ({'; '.join(diff[:3])}, this run's second)")
