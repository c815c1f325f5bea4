"""Impossible config values give exit 2 and one `error:` line naming the field."""

import subprocess
import sys
from enum import Enum

import pytest

from soma_edge import config
from soma_edge.errors import ConfigError


def _worker(tmp_path, toml: str, *extra: str):
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(toml)
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", "train", "--config", str(cfg), "--steps", "1", *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "toml,field",
    [
        ("[spsa]\ndirections = -3\n", "spsa.directions"),
        ("[spsa]\neps = 0\n", "spsa.eps"),
        ("[model]\nhidden = 0\n", "model.hidden"),
        ('device = "warpdrive"\n', "device"),
        ("[spsa]\nwhat = 1\n", "spsa.what"),
        ('[spsa]\nlr = "fast"\n', "spsa.lr"),
        ("[spsa\n", "invalid TOML"),
        ("seed = 4294967296\n", "seed"),
        ("[spsa]\nlr = inf\n", "spsa.lr"),
        ("[federation]\nround_seconds = inf\n", "federation.round_seconds"),
        ("[spsa]\neps = nan\n", "spsa.eps"),
        ('[spsa]\ndecoder = "backprop"\n', "spsa.decoder"),
        ("[spsa]\ndensity = 0\n", "spsa.density"),
        ("[spsa]\ndensity = 1.5\n", "spsa.density"),
        ("[spsa]\nplateau_patience = 0\n", "spsa.plateau_patience"),
        ("[spsa]\nlr_floor = 0\n", "spsa.lr_floor"),
        ("[spsa]\nlr_floor = -1e-5\n", "spsa.lr_floor"),
        ('[spsa]\nupdate = "lion"\n', "spsa.update"),
        ("[spsa]\naccumulate = 0\n", "spsa.accumulate"),
        ("[spsa]\nbeta2 = 1\n", "spsa.beta2"),
        ('[model]\nkind = "transformer"\n', "model.kind"),
        ('[model]\nkind = "soma"\nembed = 16\nhidden = 32\n', "model.embed must equal model.hidden"),
        ('[model]\nseed_decoder = "spsa"\n', "model.seed_decoder"),
        ("[federation]\nseed_steps = -1\n", "federation.seed_steps"),
        ('[spsa]\nshaping = "softmax"\n', "spsa.shaping"),
        ("[spsa]\ndirections = 3\nsplit_rows = true\n", "spsa.split_rows"),
    ],
)
def test_bad_config_is_one_line_exit_2(tmp_path, toml, field):
    r = _worker(tmp_path, toml)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert field in lines[0]
    assert "Traceback" not in r.stderr


def test_out_that_is_a_folder_fails_before_training(tmp_path):
    r = _worker(tmp_path, "", "--out", str(tmp_path))
    assert r.returncode == 2 and r.stderr.startswith("error: --out") and "Traceback" not in r.stderr


def test_seed_flag_out_of_range(tmp_path):
    r = _worker(tmp_path, "", "--seed", str(2**32))
    assert r.returncode == 2 and r.stderr.startswith("error:") and "Traceback" not in r.stderr


def test_unknown_device_flag(tmp_path):
    r = _worker(tmp_path, "", "--device", "quantum:0")
    assert r.returncode == 2 and r.stderr.startswith("error: device:")


