"""`soma-coord start --local-workers W --device D`: the local SuperNodes run on the config's device, or each
on its own (`--local-devices`) and with its own `--recipe` (`--local-recipes`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator import runconfig, start
from soma_edge.errors import ConfigError
from soma_edge.rundir.layout import RunDir


class FakeLauncher:
    """Records the workers `start` asks for instead of spawning them."""

    def __init__(self) -> None:
        self.workers: list[dict] = []

    def worker(self, name: str, coordinator: str, cache: Path, threads: int, **kw) -> None:
        self.workers.append({"name": name, "threads": threads, **kw})


@pytest.mark.parametrize("device", ["cuda:1", "cpu", "auto"])
def test_local_workers_run_on_the_device_the_command_line_gives(tmp_path: Path, device: str) -> None:
    run = RunDir(tmp_path / "run")
    cfg = runconfig.resolve_config(run, None, {"device": device, "federation.local_workers": 2})
    procs = FakeLauncher()
    start.launch_workers(procs, run, start.Options(run=run.root), "127.0.0.1:1", {}, 2, [cfg.device])
    assert [w["device"] for w in procs.workers] == [device, device]
    assert [w["name"] for w in procs.workers] == ["w0", "w1"]
    assert [w["recipe"] for w in procs.workers] == ["auto", "auto"]


def test_each_local_worker_takes_its_own_device_and_recipe_and_short_lists_repeat(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    opts = start.Options(run=run.root, local_devices=["cpu"], local_recipes=["run", "device:16"])
    start.check_options(opts)
    procs = FakeLauncher()
    start.launch_workers(procs, run, opts, "127.0.0.1:1", {}, 3, opts.local_devices)
    assert [(w["device"], w["recipe"]) for w in procs.workers] == [("cpu", "run"), ("cpu", "device:16"), ("cpu", "run")]


@pytest.mark.parametrize(
    "opts, says",
    [
        ({"local_recipes": ["run", "gpu"]}, "--local-recipes 'gpu': expected auto, run, device or device:K"),
        ({"local_devices": ["cpu", "tpu9"]}, "--local-devices: unknown execution provider 'tpu9'"),
        ({"local_devices": ["cpu"], "overrides": {"device": "cpu"}}, "give --device (every local worker) or"),
        ({"local_recipes": ["run"], "superlink": "127.0.0.1:9"}, "which need the embedded SuperLink"),
    ],
)
def test_bad_local_lists_are_refused_before_anything_starts(tmp_path: Path, opts: dict, says: str) -> None:
    with pytest.raises(ConfigError) as got:
        start.check_options(start.Options(run=tmp_path / "run", **opts))
    assert says in str(got.value)
    assert not (tmp_path / "run").exists()


def test_local_workers_take_the_configs_device(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text('device = "cuda:0"\n')
    cfg = runconfig.resolve_config(RunDir(tmp_path / "run"), conf, {})
    assert cfg.device == "cuda:0"
    # the command line wins over the file
    assert runconfig.resolve_config(RunDir(tmp_path / "run"), conf, {"device": "cpu"}).device == "cpu"


def test_an_unknown_device_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="device"):
        runconfig.resolve_config(RunDir(tmp_path / "run"), None, {"device": "tpu9"})


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="no scheduling autogroups on this kernel")
def test_a_niced_worker_s_own_session_keeps_its_niceness_across_scheduling_groups() -> None:
    """`nice soma-worker join` starts its SuperNode in a session of its own: a new scheduling group, which
    Linux would run at niceness 0 against the coordinator's group whatever the worker's own niceness."""
    import subprocess
    import sys

    child = (
        "import subprocess, sys\n"
        "from soma_edge.processes.launch import die_with_parent, session_child\n"
        "pre = session_child if sys.argv[1] == 'kept' else die_with_parent\n"
        "cat = ['cat', '/proc/self/autogroup']\n"
        "print(subprocess.run(cat, start_new_session=True, preexec_fn=pre, capture_output=True, text=True).stdout)"
    )
    seen = {
        how: subprocess.run(
            ["nice", "-n", "7", sys.executable, "-c", child, how], capture_output=True, text=True, check=True
        ).stdout
        for how in ("kept", "plain")
    }
    assert seen["kept"].strip().endswith("nice 7")
    assert seen["plain"].strip().endswith("nice 0")  # what the SuperNode's group got before
