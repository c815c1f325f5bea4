import pytest

from soma_edge.corpus import documents, sources
from tests.helpers.corpus import FOUR_DOMAINS


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
