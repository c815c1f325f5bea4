"""`soma-worker train` in a fresh process on a corpus the test has already read, so that a determinism test
compares two processes without each reading the default corpus again (~2 s a process).

    python -m tests.helpers.train_elsewhere CORPUS [soma-worker train arguments...]

(from the repository root). CORPUS is `dump`'s msgpack file of the documents; the CLI then reads them as
the default corpus (`sources.default_documents`)."""

from __future__ import annotations

import sys
from pathlib import Path

import msgpack

from soma_edge import cli
from soma_edge.corpus import sources
from soma_edge.corpus.documents import Document
from worker import cli as worker_cli

MAX_BYTES = 1 << 30  # the default corpus is ~40 MB: a bound for the decode, as every decode has one


def dump(docs: list[Document], path: Path) -> None:
    path.write_bytes(msgpack.packb([[d.name, d.domain, d.text] for d in docs], use_bin_type=True))


def load(path: Path) -> list[Document]:
    raw = msgpack.unpackb(path.read_bytes(), raw=False, max_bin_len=MAX_BYTES, max_str_len=MAX_BYTES)
    return [Document(name=n, domain=dom, text=text) for n, dom, text in raw]


def train(docs: list[Document], argv: list[str]) -> int:
    """`soma-worker train ARGV` in this process, with `docs` as the default corpus."""
    real = sources.default_documents
    sources.default_documents = lambda *a, **k: docs
    try:
        return cli.run(worker_cli.app, ["train", *argv], "soma-worker")
    finally:
        sources.default_documents = real


if __name__ == "__main__":
    sys.exit(train(load(Path(sys.argv[1])), sys.argv[2:]))
