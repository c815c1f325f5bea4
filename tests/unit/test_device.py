"""No silent fallback: a named device runs there or fails in one `error:` line (exit 2); only `auto` falls back
to the CPU, saying so once; no onnxruntime means one line naming the package; `soma-worker doctor`.

They run on boxes without a GPU: with onnxruntime-gpu lacking its CUDA libraries (the dev venv) and with the
CPU wheel (CI). What a CUDA plan asks ONNX Runtime for is checked on either, by faking the providers list and
the library check (`cuda_build`) and recording the session's arguments instead of making it. Each test that
needs a real one of the two builds skips on the other, and those that need a box without a GPU skip on one
that has one."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import onnxruntime as ort
import pytest

from export import bundle
from soma_edge import config, devices
from soma_edge.cli import run as run_cli
from soma_edge.config import ModelConfig
from soma_edge.devices import CPU, CUDA
from soma_edge.engine import evaluator, runtime
from soma_edge.engine.population import for_config
from soma_edge.errors import DeviceError
from soma_edge.expert import cuda_kernels as cuda_ops
from soma_edge.expert.graph import build
from tests.helpers.export_run import domains, make_run
from worker import doctor
from worker.cli import app as worker_app

ROOT = Path(__file__).resolve().parents[2]
TINY = ModelConfig(embed=8, hidden=16, layers=1)
GPU_BUILD = CUDA in ort.get_available_providers()
no_gpu = pytest.mark.skipif(bool(devices.gpus()), reason="needs a box without an NVIDIA GPU")
gpu_build = pytest.mark.skipif(not GPU_BUILD, reason="needs onnxruntime-gpu (this is the CPU wheel)")


@pytest.fixture(scope="module")
def deploy(tmp_path_factory) -> tuple[Path, Path]:
    """The smallest real bundle (two tiny experts) and a held-out text file."""
    base = tmp_path_factory.mktemp("device")
    make_run(base / "run", TINY, 2, domains())
    bundle.write(base / "run", base / "deploy")
    data = base / "held-out.txt"
    data.write_bytes(b"def held_out(x):\n    return x * 2  # a few hundred bytes of text\n" * 8)
    return base / "deploy", data


BLOCK_ORT = "import sys; sys.modules['onnxruntime'] = None; "  # as if no onnxruntime were installed
# A build that lists the CUDA EP (onnxruntime-gpu), on this CPU wheel: only the list is faked.
FAKE_CUDA_BUILD = f"import onnxruntime; onnxruntime.get_available_providers = lambda: [{CUDA!r}, {CPU!r}]; "


def _cli(module: str, *args: str, pre: str = "") -> subprocess.CompletedProcess:
    """A soma-edge CLI in a fresh process, so that every byte ONNX Runtime writes itself is captured too;
    `pre` runs first (BLOCK_ORT, FAKE_CUDA_BUILD)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "COLUMNS": "160"}
    return subprocess.run(
        [sys.executable, "-c", f"{pre}from {module} import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stdout + r.stderr
    assert "\x1b" not in lines[0]
    return lines[0]


def _commands(deploy: tuple[Path, Path], device: str) -> dict[str, tuple[str, ...]]:
    d, data = str(deploy[0]), str(deploy[1])
    return {
        "train": ("worker.cli", "train", "--steps", "1", "--device", device),
        "join": ("worker.cli", "join", "--coordinator", "127.0.0.1:9", "--patience", "1", "--device", device),
        "eval": ("export.cli", "eval", d, "--data", data, "--device", device),
        "generate": ("export.cli", "generate", d, "--prompt", "To be", "--bytes", "4", "--device", device),
        # onnxruntime's quantizer, not a device: what is missing is said the same way
        "quantize": ("export.cli", "onnx", str(deploy[0].parent / "run"), "--out", d + "-int8", "--quantize", "int8"),
        # the local workers' device is checked before the run is prepared or any process starts
        "start": ("coordinator.cli", "start", "--run", str(deploy[0].parent / "start"), "--local-workers", "1")
        + ("--corpus", str(deploy[0].parent / "no-corpus"), "--device", device),
    }


@no_gpu
@pytest.mark.parametrize("command", ["train", "join", "eval", "generate", "start"])
def test_cuda_without_cuda_is_one_error_line(command, deploy):
    module, *args = _commands(deploy, "cuda:0")[command]
    line = _one_error_line(_cli(module, *args))
    # It names what is missing and what to install: the CUDA wheels, the GPU build, or a driver.
    assert "soma-edge[cuda]" in line or "NVIDIA driver" in line, line
    assert "cuda:0" in line


@pytest.mark.parametrize("command", ["train", "eval", "quantize"])
def test_no_onnxruntime_says_which_to_install(command, deploy):
    module, *args = _commands(deploy, "auto")[command]
    line = _one_error_line(_cli(module, *args, pre=BLOCK_ORT))
    assert "onnxruntime is not installed" in line and "soma-edge[cpu]" in line and "soma-edge[cuda]" in line
    if command == "quantize":
        assert not Path(args[args.index("--out") + 1]).exists()  # said before anything is written


def test_load_ort_without_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime now raises ImportError
    with pytest.raises(DeviceError, match=r"pip install 'soma-edge\[cpu\]'.*'soma-edge\[cuda\]'"):
        runtime.load_ort()
    with pytest.raises(DeviceError, match="not installed"):
        runtime.make_session(build(TINY, "loss"), "cpu")


@no_gpu
@pytest.mark.parametrize("box", ["cpu wheel", "cuda ep listed"])
def test_auto_runs_on_the_cpu_and_says_so_once(deploy, box):
    """Several sessions (one per expert) in one process: the eval runs on the CPU and says so in exactly one
    plain line. runtime.py's promise: `auto` falls back to the CPU saying why, once per process, at INFO
    where no GPU is there (a WARNING only where one is, unusable). A box without a GPU says it whatever the
    build: the plain CPU wheel, or one whose providers list the CUDA EP."""
    d, data = deploy
    args = ("eval", str(d), "--data", str(data), "--device", "auto", "--top-k", "2", "--json")
    r = _cli("export.cli", *args, pre=FAKE_CUDA_BUILD if box == "cuda ep listed" else "")
    assert r.returncode == 0, r.stdout + r.stderr
    said = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(said) == 1, r.stderr
    assert said[0].endswith("soma_edge.runtime INFO device auto runs on the CPU: no NVIDIA GPU found"), said
    assert "\x1b" not in said[0] and json.loads(r.stdout)["n_experts"] == 2
    if box == "cpu wheel":
        assert runtime.plan("auto").providers == [CPU]
        assert evaluator.LossEvaluator(TINY, "auto").providers == [CPU]


@pytest.fixture
def fresh_auto():
    """`auto`'s plan and its one line are cached per process: start from empty caches, and leave them so."""
    runtime._auto.cache_clear()
    runtime._say_cpu.cache_clear()
    yield
    runtime._auto.cache_clear()
    runtime._say_cpu.cache_clear()


@pytest.fixture
def cuda_build(monkeypatch, fresh_auto):
    """This CPU wheel as a CUDA build whose CUDA and cuDNN libraries load: the providers list and the library
    check (runtime.cuda_libraries) are faked; no CUDA session can be made."""
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA, CPU])
    monkeypatch.setattr(runtime, "cuda_libraries", lambda: runtime.CudaLibraries(None, None))


