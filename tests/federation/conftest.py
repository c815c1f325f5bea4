import math
import shutil

import pytest

from coordinator import check_budget, fleet, loop, scheduler
from coordinator.prepare import prepare
from soma_edge import config as config_mod
from soma_edge.rundir.layout import RunDir
from tests.helpers.corpus import write_stdlib_corpus
from tests.helpers.fakegrid import TINY


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    """A run directory prepared (4 experts) on the standard-library corpus, shared read-only; copy it."""
    src = write_stdlib_corpus(tmp_path_factory.mktemp("corpus"))
    run = tmp_path_factory.mktemp("prepared") / "run"
    prepare(str(src), 4, run, seed=0, progress=False)
    return run


@pytest.fixture
def run(prepared, tmp_path):
    """A private copy of `prepared` with the fake grid's tiny config (`fakegrid.TINY`)."""
    dest = tmp_path / "run"
    shutil.copytree(prepared, dest)
    rd = RunDir(dest)
    rd.save_config(config_mod.from_dict(TINY))
    return rd


@pytest.fixture(autouse=True)
def in_process_link(monkeypatch):
    """The fake grid moves messages in-process: price an unmeasured link at 100 MB/s here, not at the
    shipped 1 Mbit/s, or every test whose node misses a deadline would wait out a transfer that never happens
    (test_slow_worker.py checks the shipped rate)."""
    monkeypatch.setattr(scheduler, "UNMEASURED_LINK", 1e8)


@pytest.fixture(autouse=True)
def no_check_budget(monkeypatch):
    """Rounds here last 0.05-0.2 s, and a log's checks on this busy box take a share of that which varies
    from run to run: the budget would switch nodes between logs and weights (whose int8-coded decoder changes
    differ) by the box's load, and the tests that compare two runs bit for bit would compare two plans.
    The budget is off here unless a test sets it (test_check_budget.py); the e2e tier runs it as shipped."""
    monkeypatch.setattr(check_budget, "CHECK_SHARE", math.inf)


@pytest.fixture(autouse=True)
def quick_pulls(monkeypatch):
    """The fake grid answers a message as soon as it is pulled: the coordinator's 0.5 s between pulls (for a
    real SuperLink) is only dead time here, so it pulls every 10 ms. Tests of the poll itself set their own."""
    monkeypatch.setattr(fleet, "POLL_SECONDS", 0.01)
    monkeypatch.setattr(loop, "POLL_SECONDS", 0.01)
