"""make's set-up installs through uv with pip's package sources (tools/uv_install.py): what pip is configured
with, in its files or its PIP_* variables, is what uv is given."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("uv_install", ROOT / "tools" / "uv_install.py")
uv_install = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(uv_install)

CONFIG = """global.cert='/etc/ssl/ca.crt'
global.extra-index-url='file:///srv/a/simple file:///srv/b/simple'
global.find-links='/srv/wheels'
global.index-url='https://global.invalid/simple'
install.index-url='https://install.invalid/simple'
site.find-links='/ignored'
"""


def _uv_command(monkeypatch, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """What uv_install.main runs under pip's CONFIG and the PIP_* variables `env`."""
    for key in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CERT", "SSL_CERT_FILE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    ran = []

    def run(cmd, **kwargs):
        if cmd[1:] == ["-m", "pip", "config", "list"]:
            return SimpleNamespace(stdout=CONFIG, returncode=0)
        ran.append((cmd, kwargs["env"]))
        return SimpleNamespace(returncode=3)

    monkeypatch.setattr(subprocess, "run", run)
    assert uv_install.main(["-e", ".[dev,cpu]"]) == 3  # uv's status, for make to fall back on
    ((cmd, uv_env),) = ran
    return cmd, uv_env


def _flags(cmd: list[str], flag: str) -> list[str]:
    return [cmd[i + 1] for i, x in enumerate(cmd) if x == flag]


def test_uv_gets_pips_sources_from_its_config(monkeypatch):
    cmd, env = _uv_command(monkeypatch, {})
    assert cmd[1:3] == ["pip", "install"] and cmd[-2:] == ["-e", ".[dev,cpu]"]
    assert _flags(cmd, "--index-url") == ["https://install.invalid/simple"]  # install's section wins
    assert _flags(cmd, "--extra-index-url") == ["file:///srv/a/simple", "file:///srv/b/simple"]
    assert _flags(cmd, "--find-links") == ["/srv/wheels"]  # site's section is not pip's install config
    assert _flags(cmd, "--index-strategy") == ["unsafe-best-match"]  # pip's choice across sources
    assert env["SSL_CERT_FILE"] == "/etc/ssl/ca.crt"


def test_pips_variables_win_over_its_config(monkeypatch):
    cmd, env = _uv_command(
        monkeypatch, {"PIP_FIND_LINKS": "/env/wheels /env/more", "PIP_INDEX_URL": "https://env.invalid/simple"}
    )
    assert _flags(cmd, "--find-links") == ["/env/wheels", "/env/more"]
    assert _flags(cmd, "--index-url") == ["https://env.invalid/simple"]
    assert _flags(cmd, "--extra-index-url") == ["file:///srv/a/simple", "file:///srv/b/simple"]
