"""Carry onnxruntime-gpu and Flower to an offline GPU box in chunks, install them there beside torch's CUDA,
and run bench.gpu_check with them.

The box (x86_64 Linux, Python 3.12, a CUDA 13 torch with NVIDIA's CUDA 13 and cuDNN 9 wheels, the CPU
onnxruntime) lacks onnxruntime-gpu, tomli_w and flwr (with most of its dependencies) and has no network, and
a command sent to it carries at most about 58 MiB beside the checkout, while the onnxruntime-gpu wheel is 244
MiB. The procedure, from the repository root each time:

1. On a box that reaches the package registry:

       python -m bench.gpu_kit prepare [--out .gpukit] [--chunk-mib 50] [--wheels DIR] [--no-flower]

   downloads the cp312 manylinux x86_64 wheels the GPU box lacks (onnxruntime-gpu at the pin of
   pyproject.toml's `cuda` extra, without its nvidia-* extras since torch brings CUDA 13 and cuDNN 9;
   tomli_w; and, unless --no-flower, flwr at the project's pin and tensorboardX with their dependencies,
   but numpy, which torch brought: what `soma-coord start` needs there), or takes the wheels in DIR,
   packs them into one uncompressed tar, cuts it into .gpukit/kit-01.part, kit-02.part, ... of at most
   50 MiB beside .gpukit/manifest.json (every chunk's and wheel's bytes and sha256), and prints the upload
   plan.
2. Upload i of n carries .gpukit/kit-0i.part (the first also .gpukit/manifest.json); after each, on the box:

       python3 -m bench.gpu_kit receive [--kit .gpukit] [--stage /tmp/soma-gpu-kit]

   checks the chunks that came against the manifest and copies them to the stage, where the earlier ones
   wait (a carried file does not outlive the next upload), and prints which have arrived and which not.
3. After the last receive:

       python3 -m bench.gpu_kit finish [--stage ...] [--target /tmp/soma-gpu-site] [--no-check] [-- ARGS]

   reassembles the tar, checks every chunk's and wheel's sum, installs the wheels into --target (pip
   --no-index --no-deps; unpacked by hand where the interpreter has no pip), checks the imports in the
   kit's environment (PYTHONPATH: the target first; PATH: its bin/ first, where flower-superlink and
   flower-supernode are; LD_LIBRARY_PATH: every nvidia/cu13/lib and nvidia/cudnn/lib on sys.path first), and
   runs `python -m bench.gpu_check ARGS` (default --device
   cuda:0) there, exiting with its status; --no-check stops after the import check (exit 1 if one fails).
   `python3 -m bench.gpu_kit env [--target ...]` prints that environment as export lines, for commands
   typed by hand.

Only the standard library is imported: on the box this runs before anything it installs. An error is one
line, `error: ...`, on stderr, and exit 2.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = 1
MANIFEST = "manifest.json"
MIB = 1 << 20
KIT, STAGE, TARGET = Path(".gpukit"), Path("/tmp/soma-gpu-kit"), Path("/tmp/soma-gpu-site")
# pip download asks for the box's interpreter and platform, not this one's: any manylinux x86_64 it accepts.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# pyproject asks tomli-w>=1.0; the kit pins what pip found when this was written, so that each kit (and the
# upload plan in docs/BENCHMARKS.md) comes out the same.
TOMLI_W = "tomli-w==1.2.0"
# What `soma-coord start` needs on the box besides them, with their dependencies (pyproject's pins): Flower, and
# tensorboardX for the run's event files. Not numpy: torch brought it, and a second one would shadow it.
FLOWER = ("flwr", "tensorboardX")
BOX_HAS = ("numpy",)
# torch's CUDA 13 wheel puts the CUDA libraries in nvidia/cu13/lib and cuDNN in nvidia/cudnn/lib, the folders
# onnxruntime-gpu 1.31's preload_dlls reads; installed apart from torch, ORT finds them on LD_LIBRARY_PATH.
CUDA_LIBS = (("nvidia", "cu13", "lib"), ("nvidia", "cudnn", "lib"))
DEFAULT_CHECK = ["--device", "cuda:0"]


class KitError(Exception):
    """What the user can act on: main prints it as one `error:` line and exits 2."""


@dataclass(frozen=True)
class FileRecord:
    """A chunk or a wheel as the manifest knows it."""

    name: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    chunks: list[FileRecord]  # in stream order
    wheels: list[FileRecord]  # the tar's members
    total: int  # bytes of the stream, the chunks together
    schema: int = SCHEMA

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def load(cls, path: Path) -> Manifest:
        if not path.is_file():
            raise KitError(f"no {path}: it travels with kit-01.part; upload it and run receive")
        try:
            d = json.loads(path.read_text())
            if d.get("schema") != SCHEMA:
                raise KitError(f"{path}: schema {d.get('schema')!r}, and this gpu_kit reads {SCHEMA}")
            m = cls([FileRecord(**c) for c in d["chunks"]], [FileRecord(**w) for w in d["wheels"]], d["total"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise KitError(f"{path}: not a kit manifest ({e})") from None
        # Its names become file names in the stage: a path in one would write elsewhere.
        for r in m.chunks + m.wheels:
            if Path(r.name).name != r.name or r.name in ("", ".", ".."):
                raise KitError(f"{path}: {r.name!r} is not a plain file name")
        return m


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB" if n >= MIB // 10 else f"{n:,} bytes"


# --- prepare: on a box with the registry ---------------------------------------------------------------------
def pins(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """What the box lacks: onnxruntime-gpu at the `cuda` extra's pin (its [cuda,cudnn] extras dropped), tomli_w."""
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["cuda"]
    for req in extra:
        m = re.fullmatch(r"\s*onnxruntime-gpu\s*(\[[^]]*\])?\s*==\s*([\w.+!-]+)\s*", req)
        if m:
            return [f"onnxruntime-gpu=={m.group(2)}", TOMLI_W]
    raise KitError(f"{pyproject}: the cuda extra pins no onnxruntime-gpu==VERSION ({extra})")


