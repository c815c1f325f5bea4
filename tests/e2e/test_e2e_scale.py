"""Many experts for real: `soma-coord start` prepares 64 experts of a ~1.5 MB corpus and trains them on two
local workers (real SuperLink, SuperNodes, ServerApp and ClientApps on 127.0.0.1) for three short rounds.

Every expert gets val text of its own (prepare's quotas), none fails, every one advances in every round, the
held-out loss falls, and the console stays readable: id sets as runs, the experts table as its best and
worst rows. Tiny experts (embed 16, hidden 64); every other setting is the shipped default.
"""

from __future__ import annotations

import math
import os

from soma_edge.corpus import documents
from soma_edge.rundir.layout import RunDir
from tests.helpers.corpus import write_many_documents_corpus
from tests.helpers.federation import finish, leftovers, metric_lines, start_coordinator

N = 64
CONFIG = f"""
seed = 0
[model]
embed = 16
hidden = 64
[federation]
join_grace = 0.0  # its two local workers are all there is
experts = {N}
rounds = 3
round_seconds = 6.0
local_workers = 2
"""


def test_sixty_four_experts_train_on_two_workers(tmp_path):
    src = write_many_documents_corpus(tmp_path / "corpus")
    (tmp_path / "n64.toml").write_text(CONFIG)
    env = dict(os.environ, SOMA_CACHE=str(tmp_path / "cache"))
    fed = {"root": tmp_path, "run": tmp_path / "run", "corpus": src, "config": tmp_path / "n64.toml", "env": env}
    finish(fed, start_coordinator(fed))
    assert leftovers(fed["run"]) == []
    rd = RunDir(fed["run"])
    prep = rd.read_prepare()
    for e in range(N):  # its own val text: 8 windows at least, none borrowed from other clusters
        val = documents.SEPARATOR.join(rd.shard(h) for h in prep.shards(e, "val"))
        assert (len(val) - 1) // 128 >= 8, e
    rounds = metric_lines(rd, "round")
    assert [m["round"] for m in rounds] == [1, 2, 3]
    assert [m["accepted"] for m in rounds] == [N, N, N]  # every expert advanced every round: no failed task
    assert all(m["accepted"] for m in metric_lines(rd, "expert"))
    vals = [m["val_loss_mean"] for m in rounds]
    assert vals[0] < math.log(256) - 1.0 and vals[2] < vals[0]  # learning: from ~5.5 (uniform) down, and on
    state = rd.read_state()
    assert all(state.expert(e).version >= 3 for e in range(N))
    log = (tmp_path / "start.log").read_text()
    plans = [line for line in log.splitlines() if "round 1/3: w" in line]
    assert plans and "experts: " in plans[0] and len(plans[0]) < 300  # counts and runs, not 64 ids
    words = " ".join(log.split())  # the table's title and caption as rich wrapped them
    assert f"{N} experts, the 5 lowest and 5 highest val losses" in words
    assert "every expert: soma-coord status" in words and "--all" in words