def _record_sessions(monkeypatch) -> list[dict]:
    """What runtime.make_session passes to InferenceSession, recorded instead of making a session."""
    made: list[dict] = []

    class Recorded:
        def __init__(self, data, sess_options, providers, enable_fallback):
            made.append({"sess_options": sess_options, "providers": providers, "enable_fallback": enable_fallback})
            self.names = [p[0] if isinstance(p, tuple) else p for p in providers]

        def get_providers(self):
            return self.names

    monkeypatch.setattr(ort, "InferenceSession", Recorded)
    return made


def test_a_cuda_session_lists_only_cuda_without_tf32_and_no_cpu_fallback(monkeypatch, cuda_build):
    made = _record_sessions(monkeypatch)
    for device, gpu in (("cuda", 0), ("cuda:1", 1)):
        p = runtime.plan(device)
        assert p.providers == [(CUDA, {"device_id": gpu, "use_tf32": 0})] and p.strict
        runtime.make_session(build(TINY, "loss"), device)
        kw = made.pop()
        assert kw["providers"] == [(CUDA, {"device_id": gpu, "use_tf32": 0})]
        assert kw["enable_fallback"] == 0  # ORT's Python-side retry on the CPU stays off
        assert kw["sess_options"].get_session_config_entry("session.disable_cpu_ep_fallback") == "1"
    # auto on a box with a GPU: CUDA first, the CPU EP behind it for a node CUDA lacks, TF32 still off
    monkeypatch.setattr(runtime, "_nvidia_present", lambda: True)
    p = runtime.plan("auto")
    assert p.providers == [(CUDA, {"device_id": 0, "use_tf32": 0}), CPU] and not p.strict and p.why_cpu is None
    runtime.make_session(build(TINY, "loss"), "auto")
    (kw,) = made
    assert kw["providers"] == p.providers and kw["enable_fallback"] == 0
    with pytest.raises(RuntimeError, match="does not have configuration"):
        kw["sess_options"].get_session_config_entry("session.disable_cpu_ep_fallback")


