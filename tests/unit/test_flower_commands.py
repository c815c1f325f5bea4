"""Our `flwr-clientapp` and `flower-superexec` (soma_edge/flower_commands.py): Flower's own commands,
without the sibling commands their CLI packages load. Every e2e federation runs through them."""

import shutil
import subprocess
import sys
import textwrap

import pytest

from soma_edge.processes import commands as flower_commands
from soma_edge.processes.launch import flower_env


@pytest.mark.parametrize("name", sorted(flower_commands.COMMANDS))
def test_flower_processes_find_ours_first_on_their_path(tmp_path, name):
    env = flower_env(tmp_path / "flwr", SOMA_BLOCK_TORCH="1")
    found = shutil.which(name, path=env["PATH"])
    assert found == str(tmp_path / "flwr" / "bin" / name)
    # It is Flower's command: Flower's argument parser answers.
    r = subprocess.run([found, "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--runtime-api-address" in r.stdout and "--insecure" in r.stdout
    # Written again unchanged by the next process that starts on this home.
    before = (tmp_path / "flwr" / "bin" / name).stat().st_mtime_ns
    assert flower_commands.install(tmp_path / "flwr" / "bin") == tmp_path / "flwr" / "bin"
    assert (tmp_path / "flwr" / "bin" / name).stat().st_mtime_ns == before


@pytest.mark.parametrize(
    "name, heavy",
    [
        ("flwr-clientapp", ["flwr.supernode.cli.flower_supernode", "sqlalchemy"]),
        ("flower-superexec", ["flwr.supercore.cli.flwr_agentapp", "flwr.supercore.cli.flwr_model"]),
    ],
)
def test_the_commands_do_not_load_their_sibling_commands(name, heavy):
    """What makes them cheaper. This fails if a flwr release moves a command, where ours quietly falls
    back to the full import."""
    package, module, function = flower_commands.COMMANDS[name]
    code = textwrap.dedent(
        f"""
        import importlib, sys
        from soma_edge.processes import commands as flower_commands
        flower_commands.register_package({package!r}, {module!r})
        assert callable(getattr(importlib.import_module("{package}.{module}"), {function!r}))
        print("loaded:", [m for m in {heavy!r} if m in sys.modules])
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "loaded: []", r.stdout


def test_an_unknown_command_is_one_usage_line():
    r = subprocess.run(
        [sys.executable, "-m", "soma_edge.flower_commands", "flwr-serverapp"], capture_output=True, text=True
    )
    assert r.returncode == 1 and r.stderr.strip().startswith("usage: python -m soma_edge.flower_commands")


def test_a_process_whose_parent_is_gone_ends_even_with_its_main_thread_stuck():
    """Flower's own monitor cannot interrupt a main thread blocked on a lock (a ClientApp whose SuperNode
    died while it pulled its task): ours ends the process once the parent is gone and the grace is up."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert flower_commands.parent_pid(["--token", "t", "--parent-pid", str(gone.pid)]) == gone.pid
    assert flower_commands.parent_pid(["--insecure"]) is None
    code = textwrap.dedent(
        f"""
        import threading
        from soma_edge.processes import commands as flower_commands
        flower_commands.watch_parent({gone.pid}, grace=0.2, poll=0.05)
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # stuck, as the orphan's main thread was
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1, r.stderr
