"""The typed records of a run directory (soma_edge.rundir, soma_edge.rundir.metrics) read and write the very bytes
that the coordinator wrote before them (tests/fixtures/old_run), read lines that lack the keys a later
version added, and refuse one that lacks a required key with an error naming the file and the key."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from soma_edge import checkpoint, codec
from soma_edge.errors import CheckpointError
from soma_edge.rundir import metrics
from soma_edge.rundir.layout import RunDir
from soma_edge.rundir.metrics import ExpertLine, RoundLine, Status
from soma_edge.rundir.state import STATE_KIND, PrepareSummary, RunState

OLD_RUN = Path(__file__).resolve().parents[1] / "fixtures" / "old_run"


def _metrics_lines() -> list[str]:
    return (OLD_RUN / "metrics.jsonl").read_text().splitlines()


def _fresh(rec):
    """The same record as a writer makes it in code: no memory of the dict it was read from."""
    return dataclasses.replace(rec, read_order=(), unknown={})


@pytest.mark.parametrize("i", range(len(_metrics_lines())))
def test_every_old_metrics_line_round_trips_to_the_same_bytes(i):
    text = _metrics_lines()[i]
    rec = metrics.line(json.loads(text), f"metrics.jsonl: line {i + 1}")
    assert isinstance(rec, (ExpertLine, RoundLine))
    assert json.dumps(rec.to_dict()) == text
    assert json.dumps(_fresh(rec).to_dict()) == text  # the canonical key order is today's writers' order


def test_old_status_round_trips_to_the_same_bytes():
    text = (OLD_RUN / "status.json").read_text()
    st = Status.from_dict(json.loads(text), "status.json")
    assert (st.phase, st.round, st.rounds) == ("done", 2, 2)
    assert st.experts["1"].best.version == 1 and st.nodes["1000"].name == "a"
    assert json.dumps(st.to_dict()) == text
    assert json.dumps(_fresh(st).to_dict()) == text


@pytest.mark.parametrize("name", ["state.msgpack", "state.prev.msgpack"])
def test_old_state_round_trips_to_the_same_bytes(name):
    path = OLD_RUN / name
    rd = RunDir(OLD_RUN)
    state = rd.read_state_file(path)
    assert state.expert_ids() == [0, 1] and state.expert(0).sha256 == state.experts["0"].sha256
    payload = path.read_bytes()[len(checkpoint.MAGIC) + 32 :]  # the checksummed file's msgpack
    assert codec.encode(state.to_dict(), STATE_KIND) == payload
    fresh = dataclasses.replace(_fresh(state), experts={e: _fresh(x) for e, x in state.experts.items()})
    assert codec.encode(fresh.to_dict(), STATE_KIND) == payload


def test_old_prepare_round_trips_to_the_same_bytes_and_gives_shards():
    text = (OLD_RUN / "prepare.json").read_text()
    prep = RunDir(OLD_RUN).read_prepare()
    assert json.dumps(prep.to_dict(), indent=1) + "\n" == text
    assert json.dumps(_fresh(prep).to_dict(), indent=1) + "\n" == text
    raw = json.loads(text)
    for c in raw["clusters"]:
        for split, sha in c["shards"].items():
            assert sha in prep.shards(c["expert"], split)
            assert (OLD_RUN / "shards" / f"{sha}.bin").exists()


def test_read_state_and_read_lines_of_the_old_run():
    rd = RunDir(OLD_RUN)
    assert rd.read_state().to_dict() == checkpoint.load(rd.state_path, STATE_KIND)
    lines = metrics.read_lines(rd)
    assert [type(m) for m in lines] == [ExpertLine, ExpertLine, RoundLine] * 2
    assert metrics.read_status(rd).to_dict() == rd.read_status()


def test_the_readers_leave_out_a_damaged_line_or_status_instead_of_failing(tmp_path):
    """A log is never a reason to fail: `soma-coord start` reads these every second while the run goes on."""
    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    good = _metrics_lines()
    broken = json.loads(good[0])
    del broken["expert"]
    rd.metrics_path.write_text("".join(x + "\n" for x in [good[0], json.dumps(broken), *good[1:]]))
    assert len(metrics.read_lines(rd)) == len(good)
    rd.status_path.write_text(json.dumps({"round": 2}))  # no phase
    assert metrics.read_status(rd) is None


def test_a_round_line_without_next_round_ahead_reads_and_writes_back_without_it():
    d = json.loads(_metrics_lines()[2])
    del d["next_round_ahead"]
    rec = RoundLine.from_dict(d, "metrics.jsonl: line 3")
    assert rec.next_round_ahead is False and rec.mixture_val_loss == d["mixture_val_loss"]
    assert json.dumps(rec.to_dict()) == json.dumps(d)


def test_an_expert_line_without_later_keys_reads():
    d = json.loads(_metrics_lines()[0])
    for k in ("step", "lr", "eps", "log_bytes_up", "opt_bytes_up", "lr_scale", "next_lr_scale", "best_version"):
        del d[k]
    rec = ExpertLine.from_dict(d, "metrics.jsonl: line 1")
    assert (rec.step, rec.lr, rec.eps, rec.lr_scale) == (None, None, None, 1.0)
    assert json.dumps(rec.to_dict()) == json.dumps(d)


def test_an_unknown_key_is_kept_in_place():
    d = json.loads(_metrics_lines()[2])
    d = {**dict(list(d.items())[:3]), "from_the_future": [1, 2], **dict(list(d.items())[3:])}
    assert json.dumps(RoundLine.from_dict(d, "x").to_dict()) == json.dumps(d)


def test_an_old_expert_record_without_best_reads():
    state = RunState.from_dict({"round": 4, "experts": {"0": {"version": 1, "sha256": "ab", "path": "p"}}}, "s")
    x = state.expert(0)
    assert x.best is None and x.step == 0 and x.lr_scale == 1.0
    assert state.to_dict() == {"round": 4, "experts": {"0": {"version": 1, "sha256": "ab", "path": "p"}}}


@pytest.mark.parametrize(
    "make,fragments",
    [
        (
            lambda: RoundLine.from_dict({"type": "round", "rounds": 2}, "RUN/metrics.jsonl: line 3"),
            ["RUN/metrics.jsonl: line 3", "missing key 'round'"],
        ),
        (
            lambda: metrics.line({"type": "expert", "round": 1, "expert": 0, "version": 1, "sha256": "x"}, "m: 1"),
            ["m: 1", "missing key 'accepted'"],
        ),
        (
            lambda: RunState.from_dict(
                {"round": 1, "experts": {"0": {"version": 1, "path": "p"}}}, "RUN/state.msgpack"
            ),
            ["RUN/state.msgpack: experts['0']", "missing key 'sha256'"],
        ),
        (
            lambda: PrepareSummary.from_dict({"experts": 2, "clusters": [{"id": 0, "expert": 0}]}, "RUN/prepare.json"),
            ["RUN/prepare.json: clusters[0]", "missing key 'shards'"],
        ),
        (lambda: Status.from_dict({"round": 1}, "RUN/status.json"), ["RUN/status.json", "missing key 'phase'"]),
    ],
)
def test_a_missing_required_key_is_one_clear_error(make, fragments):
    with pytest.raises(CheckpointError) as err:
        make()
    msg = str(err.value)
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, msg


def test_a_prepare_json_without_a_required_key_names_the_file(tmp_path):
    rd = RunDir(tmp_path)
    rd.prepare_json.write_text(json.dumps({"experts": 2}))
    with pytest.raises(CheckpointError, match=r"prepare\.json: missing key 'clusters'"):
        rd.read_prepare()