def test_a_cuda_plan_turns_an_inherited_tf32_override_off(monkeypatch, cuda_build):
    """NVIDIA's libraries turn TF32 off only for "0": an inherited "1" must not survive a CUDA plan."""
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "1")
    runtime.plan("cpu")
    assert os.environ["NVIDIA_TF32_OVERRIDE"] == "1"  # nothing on CUDA: the environment is left alone
    runtime.plan("cuda:0")
    assert os.environ["NVIDIA_TF32_OVERRIDE"] == "0"
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "1")
    monkeypatch.setattr(runtime, "_nvidia_present", lambda: True)
    runtime.plan("auto")  # CUDA with the CPU EP behind it
    assert os.environ["NVIDIA_TF32_OVERRIDE"] == "0"


@pytest.mark.parametrize("box", ["cpu wheel", "cuda libraries missing"])
def test_auto_on_a_gpu_box_that_cannot_use_it_warns_once(monkeypatch, caplog, fresh_auto, box):
    """A GPU is there but `auto` runs on the CPU: one WARNING naming what to install, however many sessions."""
    monkeypatch.setattr(runtime, "_nvidia_present", lambda: True)
    if box == "cuda libraries missing":
        monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA, CPU])
        missing = runtime.CudaLibraries("libcublasLt.so.13: cannot open shared object file", None)
        monkeypatch.setattr(runtime, "cuda_libraries", lambda: missing)
    with caplog.at_level(logging.INFO, logger="soma_edge.runtime"):
        for _ in range(3):
            runtime.make_session(build(TINY, "loss"), "auto")
    (said,) = [r for r in caplog.records if r.name == "soma_edge.runtime"]
    assert said.levelno == logging.WARNING and "device auto runs on the CPU" in said.getMessage()
    assert runtime.INSTALL_CUDA in said.getMessage()


def test_the_cuda_ep_named_in_full_is_cuda_0(monkeypatch, cuda_build):
    """`--device CUDAExecutionProvider` gets exactly what `cuda:0` gets: the options and the library check."""
    assert devices.parse("CUDAExecutionProvider") == devices.parse("cuda:0") == devices.parse("cuda")
    assert devices.parse("cudaexecutionprovider").cuda_id == 0
    assert runtime.plan("CUDAExecutionProvider") == runtime.plan("cuda:0")
    missing = runtime.CudaLibraries("libcublasLt.so.13: cannot open shared object file", None)
    monkeypatch.setattr(runtime, "cuda_libraries", lambda: missing)
    for device in ("CUDAExecutionProvider", "cuda:0"):
        with pytest.raises(DeviceError, match=r"libcublasLt\.so\.13"):
            runtime.plan(device)


@pytest.mark.parametrize("strict_honoured", [True, False])
def test_a_named_device_that_cannot_start_raises_the_real_sessions_error_in_one_line(
    monkeypatch, capfd, cuda_build, strict_honoured
):
    """The real InferenceSession of this CPU wheel, asked for the CUDA EP (the build and its libraries faked
    as present): one DeviceError line, nothing else on the terminal, and never a session on the CPU, even
    where ORT would make one (the CPU-fallback refusal left out of the session's options)."""
    if not strict_honoured:
        real = runtime.session_options
        monkeypatch.setattr(runtime, "session_options", lambda threads, spin, strict: real(threads, spin, False))
    capfd.readouterr()
    with pytest.raises(DeviceError) as e:
        runtime.make_session(build(TINY, "loss"), "cuda:0")
    said = str(e.value)
    assert "\n" not in said and said.startswith("device 'cuda:0': ")
    if strict_honoured:  # ORT's own refusal, read back as which EP did not start
        assert "CUDAExecutionProvider did not start" in said
    else:  # ORT made a CPU session: refused all the same
        assert "made the session on CPUExecutionProvider, not CUDAExecutionProvider" in said
    out, err = capfd.readouterr()
    assert out == err == ""


