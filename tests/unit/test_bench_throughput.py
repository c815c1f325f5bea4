"""bench/spsa_throughput.py runs end to end at a tiny shape: its table has the loop, population and rank-1
rows per size, its --json last line names, per size and in four keys, the evaluator auto trains with on the
CPU (the loop, whatever the rates) with its ratio to torch eager, the line before it the figures and whether
the population beat the loop; it runs without torch (no torch row, a null ratio); on an accelerator `chosen`
is the faster evaluator, as the worker's probe keeps it; and the population rows are fed the keyed noise."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import spsa_throughput
from bench.sizes import SIZES
from bench.spsa_throughput import chosen_evaluator, loop_row, population_feeds
from soma_edge.devices import CPU, CUDA
from soma_edge.engine.population import direction
from soma_edge.expert import params
from soma_edge.expert.population_graph import Noise
from soma_edge.spsa import noise as keyed

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--seconds", "0.05", "--seq-len", "8", "--batch", "4", "--k", "1", "--no-overhead", "--json"]
NO_TORCH = (
    'import runpy, sys; sys.modules["torch"] = None; runpy.run_module("bench.spsa_throughput", run_name="__main__")'
)


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return r


def _check(stdout: str, sizes: list[str], torch: bool) -> list[dict]:
    lines = stdout.strip().splitlines()
    out, figures = json.loads(lines[-1]), json.loads(lines[-2])["measured"]
    assert list(out) == ["sizes"] and [s["name"] for s in out["sizes"]] == sizes
    assert [f["name"] for f in figures] == sizes
    for s, f in zip(out["sizes"], figures):
        assert list(s) == ["name", "params", "chosen", "chosen_vs_torch"]  # exactly these four keys
        assert s["params"] == params.count(SIZES[s["name"]])
        rates = f["evals_per_s"]
        assert rates["population"] > 0 and rates["rank1"] > 0
        # what the trainer runs: auto on the CPU EP is the loop at the trainer's concurrency plan, always
        loop = rates[loop_row()]
        assert s["chosen"] == "loop"
        assert f["population_beats_loop"] == (rates["population"] > loop)
        assert f["population_vs_loop"] == pytest.approx(rates["population"] / loop, rel=1e-2)
        beat = "beat" if f["population_beats_loop"] else "did not beat"
        assert any(ln.startswith(f"{s['name']:>4} chosen") and f"the population {beat} the loop" in ln for ln in lines)
        table = [ln for ln in lines if ln.split()[:1] == [s["name"]] and len(ln.split()) == 8]
        assert {ln.split()[2] for ln in table} == set(rates), table
        if torch:
            assert s["chosen_vs_torch"] == pytest.approx(loop / rates["torch_eager"], rel=1e-2)
        else:
            assert s["chosen_vs_torch"] is None and "torch_eager" not in rates
    return out["sizes"]


def test_chosen_is_what_auto_trains_with_on_the_device_measured():
    """The CPU EP: evaluator.choose_evaluator's fixed loop, even where the population measured faster; an
    accelerator, where auto measures: the faster, a tie to the population (worker/probe.py's rule)."""
    loop = loop_row()
    fast_pop, fast_loop = {loop: 1.0, "population": 2.0}, {loop: 2.0, "population": 1.0}
    assert chosen_evaluator([CPU], fast_pop) == "loop"
    assert chosen_evaluator([CUDA, CPU], fast_pop) == "population"
    assert chosen_evaluator([CUDA, CPU], fast_loop) == "loop"
    assert chosen_evaluator([CUDA, CPU], {loop: 1.0, "population": 1.0}) == "population"


def test_throughput_bench_tiny_json(monkeypatch, capsys):
    """In-process: a subprocess would spend ~2.5 s importing torch again (the command line itself is run by
    the test without torch below)."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    monkeypatch.setattr(sys, "argv", ["spsa_throughput", "--sizes", "124K,S", *TINY])
    try:
        spsa_throughput.main()
    finally:  # its matmul peak sets torch's threads for the whole process: the tests after this keep theirs
        torch.set_num_threads(threads)
    _check(capsys.readouterr().out, ["124K", "S"], torch=True)


def test_throughput_bench_without_torch():
    r = _run([sys.executable, "-c", NO_TORCH, "--sizes", "124K", *TINY])
    assert "torch not installed" in r.stdout
    _check(r.stdout, ["124K"], torch=False)


@pytest.mark.parametrize("noise", [Noise.BITS, Noise.SIGNS, Noise.RANK1])
def test_population_rows_get_the_keyed_noise(noise):
    m = SIZES["124K"]
    lay = params.layout(m)
    body, feeds = population_feeds(m, 2, noise)
    shapes = [lay.shapes[lay.names.index(n)] for n in body]
    for j in range(2):
        want = keyed.noise(0, 0, 0, j, lay.body) if noise is not Noise.RANK1 else keyed.rank1_probe(0, 0, 0, j, shapes)
        z = direction(lay, feeds, j, lay.body)
        np.testing.assert_array_equal(z[: lay.body], want)
        assert not z[lay.body :].any()  # the decoder is not perturbed: it learns by the delta rule


def test_host_noise_prints_both_forms_and_the_bits_cross_in_fewer_bytes(capsys):
    from bench import host_noise

    assert host_noise.main(["--sizes", "124K", "--k", "2", "--repeats", "1"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| 124K")]
    mib = {(r[2].strip(), r[3].strip()): float(r[5]) for r in rows}
    assert set(mib) == {(d, f) for d in ("1", "0.5") for f in ("int8 signs", "keyed bits")}
    assert mib["1", "keyed bits"] * 8 == pytest.approx(mib["1", "int8 signs"], rel=0.05)  # a bit a weight, not a byte
    assert mib["0.5", "keyed bits"] * 4 == pytest.approx(mib["0.5", "int8 signs"], rel=0.05)  # and a mask bit
