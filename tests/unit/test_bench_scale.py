"""bench/scale.py's arms: N, N:S and N@ExH, named as given."""

from __future__ import annotations

from bench.scale import Arm, arms


def test_arms_read_experts_rotation_and_model_size():
    got = arms("8,256:5,8@64x513")
    assert got == [Arm(8), Arm(256, 5.0), Arm(8, None, 64, 513)]
    assert [a.name for a in got] == ["8", "256:5", "8@64x513"]