def test_cuda_libraries_load_from_torchs_wheels_when_onnxruntime_is_installed_elsewhere(monkeypatch, tmp_path):
    """onnxruntime-gpu installed with `pip install --target DIR` has no nvidia/ beside it, where its own
    preload_dlls() looks: the CUDA 13 and cuDNN folders on sys.path (torch's wheels) are loaded from."""
    for site in ("a", "b"):
        for sub in ("cu13", "cudnn"):
            (tmp_path / site / "nvidia" / sub / "lib").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path / "b"))
    monkeypatch.syspath_prepend(str(tmp_path / "a"))
    first = tmp_path / "a" / "nvidia"
    assert runtime.nvidia_library_folders() == [(first / "cu13" / "lib", True), (first / "cudnn" / "lib", False)]
    calls = []
    monkeypatch.setattr(ort, "preload_dlls", lambda **k: calls.append(k), raising=False)
    runtime.cuda_libraries.cache_clear()
    try:
        runtime.cuda_libraries()
    finally:
        runtime.cuda_libraries.cache_clear()
    assert calls[0] == {}  # ORT's own search first, then each folder
    assert calls[1:] == [
        {"cuda": True, "cudnn": False, "directory": str(first / "cu13" / "lib")},
        {"cuda": False, "cudnn": True, "directory": str(first / "cudnn" / "lib")},
    ]


@gpu_build
@no_gpu
def test_cuda_session_lists_only_cuda_and_refuses_the_cpu(monkeypatch):
    """Pretend the CUDA libraries load: ORT, asked for the CUDA EP alone with CPU fallback disabled, must
    refuse the graph (its CUDA EP cannot start here) instead of quietly running it on the CPU."""
    monkeypatch.setattr(runtime, "cuda_libraries", lambda: runtime.CudaLibraries(None, None))
    p = runtime.plan("cuda:1")
    assert p.providers == [(CUDA, {"device_id": 1, "use_tf32": 0})] and p.strict
    with pytest.raises(DeviceError, match="CUDAExecutionProvider did not start"):
        runtime.make_session(build(TINY, "loss"), "cuda:0")


@gpu_build
@no_gpu
def test_missing_cuda_library_is_named():
    why = runtime.cuda_libraries().error
    assert why is not None and ".so" in why and "soma-edge[cuda]" in why or "NVIDIA driver" in why, why
    with pytest.raises(DeviceError, match=r"device 'cuda:0': .*\.so"):
        runtime.check_device("cuda:0")


def test_tf32_override_is_set_before_cuda_loads(monkeypatch):
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "1")  # inherited: overridden, not kept
    runtime.cuda_libraries.cache_clear()
    runtime.cuda_libraries()
    assert os.environ["NVIDIA_TF32_OVERRIDE"] == "0"


def test_a_named_ep_lists_only_itself(monkeypatch):
    real = ort.get_available_providers
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["OpenVINOExecutionProvider", *real()])
    p = runtime.plan("openvino")
    assert p.providers == ["OpenVINOExecutionProvider"] and p.strict
    monkeypatch.setattr(ort, "get_available_providers", real)
    with pytest.raises(DeviceError, match="has no OpenVINOExecutionProvider"):
        runtime.plan("openvino")
    assert runtime.plan("cpu").providers == [CPU]


def test_strict_session_options():
    so = runtime.session_options(1, strict=True)
    assert so.get_session_config_entry("session.disable_cpu_ep_fallback") == "1"
    assert so.log_severity_level == runtime.ORT_SILENT
    with pytest.raises(RuntimeError, match="does not have configuration"):  # auto and cpu: no such entry
        runtime.session_options(1).get_session_config_entry("session.disable_cpu_ep_fallback")


