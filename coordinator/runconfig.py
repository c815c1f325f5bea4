"""A run's config at start: resolve run.toml, --config and the command-line overrides, prepare RUN if it is
not, and save run.toml.

Two callers do exactly this: a local `soma-coord start` (coordinator.start), and the ServerApp on the
SuperLink's host when an external start sent its request along (coordinator.remote.apply_request).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Callable

from coordinator.prepare import prepare
from soma_edge import config as config_mod
from soma_edge.config import Config
from soma_edge.errors import ConfigError
from soma_edge.rundir.layout import RunDir

IMMUTABLE = ("model", "data", "seed", "federation.experts", "federation.corpus", "federation.seed_steps")


def configure(
    run: RunDir,
    config_path: Path | None,
    overrides: dict[str, Any],
    own_lock: bool = False,
    check: Callable[[Config], None] | None = None,
) -> Config:
    """The config RUN trains with, RUN prepared for it and run.toml saved (`own_lock`: the caller holds
    the run lock that prepare would take; `check`: the caller's own checks of the config, before prepare)."""
    run.root.mkdir(parents=True, exist_ok=True)
    cfg = resolve_config(run, config_path, overrides)
    if check is not None:
        check(cfg)
    given = set(overrides) | (explicit_keys(config_path) if config_path else set())
    ensure_prepared(run, cfg, given, own_lock=own_lock)
    run.save_config(cfg)
    return cfg


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj.__dict__ if hasattr(obj, "__dataclass_fields__") else obj


def _set(cfg: Config, dotted: str, value: Any) -> None:
    *path, last = dotted.split(".")
    obj: Any = cfg
    for part in path:
        obj = getattr(obj, part)
    setattr(obj, last, value)


def resolve_config(run: RunDir, config_path: Path | None, overrides: dict[str, Any]) -> Config:
    """The run's config: run.toml when resuming, else --config or the defaults; then the CLI overrides.

    A resumed run may change rounds, round length, workers and SPSA settings, but not what its
    checkpoints depend on (model, data, seed, experts, corpus, the seed run's length)."""
    given = config_mod.load(config_path) if config_path else None
    if run.has_config():
        cfg = run.load_config()
        explicit = explicit_keys(config_path) if config_path else set()
        changed = [(k, _get(given, k)) for k in IMMUTABLE if k in explicit and _get(given, k) != _get(cfg, k)]
        changed += [(k, v) for k, v in overrides.items() if k in IMMUTABLE and v != _get(cfg, k)]
        if changed:
            key, new = changed[0]
            raise ConfigError(
                f"{run.root} was started with {key} = {_get(cfg, key)!r}; it cannot change to {new!r} "
                "on resume (use a new --run directory)"
            )
        if given is not None:  # a resumed run takes the file's SPSA and federation settings, not its identity
            keep = (cfg.federation.experts, cfg.federation.corpus, cfg.federation.seed_steps)
            cfg.spsa, cfg.federation = given.spsa, given.federation
            cfg.federation.experts, cfg.federation.corpus, cfg.federation.seed_steps = keep
    else:
        cfg = given or Config()
    for k, v in overrides.items():
        _set(cfg, k, v)
    fed = cfg.federation
    if fed.local_workers > 0 and fed.min_nodes < fed.local_workers:
        fed.min_nodes = fed.local_workers
    return config_mod.validate(cfg)


def explicit_keys(path: Path) -> set[str]:
    """Which IMMUTABLE keys the TOML file itself sets (defaults filled in by Config do not count)."""
    raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    out = {k for k in ("model", "data", "seed") if k in raw}
    fed = raw.get("federation") or {}
    return out | {f"federation.{k}" for k in ("experts", "corpus", "seed_steps") if k in fed}


def _same_corpus(a: str, b: str) -> bool:
    """Corpus names are equal, or both name the same existing path (`data/` vs `./data`)."""
    if a == b:
        return True
    pa, pb = Path(a), Path(b)
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def ensure_prepared(
    run: RunDir, cfg: Config, given: set[str] | frozenset[str] = frozenset(), own_lock: bool = False
) -> None:
    """Prepare RUN unless it is; a prepared RUN must match the experts, and the corpus and seed when the
    user gave them (`given`: dotted keys set on the command line or in --config), else training would
    silently run on another corpus than the one asked for."""
    if run.is_prepared():
        prep = run.load_prepare()
        if int(prep.get("experts", -1)) != cfg.federation.experts:
            raise ConfigError(f"{run.root} is prepared for {prep.get('experts')} experts, not {cfg.federation.experts}")
        if "federation.corpus" in given and not _same_corpus(cfg.federation.corpus, str(prep.get("corpus"))):
            raise ConfigError(
                f"{run.root} is prepared from corpus {prep.get('corpus')!r}, not "
                f"{cfg.federation.corpus!r} (use a new --run directory)"
            )
        cut = prep.get("seq_len")  # absent from a run prepared before the held-out quotas
        if isinstance(cut, int) and cfg.data.seq_len > cut:
            raise ConfigError(
                f"{run.root} is prepared for data.seq_len <= {cut} (its held-out windows are {cut + 1} bytes), "
                f"not {cfg.data.seq_len}: longer windows leave experts too few of them (use a new --run directory)"
            )
        if "seed" in given and prep.get("seed") != cfg.seed:
            raise ConfigError(
                f"{run.root} is prepared with seed {prep.get('seed')!r}, not {cfg.seed!r} (use a new --run directory)"
            )
        return
    print(f"preparing {cfg.federation.corpus} into {run.root} ({cfg.federation.experts} experts)", flush=True)
    prepare(
        cfg.federation.corpus,
        cfg.federation.experts,
        run.root,
        seed=cfg.seed,
        progress=True,
        own_lock=own_lock,
        seq_len=cfg.data.seq_len,
    )
