"""What the console shows at many experts: id sets as runs, the experts table as its best and worst rows."""

from coordinator.progress import EDGE_ROWS, TABLE_ROWS, experts_table
from soma_edge.processes import logs


def summary_of(n: int) -> dict:
    experts = {
        str(e): {"version": 1, "sha256": f"{e:064x}", "step": 10, "train_loss": 2.0, "val_loss": 2.0 + (e * 7 % n) / n}
        for e in range(n)
    }
    experts[str(n - 1)]["val_loss"] = None  # never scored: counts as the worst
    return {"run": "runs/x", "round": 3, "rounds": 5, "experts": experts}


def test_a_table_of_many_experts_shows_the_best_and_worst_and_says_how_to_see_all():
    s = summary_of(256)
    t = experts_table(s)
    ids = [int(c) for c in t.columns[0]._cells]
    vals = {e: s["experts"][str(e)]["val_loss"] for e in range(256)}
    scored = sorted((v, e) for e, v in vals.items() if v is not None)
    assert ids[:EDGE_ROWS] == [e for _, e in scored[:EDGE_ROWS]]
    assert ids[-1] == 255 and ids[EDGE_ROWS:-1] == [e for _, e in scored[-(EDGE_ROWS - 1) :]]
    assert "256 experts" in t.title and "soma-coord status runs/x --all" in t.caption
    assert len(experts_table(s, every=True).columns[0]._cells) == 256
    small = summary_of(TABLE_ROWS)
    assert len(experts_table(small).columns[0]._cells) == TABLE_ROWS and experts_table(small).caption is None


def test_expert_sets_print_as_runs_of_ids_beyond_eight():
    assert logs.expert_set({3, 1, 2}) == "[1, 2, 3]"
    assert logs.expert_set(range(64)) == "64 experts: 0-63"
    assert logs.expert_set([*range(32), *range(40, 48), 50]) == "41 experts: 0-31, 40-47, 50"
    assert logs.expert_set(range(0, 256, 2)) == "128 experts: 0, 2, 4, 6, ..."
