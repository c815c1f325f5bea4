"""Wheels of what this environment has installed, for a test of bench/gpu_kit.py that has no network.

`repack(["flwr", "tensorboardX"], out)` writes one wheel per distribution in their dependency closure (but
`skip`), made of the files each one installed under site-packages (its RECORD) and its .dist-info, with the
tag its WHEEL file names: what the kit would download for this interpreter. Console scripts come back from
entry_points.txt when the wheel is installed; files installed outside site-packages (a bin/ of their own,
such as uv's binary) are left out.
"""

from __future__ import annotations

import importlib.metadata as md
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

from bench.gpu_kit import normalized


def closure(names: list[str], skip: tuple[str, ...] = ("numpy",)) -> list[md.Distribution]:
    """The installed distributions `names` need, themselves included (markers evaluated here, no extras)."""
    env, seen, todo = {**default_environment(), "extra": ""}, {}, list(names)
    while todo:
        name = todo.pop()
        if normalized(name) in seen or normalized(name) in map(normalized, skip):
            continue
        dist = md.distribution(name)
        seen[normalized(name)] = dist
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return [seen[k] for k in sorted(seen)]


def _tag(wheel_file: str) -> str:
    """The file-name tag of a WHEEL file's Tag lines, compressed as wheel names write them (py2.py3-none-any)."""
    tags = [line.split(":", 1)[1].strip().split("-") for line in wheel_file.splitlines() if line.startswith("Tag:")]
    return "-".join(".".join(sorted({t[i] for t in tags})) for i in range(3))


def repack(names: list[str], out: Path, skip: tuple[str, ...] = ("numpy",)) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    wheels = []
    for dist in closure(names, skip):
        site = Path(dist.locate_file(""))
        files = [f for f in dist.files or [] if not str(f).startswith("..") and "__pycache__" not in str(f)]
        tag = _tag(dist.read_text("WHEEL"))
        name = dist.metadata["Name"].replace("-", "_")
        info = next(str(f).split("/")[0] for f in files if str(f).endswith(".dist-info/METADATA"))
        path = out / f"{name}-{dist.version}-{tag}.whl"
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
            for f in files:
                if str(f) != f"{info}/RECORD" and (site / f).is_file():
                    z.write(site / f, str(f))
            z.writestr(
                f"{info}/RECORD",
                "".join(f"{f},,\n" for f in files if str(f) != f"{info}/RECORD") + f"{info}/RECORD,,\n",
            )
        wheels.append(path)
    return wheels