def flower_pins(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The project's requirements of FLOWER, as pyproject.toml pins them."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    out = [d.replace(" ", "") for d in deps if re.split(r"[\s=<>~!\[;]", d.strip(), maxsplit=1)[0] in FLOWER]
    if len(out) != len(FLOWER):
        raise KitError(f"{pyproject}: the dependencies name {out}, not each of {', '.join(FLOWER)}")
    return out


def download_command(pin: str, dest: Path, deps: bool = False) -> list[str]:
    """--no-deps (but for Flower's): the nvidia-* wheels onnxruntime-gpu asks for are torch's on the box already."""
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    flags = "--only-binary=:all: --python-version 3.12 --implementation cp".split() + ([] if deps else ["--no-deps"])
    return [sys.executable, "-m", "pip", "download", *flags, *platforms, "-d", str(dest), pin]


def normalized(name: str) -> str:
    """A distribution's name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def dist_name(wheel: Path) -> str:
    """A wheel's distribution name, normalized: its file name up to the first dash."""
    return normalized(wheel.name.split("-", 1)[0])


def download(dest: Path, flower: bool = True) -> Path:
    todo = [(p, True) for p in flower_pins()] if flower else []
    for pin, deps in todo + [(p, False) for p in pins()]:
        print(f"downloading {pin}{' and its dependencies' if deps else ''} (cp312, manylinux x86_64) ...", flush=True)
        r = subprocess.run(download_command(pin, dest, deps), capture_output=True, text=True)
        if r.returncode:
            last = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[-1]
            raise KitError(f"pip download {pin} failed: {last}")
    pinned = dict((normalized(name), version) for name, version in (p.split("==") for p in pins()))
    for w in dest.glob("*.whl"):
        name, version = dist_name(w), w.name.split("-")[1]
        # Not what the box has; and one version of each pinned wheel (Flower's dependencies ask tomli-w too).
        if name in BOX_HAS or (name in pinned and version != pinned[name]):
            w.unlink()
    return dest


def pack(wheels: list[Path], out: Path, chunk_bytes: int) -> Manifest:
    """The wheels in one uncompressed tar (they are compressed already), cut into kit-01.part, kit-02.part, ..."""
    records = [FileRecord(w.name, w.stat().st_size, sha256_of(w)) for w in wheels]
    chunks = []
    with tempfile.TemporaryFile() as stream:
        # Fixed owners and times: the same wheels give the same chunks. PAX: a manylinux wheel's name can pass
        # USTAR's 100 characters (charset_normalizer's, one of Flower's dependencies, does).
        with tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for w in wheels:
                info = tarfile.TarInfo(w.name)
                info.size, info.mode, info.mtime = w.stat().st_size, 0o644, 0
                with open(w, "rb") as f:
                    tar.addfile(info, f)
        stream.seek(0)
        while block := stream.read(chunk_bytes):
            name = f"kit-{len(chunks) + 1:02d}.part"
            (out / name).write_bytes(block)
            chunks.append(FileRecord(name, len(block), hashlib.sha256(block).hexdigest()))
    return Manifest(chunks, records, sum(c.bytes for c in chunks))


def prepare(out: Path, chunk_bytes: int, wheels_dir: Path | None, flower: bool = True) -> Manifest:
    if chunk_bytes <= 0:
        raise KitError("the chunk size must be positive")
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("kit-*.part"), out / MANIFEST]:  # an earlier kit's, which this one may not overwrite
        old.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpukit-") as tmp:
        source = wheels_dir if wheels_dir is not None else download(Path(tmp), flower)
        wheels = sorted(source.glob("*.whl"))
        if not wheels:
            raise KitError(f"no wheels in {source}")
        manifest = pack(wheels, out, chunk_bytes)
    (out / MANIFEST).write_text(manifest.to_json())
    return manifest


