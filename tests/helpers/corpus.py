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
