"""The worker's `flwr-clientapp` (worker/app_process.py): Flower's own command, without loading the
SuperNode's CLI in every ClientApp process. The e2e tests run every ClientApp through it."""

import shutil
import subprocess
import sys
import textwrap

from worker import app_process
from worker.cli import supernode_env


def test_join_puts_our_flwr_clientapp_first_on_the_supernodes_path(tmp_path):
    env = supernode_env(tmp_path / "cache")
    found = shutil.which(app_process.NAME, path=env["PATH"])
    assert found == str(tmp_path / "cache" / "bin" / app_process.NAME)
    assert env["SOMA_BLOCK_TORCH"] == "1"
    # It is Flower's command: Flower's argument parser answers.
    r = subprocess.run([found, "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--runtime-api-address" in r.stdout and "--token" in r.stdout
    # Written again unchanged on the next join: the same file, still executable.
    assert app_process.command(tmp_path / "cache") == tmp_path / "cache" / "bin"
    assert shutil.which(app_process.NAME, path=env["PATH"]) == found


def test_the_clientapp_process_does_not_load_the_supernodes_cli():
    """What makes it cheaper: Flower's `flwr-clientapp` imports `flwr.supernode.cli`, whose __init__ loads
    the SuperNode's command (SQLAlchemy, its object store); ours loads the ClientApp's module alone. This
    fails if a flwr release moves the command, where the shim quietly falls back to the full import."""
    code = textwrap.dedent(
        """
        import sys
        from worker import app_process
        app_process.register_package()
        from flwr.supernode.cli.flwr_clientapp import flwr_clientapp
        assert callable(flwr_clientapp)
        heavy = [m for m in ("flwr.supernode.cli.flower_supernode", "sqlalchemy") if m in sys.modules]
        print("loaded:", heavy)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "loaded: []", r.stdout