def plan(m: Manifest, out: Path, chunk_bytes: int) -> list[str]:
    """The uploads, one line each: what it carries and what to run on the box after it."""
    receive = "python3 -m bench.gpu_kit receive" + ("" if out == KIT else f" --kit {shlex.quote(str(out))}")
    wheels = ", ".join(f"{w.name} ({mib(w.bytes)})" for w in m.wheels)
    lines = [f"kit: {wheels}; {mib(m.total)} in {len(m.chunks)} chunks of at most {mib(chunk_bytes)} in {out}"]
    for i, c in enumerate(m.chunks, 1):
        carry = ([str(out / MANIFEST)] if i == 1 else []) + [str(out / c.name)]
        then = receive + (" && python3 -m bench.gpu_kit finish -- --device cuda:0" if i == len(m.chunks) else "")
        lines.append(f"upload {i} of {len(m.chunks)}: {' '.join(carry)} ({mib(c.bytes)}); on the box: {then}")
    return lines


# --- receive: on the GPU box, after each upload ----------------------------------------------------------------
def damage(path: Path, record: FileRecord) -> str | None:
    """Why the file is not the manifest's, or None."""
    if not path.is_file():
        return f"{record.name}: missing"
    size = path.stat().st_size
    if size != record.bytes:
        return f"{record.name}: {size} bytes, the manifest says {record.bytes} (cut short in transit?)"
    if sha256_of(path) != record.sha256:
        return f"{record.name}: its sha256 differs from the manifest's (damaged in transit)"
    return None


def _staged_manifest(kit: Path, stage: Path) -> Manifest:
    """The first upload's manifest goes to the stage; a different one starts a new kit there."""
    came, staged = kit / MANIFEST, stage / MANIFEST
    if came.is_file():
        Manifest.load(came)
        if not staged.is_file() or came.read_bytes() != staged.read_bytes():
            for old in stage.glob("kit-*.part"):  # another kit's chunks, which would never check out
                old.unlink()
            shutil.copyfile(came, staged)
    return Manifest.load(staged)


