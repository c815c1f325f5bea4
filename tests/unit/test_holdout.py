"""Text for every expert at any N (corpus.holdout, coordinator.prepare): train and held-out quotas, windows cut
within documents, and the router never fitted on held-out bytes."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator import prepare as prepare_mod
from soma_edge.corpus import documents, holdout, sources
from soma_edge.corpus import router as routing
from soma_edge.corpus.documents import SEPARATOR
from soma_edge.errors import CorpusError
from soma_edge.rundir.layout import RunDir

ROOT = Path(__file__).resolve().parents[2]
Q = holdout.Quota(128)
W = Q.window


def docs_of(lengths, splits, quota=Q):
    return holdout.Docs.of(lengths, splits, quota)


# ---------------------------------------------------------------- the quotas, on arrays


def test_reserve_is_at_most_a_quarter_of_a_document_in_whole_windows():
    assert Q.reserve(np.array([0, 4 * W - 1, 4 * W, 40 * W, 400 * W])).tolist() == [0, 0, 1, 10, 16]


def test_stream_windows_counts_as_eval_windows_cuts():
    for n in (0, 1, 128, 129, 257, 1000, 5000):
        want = 0 if n < 129 else len(documents.eval_windows(np.zeros(n, np.uint8), 128)[0])
        assert int(Q.stream_windows(n)) == want


def test_shortfall_counts_train_bytes_held_out_documents_and_reserves():
    # Cluster 0: one big train document, whose 16 set-aside windows cover val and test. Cluster 1: a train
    # document of 50 windows (12 set aside, 38 kept) and a val document of exactly 8 windows.
    d = docs_of([100 * W, 50 * W, 8 * 128 + 1], ["train", "train", "val"])
    s = holdout.shortfall(d, np.array([0, 1, 1]), 2, Q)
    assert s.train.tolist() == [0, 0] and s.held_out.tolist() == [0, 0] and not s.short.any()
    # Cluster 1 now: 30 windows (7 set aside, 23 kept: 9 short of 32) and a val document of 7 windows, so it
    # lacks 1 val and 8 test windows, 7 of which its reserve covers.
    d = docs_of([100 * W, 30 * W, 8 * 128], ["train", "train", "val"])
    s = holdout.shortfall(d, np.array([0, 1, 1]), 2, Q)
    assert s.train.tolist() == [0, 9 * W] and s.held_out.tolist() == [0, 2] and s.short.tolist() == [False, True]


def test_rebalance_gives_a_short_cluster_the_nearest_document_a_donor_can_spare():
    lengths = [100 * W, 100 * W, 100 * W, 10]
    d = docs_of(lengths, ["train"] * 4)
    labels = np.array([0, 0, 0, 1])  # cluster 1 holds 10 bytes
    d2 = np.array([[0.1, 0.9], [0.1, 0.5], [0.1, 0.7], [0.9, 0.0]], dtype=np.float32)
    got = holdout.rebalance(d, labels, d2, Q)
    assert got.tolist() == [0, 1, 0, 1]  # document 1 is cluster 1's nearest
    assert not holdout.shortfall(d, got, 2, Q).short.any()


def test_rebalance_refuses_when_no_donor_can_spare_a_document():
    d = docs_of([60 * W, 10], ["train", "train"])
    with pytest.raises(CorpusError, match="cannot give cluster 1 .* use fewer experts"):
        holdout.rebalance(d, np.array([0, 1]), np.array([[0.0, 0.5], [0.5, 0.0]], np.float32), Q)


def test_cut_takes_whole_windows_from_the_ends_of_train_documents():
    d = docs_of([40 * W, 40 * W, 3 * 128 + 1], ["train", "train", "val"])
    cuts = holdout.cut(d, np.array([0, 0, 0]), 1, Q)
    # val lacks 8 - 3 = 5 windows and test 8: document 0 gives its 10, document 1 the other 3.
    assert cuts == [holdout.Cut(0, 10, 5), holdout.Cut(1, 3, 0)]


def test_val_documents_heavier_than_a_quarter_of_the_train_text_join_it():
    # Cluster 0: 40 windows of train, a 40-window val document and a small one: both join train, and the large
    # one's last 8 windows are its val. Cluster 1: 400 windows of train, the same val: it stays val. Test
    # documents never move.
    d = docs_of([40 * W, 40 * W, 3 * W, 40 * W, 400 * W, 40 * W], ["train", "val", "val", "test", "train", "val"], None)
    labels = np.array([0, 0, 0, 0, 1, 1])
    assert holdout.heavy_val(d, labels, 2, Q) == [holdout.Cut(1, 8, 8), holdout.Cut(2, 0, 0)]
    # A val document too short to give 8 windows from its last quarter leaves its cluster as it is.
    short = docs_of([10 * W, 20 * W], ["train", "val"], None)
    assert holdout.heavy_val(short, np.array([0, 0]), 1, Q) == []


# ---------------------------------------------------------------- prepare at many experts


@pytest.fixture(scope="module")
def many(four_domain_docs, tmp_path_factory):
    """The four-domain corpus (167 documents, 11 held out) at 32 experts: the documents' split leaves most
    clusters without val or test text. The router fits are recorded to check what they saw."""
    base = tmp_path_factory.mktemp("many")
    with open(base / "four.jsonl", "w") as f:
        for d in four_domain_docs:
            f.write(json.dumps({"text": d.text.decode(), "domain": d.domain}) + "\n")
    fits = []
    real_fit = routing.fit

    def spy(texts, *args, **kwargs):
        fits.append((list(texts), list(kwargs["fit_on"])))
        return real_fit(texts, *args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(routing, "fit", spy)
    try:
        summary = prepare_mod.prepare(str(base / "four.jsonl"), 32, base / "run", seed=0, progress=False)
    finally:
        mp.undo()
    return base, summary, fits, sources.load_documents(base / "four.jsonl")


def test_every_expert_gets_train_text_and_eight_val_and_test_windows(many):
    base, s, _, _ = many
    run = RunDir(base / "run")
    prep = run.read_prepare()
    assert prep.seq_len == 128
    for e in range(32):
        stream = {sp: SEPARATOR.join(run.shard(h) for h in prep.shards(e, sp)) for sp in documents.SPLITS}
        assert len(stream["train"]) >= Q.train_bytes, e
        for sp in ("val", "test"):
            assert len(documents.eval_windows(np.frombuffer(stream[sp], np.uint8), 128)[0]) >= 8, (e, sp)
    assert sum(1 for c in s["clusters"] if c.get("cut")) >= 16  # most clusters needed windows cut


def test_a_cut_document_is_split_at_window_boundaries_into_disjoint_pieces(many):
    base, s, _, docs = many
    run = RunDir(base / "run")
    shards = {sp: [run.shard(c["shards"][sp]) for c in s["clusters"]] for sp in documents.SPLITS}
    cut_docs = 0
    for d in docs:
        if d.split != "train":
            continue
        # Its cluster: the one whose train shard holds its first half (a document gives at most a quarter).
        k = next(k for k, t in enumerate(shards["train"]) if d.text[: len(d.text) // 2] in t)
        train = shards["train"][k] + SEPARATOR
        if d.text + SEPARATOR in train:
            continue  # kept whole
        # The train shard holds the document up to a window boundary counted from its end, and not a byte
        # more; each window after it is in its cluster's val or test shard.
        u = next(u for u in range(1, 17) if d.text[: len(d.text) - u * W] + SEPARATOR in train)
        start = len(d.text) - u * W
        assert d.text[: start + 1] not in train
        for i in range(u):
            piece = d.text[start + i * W : start + (i + 1) * W]
            assert piece in shards["val"][k] or piece in shards["test"][k]
        cut_docs += 1
    assert cut_docs >= sum(1 for c in s["clusters"] if c.get("cut")) >= 16


def test_held_out_bytes_never_reach_the_routers_fit(many):
    _, s, fits, docs = many
    assert len(fits) == 2  # the plain fit left clusters short; the second fit set document ends aside
    texts, fit_on = fits[-1]
    assert fit_on == [i for i, d in enumerate(docs) if d.split == "train"]
    for i, d in enumerate(docs):
        if d.split == "train":
            aside = int(Q.reserve(np.array([len(d.text)]))[0]) * W
            assert texts[i] == d.text[: len(d.text) - aside]  # every window a cluster could cut is left out


def test_the_demos_prepare_cuts_nothing(tmp_path, monkeypatch):
    """4 experts on the default corpus: every cluster has its held-out documents, so the first fit stands and
    the shards are the plain document split (the demo's held-out set is what it was before quotas)."""
    loaded, real_load = [], sources.load_documents

    def load(*args, **kwargs):  # keeps the documents prepare read: reading the default corpus again costs ~2 s
        loaded.append(real_load(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(sources, "load_documents", load)
    s = prepare_mod.prepare("default", 4, tmp_path / "run", seed=0, progress=False)
    assert not any(c.get("cut") for c in s["clusters"])
    [docs] = loaded
    held = sum(len(d.text) for d in docs if d.split == "val")
    n_val = sum(1 for d in docs if d.split == "val")
    assert sum(c["bytes"]["val"] for c in s["clusters"]) == held + len(SEPARATOR) * (n_val - 4)


def test_a_corpus_too_small_is_refused_naming_the_most_experts_it_supports(tmp_path):
    src = tmp_path / "small.txt"
    src.write_text("".join(f"line {i} of a small corpus\n" for i in range(3000)))  # ~80 KB, 5 documents
    with pytest.raises(CorpusError, match=r"supports at most \d+ experts"):
        prepare_mod.prepare(str(src), 5, tmp_path / "run", progress=False)
    r = subprocess.run(
        [sys.executable, "-m", "coordinator", "prepare", str(src), "--experts", "64", "--out", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: ")
    assert "supports at most" in r.stderr and not (tmp_path / "r").exists()
