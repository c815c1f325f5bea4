"""The suite's tiers, one folder each, marked by folder so that `pytest -m "not e2e"` runs the fast ones:

    tests/unit/        no Flower transport: pure functions, ORT sessions, CLIs in-process or short subprocesses
    tests/federation/  the round loop on the fake grid (tests/helpers/fakegrid.py): real ClientApp, real ORT
    tests/e2e/         real flower-superlink / flower-supernode processes

Shared helpers live in tests/helpers/; fixtures in this file's tier-level siblings."""

import os
from pathlib import Path

import pytest

# Keep ORT and BLAS from oversubscribing the 2 CI cores when tests run subprocesses.
os.environ.setdefault("OMP_NUM_THREADS", "1")

HERE = Path(__file__).resolve().parent
TIERS = ("unit", "federation", "e2e")  # folders under tests/, and the marker each one's tests carry


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(item.path).resolve().relative_to(HERE).parts[0]
        if tier in TIERS:  # a test elsewhere gets no tier: tests/unit/test_suite.py names it (an error raised
            item.add_marker(tier)  # here would end a pytest-xdist worker without a word)