def receive(kit: Path, stage: Path) -> str:
    stage.mkdir(parents=True, exist_ok=True)
    m = _staged_manifest(kit, stage)
    expected = {c.name: c for c in m.chunks}
    came = sorted(kit.glob("kit-*.part")) if kit.is_dir() else []
    stray = [p.name for p in came if p.name not in expected]
    if stray:
        raise KitError(f"{', '.join(stray)} in {kit}: not in the manifest (a chunk of another kit?)")
    bad = []
    for p in came:
        why = damage(p, expected[p.name])
        if why:
            bad.append(why)
        elif not (stage / p.name).is_file() or damage(stage / p.name, expected[p.name]):
            # Copied, not moved: the kit stays whole where it was made (a rehearsal must not eat it). The stage
            # outlives the upload; a damaged chunk never gets there.
            shutil.copyfile(p, stage / p.name)
    if bad:
        raise KitError("; ".join(bad) + ": upload it again and run receive (the others were staged)")
    here = [c.name for c in m.chunks if (stage / c.name).is_file()]
    missing = [c.name for c in m.chunks if c.name not in here]
    got = f"received {', '.join(p.name for p in came) or 'no chunk'}; {len(here)} of {len(m.chunks)} in {stage}"
    if missing:
        return f"{got}; missing: {', '.join(missing)}"
    return f"{got}; all here: run python3 -m bench.gpu_kit finish"


# --- finish: reassemble, install, check ------------------------------------------------------------------------
def reassemble(stage: Path, m: Manifest) -> list[Path]:
    """The wheels out of the staged chunks, every sum checked; their paths in stage/wheels."""
    missing = [c.name for c in m.chunks if not (stage / c.name).is_file()]
    if missing:
        here = f"{len(m.chunks) - len(missing)} of {len(m.chunks)} here"
        raise KitError(f"{', '.join(missing)} missing from {stage} ({here}): upload and receive each")
    for c in m.chunks:
        why = damage(stage / c.name, c)
        if why:
            raise KitError(f"{why} in {stage}: upload it again and run receive")
    joined, out = stage / "kit.tar", stage / "wheels"
    with open(joined, "wb") as f:
        for c in m.chunks:
            with open(stage / c.name, "rb") as part:
                shutil.copyfileobj(part, f, 1 << 20)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    wanted = {w.name: w for w in m.wheels}
    with tarfile.open(joined, "r:") as tar:
        for member in tar:
            # Only the manifest's wheels, written under names of our choosing: no path in the tar is trusted.
            if member.isfile() and member.name in wanted:
                with tar.extractfile(member) as src, open(out / member.name, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
    joined.unlink()
    for w in m.wheels:
        why = damage(out / w.name, w)
        if why:
            raise KitError(f"wheel {why} in the reassembled chunks")
    return [out / w.name for w in m.wheels]


def unpack_wheel(wheel: Path, target: Path) -> None:
    """What `pip install --target` does with a wheel, for an interpreter without pip: its files into the
    target, NAME.data/purelib and platlib too (scripts, headers and data are not needed to import it), and
    its console scripts into target/bin (`flower-superlink`, ...)."""
    with zipfile.ZipFile(wheel) as z:
        entry_points = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/entry_points.txt")]
        for name in entry_points:
            console_scripts(z.read(name).decode(), target / "bin")
        for info in z.infolist():
            parts = info.filename.split("/")
            if info.filename.startswith("/") or ".." in parts:
                raise KitError(f"{wheel.name}: {info.filename!r} points outside the target")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            if info.is_dir():
                continue
            dest = target.joinpath(*parts)
            dest.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            if (info.external_attr >> 16) & 0o111:
                dest.chmod(0o755)


SCRIPT = """#!{python}
import importlib, sys
obj = importlib.import_module({module!r})
for part in {attrs!r}:
    obj = getattr(obj, part)
sys.exit(obj())
"""


def console_scripts(entry_points: str, bin_dir: Path) -> None:
    """A wheel's [console_scripts] as executables in bin_dir, run by this interpreter (as pip writes them)."""
    section = None
    for raw in entry_points.splitlines():
        line = raw.strip()
        if line.startswith("["):
            section = line.strip("[]").strip()
        elif section == "console_scripts" and "=" in line:
            name, ref = (x.strip() for x in line.split("=", 1))
            module, _, attr = ref.split("[")[0].strip().partition(":")
            if not re.fullmatch(r"[\w.-]+", name) or not module:
                raise KitError(f"console script {line!r}: not NAME = MODULE:ATTR")
            bin_dir.mkdir(parents=True, exist_ok=True)
            text = SCRIPT.format(python=sys.executable, module=module, attrs=tuple(filter(None, attr.split("."))))
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)


