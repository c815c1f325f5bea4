"""bench/gpu_kit.py, which carries onnxruntime-gpu to an offline GPU box in chunks: a tiny pure-Python wheel
(this Python cannot import the box's cp312 wheels) goes through prepare, one receive per upload, and finish
--no-check, and imports from the target; a damaged or missing chunk is one `error:` line and exit 2; the
environment finish builds puts the target and torch's CUDA 13 and cuDNN folders first. No network."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bench import gpu_kit

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 4096  # the tar stream is at least one 10 KiB record: three chunks or more


def _wheel(folder: Path) -> Path:
    """gpukit_probe 0.1, py3-none-any: a module, METADATA, WHEEL and RECORD, stored uncompressed."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = "gpukit_probe-0.1.dist-info"
    files = {
        "gpukit_probe.py": "VALUE = 42\n# " + "x" * 6000 + "\n",  # a few chunks' worth
        f"{dist}/METADATA": "Metadata-Version: 2.1\nName: gpukit-probe\nVersion: 0.1\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{dist}/RECORD,,\n"
    path = folder / "gpukit_probe-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in {**files, f"{dist}/RECORD": record}.items():
            z.writestr(name, text)
    return path


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "bench.gpu_kit", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)


@pytest.fixture
def kit(tmp_path) -> Path:
    """A prepared kit of the tiny wheel, in chunks of CHUNK bytes."""
    _wheel(tmp_path / "wheels")
    out = tmp_path / "kit"
    r = _cli("prepare", "--wheels", str(tmp_path / "wheels"), "--out", str(out), "--chunk-bytes", str(CHUNK))
    assert r.returncode == 0, r.stderr
    return out


def _upload(kit: Path, names: list[str], box: Path) -> Path:
    """What one upload leaves on the box: a fresh kit folder holding just these files."""
    shutil.rmtree(box, ignore_errors=True)
    box.mkdir(parents=True)
    for name in names:
        shutil.copy(kit / name, box / name)
    return box


def _error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def test_prepare_writes_chunks_a_manifest_and_the_upload_plan(tmp_path):
    wheel = _wheel(tmp_path / "wheels")
    out = tmp_path / "kit"
    assert gpu_kit.main(["prepare", "--wheels", str(wheel.parent), "--out", str(out), "--chunk-bytes", "4096"]) == 0
    m = gpu_kit.Manifest.load(out / "manifest.json")
    assert json.loads((out / "manifest.json").read_text())["schema"] == gpu_kit.SCHEMA
    assert len(m.chunks) >= 3 and all(c.bytes <= CHUNK for c in m.chunks)
    assert [c.name for c in m.chunks] == [f"kit-{i:02d}.part" for i in range(1, len(m.chunks) + 1)]
    assert sorted(p.name for p in out.iterdir()) == sorted([c.name for c in m.chunks] + ["manifest.json"])
    assert m.total == sum((out / c.name).stat().st_size for c in m.chunks)
    assert m.wheels == [gpu_kit.FileRecord(wheel.name, wheel.stat().st_size, gpu_kit.sha256_of(wheel))]
    lines = gpu_kit.plan(m, out, CHUNK)
    assert len(lines) == 1 + len(m.chunks)
    assert f"{out}/manifest.json {out}/kit-01.part" in lines[1] and "manifest" not in lines[2]
    assert lines[-1].endswith(f"receive --kit {out} && python3 -m bench.gpu_kit finish -- --device cuda:0")


def test_one_receive_per_upload_then_finish_installs_what_imports(kit, tmp_path):
    stage, target = tmp_path / "stage", tmp_path / "site"
    names = sorted(p.name for p in kit.glob("kit-*.part"))
    for i, name in enumerate(names, 1):
        box = _upload(kit, ["manifest.json", name] if i == 1 else [name], tmp_path / "box" / ".gpukit")
        r = _cli("receive", "--kit", str(box), "--stage", str(stage))
        assert r.returncode == 0 and r.stderr == "", r.stderr
        (line,) = r.stdout.splitlines()
        assert f"received {name}; {i} of {len(names)} in {stage}" in line
        assert ("missing: " + ", ".join(names[i:]) if i < len(names) else "all here") in line
        assert (box / name).is_file() and (stage / name).is_file()  # copied to the stage: the kit stays whole
    r = _cli("finish", "--stage", str(stage), "--target", str(target), "--no-check")
    # Here the CPU onnxruntime is the one that imports (no CUDA EP): the import check says so, and exits 1.
    assert f"installed gpukit_probe-0.1-py3-none-any.whl into {target}" in r.stdout, r.stderr
    assert "onnxruntime: imported from" in r.stdout and r.returncode == 1
    probe = [sys.executable, "-c", "import gpukit_probe, sys; print(gpukit_probe.VALUE, gpukit_probe.__file__)"]
    got = subprocess.run(probe, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(target)})
    assert got.stdout.split() == ["42", str(target / "gpukit_probe.py")], got.stderr


