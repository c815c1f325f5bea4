import subprocess
import sys
from pathlib import Path

import pytest

from soma_edge.corpus import documents, sources
from tests.helpers import train_elsewhere
from tests.helpers.corpus import FOUR_DOMAINS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def default_docs():
    return documents.by_split(sources.default_documents())


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


@pytest.fixture
def train(default_docs, capsys, tmp_path):
    """train(*ARGS, fresh=False): `soma-worker train ARGS` in this process, or (fresh) in a new one, on the
    session's default corpus; asserts it succeeds. The CLI reads by_split(default_documents()), which the
    split lists, flattened, give back list for list."""
    corpus = [d for split in default_docs.values() for d in split]
    dumped = tmp_path / "corpus.msgpack"

    def run(*args: str, fresh: bool = False) -> None:
        if fresh:
            if not dumped.exists():
                train_elsewhere.dump(corpus, dumped)
            cmd = [sys.executable, "-m", "tests.helpers.train_elsewhere", str(dumped), *args]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
            assert r.returncode == 0, r.stderr
            return
        assert train_elsewhere.train(corpus, list(args)) == 0
        capsys.readouterr()  # its JSON summary: only the checkpoint is compared

    return run
