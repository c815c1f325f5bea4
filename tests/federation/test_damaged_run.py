"""Damaged run directories: a corrupt or missing last commit falls back to the one before and redoes
its round, and a run with nothing loadable, or a damaged config, prepare.json or state, refuses to start
with one `error:` line naming the file instead of a traceback.
"""

from __future__ import annotations

import logging

import pytest

from coordinator.loop import Coordinator
from soma_edge import checkpoint
from soma_edge.errors import CheckpointError
from soma_edge.wire import protocol
from tests.helpers.fakegrid import SHORT_ROUND, FakeGrid, cli, set_fed


@pytest.mark.parametrize("damage", ["truncated state", "garbage state", "missing state", "corrupt expert file"])
def test_corrupt_commit_falls_back_to_the_one_before(run, tmp_path, damage, caplog):
    set_fed(run, rounds=2, keep_versions=1, round_seconds=SHORT_ROUND)
    Coordinator(FakeGrid(tmp_path / "n1", ["a", "b"]), run).main()
    prev = checkpoint.load(run.prev_state_path, "run_state")
    assert prev["round"] == 1
    for x in prev["experts"].values():  # keep_versions = 1, yet the fallback's versions were kept
        assert (run.root / x["path"]).is_file()
    if damage == "truncated state":
        run.state_path.write_bytes(run.state_path.read_bytes()[:50])
    elif damage == "garbage state":
        run.state_path.write_bytes(b"\x00" * 400)
    elif damage == "missing state":
        run.state_path.unlink()
    else:
        p = run.root / run.read_state().expert(2).path
        p.write_bytes(p.read_bytes()[:-7] + b"corrupt")
    set_fed(run, rounds=3)
    with caplog.at_level(logging.WARNING, logger="soma.coord"):
        state = Coordinator(FakeGrid(tmp_path / "n2", ["a", "b"]), run).main()
    warned = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(warned) == 1 and "round 1" in warned[0], warned
    assert state.round == 3 and all(x.version == 3 for x in state.experts.values())
    assert [m["round"] for m in run.read_metrics() if m["type"] == "round"] == [1, 2, 3]  # round 2 redone once
    for x in state.experts.values():
        body = checkpoint.load(run.root / x.path, "expert")
        assert protocol.weights_sha256(body["weights"]) == x.sha256


def test_a_run_with_no_loadable_commit_refuses_to_start(run, tmp_path, capsys):
    from coordinator.cli import app as coord_app
    from soma_edge.cli import run as run_cli

    set_fed(run, rounds=2, round_seconds=SHORT_ROUND)
    Coordinator(FakeGrid(tmp_path / "n1", ["a", "b"]), run).main()
    for p in (run.state_path, run.prev_state_path):
        p.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="no committed state loads"):
        run.read_state()
    rc = run_cli(coord_app, ["start", "--run", str(run.root), "--rounds", "3"], prog="soma-coord")
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "no committed state loads" in lines[0]
    assert "Traceback" not in " ".join(lines)


@pytest.mark.parametrize(
    "name,damage,fragment",
    [
        ("run.toml", b"[model\nembed = ", "run.toml: invalid TOML"),
        ("run.toml", b"\xff\xfe", "run.toml: config is not UTF-8 text"),
        ("run.toml", b"[model]\nembed = -3\n", "model.embed must be >= 1"),
        ("prepare.json", b'{"experts": 4, "clus', "prepare.json: not valid JSON"),
        ("state.msgpack", b"", "no committed state loads"),
    ],
)
def test_start_on_a_damaged_run_says_what_in_one_line(run, tmp_path, capsys, name, damage, fragment):
    """Startup never ends in a traceback: each damaged file is one `error:` line naming it, exit 2."""
    set_fed(run, rounds=1)
    Coordinator(FakeGrid(tmp_path / "n1", ["a", "b"]), run).main()
    if name == "state.msgpack":
        run.prev_state_path.write_bytes(damage)
    (run.root / name).write_bytes(damage)
    code, _, err = cli(["start", "--run", str(run.root), "--rounds", "2"], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines
