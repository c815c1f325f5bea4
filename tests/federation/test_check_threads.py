"""The coordinator's checks side by side (`federation.check_threads`): the costly part of settling a round's
results runs on threads, and the verdicts, the versions and their val losses are the ones one thread gives.
With the fake Grid (tests/helpers/fakegrid.py): real ClientApp, real ORT training and scoring."""

from __future__ import annotations

import shutil
import threading

from coordinator.checks import Checks
from coordinator.loop import Coordinator
from soma_edge import config as config_mod
from tests.helpers.fakegrid import FakeGrid, equal_rates, set_fed, step_budgets_bind


def _run(run, tmp_path, threads: int) -> tuple[dict, list]:
    rd = type(run)(tmp_path / f"copy-{threads}")
    shutil.copytree(run.root, rd.root)
    set_fed(rd, check_threads=threads)
    grid = FakeGrid(tmp_path / f"nodes-{threads}", ["a", "b"])
    step_budgets_bind(grid)
    state = Coordinator(grid, rd).main()
    lines = [
        (m["round"], m["expert"], m["accepted"], m.get("val_loss")) for m in rd.read_metrics() if m["type"] == "expert"
    ]
    return {e: x.sha256 for e, x in state.experts.items()}, lines


def test_checks_on_threads_give_what_one_thread_gives(run, tmp_path, monkeypatch):
    equal_rates(monkeypatch)
    set_fed(run, rounds=3, pipeline=False)  # every round's results wait for settle_all, where the threads are
    on: list[str] = []
    real = Checks.check

    def spied(self, c):
        on.append(threading.current_thread().name)
        return real(self, c)

    monkeypatch.setattr(Checks, "check", spied)
    one = _run(run, tmp_path, 1)
    assert on and not any(n.startswith("check") for n in on)
    on.clear()
    four = _run(run, tmp_path, 4)
    assert sum(n.startswith("check") for n in on) >= len(on) // 2, on  # most results were checked on the threads
    assert four == one
    assert any(accepted for _, _, accepted, _ in one[1]), one[1]


def test_the_default_leaves_local_workers_their_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 16)

    def threads(device: str = "cpu", **fed) -> int:
        return config_mod.check_threads(config_mod.Config(device=device, federation=config_mod.FederationConfig(**fed)))

    assert threads(local_workers=0) == 16  # a coordinator box alone: every core
    assert threads(local_workers=1) == 1  # one local worker takes every core
    assert threads(local_workers=3) == 1  # 3 x 5 threads: one core left
    assert threads("auto", local_workers=3) == 1  # auto may be the CPU: counted as the CPU
    assert threads(local_workers=3, check_threads=6) == 6  # set: as set
    assert threads("cuda:0", local_workers=3) == 13  # on a GPU a worker takes the one core that feeds it
    assert threads("CUDAExecutionProvider", local_workers=1) == 15
    assert threads("tensorrt", local_workers=3) == 13
