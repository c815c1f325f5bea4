"""bench/scale.py's arms: N, N:S and N@ExH, named as given."""

from __future__ import annotations

from bench.scale import Arm, arms


def test_arms_read_experts_rotation_and_model_size():
    got = arms("8,256:5,8@64x513")
    assert got == [Arm(8), Arm(256, 5.0), Arm(8, None, 64, 513)]
    assert [a.name for a in got] == ["8", "256:5", "8@64x513"]


def test_an_arms_config_takes_the_kinds_shipped_lr_unless_one_is_given():
    import tomllib
    from types import SimpleNamespace

    from bench.scale import config
    from soma_edge.config import SOMA_KIND_LR, from_dict

    args = SimpleNamespace(
        embed=32, hidden=32, kind="soma", layers=1, seed=7, rounds=5, round_seconds=60.0, paper=False, lr=None
    )
    shipped = from_dict(tomllib.loads(config(Arm(256), args)))
    assert shipped.spsa.lr == SOMA_KIND_LR and shipped.model.kind == "soma" and shipped.federation.experts == 256
    args.lr = 4e-3
    assert from_dict(tomllib.loads(config(Arm(256), args))).spsa.lr == 4e-3