def test_placement_report_names_the_ops_on_the_cpu():
    # ORT's own "Node placements" lines (session_state.cc, VerifyEachNodeIsAssignedToAnEp), log prefix kept.
    text = "\n".join(
        [
            "2026-01-01 [V:onnxruntime:, session_state.cc:1578 VerifyEachNodeIsAssignedToAnEp] Node placements",
            "2026-01-01 [V:onnxruntime:, session_state.cc:1584 VerifyEachNodeIsAssignedToAnEp]  Node(s) placed on "
            "[CUDAExecutionProvider]. Number of nodes: 9",
            "2026-01-01 [V:onnxruntime:, session_state.cc:1587 VerifyEachNodeIsAssignedToAnEp]   LSTM (lstm0)",
            "2026-01-01 [V:onnxruntime:, session_state.cc:1584 VerifyEachNodeIsAssignedToAnEp]  Node(s) placed on "
            "[CPUExecutionProvider]. Number of nodes: 1",
            "2026-01-01 [V:onnxruntime:, session_state.cc:1587 VerifyEachNodeIsAssignedToAnEp]   "
            "SoftmaxCrossEntropyLoss (loss)",
        ]
    )
    placed = runtime.parse_placement(text)
    assert placed[CPU] == runtime.Placed(1, ["SoftmaxCrossEntropyLoss"])
    assert placed[CUDA] == runtime.Placed(9, ["LSTM"])
    real = runtime.placement(build(TINY, "train"), [CPU])  # the same report, from this ORT, on the CPU alone
    assert list(real) == [CPU] and real[CPU].count > 0


DOCTOR_LINES = ["onnxruntime:", "gpu", "cuda:", "device auto:", *[f"graph {g}:" for g in doctor.GRAPHS], "demo expert"]


def _doctor(capsys, *args: str) -> list[str]:
    """`soma-worker doctor` in this process: its lines, after checking it exits 0 and says nothing else."""
    rc = run_cli(worker_app, ["doctor", "--seconds", "0.05", *args], prog="soma-worker")
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert "runs on the CPU" not in err and "\x1b" not in out + err
    lines = out.splitlines()
    assert [next(p for p in DOCTOR_LINES if line.startswith(p)) for line in lines] == DOCTOR_LINES, out
    return lines


@no_gpu
def test_doctor_on_a_cpu_box(capsys):
    """One line each, in order: build and EPs, GPUs, CUDA, the device (the one "runs on the CPU" line), every
    graph a worker runs with its placement and its CUDA-kernel check, steps/s."""
    build_line, gpu, cuda, device, *graphs, rate = _doctor(capsys)
    assert build_line.startswith(f"onnxruntime: {runtime.ort_package()}; execution providers: ") and CPU in build_line
    assert gpu == "gpu: none found (no nvidia-smi answer, no /proc/driver/nvidia)"
    if GPU_BUILD:  # onnxruntime-gpu without its libraries or a driver: it names what is missing
        assert cuda.startswith("cuda: ") and ("soma-edge[cuda]" in cuda or "NVIDIA driver" in cuda), cuda
    else:
        assert cuda == "cuda: not used, this onnxruntime has no CUDA EP"
    assert device == "device auto: runs on the CPU (no NVIDIA GPU found)"
    for name, line in zip(doctor.GRAPHS, graphs):
        assert line.startswith(f"graph {name}: ") and f"nodes on {CPU}" in line, line
        assert CUDA not in line and line.endswith(
            f"every node has a CUDA kernel in onnxruntime-gpu {cuda_ops.ORT_VERSION}"
        )
    assert "unrolled over 4 of its 128 bytes" in graphs[2]
    m = re.fullmatch(rf"demo expert \(\d+ params, batch 16 x 128 bytes, loop evaluator\): (\S+) steps/s on {CPU}", rate)
    assert m and float(m.group(1)) > 0, rate
    assert sum("runs on the CPU" in line for line in (build_line, gpu, cuda, device, *graphs, rate)) == 1


NVIDIA_SMI = "#!/bin/sh\necho 'NVIDIA H200, 580.65.06, 143771'\n"  # nvidia-smi's csv: name, driver, MiB


