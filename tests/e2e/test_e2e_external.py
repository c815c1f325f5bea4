"""One worker, `soma-worker join --stay`, through two runs and a SuperLink that goes, with real processes on
127.0.0.1. Three stories share it, in order, to keep the suite short (each federation costs ~15 s to start):

1. External mode: a SuperLink started on its own (as on another box), the worker joined to it, and
   `soma-coord start --superlink` submitting from elsewhere. `start` must not read or write the run
   directory (on the SuperLink's host): the config travels with the submission, and the progress comes
   back through the SuperLink.
2. --stay: run 1 ends, then its SuperLink goes; the worker waits, and trains in run 2, a `soma-coord start`
   on the same address.
3. Run 2 trains with the population evaluator (spsa.evaluator = "population": one ORT call per minibatch for
   its clean forward and 2K probes, the expert resident in the worker's update graph) and log replies: the
   coordinator replays each log, audits sampled steps with the loop, and accepts it; every version names
   the evaluator that made it, and the held-out loss falls.
4. Mixed recipes: a second worker joins run 2 once its round 1 is under way, given a GPU-sized recipe by
   `--recipe device:8` (8 dense directions on the whole batch, where the run's are 4 on a quarter each). It
   takes an expert over from the first; every log of both recipes is audited (8 steps) and replayed under
   its own recipe, and accepted.
5. The GPU box's rehearsal: every process runs Flower from the target install of a kit (bench/gpu_kit.py:
   prepare, receive, finish), as on an offline GPU box, its wheels repacked from this environment (a test
   has no network), both workers on the CPU.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest

from bench import gpu_kit
from coordinator.launcher import Launcher
from soma_edge.processes.launch import free_port
from soma_edge.rundir.layout import RunDir
from tests.helpers.corpus import write_stdlib_corpus
from tests.helpers.federation import START_TIMEOUT, cli, leftovers, log_tails, metric_lines, val_loss, wait_until
from tests.helpers.kit_wheels import repack

# The tests that share `link` continue its story in order: one pytest-xdist process runs them all.
SHARED = pytest.mark.xdist_group("e2e_external_then_stay")

EXTERNAL = """
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
POPULATION = """
seed = 5
[model]
embed = 16
hidden = 32
[data]
batch = 8
seq_len = 64
[spsa]
directions = 4
warmup_steps = 0
evaluator = "population"
[federation]
join_grace = 0.0
experts = 2
rounds = 5  # a joining worker takes 12-17 s on a busy 2-core box: it gets rounds 3-5 to take an expert over
round_seconds = 3.0
deadline_factor = 1.5
deadline_slack = 12.0
val_windows = 16
reply = "log"
audit_steps = 8
keep_versions = 6  # version 0 stays, for the held-out loss before training
"""
GPU_SIZED = {"directions": 8, "split_rows": False, "noise": "rademacher", "density": 1.0}


def _kit_target(root: Path) -> Path:
    """Flower and its dependencies through a kit, as a GPU box gets them: prepare, receive, finish --no-check
    (whose import check fails on this box's CPU onnxruntime alone)."""
    kit, stage, target = root / "kit", root / "stage", root / "site"
    wheels = repack(list(gpu_kit.FLOWER), root / "wheels")
    assert any(w.name.startswith("flwr-") for w in wheels)
    assert gpu_kit.main(["prepare", "--wheels", str(root / "wheels"), "--out", str(kit)]) == 0
    assert gpu_kit.main(["receive", "--kit", str(kit), "--stage", str(stage)]) == 0
    gpu_kit.main(["finish", "--stage", str(stage), "--target", str(target), "--no-check"])
    assert (target / "bin" / "flower-superlink").is_file() and (target / "flwr").is_dir()
    return target


@pytest.fixture(scope="module")
def link(tmp_path_factory):
    """The SuperLink on its own and the `join --stay` worker, all from a kit's target install; both go at the
    end, whatever happened."""
    root = tmp_path_factory.mktemp("link")
    target = _kit_target(root)
    env = gpu_kit.kit_env(target, base=dict(os.environ, SOMA_CACHE=str(root / "cache")))
    got = subprocess.run([sys.executable, "-c", "import flwr; print(flwr.__file__)"], env=env, capture_output=True)
    assert got.stdout.decode().startswith(str(target.resolve())), got  # every process below runs the kit's Flower
    (root / "external.toml").write_text(EXTERNAL)
    (root / "population.toml").write_text(POPULATION)
    superlink = Launcher(root / "link-host" / "logs", root / "link-host" / "flwr")
    port, log = free_port(), root / "worker.log"
    with mock.patch.dict(os.environ, {k: env[k] for k in ("PYTHONPATH", "PATH")}):  # its flower_env reads these
        superlink.superlink("127.0.0.1", port, None)  # it listens when this returns
    worker = _join(root, env, port, "s", log, "--stay", "--patience", "3")
    fed = {"root": root, "corpus": write_stdlib_corpus(root / "corpus"), "env": env, "port": port, "workers": [worker]}
    fed.update(superlink=superlink, worker=worker, log=log, run=root / "link-host" / "run")
    try:
        yield fed
    finally:
        for w in fed["workers"]:
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGKILL)
        superlink.stop_all()


def _join(root: Path, env: dict, port: int, name: str, log: Path, *extra: str) -> subprocess.Popen:
    join = ["join", "--coordinator", f"127.0.0.1:{port}", "--name", name, *extra]
    join += ["--cache", str(root / name), "--threads", "1", "--no-spin", "--parallel", "1"]
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "worker.cli", *join],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def _round_under_way(run: Path) -> bool:
    try:
        return (RunDir(run).read_status() or {}).get("round", 0) >= 1
    except Exception:  # noqa: BLE001  (a status.json being replaced, or not there yet)
        return False


