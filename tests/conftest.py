import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # bench/ (torch reference) is a plain folder, not an installed package

# Keep ORT and BLAS from oversubscribing the 2 CI cores when tests run subprocesses.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def default_docs():
    from soma_edge import corpus

    return corpus.by_split(corpus.default_documents())


FOUR_DOMAINS = ("shakespeare", "milton", "python", "pydoc")


@pytest.fixture(scope="session")
def four_domain_docs(default_docs):
    """About 400 KB of each of the default corpus's four sources (documents in sha256 order), labelled."""
    docs = [d for split in default_docs.values() for d in split]
    out = []
    for domain in FOUR_DOMAINS:
        got = 0
        for d in sorted((d for d in docs if d.domain == domain), key=lambda d: d.sha256):
            if got >= 400_000:
                break
            out.append(d)
            got += len(d.text)
    return out


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
    import sysconfig

    folder.mkdir(parents=True, exist_ok=True)
    lib = Path(sysconfig.get_paths()["stdlib"])
    for name in STDLIB_SAMPLE:
        (folder / f"{name}.txt").write_bytes((lib / name).read_bytes())
    return folder


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    """A run directory prepared (4 experts) on the standard-library corpus, shared read-only; copy it."""
    from coordinator.prepare import prepare

    src = write_stdlib_corpus(tmp_path_factory.mktemp("corpus"))
    run = tmp_path_factory.mktemp("prepared") / "run"
    prepare(str(src), 4, run, seed=0, progress=False)
    return run


@pytest.fixture
def run(prepared, tmp_path):
    """A private copy of `prepared` with the fake grid's tiny config (`fakegrid.TINY`)."""
    import shutil

    from fakegrid import TINY

    from soma_edge import config as config_mod
    from soma_edge.rundir import RunDir

    dest = tmp_path / "run"
    shutil.copytree(prepared, dest)
    rd = RunDir(dest)
    rd.save_config(config_mod.from_dict(TINY))
    return rd
