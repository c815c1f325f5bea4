"""`prepare`: router + content-addressed cluster shards; the corpus loaders; the CLI's bad-input contract."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator import debian_corpus
from coordinator.prepare import prepare
from soma_edge.corpus import documents
from soma_edge.corpus import router as routing
from soma_edge.corpus import sources as corpus_sources
from soma_edge.errors import CorpusError
from soma_edge.rundir.layout import RunDir
from tests.helpers.corpus import FOUR_DOMAINS

ROOT = Path(__file__).resolve().parents[2]


def write_jsonl(docs, path: Path) -> None:
    """A labelled JSONL of documents."""
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d.text.decode("utf-8"), "domain": d.domain}) + "\n")


@pytest.fixture(scope="module")
def prepared(four_domain_docs, tmp_path_factory):
    base = tmp_path_factory.mktemp("prep")
    write_jsonl(four_domain_docs, base / "four.jsonl")
    summary = prepare(str(base / "four.jsonl"), 4, base / "run", seed=0, progress=False)
    return base, summary


def test_purity_balance_and_summary(prepared):
    base, s = prepared
    assert s["schema"] == 1 and s["experts"] == 4 and s["seed"] == 0 and len(s["clusters"]) == 4
    assert set(s["domains"]) == set(FOUR_DOMAINS)
    # Purity, recomputed from the domain-by-cluster table: the largest domain of each cluster, over all bytes.
    table = np.array([[row.get(str(k), 0) for k in range(4)] for row in s["domains"].values()], dtype=float)
    assert s["purity"] == pytest.approx(table.max(axis=0).sum() / table.sum(), abs=1e-6)
    assert s["purity"] >= 0.85
    assert table.sum() == s["bytes"]
    # Balance: no cluster holds more than 2x the mean bytes (the corpus bytes, all splits).
    per_cluster = table.sum(axis=0)
    assert per_cluster.max() <= 2 * per_cluster.mean()
    assert sum(c["docs"] for c in s["clusters"]) == s["documents"]
    assert sorted(c["expert"] for c in s["clusters"]) == [0, 1, 2, 3]


def test_shards_are_content_addressed_and_complete(prepared, default_docs):
    base, s = prepared
    run = base / "run"
    assert sorted(p.name for p in run.iterdir()) == ["prepare.json", "router.msgpack", "shards"]
    assert json.loads((run / "prepare.json").read_text()) == s
    for c in s["clusters"]:
        for split in documents.SPLITS:
            data = (run / "shards" / f"{c['shards'][split]}.bin").read_bytes()
            assert hashlib.sha256(data).hexdigest() == c["shards"][split]
            assert len(data) == c["bytes"][split]
    # Shard bytes = document bytes + one separator between consecutive pieces of a shard: the cluster's
    # documents, and where a train document gave windows to val and test (only 11 documents of this corpus
    # are held out: tests/unit/test_holdout.py), its end, one piece more per split it gave to.
    for c in s["clusters"]:
        doc_bytes = sum(row.get(str(c["id"]), 0) for row in s["domains"].values())
        nonempty = sum(1 for sp in documents.SPLITS if c["bytes"][sp])
        pieces = c["docs"] + sum(1 for v in c.get("cut", {}).values() if v)  # at least one more per split
        seps = sum(c["bytes"].values()) - doc_bytes
        if not c.get("cut"):
            assert seps == len(documents.SEPARATOR) * (pieces - nonempty)
        else:
            assert seps >= len(documents.SEPARATOR) * (pieces - nonempty)
    # Splits follow corpus.split_of: every held-out byte is in a val/test shard.
    docs = corpus_sources.load_documents(base / "four.jsonl")
    held = sum(len(d.text) for d in docs if d.split != "train")
    assert sum(c["bytes"]["val"] + c["bytes"]["test"] for c in s["clusters"]) >= held
    router = routing.load(run / "router.msgpack")
    assert router.n_experts == 4
    assert hashlib.sha256((run / "router.msgpack").read_bytes()).hexdigest() == s["router"]["sha256"]
    for e in range(4):
        want = [c["shards"]["train"] for c in s["clusters"] if c["expert"] == e]
        assert RunDir(base / "run").read_prepare().shards(e, "train") == want and want


def test_deterministic(prepared):
    base, s = prepared
    again = prepare(str(base / "four.jsonl"), 4, base / "run2", seed=0, progress=False)
    assert (base / "run" / "router.msgpack").read_bytes() == (base / "run2" / "router.msgpack").read_bytes()
    assert [c["shards"] for c in again["clusters"]] == [c["shards"] for c in s["clusters"]]
    assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in s.items() if k != "seconds"}


def test_into_an_existing_run_directory(tmp_path):
    src = tmp_path / "texts"
    for i, topic in enumerate(["alpha beta gamma\n", "lorem ipsum dolor\n", "one two three\n"]):
        (src / f"d{i}").mkdir(parents=True)
        (src / f"d{i}" / "t.txt").write_text(topic * 2000)
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.toml").write_text("seed = 0\n")
    (run / "shards").mkdir()
    (run / "shards" / "old.bin").write_bytes(b"old")
    s = prepare(str(src), 2, run, progress=False)
    assert (run / "run.toml").read_text() == "seed = 0\n" and (run / "shards" / "old.bin").read_bytes() == b"old"
    for c in s["clusters"]:
        assert all((run / "shards" / f"{h}.bin").exists() for h in c["shards"].values())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dir left


def test_failure_leaves_nothing_behind(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("some text\n" * 5000)

    def boom(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr("coordinator.prepare._write", boom)
    with pytest.raises(RuntimeError):
        prepare(str(tmp_path / "a.txt"), 1, tmp_path / "run", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


# ---------------------------------------------------------------- loaders


def test_load_documents_directory_jsonl_and_skips(tmp_path):
    (tmp_path / "poems").mkdir()
    (tmp_path / "poems" / "a.txt").write_text("roses are red\n" * 10)
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "b.py").write_text("print('hi')\n")
    (tmp_path / "code" / "img.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (tmp_path / ".hidden.txt").write_text("secret\n")
    (tmp_path / "recs.jsonl").write_text('{"text": "first", "domain": "x"}\n\n{"text": "second"}\n')
    docs = corpus_sources.load_documents(tmp_path)
    assert sorted((d.domain, d.text) for d in docs) == [
        ("", b"second"),
        ("code", b"print('hi')\n"),
        ("poems", b"roses are red\n" * 10),
        ("x", b"first"),
    ]
    big = tmp_path / "big.txt"
    big.write_bytes(b"line of text\n" * 5000)  # 65 KB -> cut at line ends into <= 16 KiB documents
    pieces = corpus_sources.load_documents(big)
    assert len(pieces) == 4 and b"".join(d.text for d in pieces) == big.read_bytes()
    assert all(len(d.text) <= documents.CHUNK and d.text.endswith(b"\n") for d in pieces)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: (p / "e.txt").write_text(""), r"e\.txt: empty corpus"),
        (lambda p: (p / "e.txt").write_text("  \n\n"), r"e\.txt: empty corpus"),
        (lambda p: (p / "b.bin").write_bytes(b"\x7fELF\x02\x01\x00\x00"), r"b\.bin: a binary file \(NUL byte"),
        (lambda p: (p / "r.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n'), r"r\.jsonl:2: not JSON"),
        (lambda p: (p / "r.jsonl").write_text('{"text": 3}\n'), r"r\.jsonl:1: expected an object"),
    ],
)
def test_load_documents_bad_files(tmp_path, make, match):
    make(tmp_path)
    (target,) = [p for p in tmp_path.iterdir()]
    with pytest.raises(CorpusError, match=match):
        corpus_sources.load_documents(target)


def test_load_documents_directory_without_text(tmp_path):
    with pytest.raises(CorpusError, match="no readable text"):
        corpus_sources.load_documents(tmp_path)
    (tmp_path / "x.bin").write_bytes(bytes(range(256)))
    with pytest.raises(CorpusError, match=r"no readable text.*skipped 1 file.*x\.bin"):
        corpus_sources.load_documents(tmp_path)
    with pytest.raises(CorpusError, match="no such file"):
        corpus_sources.load_documents(tmp_path / "nope")


def test_debian_corpus_reads_only_a_checked_cache(tmp_path):
    with pytest.raises(CorpusError, match="not in the cache"):
        corpus_sources.load_documents("debian", cache=tmp_path)
    root = tmp_path / corpus_sources.DEBIAN
    root.mkdir()
    text = b"ein kleiner Text\n" * 100
    (root / "lang_de.txt").write_bytes(text)
    entry = {"path": "lang_de.txt", "domain": "lang_de", "bytes": len(text), "sha256": hashlib.sha256(text).hexdigest()}
    (root / "manifest.json").write_text(json.dumps({"files": [entry]}))
    docs = corpus_sources.load_documents("debian", cache=tmp_path)
    assert {d.domain for d in docs} == {"lang_de"} and b"".join(d.text for d in docs) == text
    (root / "lang_de.txt").write_bytes(text + b"tampered")
    with pytest.raises(CorpusError, match="sha256 differs"):
        corpus_sources.load_documents("debian", cache=tmp_path)


# ---------------------------------------------------------------- the debian recipe's checks (never run)


def test_debian_recipe_refuses_without_root(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(CorpusError, match="must run as root.*uid 1000"):
        debian_corpus.build(cache=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_debian_recipe_names_pins_that_left_the_archive(tmp_path, monkeypatch):
    """apt-get download fails; apt-cache policy shows a newer version of one pin only."""
    pkg, version = "glibc-source", debian_corpus.PINS["glibc-source"]

    def fake_run(cmd, *args, **kwargs):
        name = cmd[2]
        listed = "2.36-9+deb12u99" if name == pkg else debian_corpus.PINS[name]
        out = f"{name}:\n  Installed: (none)\n  Candidate: {listed}\n  Version table:\n     {listed} 500\n"
        return subprocess.CompletedProcess(cmd, 0, out, "")

    monkeypatch.setattr(debian_corpus, "_run", lambda cmd, cwd: subprocess.CompletedProcess(cmd, 100, "", "E: nope"))
    monkeypatch.setattr(debian_corpus.subprocess, "run", fake_run)
    with pytest.raises(CorpusError) as e:
        debian_corpus.download(tmp_path)
    msg = str(e.value)
    assert f"{pkg}={version} (apt-cache policy offers 2.36-9+deb12u99)" in msg and "left the archive" in msg
    assert "run `apt-get update`" in msg  # stale lists look the same: the first thing to try
    assert "libpython3.11-stdlib=" not in msg  # the pins still in the archive are not blamed


def test_debian_text_extractors():
    troff = (
        '.TH X 1\n.SH NAME\nfoo \\- do things\n.SH OPTIONS\n.TP\n.BR \\-v ", " \\-\\-verbose\nSay\n.I more\nthings.\n'
    )
    assert debian_corpus.man_text(troff) == "NAME\nfoo - do things\n\nOPTIONS\n-v, --verbose\nSay more things.\n"
    assert debian_corpus.html_text("<html><head><title>t</title></head><p>a &amp; b</p><br>c</html>") == "a & b\n\nc\n"
    sources = {
        "big": [((0, b"k%d" % i), "f", i, b"x" * 99 + b"\n") for i in range(100)],
        "small": [((0, b"a"), "g", 0, b"y" * 49 + b"\n")],
    }
    text, used = debian_corpus.select("d", sources, budget=1000)
    assert used["small"] == 52 and 900 <= used["big"] <= 948 and len(text) <= 1000


# ---------------------------------------------------------------- the CLI contract


def _cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "coordinator", "prepare", *args], capture_output=True, text=True, cwd=cwd or ROOT
    )


def test_cli_prepares_and_prints_a_summary(tmp_path):
    for name, line in [("a", "the cat sat on the mat\n"), ("b", "def f(x): return x\n")]:
        (tmp_path / "src" / name).mkdir(parents=True)
        (tmp_path / "src" / name / "t.txt").write_text(line * 3000)
    r = _cli(str(tmp_path / "src"), "--experts", "2", "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    assert "purity 1.000" in r.stdout and "top domain" in r.stdout
    s = json.loads((tmp_path / "run" / "prepare.json").read_text())
    assert s["purity"] == 1.0 and len(s["clusters"]) == 2


def _bad_inputs(tmp: Path) -> list[tuple[list[str], str]]:
    (tmp / "empty.txt").write_text("")
    (tmp / "emptydir").mkdir()
    (tmp / "bindir").mkdir()
    (tmp / "bindir" / "blob.dat").write_bytes(os.urandom(2048) + b"\x00")
    (tmp / "prog").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(64))
    (tmp / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "fine"}\n{text: nope}\n')
    (tmp / "small.txt").write_text("just one short document\n")
    return [
        (["empty.txt", "--experts", "2"], "empty.txt: empty corpus"),
        (["emptydir", "--experts", "2"], "emptydir: no readable text"),
        (["bindir", "--experts", "2"], "blob.dat"),
        (["prog", "--experts", "2"], "prog: a binary file"),
        (["bad.jsonl", "--experts", "2"], "bad.jsonl:3: not JSON"),
        (["small.txt", "--experts", "2"], "has 1 training document (of 1, "),
        (["small.txt", "--experts", "1"], "too small for one expert"),
        (["small.txt", "--experts", "0"], "--experts"),
        (["small.txt", "--experts", "1", "--clusters", "0"], "--clusters"),
        (["nowhere", "--experts", "1"], "nowhere: no such file"),
    ]


def test_cli_bad_input_is_one_error_line_and_exit_2(tmp_path):
    for args, needle in _bad_inputs(tmp_path):
        r = _cli(*args, "--out", str(tmp_path / "run"), cwd=tmp_path)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2, (args, r.stderr)
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (args, r.stderr)
        assert "Traceback" not in r.stderr
        assert not (tmp_path / "run").exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".run")]  # no temp dir left