def test_a_damaged_chunk_is_one_error_line_and_is_not_staged(kit, tmp_path):
    stage = tmp_path / "stage"
    box = _upload(kit, ["manifest.json", "kit-01.part", "kit-02.part"], tmp_path / "box")
    data = bytearray((box / "kit-02.part").read_bytes())
    data[100] ^= 0x01
    (box / "kit-02.part").write_bytes(data)
    line = _error_line(_cli("receive", "--kit", str(box), "--stage", str(stage)))
    assert "kit-02.part" in line and "sha256" in line and "kit-01.part" not in line
    assert (stage / "kit-01.part").is_file() and not (stage / "kit-02.part").exists()
    (box / "kit-03.part").write_bytes(b"short")  # another damage: cut short
    (box / "kit-02.part").unlink()
    line = _error_line(_cli("receive", "--kit", str(box), "--stage", str(stage)))
    assert "kit-03.part: 5 bytes" in line and not (stage / "kit-03.part").exists()


def test_a_new_kits_manifest_drops_the_chunks_staged_for_the_old_one(kit, tmp_path):
    stage = tmp_path / "stage"
    gpu_kit.receive(_upload(kit, ["manifest.json", "kit-01.part"], tmp_path / "box"), stage)
    other = tmp_path / "other"  # the same wheel in bigger chunks: two
    assert len(gpu_kit.prepare(other, 8192, tmp_path / "wheels").chunks) == 2
    line = gpu_kit.receive(_upload(other, ["manifest.json", "kit-02.part"], tmp_path / "box"), stage)
    assert line == f"received kit-02.part; 1 of 2 in {stage}; missing: kit-01.part"
    (tmp_path / "box" / "kit-09.part").write_bytes(b"")
    with pytest.raises(gpu_kit.KitError, match="kit-09.part in .*: not in the manifest"):
        gpu_kit.receive(tmp_path / "box", stage)


def test_finish_names_a_missing_or_damaged_chunk_in_one_error_line(kit, tmp_path):
    stage, target = tmp_path / "stage", tmp_path / "site"
    names = sorted(p.name for p in kit.glob("kit-*.part"))
    box = _upload(kit, ["manifest.json", *names[:1], *names[2:]], tmp_path / "box")
    assert _cli("receive", "--kit", str(box), "--stage", str(stage)).returncode == 0
    line = _error_line(_cli("finish", "--stage", str(stage), "--target", str(target), "--no-check"))
    assert f"{names[1]} missing from {stage}" in line
    shutil.copy(kit / names[1], stage / names[1])
    data = bytearray((stage / names[0]).read_bytes())
    data[-1] ^= 0xFF  # damaged on the box's disk, after receive checked it
    (stage / names[0]).write_bytes(data)
    line = _error_line(_cli("finish", "--stage", str(stage), "--target", str(target), "--no-check"))
    assert names[0] in line and "sha256" in line and not target.exists()


