"""bench/body.py runs end to end on a tiny stream: the screen's lr sweep scored on val with the frozen twin
scored at every arm's step count, then the final stage at equal passes and equal time, its gains, JSON and
plot (the claim is the result in docs/RESULTS.md, not a test)."""

import json

import numpy as np

from bench import body
from soma_edge.config import Config, ModelConfig

TEXT = np.frombuffer(b"".join(bytes([i % 91 + 32]) * (i % 4 + 1) for i in range(6000)), dtype=np.uint8)


def _tiny(monkeypatch):
    windows = (np.stack([TEXT[i : i + 128] for i in range(0, 1024, 128)]).astype(np.int64),) * 2
    monkeypatch.setattr(body, "_DATA", {"train": TEXT, "val": windows, "test": windows})
    monkeypatch.setattr(body, "CHECK_STEPS", 4)
    monkeypatch.setattr(body, "TEST_EVERY", 4)
    monkeypatch.setitem(body.KINDS, "lstm", ModelConfig(embed=8, hidden=16))


def _short(cfg: Config) -> Config:
    cfg.data.seq_len = 16
    return cfg


def test_body_bench_tiny(tmp_path, monkeypatch, capsys):
    _tiny(monkeypatch)
    screen = tmp_path / "screen.json"
    body.main(["screen", "--arms", "k1-sparse,split4-probes", "--evals", "24", "--jobs", "1", "--json", str(screen)])
    table = capsys.readouterr().out
    rec = json.loads(screen.read_text())
    # 24 passes: 8 steps at 3 a step, 12 at 2 (the probes' own decoder gradient); the twin scored at both.
    assert {r["steps"] for r in rec["arms"]["k1-sparse"]} == {8} and {
        r["steps"] for r in rec["arms"]["split4-probes"]
    } == {12}
    assert sorted(int(k) for k in rec["twin"]["at"]) == [8, 12]
    for arm, runs in rec["arms"].items():
        assert len(runs) >= 3 and len({r["lr"] for r in runs}) == len(runs)  # a grid, extended past a winning edge
        best = min(runs, key=lambda r: r["val"])
        assert f"| {arm} | {best['lr']:g} |" in table
    out = tmp_path / "final.json"
    png = tmp_path / "body.png"
    argv = ["final", "--from", str(screen), "--top", "1", "--evals", "24", "--seeds", "0,1", "--jobs", "1"]
    body.main([*argv, "--json", str(out), "--plot", str(png)])
    fin = json.loads(out.read_text())
    assert set(fin["arms"]) == {"k1-sparse", "split4-probes"} and png.stat().st_size > 0
    base = {r["seed"]: r["seconds"] for r in fin["equal_evals"] if r["arm"] == "k1-sparse"}
    for r in fin["equal_time"]:  # the other arm, for the base arm's seconds on its seed
        assert r["arm"] == "split4-probes" and r["seconds"] >= base[r["seed"]]
    gains = body.gains(fin, "equal_evals")
    assert set(gains) == {"k1-sparse", "split4-probes"} and all(len(g) == 2 for g in gains.values())
    assert "split4-probes" in capsys.readouterr().out
    # The population graph is unrolled over seq_len: at 128 its two sessions take ~3 s to build, at 16 ~0.1 s,
    # and which evaluator an arm runs on (what the cost rows assert) does not depend on the length.
    arm_config = body.arm_config
    monkeypatch.setattr(body, "arm_config", lambda *a, **k: _short(arm_config(*a, **k)))
    body.main(["cost", "--arms", "k1-sparse,split4,split4-probes", "--cost-steps", "2"])
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines()}
    # split rows with a clean forward's decoder gradient run on the loop only (a split graph's clean member
    # reads one slice); with the probes' gradient the population graph takes them
    assert rows["split4"].endswith("| n/a | n/a |") and "n/a" not in rows["k1-sparse"] + rows["split4-probes"]
    assert rows["split4-probes"].split("|")[2].strip() == "2" and rows["k1-sparse"].split("|")[2].strip() == "3"


def test_body_noise_energies_and_bounds():
    """The signal is |E g|² unbiased for the mean's noise; equal signal-to-noise in every tensor leaves the
    Adam bound nothing to gain, and tensors of unequal signal per weight give the SGD bound a gain."""
    from bench import body_noise

    rng = np.random.default_rng(0)
    mean = np.array([3.0, 0.0, 0.0, 4.0])
    grads = {"a": mean + rng.standard_normal((20000, 4)), "b": 0.1 * (mean + rng.standard_normal((20000, 4)))}
    e = body_noise.energies(grads)
    assert abs(e["a"][1] - 25.0) < 0.5 and abs(e["a"][2] - 29.0) < 0.5 and e["b"][0] == 4
    sgd, adam = body_noise.bounds(e)
    assert abs(adam - 1.0) < 0.02 and sgd > 1.0
