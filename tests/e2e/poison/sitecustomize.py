"""A lying worker, for the poisoned-worker e2e test only: put this folder on a worker's PYTHONPATH and set
SOMA_TEST_POISON. Python imports sitecustomize at start-up, so in every ClientApp process of that worker
the training loop is wrapped: it trains honestly, then replaces the weights before they are hashed and
sent. The replies stay well-formed (right shape, dtype, finite, hashes that match); only the guard can
tell. There is no such switch in the product: this file exists in the test tree alone.

SOMA_TEST_POISON: scale10 (the trained weights x 10) | random (noise at 3x the weights' scale) | mixed
(scale10 for even experts, random for odd ones) | once (scale10, of one result of expert SOMA_TEST_POISON_EXPERT
alone, the first it sends from a step past 0, which creates the file SOMA_TEST_POISON_MARK: an honest worker
whose training went wrong once). Noise at the weights' own scale would be no lie the guard
must refuse: it is a fresh init, whose loss (~5.7-6.1 nats/byte at the e2e size) sits within a 0.5
tolerance of a young expert's best; at 3x it is 8-10.5, like scale10.
"""

import importlib.abc
import importlib.util
import os
import sys

MODE = os.environ.get("SOMA_TEST_POISON", "")


def _lie(train):
    import numpy as np

    def lying_train(state, data, cfg, evaluator, *, expert=0, **kw):
        rep = train(state, data, cfg, evaluator, expert=expert, **kw)
        mode = MODE if MODE != "mixed" else ("scale10" if expert % 2 == 0 else "random")
        w = state.weights
        if mode == "scale10":
            w[:] = w * 10
        elif mode == "random":
            w[:] = np.random.default_rng(state.step).standard_normal(w.size).astype(np.float32) * float(3 * w.std())
        print(f"poison: expert {expert} step {state.step}: weights replaced ({mode})", file=sys.stderr, flush=True)
        return rep

    return lying_train


def _once(finish):
    """`worker.task.finish` that makes the result it sends of one expert's training from a step past 0, once
    in the run, from its trained weights x 10 (a result sent, not speculated steps that may be dropped)."""

    def lying_finish(t, cfg, state, *args):
        if t["expert"] == int(os.environ["SOMA_TEST_POISON_EXPERT"]) and t["step"] > 0 and _mark():
            state.weights[:] = state.weights * 10
            print(f"poison: expert {t['expert']} step {state.step}: weights replaced (once)", file=sys.stderr)
        return finish(t, cfg, state, *args)

    return lying_finish


def _mark() -> bool:
    """True the first time in the run, across processes (the ClientApps and the speculating trainer)."""
    try:
        os.close(os.open(os.environ["SOMA_TEST_POISON_MARK"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


class _Hook(importlib.abc.MetaPathFinder):
    """Wraps `worker.task.train_loop` right after that module runs (the ClientApp's rounds and the
    speculating trainer's both train through it)."""

    def find_spec(self, name, path, target=None):
        if name != "worker.task":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            if MODE == "once":
                module.finish = _once(module.finish)
            else:
                module.train_loop = _lie(module.train_loop)

        spec.loader.exec_module = exec_module
        return spec


if MODE:
    sys.meta_path.insert(0, _Hook())