@pytest.mark.parametrize("box", ["cuda libraries missing", "cpu wheel"])
def test_doctor_on_a_gpu_box_says_once_what_to_install(capsys, monkeypatch, tmp_path, fresh_auto, box):
    """A GPU (nvidia-smi faked) that `auto` cannot use: the cuda line says why and what to install, and no
    other line repeats it; the report still runs on the CPU and exits 0."""
    (tmp_path / "nvidia-smi").write_text(NVIDIA_SMI)
    (tmp_path / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(runtime, "_nvidia_present", lambda: True)
    missing = "libcudart.so.13: cannot open shared object file: No such file or directory"
    if box == "cuda libraries missing":
        monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA, CPU])
        monkeypatch.setattr(runtime, "cuda_libraries", lambda: runtime.CudaLibraries(missing, None))
    elif GPU_BUILD:
        pytest.skip("needs the CPU wheel")
    lines = _doctor(capsys)
    assert lines[1] == "gpu 0: NVIDIA H200, driver 580.65.06, 140.4 GiB"
    (install,) = [line for line in lines if "install" in line]
    assert install == lines[2] and runtime.INSTALL_CUDA in install
    if box == "cuda libraries missing":
        assert (
            install
            == f"cuda: the CUDA libraries do not load ({missing}): {runtime.INSTALL_CUDA} brings CUDA 13 and cuDNN 9"
        )
    else:
        assert install.startswith("cuda: not used, this onnxruntime (") and "in a fresh environment" in install
    assert lines[3] == "device auto: runs on the CPU (the cuda line says why)"


@pytest.mark.parametrize(
    "noise, density", [(n, d) for n in config.Noise for d in (0.5, 1.0) if n != config.Noise.RANK1 or d == 1]
)  # rank-1 probes are dense only
@pytest.mark.parametrize("decoder", config.DECODERS)
def test_doctor_builds_the_population_graph_the_worker_builds(noise, density, decoder):
    """Doctor's population and update graphs take the arguments population.for_config gives the worker's."""
    cfg = config.Config(
        model=TINY,
        data=config.DataConfig(batch=2, seq_len=4),
        spsa=config.SPSAConfig(directions=2, noise=noise, decoder=decoder, density=density),
    )
    made = for_config(cfg, "cpu", 1, False)
    k, perturbed, graph_noise = doctor.population_args(cfg)
    assert (k, tuple(perturbed), graph_noise) == (made.k, made.perturbed, made.noise)
    graphs = doctor.expert_graphs(cfg)
    assert list(graphs) == list(doctor.GRAPHS)
    assert isinstance(graphs["train"][1], str) == (decoder != "delta")


def test_doctor_says_which_graphs_a_config_does_not_run():
    cfg = config.Config(model=TINY, spsa=config.SPSAConfig(update="rms", decoder="frozen"))
    graphs = doctor.expert_graphs(cfg)
    assert graphs["train"][1] == "not run: spsa.decoder = 'frozen'"
    assert graphs["update"][1].startswith("not run: spsa.update = 'rms'")


def test_doctor_measures_the_demo_expert():
    assert doctor.DEMO_MODEL == config.load(ROOT / "examples" / "demo.toml").model


def test_one_install_line_for_each_kind_of_box():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("onnxruntime")]
    extras = project["optional-dependencies"]
    assert extras["cpu"] == ["onnxruntime==1.31.1"]
    assert extras["cuda"] == ["onnxruntime-gpu[cuda,cudnn]==1.31.1"]
    assert not [d for d in extras["dev"] if d.startswith("onnxruntime")]
    makefile = (ROOT / "Makefile").read_text()
    assert "'.[dev,cpu]'" in makefile
    assert "'.[cpu,report]'" in makefile and "demo: demo-setup" in makefile  # the demo installs no torch


def test_gpus_from_the_driver_files(tmp_path):
    (tmp_path / "gpus" / "0000:01:00.0").mkdir(parents=True)
    (tmp_path / "version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 2025\n")
    (tmp_path / "gpus" / "0000:01:00.0" / "information").write_text("Model: \t\t NVIDIA H200\nIRQ:   \t\t 42\n")
    assert devices.proc_gpus(tmp_path) == [devices.Gpu("NVIDIA H200", "580.65.06", None)]
    assert devices.proc_gpus(tmp_path / "absent") == []