def test_config_roundtrip_and_coercion(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('seed = 3\ndevice = "cpu"\n[model]\nhidden = 64\nlayers = 2\n[spsa]\neps = 1\nlr = 2e-3\n')
    with pytest.raises(ConfigError, match="spsa.eps"):
        config.load(p)  # eps = 1 is coerced to float, then refused by the range check
    p.write_text('seed = 3\ndevice = "cpu"\n[model]\nhidden = 64\nlayers = 2\n[spsa]\nlr = 2e-3\nnoise = "gaussian"\n')
    cfg = config.load(p)
    assert (cfg.seed, cfg.model.hidden, cfg.model.layers, cfg.spsa.lr, cfg.spsa.noise) == (3, 64, 2, 2e-3, "gaussian")
    assert config.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("device", ["auto", "cpu", "CPU", "cuda", "cuda:1", "CPUExecutionProvider", "openvino"])
def test_device_names_parse(device):
    from soma_edge import devices

    devices.parse(device)  # a named EP lists only itself: tests/unit/test_device.py checks the providers


def test_cuda_request_without_gpu_fails_or_warns(caplog):
    """Asked for CUDA where ORT cannot run it: a DeviceError, or a session with a loud fallback warning."""
    import onnxruntime as ort

    from soma_edge.config import ModelConfig
    from soma_edge.engine.evaluator import LossEvaluator
    from soma_edge.errors import DeviceError

    try:
        ev = LossEvaluator(ModelConfig(embed=4, hidden=4), device="cuda:0")
    except DeviceError as e:
        assert "CUDAExecutionProvider" in str(e) or "cuda" in str(e)
        return
    if ev.providers[0] != "CUDAExecutionProvider":
        assert any("fell back" in r.message for r in caplog.records)
    else:
        assert "CUDAExecutionProvider" in ort.get_available_providers()


@pytest.mark.parametrize("name", ["demo.toml", "paper.toml"])
def test_shipped_example_configs_load(name):
    from pathlib import Path

    cfg = config.load(Path(__file__).resolve().parents[2] / "examples" / name)
    assert cfg.federation.experts == 4
    if name == "paper.toml":  # the paper's setting: its expert, a seed run, E frozen after it
        assert (cfg.model.kind, cfg.model.hidden, cfg.model.layers, cfg.model.seed_decoder) == ("soma", 32, 2, "frozen")
        assert cfg.federation.seed_steps > 0


def test_the_config_doc_lists_every_setting_with_its_default():
    """docs/CONFIG.md's "Every setting" table: one row per config key, each default the dataclasses' own."""
    import dataclasses
    import re
    import tomllib
    from pathlib import Path

    from soma_edge.config import Config

    text = (Path(__file__).resolve().parents[2] / "docs" / "CONFIG.md").read_text()
    section = text.split("## Every setting", 1)[1].split("\n\n", 2)[2].split("\n\n", 1)[0]
    rows = [re.match(r"\| `([\w.]+)` \| `(.+?)` \| (.+) \|$", line) for line in section.splitlines()[2:]]
    assert rows and all(rows), section
    documented = {m.group(1): tomllib.loads(f"v = {m.group(2)}")["v"] for m in rows}
    assert len(documented) == len(rows)  # no key twice
    cfg, expected = Config(), {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            expected |= {f"{f.name}.{g.name}": getattr(v, g.name) for g in dataclasses.fields(v)}
        else:
            expected[f.name] = v
    assert documented.keys() == expected.keys(), set(documented) ^ set(expected)
    for key, default in expected.items():
        default = default.value if isinstance(default, Enum) else default  # an enum setting is its string in TOML
        assert documented[key] == default and type(documented[key]) is type(default), (key, documented[key], default)


@pytest.mark.parametrize(
    "argv,rest,level",
    [
        (["status", "RUN", "--log-level", "debug"], ["status", "RUN"], "debug"),
        (["--log-level=warning", "stop", "RUN"], ["stop", "RUN"], "warning"),
        (["eval", "B", "--", "--log-level", "x"], ["eval", "B", "--", "--log-level", "x"], "info"),
        (["status", "RUN"], ["status", "RUN"], "info"),
    ],
)
def test_every_command_takes_log_level_anywhere(argv, rest, level):
    from soma_edge import cli

    cli._log_level[0] = "error"  # a level left over from an earlier call does not stick
    assert cli._take_log_level(argv) == rest and cli.log_level() == level


@pytest.mark.parametrize("argv", [["status", "--log-level"], ["status", "--log-level", "loud"]])
def test_a_bad_log_level_is_one_error_line(argv, capsys):
    from coordinator.cli import app
    from soma_edge import cli

    assert cli.run(app, argv, "soma-coord") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --log-level") and "\n" not in err


@pytest.mark.parametrize("federation", [True, False])
def test_train_names_the_section_it_does_not_read(federation, tmp_path, capsys, monkeypatch):
    """`soma-worker train` reads [model], [spsa] and [data]; a [federation] section (soma-coord start's) is
    one warning line, not silently nothing."""
    from soma_edge import cli
    from worker import cli as worker_cli

    class Stop(Exception):
        pass

    def stop():
        raise Stop  # the corpus comes next: the warning must be out by now

    monkeypatch.setattr(worker_cli.sources, "default_documents", stop)
    path = tmp_path / "my.toml"
    path.write_text("[model]\nhidden = 64\n" + ("[federation]\nexperts = 4\n" if federation else ""))
    with pytest.raises(Stop):
        cli.run(worker_cli.app, ["train", "--config", str(path), "--device", "cpu"], "soma-worker")
    err = capsys.readouterr().err
    if federation:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"warning: {path}: [federation]") and "ignored" in lines[0]
    else:
        assert err == ""


def test_the_soma_kind_takes_the_tied_decoder_lr_unless_one_is_set():
    from soma_edge.config import TIED_DECODER_LR, from_dict

    soma = {"model": {"kind": "soma", "embed": 32, "hidden": 32}}
    assert from_dict(soma).spsa.decoder_lr == TIED_DECODER_LR == 3e-3
    assert from_dict({**soma, "spsa": {"decoder_lr": 3e-2}}).spsa.decoder_lr == 3e-2
    assert from_dict({}).spsa.decoder_lr == 3e-2  # the lstm kind's head is untied
    assert from_dict(from_dict(soma).to_dict()).spsa.decoder_lr == 3e-3  # a resolved config keeps it


def test_the_soma_kind_takes_its_body_lr_unless_one_is_set():
    from soma_edge.config import SOMA_KIND_LR, Config, from_dict

    soma = {"model": {"kind": "soma", "embed": 32, "hidden": 32}}
    assert from_dict(soma).spsa.lr == SOMA_KIND_LR == 4e-3
    assert from_dict({**soma, "spsa": {"lr": 1e-3}}).spsa.lr == 1e-3
    assert from_dict({}).spsa.lr == Config().spsa.lr == 2e-3  # the lstm kind's
    assert from_dict(from_dict({**soma, "spsa": {"lr": 1e-3}}).to_dict()).spsa.lr == 1e-3  # a resolved config keeps it
