"""Small corpora for the tests: the default corpus's four labelled sources, and a folder of standard-library
Python that federation tests prepare runs from."""

from __future__ import annotations

import sysconfig
from pathlib import Path

FOUR_DOMAINS = ("shakespeare", "milton", "python", "pydoc")

STDLIB_SAMPLE = (
    "argparse.py",
    "textwrap.py",
    "string.py",
    "shlex.py",
    "csv.py",
    "fractions.py",
    "heapq.py",
    "bisect.py",
    "calendar.py",
    "difflib.py",
    "glob.py",
    "fnmatch.py",
)


def write_stdlib_corpus(folder: Path) -> Path:
    """A small corpus folder (~400 KB of standard-library Python as .txt files) for federation tests."""
    folder.mkdir(parents=True, exist_ok=True)
    lib = Path(sysconfig.get_paths()["stdlib"])
    for name in STDLIB_SAMPLE:
        (folder / f"{name}.txt").write_bytes((lib / name).read_bytes())
    return folder


def write_many_documents_corpus(folder: Path, total: int = 1_500_000) -> Path:
    """The standard library's top-level modules, in name order, up to `total` bytes as .txt files: ~100
    documents of at most 16 KiB, enough to prepare 64 experts."""
    folder.mkdir(parents=True, exist_ok=True)
    lib, written = Path(sysconfig.get_paths()["stdlib"]), 0
    for path in sorted(lib.glob("*.py")):
        if written >= total:
            break
        data = path.read_bytes()
        (folder / f"{path.name}.txt").write_bytes(data)
        written += len(data)
    return folder
