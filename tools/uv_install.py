"""`uv pip install ARGS` into this Python's environment, from the package sources pip is configured with.

make's set-up installs through uv, which fetches and unpacks in parallel (the dev install: ~20 s where pip
took ~70 s). uv does not read pip's configuration, so this hands it pip's: index-url, extra-index-url and
find-links from `pip config list` (the global and install sections) and the PIP_* variables, which win as
they do in pip, and pip's cert as SSL_CERT_FILE. `--index-strategy unsafe-best-match` picks a version
across all sources as pip does (torch 2.13.0+cpu from find-links ranks above the index's 2.13.0). Exits
with uv's status; make falls back to pip if it fails.

    python tools/uv_install.py -e '.[dev,cpu]'
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links"}


def pip_settings() -> dict[str, str]:
    """pip's effective value of each key in FLAGS, and of cert."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    found: dict[str, str] = {}
    for section in ("global", "install"):  # install's keys override global's, as in pip
        for line in out.splitlines():
            name, _, value = line.partition("=")
            where, _, key = name.partition(".")
            if where == section and (key in FLAGS or key == "cert"):
                found[key] = ast.literal_eval(value)  # pip prints each value as a Python literal
    for key in (*FLAGS, "cert"):
        env = os.environ.get("PIP_" + key.upper().replace("-", "_"))
        if env:
            found[key] = env
    return found


def main(args: list[str]) -> int:
    settings = pip_settings()
    cmd = [str(Path(sys.executable).with_name("uv")), "pip", "install", "--quiet", "--compile-bytecode"]
    cmd += ["--python", sys.executable, "--index-strategy", "unsafe-best-match"]
    for key, flag in FLAGS.items():
        for value in settings.get(key, "").split():
            cmd += [flag, value]
    env = dict(os.environ)
    if "cert" in settings:
        env.setdefault("SSL_CERT_FILE", settings["cert"])
    return subprocess.run(cmd + args, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