def test_finish_runs_gpu_check_in_the_kits_environment_and_returns_its_status(kit, tmp_path, monkeypatch):
    stage, target = tmp_path / "stage", tmp_path / "site"
    gpu_kit.receive(_upload(kit, [p.name for p in kit.iterdir()], tmp_path / "box"), stage)
    monkeypatch.setattr(gpu_kit, "imports_ok", lambda env, target, flower=False: True)
    real, calls = subprocess.run, []

    def run(cmd, **kw):  # pip runs for real; bench.gpu_check is only recorded
        if cmd[1:3] != ["-m", "bench.gpu_check"]:
            return real(cmd, **kw)
        calls.append((cmd[3:], kw))
        return subprocess.CompletedProcess(cmd, 3)

    monkeypatch.setattr(gpu_kit.subprocess, "run", run)
    args = ["--device", "cpu", "--no-throughput"]
    assert gpu_kit.main(["finish", "--stage", str(stage), "--target", str(target), "--", *args]) == 3
    ((got, kw),) = calls
    assert got == args and kw["cwd"] == ROOT and gpu_kit.DEFAULT_CHECK == ["--device", "cuda:0"]  # without --
    assert kw["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(target.resolve())
    assert (target / "gpukit_probe.py").is_file()


def test_usage_errors_are_one_line(tmp_path):
    assert "required" in _error_line(_cli())
    assert "chunk-bytes" in _error_line(_cli("prepare", "--chunk-mib", "1", "--chunk-bytes", "9"))
    assert "only finish" in _error_line(_cli("receive", "--", "--device", "cpu"))
    line = _error_line(_cli("receive", "--kit", str(tmp_path), "--stage", str(tmp_path / "stage")))
    assert "manifest.json" in line and "kit-01.part" in line  # nothing uploaded yet
    assert "no wheels" in _error_line(_cli("prepare", "--wheels", str(tmp_path), "--out", str(tmp_path / "k")))


def _fake_nvidia(root: Path) -> tuple[Path, Path]:
    cu13, cudnn = root / "nvidia" / "cu13" / "lib", root / "nvidia" / "cudnn" / "lib"
    cu13.mkdir(parents=True)
    cudnn.mkdir(parents=True)
    return cu13, cudnn


def test_the_kit_environment_puts_the_target_and_torchs_cuda_libraries_first(tmp_path, monkeypatch):
    cu13, cudnn = _fake_nvidia(tmp_path / "site-packages")
    monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
    target = tmp_path / "site"
    env = gpu_kit.kit_env(target, base={"PYTHONPATH": "/old/py", "LD_LIBRARY_PATH": "/old/lib", "HOME": "/h"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(target.resolve()), "/old/py"]
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[:2] == [str(cu13.resolve()), str(cudnn.resolve())]
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[-1] == "/old/lib" and env["HOME"] == "/h"
    # Two site folders with the nvidia namespace: each kind's folders together, CUDA first.
    cu13b, cudnnb = _fake_nvidia(tmp_path / "other")
    dirs = gpu_kit.cuda_lib_dirs([str(tmp_path / "site-packages"), str(tmp_path / "other"), ""])
    assert dirs == [p.resolve() for p in (cu13, cu13b, cudnn, cudnnb)]


def test_env_prints_the_export_lines(tmp_path):
    cu13, cudnn = _fake_nvidia(tmp_path / "sp")
    target = tmp_path / "site"
    assert "finish first" in _error_line(_cli("env", "--target", str(target)))
    target.mkdir()
    r = _cli("env", "--target", str(target), env={**os.environ, "PYTHONPATH": str(tmp_path / "sp")})
    exports = dict(line.removeprefix("export ").split("=", 1) for line in r.stdout.splitlines())
    assert exports["PYTHONPATH"].split(os.pathsep)[:2] == [str(target), str(tmp_path / "sp")]
    assert exports["LD_LIBRARY_PATH"].split(os.pathsep)[:2] == [str(cu13), str(cudnn)]


def test_a_wheel_unpacks_without_pip(tmp_path):
    """The box's interpreter may lack pip (a venv uv made): finish then unpacks the wheels itself."""
    target = tmp_path / "site"
    gpu_kit.unpack_wheel(_wheel(tmp_path / "wheels"), target)
    assert (target / "gpukit_probe.py").read_text().startswith("VALUE = 42")
    assert (target / "gpukit_probe-0.1.dist-info" / "RECORD").is_file()


def test_prepare_downloads_the_pinned_wheels_for_the_box_without_their_nvidia_extras():
    ort, tomli_w = gpu_kit.pins()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"onnxruntime-gpu[cuda,cudnn]{ort.removeprefix("onnxruntime-gpu")}"' in pyproject
    assert tomli_w == "tomli-w==1.2.0"
    cmd = gpu_kit.download_command(ort, Path("/d"))
    assert cmd[1:4] == ["-m", "pip", "download"] and cmd[-3:] == ["-d", "/d", ort]
    assert {"--no-deps", "--only-binary=:all:", "manylinux_2_28_x86_64", "manylinux2014_x86_64"} <= set(cmd)
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and cmd[cmd.index("--implementation") + 1] == "cp"


def test_it_imports_only_the_standard_library():
    """On the box it runs before anything it installs, and must not reach soma_edge or numpy."""
    tree = ast.parse((ROOT / "bench" / "gpu_kit.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {n.split(".")[0] for n in names} <= set(sys.stdlib_module_names) | {"__future__"}


def test_prepare_carries_flower_with_its_dependencies_but_what_the_box_has(tmp_path, monkeypatch):
    """flwr and tensorboardX at pyproject's pins come with their dependencies (`soma-coord start` runs on the
    box); not numpy, which torch brought; and one tomli-w, the pinned one, though Flower asks for it too."""
    flwr, tbx = gpu_kit.flower_pins()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"{flwr}"' in pyproject and tbx.startswith("tensorboardX")
    assert "--no-deps" not in gpu_kit.download_command(flwr, Path("/d"), deps=True)
    fetched = {  # what each pip download leaves, as the registry would
        flwr: ["flwr-1.42.0-py3-none-any.whl", "numpy-2.5.5-cp312-cp312-manylinux_2_28_x86_64.whl"],
        tbx: ["tensorboardx-2.6.5-py3-none-any.whl", "tomli_w-1.3.0-py3-none-any.whl"],
        "onnxruntime-gpu==1.31.1": ["onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_27_x86_64.whl"],
        "tomli-w==1.2.0": ["tomli_w-1.2.0-py3-none-any.whl"],
    }
    calls = []

    def fake_run(cmd, **kw):
        pin, dest = cmd[-1], Path(cmd[cmd.index("-d") + 1])
        calls.append((pin, "--no-deps" in cmd))
        for name in fetched[pin]:
            (dest / name).write_bytes(b"w")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(gpu_kit.subprocess, "run", fake_run)
    monkeypatch.setattr(gpu_kit, "pins", lambda: ["onnxruntime-gpu==1.31.1", "tomli-w==1.2.0"])
    got = sorted(p.name for p in gpu_kit.download(tmp_path).glob("*.whl"))
    assert got == sorted(
        fetched[flwr][:1] + fetched[tbx][:1] + fetched["onnxruntime-gpu==1.31.1"] + fetched["tomli-w==1.2.0"]
    )
    assert calls == [(flwr, False), (tbx, False), ("onnxruntime-gpu==1.31.1", True), ("tomli-w==1.2.0", True)]
    (tmp_path / "only").mkdir()
    gpu_kit.download(tmp_path / "only", flower=False)
    assert sorted(p.name for p in (tmp_path / "only").glob("*.whl")) == [
        "onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_27_x86_64.whl",
        "tomli_w-1.2.0-py3-none-any.whl",
    ]


def test_flower_commands_come_from_the_targets_bin(tmp_path):
    """pip --target writes a wheel's console scripts into target/bin, and so does the kit without pip; the
    kit's PATH puts that folder first, where `soma-coord start` finds flower-superlink and flower-supernode."""
    target = tmp_path / "site"
    gpu_kit.console_scripts("[console_scripts]\nkit-hello = json.tool:main\n[other]\nx = y:z\n", target / "bin")
    assert sorted(p.name for p in (target / "bin").iterdir()) == ["kit-hello"]
    env = gpu_kit.kit_env(target, base={"PATH": "/usr/bin:/bin"})
    assert env["PATH"].split(os.pathsep) == [str((target / "bin").resolve()), "/usr/bin", "/bin"]
    r = subprocess.run(["kit-hello"], input='{"a": 1}', capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 0 and '"a": 1' in r.stdout, r.stderr
    with pytest.raises(gpu_kit.KitError, match="not NAME = MODULE:ATTR"):
        gpu_kit.console_scripts("[console_scripts]\nbad name = :main\n", target / "bin")


def test_the_import_check_asks_for_flower_and_its_commands_where_the_kit_carries_flwr(tmp_path, capsys):
    target = tmp_path / "site"
    target.mkdir()
    assert not gpu_kit.imports_ok(gpu_kit.kit_env(target), target, flower=True)
    out = capsys.readouterr().out
    assert f"flower-superlink: not found in {target.resolve()}/bin on PATH" in out
    assert "flower-supernode: not found" in out and "flwr:" not in out  # flwr itself imports (the venv's)


def test_a_wheel_name_longer_than_ustar_allows_goes_through(tmp_path):
    """Manylinux wheels of Flower's dependencies have names past USTAR's 100 characters (charset_normalizer's)."""
    name = "charset_normalizer-3.5.3-cp312-cp312-manylinux1_x86_64.manylinux_2_28_x86_64.manylinux_2_5_x86_64.whl"
    assert len(name) > 100
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / name).write_bytes(b"wheel bytes " * 1000)
    m = gpu_kit.prepare(tmp_path / "kit", CHUNK, tmp_path / "w")
    for c in m.chunks:
        shutil.copy(tmp_path / "kit" / c.name, tmp_path / c.name)
    (got,) = gpu_kit.reassemble(tmp_path, m)
    assert got.name == name and got.read_bytes() == b"wheel bytes " * 1000