def _said(fed, text: str) -> bool:
    return text in fed["log"].read_text(errors="replace")


@SHARED
def test_start_against_an_external_superlink_follows_it_without_the_run_dir(link):
    (link["root"] / "elsewhere").mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "coordinator", "start", "--superlink", f"127.0.0.1:{link['port']}"]
        + ["--run", str(link["run"]), "--config", str(link["root"] / "external.toml")]
        + ["--corpus", str(link["corpus"]), "--rounds", "2"],
        capture_output=True,
        text=True,
        env=link["env"],
        cwd=link["root"] / "elsewhere",
        timeout=400,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # The progress came through the SuperLink: the coordinator's own round lines, as it logged them.
    assert "following it through the SuperLink" in r.stdout
    assert "round 1/2 committed" in r.stdout and "round 2/2 committed" in r.stdout, r.stdout
    # The ServerApp prepared RUN and applied the config there; start wrote nothing into it.
    rd = RunDir(link["run"])
    cfg = rd.load_config()
    assert (cfg.federation.rounds, cfg.federation.experts, cfg.seed, cfg.model.hidden) == (2, 2, 4, 16)
    assert rd.read_state().round == 2
    assert not (link["run"] / "flwr").exists() and not (link["run"] / "flwr_run.json").exists()
    assert (link["root"] / "cache" / "coord-flwr" / "config.toml").exists()  # start's Flower connection is its own


def test_start_against_an_external_superlink_needs_an_absolute_run_path(tmp_path):
    r = cli(tmp_path, dict(os.environ), "coordinator", "start", "--superlink", "127.0.0.1:9", "--run", "runs/x")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: --run runs/x: with --superlink")
    assert not Path(tmp_path / "runs").exists()


@SHARED
def test_a_worker_with_stay_serves_the_next_run(link):
    """Run 1 ended with its SuperLink still up; then the SuperLink goes. The worker waits, and trains in run 2."""
    worker, log = link["worker"], link["log"]
    wait_until(lambda: _said(link, "waiting for the next run (--stay)"), 60, "the worker to wait for a next run")
    assert _said(link, "the run ended (2/2 rounds, complete); waiting for the next run (--stay)")
    link["superlink"].stop_all()
    wait_until(lambda: _said(link, "waiting for it to come back (--stay)"), 60, "the worker to see it gone")
    assert worker.poll() is None, log.read_text(errors="replace")[-2000:]
    run = link["root"] / "run2"
    fed = {"root": link["root"], "run": run}
    start = [sys.executable, "-m", "coordinator", "start", "--run", str(run), "--port", str(link["port"])]
    start += ["--config", str(link["root"] / "population.toml"), "--corpus", str(link["corpus"])]
    with open(link["root"] / "start.log", "ab") as out:
        second = subprocess.Popen(start, stdout=out, stderr=subprocess.STDOUT, env=link["env"], cwd=link["root"])
    try:
        # The GPU-sized worker joins once round 1 is planned without it, so that a later plan moves an expert to it.
        wait_until(lambda: _round_under_way(run), 120, "run 2's round 1 to start", fed)
        g = _join(link["root"], link["env"], link["port"], "g", link["root"] / "g.log", "--recipe", "device:8")
        link["workers"].append(g)
        assert second.wait(START_TIMEOUT) == 0, log_tails(fed, 3000)
    finally:
        if second.poll() is None:
            second.kill()
    nodes = {m["node"] for m in metric_lines(RunDir(run), "expert") if m["accepted"]}
    assert nodes == {"s", "g"} and worker.poll() is None, log_tails(fed, 3000)
    worker.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    assert worker.wait(30) == 0 and time.monotonic() - t0 < 30


@SHARED
def test_a_population_worker_trains_and_its_log_replies_are_accepted(link):
    rd = RunDir(link["root"] / "run2")
    state = rd.read_state()
    lines = metric_lines(rd, "expert")
    assert state.round == 5 and len(lines) == 10, lines
    for m in lines:  # each version: a log reply (no weights up), audited and accepted, made by the population
        assert m["accepted"] and m["evaluator"] == "population", m
        assert m["weights_bytes_up"] == 0 and m["log_bytes_up"], m
    assert not [x for m in metric_lines(rd, "round") for x in m["rejected"]]
    for e in range(2):
        assert state.expert(e).version == 5
        before, after = val_loss(rd, e, 0), val_loss(rd, e, 5)
        assert after < before, (e, before, after)


@SHARED
def test_a_gpu_sized_worker_takes_an_expert_over_and_its_logs_pass_the_audit(link):
    rd = RunDir(link["root"] / "run2")
    lines = metric_lines(rd, "expert")
    run_probes = {"directions": 4, "split_rows": True, "noise": "rademacher", "density": 1.0}
    assert {m["node"]: m["recipe"] for m in lines} == {"s": run_probes, "g": GPU_SIZED}
    moved = [e for e in range(2) if len({m["node"] for m in lines if m["expert"] == e}) == 2]
    assert moved, [(m["round"], m["expert"], m["node"]) for m in lines]
    text = (link["root"] / "g.log").read_text(errors="replace")
    assert "recipe (--recipe device:8): K=8 rademacher directions on the whole batch each" in text
    wait_until(lambda: not leftovers(rd.root), 30, f"no processes of the run left: {leftovers(rd.root)}")
