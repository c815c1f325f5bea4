"""Typed records that read and write the same bytes as the dicts they stand for.

A record is a keyword-only dataclass, a `Record`, whose fields are named as its keys on disk, plus two
of its own: `read_order` (the keys of the dict it was read from, in order) and `unknown` (the keys this
version does not know, as read). `read` makes one from a dict:

- a key that the class requires (a field without a default) and the dict lacks: a CheckpointError that
  names the file and the key;
- a key that the dict lacks and the class does not require takes its default (a run written before that
  key existed), and is not written back;
- a key that the class does not know is kept as it was (a run written by a later version).

`write` gives the dict back with its keys in the order they were read, so that msgpack and JSON encode
it to the same bytes. A record made in code writes its class's keys (`keys`, the order today's writers
use), then any other field whose value is not its default, in field order, as today's writers add
`late`, `seed` or `seed_done` to a dict after making it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, TypeVar

from soma_edge.errors import CheckpointError

OWN = ("read_order", "unknown")  # a record's own fields, never keys on disk


@dataclasses.dataclass(kw_only=True)
class Record:
    read_order: tuple[Any, ...] = dataclasses.field(default=(), repr=False, compare=False)
    unknown: dict[Any, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)


R = TypeVar("R", bound=Record)


def data_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.name not in OWN]


def read(cls: type[R], d: Any, where: str, **convert: Callable[[Any, str], Any]) -> R:
    """The record of class `cls` that dict `d` (from `where`) holds; `convert` maps a key to the function
    that makes its value a record (given the value, not None, and where it is)."""
    if not isinstance(d, dict):
        raise CheckpointError(f"{where}: not a map (a {type(d).__name__})")
    names = set()
    for f in data_fields(cls):
        names.add(f.name)
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in d:
            raise CheckpointError(f"{where}: missing key {f.name!r}")
    values = {}
    for k, v in d.items():
        if k in names:
            values[k] = convert[k](v, f"{where}: {k}") if k in convert and v is not None else v
    unknown = {k: v for k, v in d.items() if k not in names}
    return cls(**values, read_order=tuple(d), unknown=unknown)


def write(rec: Record, keys: tuple[str, ...], **values: Any) -> dict[Any, Any]:
    """The dict of record `rec`: the keys it was read with (else `keys`), then every other field that is
    not at its default. `values` gives a key's value where the field's is not it (a nested record's dict)."""
    names = list(rec.read_order or keys)
    for f in data_fields(type(rec)):
        if f.name not in names and getattr(rec, f.name) != default(f):
            names.append(f.name)
    out = {}
    for k in names:
        if k in values:
            out[k] = values[k]
        elif k in rec.unknown:
            out[k] = rec.unknown[k]
        else:
            out[k] = getattr(rec, k)
    return out


def default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
