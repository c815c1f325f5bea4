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
