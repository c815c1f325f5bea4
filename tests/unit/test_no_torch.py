"""The worker's training path runs with torch unimportable."""

import subprocess
import sys
import textwrap


def test_worker_training_path_without_torch():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import numpy as np
        from soma_edge.expert import params
        from soma_edge.config import Config, DataConfig, ModelConfig, evals_per_step
        from soma_edge.engine.evaluator import evaluator_for
        from soma_edge.spsa.optim import State
        import worker.trainer, worker.cli, worker.client_app, worker.cache, worker.probe
        cfg = Config(model=ModelConfig(embed=8, hidden=16), data=DataConfig(batch=4, seq_len=16), device="cpu")
        data = np.frombuffer(b"hello forward-only world " * 50, dtype=np.uint8)
        state = State(params.init(cfg.model, 0))
        w0 = state.weights.copy()
        rep = worker.trainer.train(state, data, cfg, evaluator_for(cfg, threads=1), steps=3)
        assert rep.steps == 3 and state.step == 3
        assert rep.forward_evals == 3 * evals_per_step(cfg.spsa) == 3 * 2  # K directions on their own rows
        assert not np.array_equal(state.weights, w0)
        assert worker.client_app.torch_importable() is False
        try:
            import torch  # noqa: F401 - the import itself is the test
        except ImportError:
            print("torch-blocked-ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "torch-blocked-ok" in r.stdout
    assert "torch" not in r.stderr


def test_worker_path_never_loads_torch_even_when_installed():
    """Without the block, the worker's modules and a training step still leave torch unloaded."""
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        from soma_edge.expert import params
        from soma_edge.config import Config, DataConfig, ModelConfig, evals_per_step
        from soma_edge.engine.evaluator import evaluator_for
        from soma_edge.spsa.optim import State
        import worker.trainer, worker.cli, worker.client_app, worker.cache, worker.probe
        cfg = Config(model=ModelConfig(embed=8, hidden=16), data=DataConfig(batch=4, seq_len=16), device="cpu")
        data = np.frombuffer(b"no autograd here " * 50, dtype=np.uint8)
        worker.trainer.train(State(params.init(cfg.model, 0)), data, cfg, evaluator_for(cfg, threads=1), steps=2)
        worker.client_app.torch_importable()
        print("loaded" if "torch" in sys.modules else "not-loaded")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "not-loaded"


def test_the_coordinators_event_writer_leaves_torch_unloaded(tmp_path):
    """tensorboardX imports torch where it can; the coordinator's Board keeps it out (seconds at every start)
    and leaves it importable for the rest of the process."""
    code = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from coordinator.board import Board
        board = Board(Path({str(tmp_path / "tb")!r}), 0)
        board.commit([])
        board.close()
        print("loaded" if "torch" in sys.modules else "not-loaded")
        import importlib.util
        print("importable" if importlib.util.find_spec("torch") else "absent")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["not-loaded", "importable"]
