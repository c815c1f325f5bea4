"""Watching and stopping a real run on 127.0.0.1 (`soma-coord start` with its SuperLink and two local
workers): `status --watch` follows it from another process, `soma-coord stop` ends it after a committed
round with every process gone, RUN/tb/ holds the metrics, and `soma-coord report` draws them."""

from __future__ import annotations

import base64
import io
import os
import re
import subprocess
import sys

from soma_edge.rundir import RunDir
from tests.helpers.board import events
from tests.helpers.corpus import write_stdlib_corpus
from tests.helpers.federation import leftovers, start_coordinator, wait_until

CONFIG = """
seed = 4
[model]
embed = 8
hidden = 16
[data]
batch = 4
seq_len = 32
[federation]
join_grace = 0.0
experts = 2
rounds = 50
round_seconds = 2.0
deadline_factor = 1.5
deadline_slack = 10.0
val_windows = 8
local_workers = 2
"""


def _cli(tmp_path, env, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "coordinator", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=timeout,
    )


def test_watch_stop_tensorboard_and_report_on_a_real_run(tmp_path):
    from PIL import Image

    (tmp_path / "fed.toml").write_text(CONFIG)
    env = dict(os.environ, SOMA_CACHE=str(tmp_path / "cache"), COLUMNS="200")
    fed = {
        "root": tmp_path,
        "run": tmp_path / "run",
        "corpus": write_stdlib_corpus(tmp_path / "corpus"),
        "config": tmp_path / "fed.toml",
        "env": env,
    }
    rd = RunDir(fed["run"])
    assert _cli(tmp_path, env, "stop", str(fed["run"])).returncode == 2  # nothing is running yet
    start = start_coordinator(fed)
    try:
        wait_until(lambda: rd.is_locked() and getattr(rd.read_state(), "round", 0) >= 1, 240, "round 1 to commit")
        watch = subprocess.Popen(
            [sys.executable, "-m", "coordinator", "status", str(fed["run"]), "--watch", "--every", "0.3"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        wait_until(lambda: rd.read_state().round >= 3, 120, "round 3 to commit")
        stop = _cli(tmp_path, env, "stop", str(fed["run"]), "--log-level", "warning")
        code = start.wait(120)
        watched, _ = watch.communicate(timeout=60)
    finally:
        if start.poll() is None:
            start.kill()
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert code == 0, (tmp_path / "start.log").read_text(errors="replace")[-3000:]
    wait_until(lambda: not leftovers(fed["run"]), 30, f"no processes of the run left: {leftovers(fed['run'])}")
    assert not rd.is_locked() and not rd.stop_path.exists()

    # Stopped after a committed round, with that round's metrics and nothing of a later one.
    state = rd.read_state()
    lines = rd.read_metrics()
    rounds = [m["round"] for m in lines if m["type"] == "round"]
    assert 3 <= state.round < 50 and rounds == list(range(1, state.round + 1))
    said = re.search(r"stopped after round (\d+) of 50", stop.stdout)
    assert said and int(said.group(1)) == state.round, stop.stdout
    console = (tmp_path / "start.log").read_text(errors="replace")
    assert f"stopped after round {state.round} of 50 (soma-coord stop)" in console
    assert "stop requested (soma-coord stop)" in console
    # The watcher saw the rounds commit as they did, and left by itself when the coordinator stopped.
    assert watch.returncode == 0 and re.search(r"round \d+/50 committed", watched), watched
    assert "the coordinator has stopped" in watched

    # TensorBoard's reader finds every round's numbers as metrics.jsonl has them.
    got = events(rd.tb)
    for m in lines:
        if m["type"] == "round":
            (share,) = got[("round/compute_share", m["round"])]
            assert abs(share - m["compute_share"]) < 1e-6
        elif m["accepted"]:
            assert abs(got[(f"expert_{m['expert']}/val_loss", m["round"])][0] - m["val_loss"]) < 1e-5

    # The report: one page whose every image is a PNG that decodes.
    rep = _cli(tmp_path, env, "report", str(fed["run"]))
    assert rep.returncode == 0, rep.stdout + rep.stderr
    page = (fed["run"] / "report" / "report.html").read_text()
    uris = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert len(uris) == 3 == page.count("<img")
    for uri in uris:
        img = Image.open(io.BytesIO(base64.b64decode(uri)))
        assert img.format == "PNG" and img.size[0] > 400
        img.load()
    assert "<table>" in page and f"round {state.round} of 50" in page

    # Starting again resumes where the stop left the run.
    assert (
        _cli(
            tmp_path, env, "start", "--run", str(fed["run"]), "--rounds", str(state.round + 1), "--port", "0"
        ).returncode
        == 0
    )
    assert rd.read_state().round == state.round + 1
