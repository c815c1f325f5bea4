"""External mode with real processes: a SuperLink started on its own (as on another box), a worker
joined to it, and `soma-coord start --superlink` submitting from elsewhere. `start` must not read or
write the run directory (on the SuperLink's host): the config travels with the submission, and the
progress comes back through the SuperLink.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from coordinator.launcher import Launcher
from soma_edge.processes.launch import free_port
from soma_edge.rundir.layout import RunDir
from tests.helpers.corpus import write_stdlib_corpus
from tests.helpers.federation import cli

CONFIG = """
seed = 4
[model]
embed = 8
hidden = 16
[data]
batch = 4
seq_len = 32
[federation]
join_grace = 0.0  # every worker is there at once; the grace is tested in test_e2e_operator.py
experts = 2
round_seconds = 3.0
deadline_factor = 1.0
deadline_slack = 8.0
val_windows = 8
wait_seconds = 120
"""


def test_start_against_an_external_superlink_follows_it_without_the_run_dir(tmp_path):
    env = dict(os.environ, SOMA_CACHE=str(tmp_path / "cache"))
    src = write_stdlib_corpus(tmp_path / "corpus")
    run = tmp_path / "link-host" / "run"
    (tmp_path / "fed.toml").write_text(CONFIG)
    link = Launcher(tmp_path / "link-host" / "logs", tmp_path / "link-host" / "flwr")
    port = free_port()
    worker = None
    try:
        link.superlink("127.0.0.1", port, None)
        cmd = [
            sys.executable,
            "-m",
            "worker.cli",
            "join",
            "--coordinator",
            f"127.0.0.1:{port}",
            "--name",
            "box1",
            "--cache",
            str(tmp_path / "box1"),
            "--threads",
            "1",
            "--no-spin",
            "--parallel",
            "1",
        ]
        with open(tmp_path / "box1.log", "ab") as out:
            worker = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        (tmp_path / "elsewhere").mkdir()
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "coordinator",
                "start",
                "--superlink",
                f"127.0.0.1:{port}",
                "--run",
                str(run),
                "--config",
                str(tmp_path / "fed.toml"),
                "--corpus",
                str(src),
                "--rounds",
                "2",
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path / "elsewhere",
            timeout=400,
        )
    finally:
        if worker is not None and worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
        link.stop_all()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # The progress came through the SuperLink: the coordinator's own round lines, as it logged them.
    assert "following it through the SuperLink" in r.stdout
    assert "round 1/2 committed" in r.stdout and "round 2/2 committed" in r.stdout, r.stdout
    # The ServerApp prepared RUN and applied the config there; start wrote nothing into it.
    rd = RunDir(run)
    cfg = rd.load_config()
    assert (cfg.federation.rounds, cfg.federation.experts, cfg.seed, cfg.model.hidden) == (2, 2, 4, 16)
    assert rd.read_state().round == 2
    assert not (run / "flwr").exists() and not (run / "flwr_run.json").exists()
    assert (tmp_path / "cache" / "coord-flwr" / "config.toml").exists()  # start's Flower connection is its own


def test_start_against_an_external_superlink_needs_an_absolute_run_path(tmp_path):
    r = cli(tmp_path, dict(os.environ), "coordinator", "start", "--superlink", "127.0.0.1:9", "--run", "runs/x")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: --run runs/x: with --superlink")
    assert not Path(tmp_path / "runs").exists()