def install(wheels: list[Path], target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("pip") is None:  # a venv made without pip (uv makes them so)
        for w in wheels:
            unpack_wheel(w, target)
        return
    # --upgrade: a second finish replaces the first one's packages instead of warning and keeping them.
    flags = "-q --no-index --no-deps --no-compile --upgrade --target".split()
    cmd = [sys.executable, "-m", "pip", "install", *flags, str(target), *map(str, wheels)]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    if r.returncode:
        last = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[-1]
        raise KitError(f"pip install --target {target} failed: {last}")


def cuda_lib_dirs(path: list[str] | None = None) -> list[Path]:
    """Every nvidia/cu13/lib, then every nvidia/cudnn/lib, under the entries of sys.path (the locations of the
    `nvidia` namespace package torch's CUDA wheels share)."""
    found = []
    for parts in CUDA_LIBS:
        for entry in sys.path if path is None else path:
            d = Path(entry).joinpath(*parts).resolve() if entry else None  # "": the cwd, not a site folder
            if d is not None and d.is_dir() and d not in found:
                found.append(d)
    return found


def _first(paths: list[str], rest: str | None) -> str:
    return os.pathsep.join(paths + ([rest] if rest else []))


def kit_env(target: Path, base: dict[str, str] | None = None, path: list[str] | None = None) -> dict[str, str]:
    """The environment the kit runs in. LD_LIBRARY_PATH is read when a process starts, so the checks that
    need it run in a child process; the CPU onnxruntime stays installed, and the target first shadows it."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = _first([str(target.resolve())], env.get("PYTHONPATH"))
    env["PATH"] = _first([str(target.resolve() / "bin")], env.get("PATH"))  # flower-superlink, flower-supernode
    env["LD_LIBRARY_PATH"] = _first([str(d) for d in cuda_lib_dirs(path)], env.get("LD_LIBRARY_PATH"))
    return env


# Run in the kit's environment, from the repository root: a line for each import that fails.
IMPORT_CHECK = """
import shutil, sys
target, flower, bad = sys.argv[1], sys.argv[2] == "flower", []
def why(e):
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
try:
    import onnxruntime as ort
    if not ort.__file__.startswith(target):
        bad.append(f"onnxruntime: imported from {ort.__file__}, not from {target}")
    elif "CUDAExecutionProvider" not in ort.get_available_providers():
        bad.append(f"onnxruntime: no CUDAExecutionProvider in {ort.get_available_providers()}")
except Exception as e:
    bad.append(f"onnxruntime: {why(e)}")
for name in ("tomli_w", "bench.gpu_check") + (("flwr", "coordinator.cli", "worker.cli") if flower else ()):
    try:
        __import__(name)
    except Exception as e:
        bad.append(f"{name}: {why(e)}")
for tool in ("flower-superlink", "flower-supernode") if flower else ():
    if not (shutil.which(tool) or "").startswith(target):
        bad.append(f"{tool}: not found in {target}/bin on PATH (found: {shutil.which(tool)})")
print("\\n".join(bad) or "imports: ok")
sys.exit(1 if bad else 0)
"""


def imports_ok(env: dict[str, str], target: Path, flower: bool = False) -> bool:
    cmd = [sys.executable, "-c", IMPORT_CHECK, str(target.resolve()), "flower" if flower else "-"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = r.stdout.strip().splitlines()
    if r.returncode not in (0, 1) or not lines:  # it died importing (a library that crashed on load)
        lines.append(f"import check: exit {r.returncode}: {(r.stderr.strip().splitlines() or [''])[-1]}")
    print("\n".join(lines), flush=True)
    return r.returncode == 0


def finish(stage: Path, target: Path, check_args: list[str], no_check: bool) -> int:
    m = Manifest.load(stage / MANIFEST)
    wheels = reassemble(stage, m)
    install(wheels, target)
    print(f"installed {', '.join(w.name for w in wheels)} into {target}", flush=True)
    env = kit_env(target)
    ok = imports_ok(env, target, flower=any(dist_name(w) == "flwr" for w in wheels))
    if no_check:
        return 0 if ok else 1
    args = check_args or DEFAULT_CHECK
    print(f"running python -m bench.gpu_check {shlex.join(args)}", flush=True)
    return subprocess.run([sys.executable, "-m", "bench.gpu_check", *args], cwd=ROOT, env=env).returncode


def env_lines(target: Path) -> list[str]:
    if not target.is_dir():
        raise KitError(f"no {target}: run python3 -m bench.gpu_kit finish first")
    env = kit_env(target)
    return [f"export {k}={shlex.quote(env[k])}" for k in ("PYTHONPATH", "PATH", "LD_LIBRARY_PATH")]


# --- the command line -----------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's usage and message are several lines; ours is one
        raise KitError(message)


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m bench.gpu_kit", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="download the wheels and cut them into chunks (a box with the registry)")
    p.add_argument("--out", type=Path, default=KIT, help="where the chunks and manifest.json go")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--chunk-mib", type=float, default=50.0, help="the most MiB a chunk holds")
    size.add_argument("--chunk-bytes", type=int, help="the same in bytes (tests)")
    p.add_argument("--wheels", type=Path, help="take the wheels in this folder instead of downloading them")
    p.add_argument("--no-flower", action="store_true", help="onnxruntime-gpu and tomli_w only (gpu_check's needs)")
    p = sub.add_parser("receive", help="check the chunks of one upload and stage them (the GPU box)")
    p.add_argument("--kit", type=Path, default=KIT, help="where the upload put the chunks")
    p.add_argument("--stage", type=Path, default=STAGE, help="where the chunks wait for the others")
    after = "arguments after -- go to python -m bench.gpu_check (without them: --device cuda:0)"
    p = sub.add_parser("finish", help="install the wheels and run bench.gpu_check (the GPU box)", epilog=after)
    p.add_argument("--stage", type=Path, default=STAGE, help="where receive put the chunks")
    p.add_argument("--target", type=Path, default=TARGET, help="where the wheels are installed")
    p.add_argument("--no-check", action="store_true", help="stop after the install and the import check")
    p = sub.add_parser("env", help="print the export lines of the installed kit's environment")
    p.add_argument("--target", type=Path, default=TARGET, help="where finish installed the wheels")
    return ap


def run(a: argparse.Namespace, extra: list[str]) -> int:
    if extra and a.cmd != "finish":
        raise KitError("only finish takes arguments after --")
    if a.cmd == "prepare":
        chunk = a.chunk_bytes if a.chunk_bytes is not None else int(a.chunk_mib * MIB)
        print("\n".join(plan(prepare(a.out, chunk, a.wheels, not a.no_flower), a.out, chunk)))
    elif a.cmd == "receive":
        print(receive(a.kit, a.stage))
    elif a.cmd == "finish":
        return finish(a.stage, a.target, extra, a.no_check)
    else:
        print("\n".join(env_lines(a.target)))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    try:
        return run(parser().parse_args(argv), extra)
    except (KitError, OSError, tarfile.TarError, zipfile.BadZipFile) as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
