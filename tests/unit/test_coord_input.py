"""soma-coord on bad input: a RUN that is not a run, a corrupt commit. One `error:` line and exit 2, or one
honest `warning:` line where the command can still do its job. No Flower processes: the run read here is
tests/fixtures/old_run (2 rounds, both commits on disk)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from coordinator.cli import app
from soma_edge.cli import run as run_cli

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ROUND_VAL = {1: 3.5852337806325907, 2: 3.5365609399789117}  # old_run's mixture val loss by round (metrics.jsonl)


@pytest.fixture
def old_run(tmp_path) -> Path:
    dest = tmp_path / "old_run"
    shutil.copytree(FIXTURES / "old_run", dest)
    return dest


def cli(argv: list, capsys) -> tuple[int, str, str]:
    rc = run_cli(app, [str(a) for a in argv], prog="soma-coord")
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(err: str, prefix: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0]


@pytest.mark.parametrize("command", [["workers"], ["status"], ["status", "--watch"], ["report"], ["stop"]])
@pytest.mark.parametrize("what", ["missing", "file", "empty"])
def test_a_run_argument_that_is_no_run_is_refused(command, what, tmp_path, capsys):
    path = tmp_path / "nowhere"
    if what == "file":
        path.write_text("not a run")
    elif what == "empty":
        path.mkdir()
    rc, out, err = cli([command[0], path, *command[1:]], capsys)
    assert rc == 2 and out == ""
    line = one_line(err, "error: ")
    assert str(path) in line
    assert {"missing": "no such run directory", "file": "not a directory", "empty": "not a run directory"}[what] in line
    assert not (tmp_path / "nowhere" / "workers.json").exists()


def test_workers_reads_a_run_that_only_has_keys_and_one_that_never_had_any(old_run, tmp_path, capsys):
    rc, out, err = cli(["workers", old_run], capsys)  # a trained run with no registered keys: honest zero
    assert rc == 0 and err == "" and "0 worker key(s)" in out
    keys = tmp_path / "keys-first"
    keys.mkdir()
    (keys / "workers.json").write_text("[]")  # `add-worker` before the first start leaves only this
    assert cli(["workers", keys], capsys)[0] == 0
    preparing = tmp_path / "preparing"
    preparing.mkdir()
    (preparing / "run.lock").touch()  # a first start, still preparing: `status --watch` may follow it
    assert cli(["workers", preparing], capsys)[0] == 0


def test_status_of_a_corrupt_commit_shows_the_one_before_whole_and_says_so(old_run, capsys):
    rc, out, err = cli(["status", old_run, "--json"], capsys)
    assert rc == 0 and err == ""
    good = json.loads(out)
    assert good["round"] == 2 and good["mixture_val_loss"] == pytest.approx(ROUND_VAL[2])

    state = old_run / "state.msgpack"
    state.write_bytes(state.read_bytes()[:300])  # a torn write
    rc, out, err = cli(["status", old_run, "--json"], capsys)
    assert rc == 0
    line = one_line(err, "warning: ")
    assert str(state) in line and "state.prev.msgpack" in line and "round 1" in line
    s = json.loads(out)
    assert s["round"] == 1 and s["mixture_val_loss"] == pytest.approx(ROUND_VAL[1])  # round and numbers agree
    assert {e: (x["version"], x["last_round"]) for e, x in s["experts"].items()} == {"0": (1, 1), "1": (1, 1)}
    rc, out, err = cli(["status", old_run], capsys)
    assert rc == 0 and "round 1/2, routed val 3.5852" in out
    one_line(err, "warning: ")

    rc, out, err = cli(["workers", old_run], capsys)  # its strikes come from the same commit, and it says so
    assert rc == 0 and "state.prev.msgpack" in one_line(err, "warning: ")

    state.unlink()  # a crash between moving the commit aside and writing the new one
    rc, out, err = cli(["status", old_run, "--json"], capsys)
    assert rc == 0 and json.loads(out)["round"] == 1 and "missing" in one_line(err, "warning: ")

    (old_run / "state.prev.msgpack").write_bytes(b"\x00" * 40)
    state.write_bytes(b"")
    rc, out, err = cli(["status", old_run], capsys)
    assert rc == 2 and out == ""
    assert "no committed state loads" in one_line(err, "error: ")


@pytest.mark.parametrize("why", ["corpus", "config"])
def test_a_failed_first_start_leaves_no_run_directory_behind(why, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.toml").write_text("[spsa]\neps = 0\n")
    bad = ["--corpus", tmp_path / "no-corpus"] if why == "corpus" else ["--config", "bad.toml"]
    rc, _, err = cli(["start", "--run", "runs/new/run", *bad, "--port", "0"], capsys)
    assert rc == 2
    one_line(err, "error: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.toml"]  # runs/new/run, and runs/ that it made

    (tmp_path / "runs" / "mine").mkdir(parents=True)  # folders that were there before start stay
    rc, _, err = cli(["start", "--run", "runs/mine", *bad, "--port", "0"], capsys)
    assert rc == 2 and (tmp_path / "runs" / "mine").is_dir()
    rc, _, err = cli(["start", "--run", "runs/mine/run", *bad, "--port", "0"], capsys)
    assert rc == 2 and [p.name for p in (tmp_path / "runs").iterdir()] == ["mine"]
    assert list((tmp_path / "runs" / "mine").iterdir()) == []


def test_a_run_with_a_commit_is_never_removed(old_run):
    from coordinator.start import first_missing, remove_made
    from soma_edge.rundir.layout import RunDir

    assert first_missing(old_run) is None and first_missing(old_run / "a" / "b") == old_run / "a"
    before = sorted(p.relative_to(old_run) for p in old_run.rglob("*"))
    remove_made(RunDir(old_run), old_run)  # even if start had believed it made the folder
    assert sorted(p.relative_to(old_run) for p in old_run.rglob("*")) == before


def test_reopen_refuses_a_path_with_no_run_and_reopens_a_committed_runs_finished_experts(old_run, tmp_path, capsys):
    from coordinator.start import reopen_finished
    from soma_edge.rundir.layout import RunDir

    nowhere = tmp_path / "nowhere"
    rc, out, err = cli(["start", "--run", nowhere, "--reopen", "--port", 0], capsys)
    assert rc == 2 and "--reopen" in one_line(err, "error: ") and not nowhere.exists()
    rd = RunDir(old_run)
    assert reopen_finished(rd) == [] and "no expert is finished" in capsys.readouterr().out
    state = rd.read_state()
    state.expert(1).finished, state.expert(1).stale = "patience: 6 versions without a gain", 6
    rd.save_state(state.to_dict())
    assert reopen_finished(rd) == [1]
    again = rd.read_state().expert(1)
    assert (
        again.finished is None and again.stale == 0 and "reopened 1 finished expert(s): [1]" in capsys.readouterr().out
    )


def test_an_old_runs_config_keeps_the_recipe_it_was_saved_with(old_run):
    """old_run's run.toml predates spsa.split_rows, shaping and decoder_from: resuming it keeps the recipe it
    trained with (config.SAVED_WITHOUT), whatever today's defaults are; a new config file takes the defaults."""
    from soma_edge import config as config_mod
    from soma_edge.rundir.layout import RunDir

    assert "decoder_from" not in (old_run / "run.toml").read_text()
    spsa = RunDir(old_run).load_config().spsa
    assert (spsa.split_rows, spsa.shaping, spsa.decoder_from) == (False, "none", "clean")
    fresh = config_mod.load(old_run / "run.toml").spsa
    default = config_mod.Config().spsa
    assert (fresh.split_rows, fresh.shaping, fresh.decoder_from) == (
        default.split_rows,
        default.shaping,
        default.decoder_from,
    )
