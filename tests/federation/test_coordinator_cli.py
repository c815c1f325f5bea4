"""The `soma-coord` command line, called in-process (no Flower processes): `app-path` gives a valid
Flower app, `status` reports the checkpoint, and `prepare`/`start` refuse what would corrupt a run (a new
identity, another corpus, re-preparing a trained run) with exit 2 and one `error:` line.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from coordinator.loop import Coordinator
from tests.helpers.fakegrid import FakeGrid, cli, hashes, set_fed


def test_app_path_is_a_valid_flower_app(capsys):
    import tomllib

    from flwr.common.config import validate_fields_in_config

    code, out, _ = cli(["app-path"], capsys)
    app_dir = Path(out.strip())
    assert code == 0 and app_dir.is_dir()
    cfg = tomllib.loads((app_dir / "pyproject.toml").read_text())
    ok, errors, _ = validate_fields_in_config(cfg)
    assert ok, errors
    comps = cfg["tool"]["flwr"]["app"]["components"]
    assert comps == {"serverapp": "coordinator.server_app:app", "clientapp": "worker.client_app:app"}
    assert cfg["tool"]["flwr"]["app"]["config"] == {"run-dir": "", "start": ""}


def test_status_prints_the_checkpoint_and_start_refuses_identity_changes(run, tmp_path, capsys):
    import json

    set_fed(run, rounds=1)
    Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main()
    code, out, _ = cli(["status", str(run.root), "--json"], capsys)
    s = json.loads(out)
    assert code == 0 and s["round"] == 1 and s["rounds"] == 1 and not s["running"]
    assert {e: x["version"] for e, x in s["experts"].items()} == {str(e): 1 for e in range(4)}
    code, out, _ = cli(["status", str(run.root)], capsys)
    assert code == 0 and run.read_state().expert(0).sha256[:12] in out
    # Resuming with another number of experts is the user's error: exit 2, one line, nothing started.
    code, _, err = cli(["start", "--run", str(run.root), "--experts", "3", "--port", "0"], capsys)
    assert (
        code == 2 and err.startswith("error: ") and "federation.experts" in err and len(err.strip().splitlines()) == 1
    )
    code, _, err = cli(["status", str(tmp_path / "nothing")], capsys)
    assert code == 2 and "no such run directory" in err
    (tmp_path / "prepared").mkdir()
    shutil.copy(run.prepare_json, tmp_path / "prepared")
    code, _, err = cli(["status", str(tmp_path / "prepared")], capsys)
    assert code == 2 and "no state.msgpack" in err


def test_prepare_refuses_a_trained_or_running_run_and_start_refuses_another_corpus(run, capsys):
    """Re-preparing would swap router and shards under trained experts; `start --corpus/--seed` on a run
    prepared otherwise would silently train on the prepared corpus."""
    from coordinator.prepare import prepare
    from coordinator.runconfig import ensure_prepared
    from soma_edge.errors import ConfigError

    prep = run.load_prepare()
    before = hashes(run.root, subdirs=("shards",))
    with run.lock():
        with pytest.raises(ConfigError, match="a coordinator is running on it"):
            prepare(prep["corpus"], 4, run.root, seed=1, progress=False)
    run.state_path.write_bytes(b"a committed round")
    code, _, err = cli(["prepare", prep["corpus"], "--experts", "4", "--out", str(run.root), "--seed", "1"], capsys)
    assert code == 2 and err.startswith("error: ") and "trained experts" in err and len(err.strip().splitlines()) == 1
    assert hashes(run.root, subdirs=("shards",)) == before  # router, shards, prepare.json untouched

    cfg = run.load_config()
    cfg.federation.corpus, cfg.seed = prep["corpus"], prep["seed"]
    ensure_prepared(run, cfg, {"federation.corpus", "seed"})  # the same corpus and seed: fine
    cfg.federation.corpus = "default"
    ensure_prepared(run, cfg)  # not given by the user (the config default): the prepared corpus is used
    with pytest.raises(ConfigError, match="prepared from corpus"):
        ensure_prepared(run, cfg, {"federation.corpus"})
    cfg.federation.corpus, cfg.seed = prep["corpus"], prep["seed"] + 1
    with pytest.raises(ConfigError, match="prepared with seed 0"):
        ensure_prepared(run, cfg, {"seed"})
    cfg.seed = prep["seed"]
    cfg.data.seq_len = prep["seq_len"] + 1  # windows longer than the held-out ones it was cut for
    with pytest.raises(ConfigError, match=f"prepared for data.seq_len <= {prep['seq_len']}"):
        ensure_prepared(run, cfg)
    cfg.data.seq_len = prep["seq_len"] // 2  # shorter ones fit: more of them
    ensure_prepared(run, cfg)
