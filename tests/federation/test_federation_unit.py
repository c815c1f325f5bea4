"""The round loop and reply validation, with a fake Flower Grid.

The fake Grid hands each message straight to the real ClientApp (`worker.client_app.app`), which trains
for real on ORT; only Flower's transport is replaced. Real-process tests are in test_e2e_federation.py.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys

import numpy as np
import pytest
from flwr.app import Message, RecordDict

from coordinator import scheduler
from coordinator.loop import Coordinator
from soma_edge import checkpoint
from soma_edge import config as config_mod
from soma_edge.errors import CheckpointError, CodecError, ValidationError
from soma_edge.rundir.layout import RunDir, RunLockedError
from soma_edge.spsa.optim import OptState
from soma_edge.wire import protocol
from tests.helpers.fakegrid import (
    SHORT_ROUND,
    FakeGrid,
    equal_rates,
    hashes,
    hold_first_train_reply,
    set_fed,
    train_tasks,
)
from tests.helpers.fuzz import good_result
from worker import client_app


def test_rounds_advance_sticky_and_checkpointed(run, tmp_path, monkeypatch):
    equal_rates(monkeypatch)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    state = Coordinator(grid, run).main()
    assert state.round == 2
    for e in range(4):
        x = state.expert(e)
        assert x.version == 2 and x.step > 0
        body = checkpoint.load(run.root / x.path, "expert")
        assert protocol.weights_sha256(body["weights"]) == x.sha256 == body["sha256"]
        assert body["weights"].dtype == np.float32 and np.isfinite(body["val_loss"])
    m = run.read_metrics()
    assert [(x["type"], x["round"]) for x in m].count(("round", 1)) == 1 and len(m) == 2 * (4 + 1)
    r2 = [x for x in m if x["type"] == "expert" and x["round"] == 2]
    # Round 2 keeps every expert where it was: no weights travel, no shard travels, and nothing moved.
    assert all(x["accepted"] for x in r2)
    assert [x["weights_bytes_down"] for x in r2] == [0, 0, 0, 0]
    assert [x["shard_bytes_down"] for x in r2] == [0, 0, 0, 0]
    assert next(x for x in m if x["type"] == "round" and x["round"] == 2)["moved"] == []
    # Round 1 sent version 0 weights to every node (their caches were empty).
    assert all(x["weights_bytes_down"] > 0 for x in m if x["type"] == "expert" and x["round"] == 1)
    # Two equal nodes get two experts each.
    assert sorted([x["node"] for x in r2].count(n) for n in ("a", "b")) == [2, 2]
    # The routed-mixture val loss is computed every round.
    assert all(np.isfinite(x["mixture_val_loss"]) for x in m if x["type"] == "round")
    # Old versions are pruned to keep_versions (3): v0..v2 all kept here, with the update logs that made v1
    # and v2 (reply = auto sends logs on the fake grid's unmeasured links); status says done.
    kept = sorted(p.name for p in (run.root / "experts" / "0").iterdir())
    assert kept == ["l1.msgpack", "l2.msgpack", "v0.msgpack", "v1.msgpack", "v2.msgpack"]
    assert run.read_status()["phase"] == "done"


def test_float16_replies_stored_as_received_and_old_versions_pruned(run, tmp_path):
    set_fed(run, rounds=3, reply="weights", reply_dtype="float16", keep_versions=2, round_seconds=SHORT_ROUND)
    state = Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main()
    for e in range(4):
        x = state.expert(e)
        body = checkpoint.load(run.root / x.path, "expert")
        assert body["weights"].dtype == np.float16 and x.version == 3
        assert protocol.weights_sha256(body["weights"]) == x.sha256  # the hash of the float16 bytes received
        # keep_versions = 2 newest, plus the best version of this commit and of the one before (the fallback)
        prev = checkpoint.load(run.prev_state_path, "run_state")["experts"][str(e)]
        kept = {2, 3, x.best.version, prev["best"]["version"]}
        assert sorted(p.name for p in (run.root / "experts" / str(e)).iterdir()) == [
            f"v{v}.msgpack" for v in sorted(kept)
        ]
    up = [m["weights_bytes_up"] for m in run.read_metrics() if m["type"] == "expert"]
    assert set(up) == {2 * state_size(run)}  # half the bytes of float32


def state_size(rd: RunDir) -> int:
    from soma_edge.expert import params

    return params.layout(rd.load_config().model).size


def _tamper_all(kind):
    def fn(nid, body):
        for res in body["results"]:
            if kind == "shape":
                res["weights"] = res["weights"][:-1]
            elif kind == "nan":
                res["weights"] = res["weights"].copy()
                res["weights"][3] = np.nan
                res["sha256"] = protocol.weights_sha256(res["weights"])
            elif kind == "stale":
                res["base_sha256"] = "0" * 64
            elif kind == "unknown_expert":
                res["expert"] = 99
            elif kind == "dtype":
                res["weights"] = res["weights"].astype(np.float64)
                res["sha256"] = protocol.weights_sha256(res["weights"])
            elif kind == "loss":
                res["train_loss"] = float("inf")
            elif kind == "hash":
                res["sha256"] = "f" * 64
            elif kind == "expert_list":  # unhashable: must not reach `e in seen`
                res["expert"] = [res["expert"]]
            elif kind == "seconds_str":
                res["seconds"] = "x"
            elif kind == "evals_negative":
                res["forward_evals"] = -1
        if kind == "wrong_node":
            body["node"] = nid + 1
        elif kind == "torch_bytes":  # would make json.dumps of status.json / metrics.jsonl raise
            body["torch_importable"] = b"yes"
        elif kind == "missing_type":
            body["missing"] = {"weights": 5}
        elif kind == "errors_type":
            body["errors"] = [1]
        return body

    return fn


REASONS = {
    "shape": "shape",
    "nan": "NaN",
    "stale": "stale base version",
    "unknown_expert": "unknown expert 99",
    "dtype": "expected float32",
    "loss": "not finite",
    "hash": "sha256",
    "wrong_node": "claiming node",
    "expert_list": "names no expert",
    "seconds_str": "not a finite duration",
    "evals_negative": "not a count",
    "torch_bytes": "torch_importable",
    "missing_type": "missing.weights",
    "errors_type": "errors is not a list",
}


@pytest.mark.parametrize("kind", sorted(REASONS))
def test_bad_replies_rejected_and_run_dir_untouched(run, tmp_path, kind, caplog, monkeypatch):
    # Equal rates: with a noisy probe one node could get all 4 experts, and its 3rd strike drops the 4th reply.
    equal_rates(monkeypatch)
    set_fed(run, rounds=0, round_seconds=SHORT_ROUND)
    Coordinator(FakeGrid(tmp_path / "idle", ["a", "b"]), run).main()  # writes version 0 of every expert, no round
    set_fed(run, rounds=1, reply="weights")  # the tampering edits the weights a weights reply carries
    before = hashes(run.root)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"], tamper=_tamper_all(kind))
    with caplog.at_level(logging.WARNING, logger="soma.coord"):
        state = Coordinator(grid, run).main()
    assert state.round == 1 and all(x.version == 0 for x in state.experts.values())
    assert hashes(run.root) == before  # experts, shards, router, prepare.json, run.toml: byte-identical
    rejected = next(m for m in run.read_metrics() if m["type"] == "round")["rejected"]
    assert len(rejected) == 4 and all(REASONS[kind] in r["reason"] for r in rejected), rejected
    assert REASONS[kind] in caplog.text and "rejected" in caplog.text


def test_rejection_leaves_existing_versions_and_files_unchanged(run, tmp_path):
    set_fed(run, rounds=1, reply="weights", round_seconds=SHORT_ROUND)  # NaN weights: a weights reply
    Coordinator(FakeGrid(tmp_path / "n1", ["a", "b"]), run).main()
    state_before = run.read_state().experts
    set_fed(run, rounds=2)
    before = hashes(run.root)  # run.toml changed by _set; everything else is what round 1 left
    grid = FakeGrid(tmp_path / "n2", ["a", "b"], tamper=_tamper_all("nan"))
    state = Coordinator(grid, run).main()
    assert state.round == 2 and state.experts == state_before
    assert hashes(run.root) == before


def _padded(body: dict, nbytes: int) -> dict:
    """`body` with a "pad" field sized so that its packed reply is exactly `nbytes` long."""
    out = {**body, "pad": b""}
    for _ in range(4):  # the bin header grows from 2 to 5 bytes once, then the size is exact
        short = nbytes - protocol.payload_bytes(protocol.pack(out, protocol.KIND_REPLY))
        out["pad"] = b"\0" * (len(out["pad"]) + short)
    assert protocol.payload_bytes(protocol.pack(out, protocol.KIND_REPLY)) == nbytes
    return out


def test_a_reply_over_the_per_node_bound_is_refused_and_one_at_it_accepted(run, tmp_path, caplog, monkeypatch):
    """The coordinator decodes a node's train reply only up to that node's bound (`Expected.max_reply_bytes`:
    its tasks' weights and three optimizer vectors each, plus room for metrics). Node a's replies come
    back one byte over it, node b's exactly at it: a's experts keep version 0 with their files untouched,
    one line per refused result names the size and the bound, and b's experts advance, so an off-by-one
    bound either way fails here."""
    from soma_edge.expert import params

    equal_rates(monkeypatch)  # two experts per node
    set_fed(run, rounds=0)
    Coordinator(FakeGrid(tmp_path / "idle", ["a", "b"]), run).main()  # version 0 of every expert, no round
    set_fed(run, rounds=1)
    cfg = run.load_config()
    before = hashes(run.root)
    bounds: dict[int, int] = {}

    def pad(nid, body):
        tasks = {r["expert"]: protocol.SentTask() for r in body["results"]}
        bound = protocol.Expected(nid, body["round"], tasks, params.count(cfg.model), "float32").max_reply_bytes()
        bounds[nid] = bound
        return _padded(body, bound + 1 if nid == 1000 else bound)

    with caplog.at_level(logging.WARNING, logger="soma.coord"):
        state = Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"], tamper=pad), run).main()
    rnd = next(m for m in run.read_metrics() if m["type"] == "round")
    refused = sorted(r["expert"] for r in rnd["rejected"])
    accepted = [e for e in range(4) if state.expert(e).version == 1]
    assert len(refused) == 2 and sorted(refused + accepted) == [0, 1, 2, 3], (refused, accepted)
    assert all(state.expert(e).version == 0 for e in refused)
    why = f"train_reply message of {bounds[1000] + 1} bytes exceeds the limit of {bounds[1000]} bytes"
    assert all(r["node"] == "a" and r["reason"] == why for r in rnd["rejected"]), rnd["rejected"]
    lines = [r.getMessage() for r in caplog.records if "rejected expert" in r.getMessage()]
    assert len(lines) == 2 and all(why in x and "\n" not in x for x in lines), lines
    after = hashes(run.root)
    for e in refused:  # nothing of the refused results was stored
        assert {k: v for k, v in after.items() if k.startswith(f"experts/{e}/")} == {
            k: v for k, v in before.items() if k.startswith(f"experts/{e}/")
        }
    assert all((run.root / "experts" / str(e) / "v1.msgpack").is_file() for e in accepted)


def test_missed_deadline_moves_experts_and_loses_nothing(run, tmp_path):
    set_fed(run, rounds=2, deadline_slack=1.0)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])

    orig_push = grid.push_messages

    def push(messages):
        ids = orig_push(messages)
        if any(m.metadata.message_type == protocol.TRAIN for m in messages) and not grid.dead:
            grid.dead.add(1001)  # node "b" dies as soon as round 1 is sent
        return ids

    grid.push_messages = push
    state = Coordinator(grid, run).main()
    m = run.read_metrics()
    r1 = {x["expert"]: x for x in m if x["type"] == "expert" and x["round"] == 1}
    r2 = {x["expert"]: x for x in m if x["type"] == "expert" and x["round"] == 2}
    lost = [e for e, x in r1.items() if x["node"] == "b"]
    assert lost and all(not r1[e]["accepted"] and "deadline" in r1[e]["reason"] for e in lost)
    # Round 2: everything on the survivor, every expert advanced, the dead node's experts included.
    assert all(x["node"] == "a" and x["accepted"] for x in r2.values())
    for e in range(4):
        assert state.expert(e).version == (2 if e not in lost else 1)
        # every accepted version is on disk and intact
        for v in range(state.expert(e).version + 1):
            checkpoint.load(run.root / f"experts/{e}/v{v}.msgpack", "expert")


def test_resume_continues_without_repeating_rounds(run, tmp_path):
    set_fed(run, rounds=1, round_seconds=SHORT_ROUND)
    Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main()
    s1 = run.read_state()
    set_fed(run, rounds=3)
    # Debris of a crashed round 2: a metrics line and a version file beyond the committed state.
    run.write_metrics(run.read_metrics() + [{"type": "round", "round": 2, "debris": True}])
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])  # same caches: nothing needs sending again
    state = Coordinator(grid, run).main()
    rounds = [x["round"] for x in run.read_metrics() if x["type"] == "round"]
    assert rounds == [1, 2, 3] and not any(x.get("debris") for x in run.read_metrics())
    assert all(x.version == 3 for x in state.experts.values())
    assert state.run_id == s1.run_id
    r2 = [x for x in run.read_metrics() if x["type"] == "expert" and x["round"] == 2]
    assert sum(x["weights_bytes_down"] for x in r2) == 0  # the restarted nodes reported their caches


def test_metrics_only_grow_during_a_run_and_a_torn_last_line_goes_on_resume(run, tmp_path):
    set_fed(run, rounds=2, round_seconds=SHORT_ROUND)
    sizes, real = [], run.append_metrics

    def append(lines):
        real(lines)
        sizes.append(run.metrics_path.read_bytes())

    run.append_metrics = append
    Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main()
    assert len(sizes) == 2 and sizes[1].startswith(sizes[0]) and sizes[1] == run.metrics_path.read_bytes()
    # A crash tore the last line of a third commit's append, which never reached state.msgpack.
    with open(run.metrics_path, "ab") as f:
        f.write(b'{"type": "expert", "round": 3, "exp')
    assert run.read_metrics() == [json.loads(x) for x in sizes[1].splitlines()]  # readers skip it
    run.truncate_metrics(2)
    assert run.metrics_path.read_bytes() == sizes[1]
    run.truncate_metrics(1)  # and whole lines of an uncommitted round go too
    assert [m["round"] for m in run.read_metrics()] == [1] * 5


def test_optimizer_state_travels_checkpoints_and_resumes_bit_for_bit(run, tmp_path):
    cfg = run.load_config()
    cfg.spsa.update, cfg.spsa.plateau, cfg.spsa.plateau_patience = "adam", True, 1
    cfg.federation.rounds, cfg.federation.round_seconds = 1, SHORT_ROUND
    cfg.federation.reply = "weights"  # the optimizer state travels in weights replies
    cfg.federation.pipeline = False  # pipelined, round 3 starts before round 2's val loss: its scale lags a round
    run.save_config(config_mod.validate(cfg))
    Coordinator(FakeGrid(tmp_path / "n1", ["a", "b"]), run).main()
    state = run.read_state()
    stored = {}
    for e in range(4):
        x = state.expert(e)
        opt = OptState.from_record(checkpoint.load(run.root / x.path, "expert")["opt"], state_size(run))
        assert opt.adam_m is not None and np.any(opt.adam_v > 0) and opt.lr_scale == 1.0
        assert x.best_val == x.val_loss and x.best_step == x.step  # the first val is the best
        stored[e] = opt
        x.best_val = 0.0  # unbeatable: round 2 must count as a plateau and halve lr and eps
    run.save_state(state.to_dict())
    set_fed(run, rounds=3)
    grid = FakeGrid(tmp_path / "n2", ["a", "b"])  # fresh caches: weights and optimizer state are sent again
    state = Coordinator(grid, run).main()
    tasks = train_tasks(grid)
    r2 = {t["expert"]: t for t in tasks[:4]}
    for e, opt in stored.items():  # what resumed is exactly what was checkpointed
        sent = OptState.from_record(r2[e]["opt"], state_size(run))
        assert sent.adam_m.tobytes() == opt.adam_m.tobytes() and sent.adam_v.tobytes() == opt.adam_v.tobytes()
        assert r2[e]["lr_scale"] == 1.0
    assert {t["lr_scale"] for t in tasks[4:]} == {0.5}  # round 3 runs at the scale decided after round 2
    assert all(x.lr_scale == 0.25 and x.version == 3 for x in state.experts.values())  # and halves again
    lines = [m for m in run.read_metrics() if m["type"] == "expert" and m["round"] == 3]
    assert all(m["accepted"] and m["lr_scale"] == 0.5 and m["next_lr_scale"] == 0.25 for m in lines)
    assert all(m["opt_bytes_up"] == 2 * 4 * state_size(run) for m in lines)  # Adam's two float32 moments


def test_optimizer_state_that_does_not_fit_its_weights_stops_the_run(run, tmp_path):
    set_fed(run, rounds=0)
    Coordinator(FakeGrid(tmp_path / "idle", ["a", "b"]), run).main()
    path = run.root / run.read_state().expert(2).path
    body = checkpoint.load(path, "expert")
    body["opt"] = OptState(adam_m=np.zeros(7, np.float32), adam_v=np.zeros(7, np.float32)).to_record()
    checkpoint.save(path, body, "expert")
    set_fed(run, rounds=1)
    with pytest.raises(CheckpointError, match=r"v0.msgpack: optimizer state: adam_m is float32\[7\]"):
        Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main()


def test_run_lock_excludes_a_second_coordinator(run, tmp_path):
    with run.lock():
        assert run.is_locked()
        with pytest.raises(RunLockedError, match="in use"):
            Coordinator(FakeGrid(tmp_path / "n", ["a"]), run).main(lock_wait=0.2)
    assert not run.is_locked()


def test_version_mismatch_excludes_node(run, tmp_path, monkeypatch, caplog):
    set_fed(run, rounds=1, min_nodes=1)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    real = client_app.capabilities

    def old_version(msg, context):
        reply = real(msg, context)
        if context.node_id == 1001:
            body = protocol.unpack(reply.content, protocol.KIND_CAPS)
            body["soma_version"] = "0.0.1"
            return Message(protocol.pack(body, protocol.KIND_CAPS), reply_to=msg)
        return reply

    monkeypatch.setitem(client_app.app._registered_funcs, "query.capabilities", old_version)
    with caplog.at_level(logging.WARNING, logger="soma.coord"):
        Coordinator(grid, run).main()
    assert "runs soma-edge 0.0.1" in caplog.text and "excluded" in caplog.text
    assert {x["node"] for x in run.read_metrics() if x["type"] == "expert"} == {"a"}


CAPS_TAMPER = {  # node name -> (field, value) of a bad capability reply, and what the log must say
    "b": ("cache", [1], "cache is not a map"),
    "c": ("providers", 5, "providers is not a list"),
    "d": ("evals_per_s", "fast", "throughput 'fast'"),
    "e": ("torch_importable", b"x", "torch_importable"),
    # probes the run's batch (2 rows) cannot split 4 ways
    "g": ("probes", {"directions": 4, "split_rows": True, "noise": "rademacher", "density": 1.0}, "its probes:"),
}


def test_bad_capability_replies_exclude_the_node_and_huge_rates_are_clamped(run, tmp_path, monkeypatch, caplog):
    """A hostile capability reply excludes its node (the run goes on); a claimed 1e300 evals/s is bounded."""
    set_fed(run, rounds=1, min_nodes=1)
    names = ["a", *CAPS_TAMPER, "f"]
    grid = FakeGrid(tmp_path / "nodes", names)
    real = client_app.capabilities

    def tampered(msg, context):
        reply = real(msg, context)
        name = names[context.node_id - 1000]
        body = protocol.unpack(reply.content, protocol.KIND_CAPS)
        if name in CAPS_TAMPER:
            body[CAPS_TAMPER[name][0]] = CAPS_TAMPER[name][1]
        elif name == "f":
            body["evals_per_s"] = 1e300
        return Message(protocol.pack(body, protocol.KIND_CAPS), reply_to=msg)

    monkeypatch.setitem(client_app.app._registered_funcs, "query.capabilities", tampered)
    with caplog.at_level(logging.WARNING, logger="soma.coord"):
        state = Coordinator(grid, run).main()
    assert state.round == 1
    for name, (_, _, reason) in CAPS_TAMPER.items():
        assert f"node {1000 + names.index(name)}: bad capability reply ({reason}" in caplog.text
    nodes = run.read_status()["nodes"]
    excluded = sorted(int(nid) for nid, n in nodes.items() if n["status"] == "excluded")
    assert excluded == list(range(1001, 1001 + len(CAPS_TAMPER)))
    assert all(0 < n["rate"] <= scheduler.MAX_RATE for n in nodes.values() if n["status"] == "active")
    sent = [
        protocol.unpack(m.content, protocol.KIND_TRAIN) for m in grid.sent if m.metadata.message_type == protocol.TRAIN
    ]
    assert sent and all(t["steps"] <= scheduler.MAX_STEPS for b in sent for t in b["tasks"])
    assert {x["node"] for x in run.read_metrics() if x["type"] == "expert"} <= {"a", "f"}


def test_workers_sharing_a_name_are_accounted_apart(run, tmp_path, monkeypatch):
    """The default worker name is the host name: two such workers must not merge their compute time."""
    set_fed(run, rounds=1)
    grid = FakeGrid(tmp_path / "nodes", ["a", "a"])
    grid.nodes[1001]["cache"] = str(tmp_path / "nodes" / "a2")
    equal_rates(monkeypatch)
    state = Coordinator(grid, run).main()
    m = next(m for m in run.read_metrics() if m["type"] == "round")
    assert m["nodes"] == ["a", "a#1001"] and sorted(m["compute_seconds"]) == ["a", "a#1001"]
    assert all(s > 0 for s in m["compute_seconds"].values()) and m["compute_share"] <= 1.0
    assert sorted(state.assignment.values()) == ["a", "a", "a#1001", "a#1001"]
    experts = [x for x in run.read_metrics() if x["type"] == "expert"]
    assert sorted(x["node"] for x in experts) == ["a", "a", "a#1001", "a#1001"] and all(x["accepted"] for x in experts)


def test_torch_blocked_in_worker_reply(run, tmp_path, monkeypatch):
    """Every reply says whether torch was importable in the ClientApp: False once it is blocked there."""
    # Installed here, so a True flag would mean the block did not hold. Found, not imported (~2 s): the
    # worker asks find_spec too.
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    set_fed(run, rounds=1)
    monkeypatch.setitem(sys.modules, "torch", None)
    Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main()
    flags = {x["torch_importable"] for x in run.read_metrics() if x["type"] == "expert"}
    assert flags == {False}


def test_protocol_refuses_foreign_and_oversized_bodies():
    from flwr.app import Array, ArrayRecord

    rd = protocol.pack({"x": 1}, protocol.KIND_CAPS)
    assert protocol.unpack(rd, protocol.KIND_CAPS)["x"] == 1
    with pytest.raises(CodecError, match="expected a train_reply"):
        protocol.unpack(rd, protocol.KIND_REPLY)
    with pytest.raises(CodecError, match="exceeds"):
        protocol.unpack(protocol.pack({"x": "y" * 5000}, protocol.KIND_CAPS), protocol.KIND_CAPS, 1000)
    with pytest.raises(CodecError, match="not a soma-edge message"):
        protocol.unpack(RecordDict({}), protocol.KIND_CAPS)
    bad = RecordDict({"soma": ArrayRecord({"body": Array(np.zeros(3, dtype=np.uint8))})})
    with pytest.raises(CodecError, match="payload type"):
        protocol.unpack(bad, protocol.KIND_CAPS)
    from soma_edge import codec

    other = codec.encode({"protocol": 99}, protocol.KIND_CAPS)
    rd = RecordDict(
        {"soma": ArrayRecord({"body": Array(dtype="uint8", shape=(len(other),), stype=protocol.STYPE, data=other)})}
    )
    with pytest.raises(CodecError, match="protocol 99"):
        protocol.unpack(rd, protocol.KIND_CAPS)


def test_check_result_accepts_a_good_result_and_float16():
    res, exp, _ = good_result()
    w, opt = res["weights"], res["opt"]
    got, got_opt = protocol.check_result(res, exp, {0: "a" * 64})
    assert got is w and got_opt.lr_scale == 0.5 and np.array_equal(got_opt.adam_v, opt["adam_v"])
    # Optimizer state that does not fit the weights, is not finite, or ignores the round's lr scale.
    for bad_opt, match in [
        ({**opt, "adam_m": np.zeros(9, np.float32)}, "adam_m"),
        ({**opt, "adam_v": np.full(10, np.nan, np.float32)}, "adam_v"),
        ({**opt, "adam_v": -np.ones(10, np.float32)}, "negative"),
        ({**opt, "adam_m": None}, "incomplete"),
        ({**opt, "adam_t": 0}, "adam_t"),
        ({**opt, "adam_t": True}, "adam_t"),
        ({**opt, "lr_scale": 1.0}, "lr scale"),
        ({**opt, "lr_scale": 3.0}, "lr_scale"),
        ({**opt, "extra": 1}, "unknown"),
        ("x", "not a map"),
    ]:
        with pytest.raises(ValidationError, match=match):
            protocol.check_result({**res, "opt": bad_opt}, exp, {0: "a" * 64})
    for key, bad in [
        ("forward_evals", True),
        ("forward_evals", 1.5),
        ("seconds", float("nan")),
        ("seconds", -1.0),
        ("seconds", None),
        ("steps", True),
        ("version", True),
        ("expert", [0]),
        ("evaluator", "gpu"),
        ("evaluator", ["loop"]),
    ]:
        with pytest.raises(ValidationError):
            protocol.check_result({**res, key: bad}, exp, {0: "a" * 64})
    assert protocol.check_result({**res, "evaluator": "population"}, exp, {0: "a" * 64})[0] is w
    with pytest.raises(ValidationError, match="step counter"):
        protocol.check_result({**res, "step": 4}, exp, {0: "a" * 64})
    with pytest.raises(ValidationError, match="steps"):
        protocol.check_result({**res, "steps": 4, "step": 4}, exp, {0: "a" * 64})


def test_a_reply_after_the_deadline_but_before_the_next_plan_is_accepted(run, tmp_path, monkeypatch):
    """Node b answers round 1 only after its deadline; the coordinator has given up on it for round 1, but
    its reply is there when round 2 is planned and its base versions are still current: accepted."""
    equal_rates(monkeypatch)
    set_fed(run, rounds=2, deadline_slack=0.5)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    coord = Coordinator(grid, run)
    hold_first_train_reply(grid, monkeypatch, 1001)
    state = coord.main()
    lines = [m for m in run.read_metrics() if m["type"] == "expert"]
    r1 = {m["expert"]: m for m in lines if m["round"] == 1 and not m.get("late")}
    lost = [e for e, m in r1.items() if m["node"] == "b"]
    assert lost and all(not r1[e]["accepted"] and "deadline" in r1[e]["reason"] for e in lost)
    late = [m for m in lines if m.get("late")]
    assert sorted(m["expert"] for m in late) == sorted(lost) and all(m["accepted"] and m["round"] == 2 for m in late)
    for e in lost:  # the late version, then round 2's on top of it
        assert any(m["expert"] == e and m["version"] == 1 for m in late)
        assert state.expert(e).version == 2
