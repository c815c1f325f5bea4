"""The round loop, reply validation, scheduler and worker cache, with a fake Flower Grid.

The fake Grid hands each message straight to the real ClientApp (`worker.client_app.app`), which trains
for real on ORT; only Flower's transport is replaced. Real-process tests are in test_e2e_federation.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict

from coordinator import heartbeat as heartbeat_mod
from coordinator import scheduler
from coordinator.dispatch import log_bytes
from coordinator.loop import Coordinator
from soma_edge import checkpoint
from soma_edge import config as config_mod
from soma_edge.errors import CheckpointError, CodecError, ValidationError
from soma_edge.rundir.layout import RunDir, RunLockedError
from soma_edge.spsa.optim import OptState
from soma_edge.wire import pieces as pieces_mod
from soma_edge.wire import protocol
from tests.helpers.fakegrid import FakeGrid, equal_rates, hold_first_train_reply, set_fed
from worker import client_app
from worker.cache import Cache

# Rounds for the tests about what a run keeps, refuses or resumes, not about how far its experts train: each
# node trains for round_seconds, and at the fake grid's 0.2 s a round of two nodes took 0.4 s.
SHORT_ROUND = 0.05


def _hashes(root: Path, subdirs=("experts", "shards")) -> dict[str, str]:
    out = {}
    for sub in subdirs:
        for p in sorted((root / sub).rglob("*")):
            if p.is_file():
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    for name in ("router.msgpack", "prepare.json", "run.toml"):
        out[name] = hashlib.sha256((root / name).read_bytes()).hexdigest()
    return out


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
    before = _hashes(run.root)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"], tamper=_tamper_all(kind))
    with caplog.at_level(logging.WARNING, logger="soma.coord"):
        state = Coordinator(grid, run).main()
    assert state.round == 1 and all(x.version == 0 for x in state.experts.values())
    assert _hashes(run.root) == before  # experts, shards, router, prepare.json, run.toml: byte-identical
    rejected = next(m for m in run.read_metrics() if m["type"] == "round")["rejected"]
    assert len(rejected) == 4 and all(REASONS[kind] in r["reason"] for r in rejected), rejected
    assert REASONS[kind] in caplog.text and "rejected" in caplog.text


def test_rejection_leaves_existing_versions_and_files_unchanged(run, tmp_path):
    set_fed(run, rounds=1, reply="weights", round_seconds=SHORT_ROUND)  # NaN weights: a weights reply
    Coordinator(FakeGrid(tmp_path / "n1", ["a", "b"]), run).main()
    state_before = run.read_state().experts
    set_fed(run, rounds=2)
    before = _hashes(run.root)  # run.toml changed by _set; everything else is what round 1 left
    grid = FakeGrid(tmp_path / "n2", ["a", "b"], tamper=_tamper_all("nan"))
    state = Coordinator(grid, run).main()
    assert state.round == 2 and state.experts == state_before
    assert _hashes(run.root) == before


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
    before = _hashes(run.root)
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
    after = _hashes(run.root)
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


def _train_tasks(grid: FakeGrid) -> list[dict]:
    return [
        t
        for m in grid.sent
        if m.metadata.message_type == protocol.TRAIN
        for t in protocol.unpack(m.content, protocol.KIND_TRAIN)["tasks"]
    ]


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
    tasks = _train_tasks(grid)
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
    assert sorted(int(nid) for nid, n in nodes.items() if n["status"] == "excluded") == [1001, 1002, 1003, 1004]
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


# --- protocol ------------------------------------------------------------------------------------------


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
    w = np.ones(10, dtype=np.float16)
    exp = protocol.Expected(
        node=5,
        round=1,
        tasks={0: {"version": 0, "base_sha256": "a" * 64, "step": 0, "steps": 3, "lr_scale": 0.5}},
        size=10,
        reply_dtype="float16",
    )
    opt = OptState(adam_m=np.zeros(10, np.float32), adam_v=np.ones(10, np.float32), adam_t=3, lr_scale=0.5).to_record()
    res = {
        "expert": 0,
        "base_sha256": "a" * 64,
        "version": 1,
        "step": 3,
        "steps": 3,
        "weights": w,
        "opt": opt,
        "train_loss": 1.0,
        "sha256": protocol.weights_sha256(w),
        "forward_evals": 12,
        "seconds": 0.5,
    }
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


# --- scheduler -----------------------------------------------------------------------------------------


def test_scheduler_quotas_follow_throughput_and_stay_sticky():
    assert scheduler.quotas(4, {1: 100.0, 2: 100.0}) == {1: 2, 2: 2}
    assert scheduler.quotas(4, {1: 300.0, 2: 100.0}) == {1: 3, 2: 1}
    assert scheduler.quotas(8, {1: 100.0}) == {1: 8}
    prev = {0: 2, 1: 2, 2: 1, 3: 1}
    a = scheduler.assign([0, 1, 2, 3], {1: 100.0, 2: 100.0}, prev)
    assert a == prev  # nothing moves when quotas allow it
    # node 2 dies: all four go to node 1; only its two experts move
    p = scheduler.plan([0, 1, 2, 3], {1: 100.0}, prev, 10.0, 16)  # 16 forward passes per step (K = 8)
    assert p.assignment == {0: 1, 1: 1, 2: 1, 3: 1} and p.moved == [0, 1]
    assert scheduler.steps_for(100.0, 4, 10.0, 16) == 15 and p.steps[0] == math.ceil(scheduler.HEADROOM * 15)
    assert scheduler.steps_for(100.0, 4, 10.0, 17) == 14  # a delta-rule step adds its clean forward
    # a faster node joins beside an idle one: it takes two, node 1 keeps one, and node 2 is not left idle
    p = scheduler.plan([0, 1, 2, 3], {1: 100.0, 2: 100.0, 3: 400.0}, {e: 1 for e in range(4)}, 10.0, 16)
    assert sorted(p.assignment.values()) == [1, 2, 3, 3] and p.assignment[0] == 1 and p.moved == [1, 2, 3]
    assert p.makespan <= 10.0 + 1e-9


def test_scheduler_leaves_no_live_node_idle_unless_it_is_far_slower():
    """Every node computes for round_seconds anyway, so a node without an expert wastes its round. Probe
    rates measured while other workers start differ up to 3x: the bare makespan rule then put all three
    experts on the fastest node (340 / 3 > 104) and the others idled. Proportional fairness gives each node
    one; only a node so slow that its expert would train far slower than the experts it relieves stays idle."""
    assert scheduler.quotas(3, {1: 340.0, 2: 104.0, 3: 93.0}) == {1: 1, 2: 1, 3: 1}
    assert scheduler.quotas(2, {1: 300.0, 2: 100.0}) == {1: 1, 2: 1}
    assert scheduler.quotas(2, {1: 1000.0, 2: 1.0}) == {1: 2, 2: 0}  # no expert starves at 1/500 the speed
    # last round's split with an idle node does not stand against one that employs it
    assert scheduler.quotas(3, {1: 340.0, 2: 104.0, 3: 93.0}, keep={1: 3}) == {1: 1, 2: 1, 3: 1}
    # nor does a split two nodes of equal speed share unequally, once the gap is real
    assert scheduler.quotas(4, {1: 100.0, 2: 100.0}, keep={1: 3, 2: 1}) == {1: 2, 2: 2}


def test_scheduler_does_not_move_experts_for_a_small_change_in_rates():
    """Three experts on two nodes of nearly equal speed: a 0.0001% faster node would take two of them by
    the bare makespan rule, moving an expert and its cache every time the measured rates cross."""
    prev = {0: 1, 1: 1, 2: 2}
    rates = {1: 1000.0, 2: 1000.001}
    assert scheduler.quotas(3, rates) == {1: 1, 2: 2}  # the bare rule
    p = scheduler.plan([0, 1, 2], rates, prev, 10.0, 2)
    assert p.assignment == prev and p.moved == []
    # A real difference still moves work: node 2 three times as fast takes two.
    p = scheduler.plan([0, 1, 2], {1: 1000.0, 2: 3000.0}, prev, 10.0, 2)
    assert sorted(p.assignment.values()).count(2) == 2 and len(p.moved) == 1


def test_scheduler_sends_a_moving_expert_where_it_is_fetched_fastest():
    """An expert that must move goes to the node that lacks the least of it on its link, and the plan
    predicts each node's fetch time (which extends its round deadline)."""
    lacks = {(0, 1): 30.0, (0, 2): 0.5, (1, 1): 0.0, (1, 2): 8.0}  # seconds to fetch, by (expert, node)
    p = scheduler.plan([0, 1], {1: 100.0, 2: 100.0}, {}, 10.0, 2, lambda e, n: lacks[(e, n)])
    assert p.assignment == {0: 2, 1: 1} and p.transfer == {1: 0.0, 2: 0.5}


def test_link_rate_is_measured_from_large_messages_only():
    assert scheduler.link_rate(None, 100_000, 20.0, 5.0) is None  # Flower's overhead would dominate
    seen = scheduler.link_rate(None, 1_000_000, 12.0, 5.0)  # 1 MB in 12 - 5 - 4.5 s
    assert seen == pytest.approx(400_000)
    assert scheduler.link_rate(seen, 1_000_000, 7.0, 5.0) == pytest.approx(0.5 * 400_000 + 0.5 * 1_000_000 / 0.5)
    assert scheduler.link_rate(seen, 1_000_000, float("nan"), 5.0) == seen


def test_heartbeat_advice_holds_while_queued_pieces_come_back_one_by_one(run):
    """A 1 Mbit/s link: 20 shard pieces of 5 s each and a 1M expert's version are pushed at once, and the
    pieces' replies come back one after another (5 s on the wire + Flower's 4.5 s each). Timed from their
    push, the pieces measured the link ever slower and the advice rose to 25 minutes, so that a worker killed
    then went unnoticed for most of an hour. Timed from when the link was free, the rate holds and the advice
    stays where the first piece put it."""
    from coordinator.fleet import Fleet, Node, NodeStatus, Outgoing, Sent

    now = [0.0]
    piece, version, link = 625_000, 12_600_000, 125_000.0
    fleet = Fleet(None, run, run.load_config(), None, version, lambda **kw: None, clock=lambda: now[0])
    fleet.advise = lambda nid: None  # no grid to push advice on: the advised interval is read below
    fleet.nodes[7] = Node(id=7, status=NodeStatus.ACTIVE)
    reply = SimpleNamespace(content=RecordDict())  # a stored piece's acknowledgement: no payload
    outs = [Outgoing(node=7, kind=Sent.PIECES, bytes_down=piece, sent_at=0.0) for _ in range(20)]
    advice = []
    for k, o in enumerate(outs, start=1):
        now[0] = k * (piece / link + scheduler.FLOWER_SECONDS)
        fleet.time_link(o, reply, 0.0)
        advice.append(fleet.heartbeat(7))
    assert fleet.nodes[7].link == pytest.approx(link)
    assert max(advice) == min(advice) == heartbeat_mod.interval(version, run.load_config().federation.piece_bytes, link)
    assert max(advice) <= 150  # two intervals, under 5 minutes
    # Each timed from its push, as before: the measured rate falls piece after piece, the advice climbs.
    old = None
    for k in range(1, 21):
        old = scheduler.link_rate(old, piece, k * (piece / link + scheduler.FLOWER_SECONDS), 0.0)
    assert old < link / 5


def test_a_round_deadline_prices_the_reply_up_a_measured_link(run, tmp_path):
    """Weights mode sends weights and Adam moments up; log mode a few bytes per step; an unmeasured link
    is priced at UNMEASURED_LINK. The round deadline adds what the slowest node's fetch and reply take."""
    set_fed(run, rounds=1, reply="weights")
    coord = Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run)
    coord.main()
    loop = coord.loop
    a = loop.fleet.nodes[1000]
    a.link, steps = None, {0: 1000, 1: 1000}
    unmeasured = loop.planner.reply_seconds(1000, [0, 1], 2, steps)
    assert unmeasured == pytest.approx(2 * 12 * loop.ledger.size / scheduler.UNMEASURED_LINK)
    a.link = 1e5
    assert loop.planner.reply_seconds(1000, [0, 1], 2, steps) == pytest.approx(2 * 12 * loop.ledger.size / 1e5)
    set_fed(run, reply="log")
    loop.cfg.federation.reply = run.load_config().federation.reply  # the config every part of the loop shares
    phase = loop.ledger.phase_config()
    assert loop.planner.reply_seconds(1000, [0, 1], 2, steps) == pytest.approx(2 * log_bytes(phase, 1000) / 1e5)
    assert log_bytes(phase, 1000) < 12 * loop.ledger.size


def test_scheduler_bounds_claimed_rates_and_steps():
    """A node claiming 1e300 evals/s gets a bounded rate and step counts that msgpack can encode."""
    from soma_edge import codec

    assert scheduler.clamp_rate(1e300) == scheduler.MAX_RATE and scheduler.clamp_rate(5.0) == 5.0
    assert scheduler.update_rate(100.0, 1e300) <= scheduler.MAX_RATE
    assert scheduler.update_rate(0.0, 1e300) == scheduler.MAX_RATE
    assert scheduler.steps_for(1e300, 1, 1e6, 1) == scheduler.MAX_STEPS
    p = scheduler.plan([0, 1, 2, 3], {1: 100.0, 2: 1e300}, {}, 10.0, 8)
    assert all(1 <= s <= scheduler.MAX_STEPS for s in p.steps.values()) and math.isfinite(p.makespan)
    codec.encode({"steps": max(p.steps.values())}, "train_request")


# --- worker cache --------------------------------------------------------------------------------------


def test_cache_verifies_prunes_and_evicts(tmp_path):
    c = Cache(tmp_path / "c", max_bytes=10_000, keep_versions=2)
    data = b"shard bytes" * 100
    sha = hashlib.sha256(data).hexdigest()
    c.put_shard(sha, data)
    assert c.get_shard(sha) == data
    with pytest.raises(CheckpointError, match="do not hash"):
        c.put_shard("0" * 64, data)
    (tmp_path / "c" / "shards" / f"{sha}.bin").write_bytes(b"corrupt")
    assert c.get_shard(sha) is None and sha not in c.shards()  # dropped, reported missing
    shas = []
    for v in range(4):
        w = np.full(100, v, dtype=np.float32)
        shas.append(protocol.weights_sha256(w))
        c.put_weights(shas[-1], expert=0, version=v, step=v, weights=w, opt=None)
    assert sorted(c.weights()) == sorted(shas[2:])  # only the newest keep_versions=2
    assert c.get_weights(shas[3])["version"] == 3
    big = np.zeros(3000, dtype=np.float32)  # 12 KB > max_bytes
    c.put_weights(protocol.weights_sha256(big), expert=1, version=0, step=0, weights=big, opt=None)
    dropped = c.evict(protect={protocol.weights_sha256(big)})
    assert set(dropped) == set(shas[2:]) and c.weights() == [protocol.weights_sha256(big)]


def test_cache_prunes_per_run_so_an_old_run_cannot_evict_a_new_one(tmp_path):
    """One join cache serves every run: v48..v50 of expert 0 from an old run must not prune v0 of a new one."""
    c = Cache(tmp_path / "c", keep_versions=3)

    def put(run_id, v):
        w = np.full(10, v, dtype=np.float32) + (0.5 if run_id == "new" else 0.0)
        sha = protocol.weights_sha256(w)
        c.put_weights(sha, expert=0, version=v, step=v, weights=w, opt=None, run_id=run_id)
        return sha

    old = [put("old", v) for v in (48, 49, 50)]
    v0 = put("new", 0)
    assert c.get_weights(v0) is not None and set(old) <= set(c.weights())
    new = [v0] + [put("new", v) for v in (1, 2, 3)]
    assert set(c.weights()) == set(old) | set(new[1:])  # each run keeps its own newest 3


def test_cache_evict_tolerates_files_vanishing(tmp_path, monkeypatch):
    """A file unlinked by another worker between listing and stat is skipped, not an error."""
    c = Cache(tmp_path / "c", max_bytes=0)
    data = b"x" * 100
    sha = hashlib.sha256(data).hexdigest()
    c.put_shard(sha, data)
    gone = tmp_path / "c" / "shards" / f"{sha}.bin"
    real_stat = Path.stat

    def stat(self, *a, **k):
        if self == gone:
            raise FileNotFoundError(self)
        return real_stat(self, *a, **k)

    monkeypatch.setattr(Path, "stat", stat)
    monkeypatch.setattr(Path, "exists", lambda self, *a, **k: True)
    assert c.evict() == []


# --- CLI contract (no Flower processes) ----------------------------------------------------------------


def _cli(argv, capsys):
    from coordinator.cli import app
    from soma_edge.cli import run as run_cli

    code = run_cli(app, argv, prog="soma-coord")
    out = capsys.readouterr()
    return code, out.out, out.err


def test_app_path_is_a_valid_flower_app(capsys):
    import tomllib

    from flwr.common.config import validate_fields_in_config

    code, out, _ = _cli(["app-path"], capsys)
    app_dir = Path(out.strip())
    assert code == 0 and app_dir.is_dir()
    cfg = tomllib.loads((app_dir / "pyproject.toml").read_text())
    ok, errors, _ = validate_fields_in_config(cfg)
    assert ok, errors
    comps = cfg["tool"]["flwr"]["app"]["components"]
    assert comps == {"serverapp": "coordinator.server_app:app", "clientapp": "worker.client_app:app"}
    assert cfg["tool"]["flwr"]["app"]["config"] == {"run-dir": "", "start": ""}


def test_status_prints_the_checkpoint_and_start_refuses_identity_changes(run, tmp_path, capsys):
    import json

    set_fed(run, rounds=1)
    Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main()
    code, out, _ = _cli(["status", str(run.root), "--json"], capsys)
    s = json.loads(out)
    assert code == 0 and s["round"] == 1 and s["rounds"] == 1 and not s["running"]
    assert {e: x["version"] for e, x in s["experts"].items()} == {str(e): 1 for e in range(4)}
    code, out, _ = _cli(["status", str(run.root)], capsys)
    assert code == 0 and run.read_state().expert(0).sha256[:12] in out
    # Resuming with another number of experts is the user's error: exit 2, one line, nothing started.
    code, _, err = _cli(["start", "--run", str(run.root), "--experts", "3", "--port", "0"], capsys)
    assert (
        code == 2 and err.startswith("error: ") and "federation.experts" in err and len(err.strip().splitlines()) == 1
    )
    code, _, err = _cli(["status", str(tmp_path / "nothing")], capsys)
    assert code == 2 and "no such run directory" in err
    (tmp_path / "prepared").mkdir()
    shutil.copy(run.prepare_json, tmp_path / "prepared")
    code, _, err = _cli(["status", str(tmp_path / "prepared")], capsys)
    assert code == 2 and "no state.msgpack" in err


def test_prepare_refuses_a_trained_or_running_run_and_start_refuses_another_corpus(run, capsys):
    """Re-preparing would swap router and shards under trained experts; `start --corpus/--seed` on a run
    prepared otherwise would silently train on the prepared corpus."""
    from coordinator.prepare import prepare
    from coordinator.runconfig import ensure_prepared
    from soma_edge.errors import ConfigError

    prep = run.load_prepare()
    before = _hashes(run.root, subdirs=("shards",))
    with run.lock():
        with pytest.raises(ConfigError, match="a coordinator is running on it"):
            prepare(prep["corpus"], 4, run.root, seed=1, progress=False)
    run.state_path.write_bytes(b"a committed round")
    code, _, err = _cli(["prepare", prep["corpus"], "--experts", "4", "--out", str(run.root), "--seed", "1"], capsys)
    assert code == 2 and err.startswith("error: ") and "trained experts" in err and len(err.strip().splitlines()) == 1
    assert _hashes(run.root, subdirs=("shards",)) == before  # router, shards, prepare.json untouched

    cfg = run.load_config()
    cfg.federation.corpus, cfg.seed = prep["corpus"], prep["seed"]
    ensure_prepared(run, cfg, {"federation.corpus", "seed"})  # the same corpus and seed: fine
    cfg.federation.corpus = "default"
    ensure_prepared(run, cfg)  # not given by the user (the config default): the prepared corpus is used
    with pytest.raises(ConfigError, match="prepared from corpus"):
        ensure_prepared(run, cfg, {"federation.corpus"})
    cfg.federation.corpus, cfg.seed = prep["corpus"], prep["seed"] + 1
    with pytest.raises(ConfigError, match="prepared with seed 0"):
        ensure_prepared(run, cfg, {"seed"})
    cfg.seed = prep["seed"]
    cfg.data.seq_len = prep["seq_len"] + 1  # windows longer than the held-out ones it was cut for
    with pytest.raises(ConfigError, match=f"prepared for data.seq_len <= {prep['seq_len']}"):
        ensure_prepared(run, cfg)
    cfg.data.seq_len = prep["seq_len"] // 2  # shorter ones fit: more of them
    ensure_prepared(run, cfg)


# ---------------------------------------------------------------------------------------------- seed run


def _seeded(rd: RunDir, **fed) -> None:
    cfg = rd.load_config()
    cfg.model.kind, cfg.model.embed, cfg.model.hidden = "soma", 8, 8  # the paper's expert, with its tied E
    for k, v in fed.items():
        setattr(cfg.federation, k, v)
    rd.save_config(config_mod.validate(cfg))


def _weights_of(rd: RunDir, rel: str) -> np.ndarray:
    return checkpoint.load(rd.root / rel, "expert")["weights"]


def test_seed_run_starts_every_expert_and_freezes_the_decoder(run, tmp_path, monkeypatch):
    from soma_edge.config import expert_steps
    from soma_edge.expert import params

    equal_rates(monkeypatch)
    # Time enough that the step budget, not a slow box's clock, ends each expert's round: 37 steps of 2
    # forwards each take 0.12 s at 600 evals/s, well within the 1.5 s each of two experts gets of 3 s.
    _seeded(run, seed_steps=12, rounds=3, max_steps=40, keep_versions=5, round_seconds=3.0)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    state = Coordinator(grid, run).main()
    cfg = run.load_config()
    seed = state.seed
    assert (state.phase, seed.expert, seed.step) == ("experts", 4, 12)
    tasks = _train_tasks(grid)
    seed_tasks = [t for t in tasks if t["expert"] == 4]
    all_train = sorted(h for e in range(4) for h in run.read_prepare().shards(e, "train"))
    assert seed_tasks and all(sorted(t["shards"]) == all_train for t in seed_tasks)  # every cluster's data
    requests = [
        protocol.unpack(m.content, protocol.KIND_TRAIN) for m in grid.sent if m.metadata.message_type == protocol.TRAIN
    ]
    decoders = [r["config"]["spsa"]["decoder"] for r in requests]  # the seed's rule, then the experts' frozen E
    assert decoders == ["delta"] * len(seed_tasks) + ["frozen"] * (len(requests) - len(seed_tasks))

    sw = _weights_of(run, seed.path)
    body = params.layout(cfg.model).body
    for e in range(4):
        v0 = checkpoint.load(run.root / f"experts/{e}/v0.msgpack", "expert")
        assert v0["weights"].tobytes() == sw.tobytes() and v0["step"] == 0 and v0["opt"] is None  # bit for bit
        x = state.expert(e)
        # 12 seed steps of 2 forward passes paid by 4 experts at 2 per step: 37 of the 40 steps are left
        assert (x.version, x.step, expert_steps(cfg)) == (1, 37, 37)
        w = _weights_of(run, x.path)
        assert w[body:].tobytes() == sw[body:].tobytes()  # E frozen after the seed
        assert not np.array_equal(w[:body], sw[:body])  # while the body trained
        first = next(t for t in tasks if t["expert"] == e)
        fresh = OptState.from_record(first["opt"], sw.size)  # fresh optimizer state
        assert (first["step"], first["version"], fresh.adam_m, fresh.adam_t, fresh.best_val) == (0, 0, None, 0, None)
    rounds = [m for m in run.read_metrics() if m["type"] == "round"]
    assert [m["phase"] for m in rounds] == ["seed", "experts"] and rounds[0]["seed_done"]["step"] == 12
    assert rounds[0]["mixture_val_loss"] is None and np.isfinite(rounds[1]["mixture_val_loss"])


def test_seed_decoder_delta_keeps_training_the_decoder(run, tmp_path, monkeypatch):
    from soma_edge.expert import params

    equal_rates(monkeypatch)
    # Two rounds for the experts after the seed's: on a box loaded 3x over, a round's replies can all come
    # late (seen once), and one round of the experts' is all this test needs.
    _seeded(run, seed_steps=4, rounds=3)
    cfg = run.load_config()
    cfg.model.seed_decoder = "delta"
    run.save_config(config_mod.validate(cfg))
    state = Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main()
    body = params.layout(cfg.model).body
    sw = _weights_of(run, state.seed.path)
    for e in range(4):
        assert not np.array_equal(_weights_of(run, state.expert(e).path)[body:], sw[body:])


def test_interrupted_seed_run_resumes_where_it_was(run, tmp_path, monkeypatch):
    equal_rates(monkeypatch)
    # A round of 0.01 s plans at most 8 seed steps (1.5 * 0.01 s * 1000 evals/s / 2 a step): the seed's 40
    # cannot finish in it, on any box.
    seed_steps = 40
    _seeded(run, seed_steps=seed_steps, rounds=1, round_seconds=0.01)
    Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main()
    s1 = run.read_state()
    seed1 = s1.expert(4)
    assert s1.phase == "seed" and list(s1.experts) == ["4"] and 0 < seed1.step < seed_steps
    from rich.console import Console

    from coordinator.progress import experts_table, summary

    console = Console(record=True, width=160)
    console.print(experts_table(summary(run)))
    text = " ".join(console.export_text().split())  # the title wraps to the table's width
    assert "seed run" in text and "4 (seed)" in text  # status says so
    with pytest.raises(CheckpointError, match="seed run"):  # nothing to export yet, and it says why
        from export.bundle import write

        write(run.root, tmp_path / "deploy")
    # Debris of a crashed round 2, then a restart with more, longer rounds: rounds are timed, and a slow
    # box (87 seed steps/s, once) left the experts no round when the seed's steps filled every round. At
    # 0.4 s, rounds 2-4 carry >= 3 * 35 steps on such a box, over twice the < 40 left, and round 5 is the
    # experts'; a fast box finishes the seed in round 2, and each later round is 0.4 s a node.
    run.write_metrics(run.read_metrics() + [{"type": "round", "round": 2, "debris": True}])
    set_fed(run, rounds=5, round_seconds=0.4)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    state = Coordinator(grid, run).main()
    first = _train_tasks(grid)[0]
    assert (first["expert"], first["step"], first["base_sha256"]) == (4, seed1.step, seed1.sha256)
    assert state.phase == "experts" and state.seed.step == seed_steps
    assert all(x.version >= 1 for x in state.experts.values())
    rounds = [m["round"] for m in run.read_metrics() if m["type"] == "round"]
    assert rounds == list(range(1, 6))
    # The experts the seed fanned out in this run advanced in it: no warning at the end says otherwise.
    assert run.read_status()["never_advanced"] == {}


# ---------------------------------------------------------------------------------------------- corrupt state


@pytest.mark.parametrize("damage", ["truncated state", "garbage state", "missing state", "corrupt expert file"])
def test_corrupt_commit_falls_back_to_the_one_before(run, tmp_path, damage, caplog):
    set_fed(run, rounds=2, keep_versions=1, round_seconds=SHORT_ROUND)
    Coordinator(FakeGrid(tmp_path / "n1", ["a", "b"]), run).main()
    prev = checkpoint.load(run.prev_state_path, "run_state")
    assert prev["round"] == 1
    for x in prev["experts"].values():  # keep_versions = 1, yet the fallback's versions were kept
        assert (run.root / x["path"]).is_file()
    if damage == "truncated state":
        run.state_path.write_bytes(run.state_path.read_bytes()[:50])
    elif damage == "garbage state":
        run.state_path.write_bytes(b"\x00" * 400)
    elif damage == "missing state":
        run.state_path.unlink()
    else:
        p = run.root / run.read_state().expert(2).path
        p.write_bytes(p.read_bytes()[:-7] + b"corrupt")
    set_fed(run, rounds=3)
    with caplog.at_level(logging.WARNING, logger="soma.coord"):
        state = Coordinator(FakeGrid(tmp_path / "n2", ["a", "b"]), run).main()
    warned = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(warned) == 1 and "round 1" in warned[0], warned
    assert state.round == 3 and all(x.version == 3 for x in state.experts.values())
    assert [m["round"] for m in run.read_metrics() if m["type"] == "round"] == [1, 2, 3]  # round 2 redone once
    for x in state.experts.values():
        body = checkpoint.load(run.root / x.path, "expert")
        assert protocol.weights_sha256(body["weights"]) == x.sha256


def test_a_run_with_no_loadable_commit_refuses_to_start(run, tmp_path, capsys):
    from coordinator.cli import app as coord_app
    from soma_edge.cli import run as run_cli

    set_fed(run, rounds=2, round_seconds=SHORT_ROUND)
    Coordinator(FakeGrid(tmp_path / "n1", ["a", "b"]), run).main()
    for p in (run.state_path, run.prev_state_path):
        p.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="no committed state loads"):
        run.read_state()
    rc = run_cli(coord_app, ["start", "--run", str(run.root), "--rounds", "3"], prog="soma-coord")
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "no committed state loads" in lines[0]
    assert "Traceback" not in " ".join(lines)


@pytest.mark.parametrize(
    "name,damage,fragment",
    [
        ("run.toml", b"[model\nembed = ", "run.toml: invalid TOML"),
        ("run.toml", b"\xff\xfe", "run.toml: config is not UTF-8 text"),
        ("run.toml", b"[model]\nembed = -3\n", "model.embed must be >= 1"),
        ("prepare.json", b'{"experts": 4, "clus', "prepare.json: not valid JSON"),
        ("state.msgpack", b"", "no committed state loads"),
    ],
)
def test_start_on_a_damaged_run_says_what_in_one_line(run, tmp_path, capsys, name, damage, fragment):
    """Startup never ends in a traceback: each damaged file is one `error:` line naming it, exit 2."""
    set_fed(run, rounds=1)
    Coordinator(FakeGrid(tmp_path / "n1", ["a", "b"]), run).main()
    if name == "state.msgpack":
        run.prev_state_path.write_bytes(damage)
    (run.root / name).write_bytes(damage)
    code, _, err = _cli(["start", "--run", str(run.root), "--rounds", "2"], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines


def test_shards_travel_in_bounded_pieces(run, tmp_path, monkeypatch):
    """With a small piece size, a node's missing shards go as several query.shards messages before its
    train request (which carries the last piece); no message holds more than one piece of shard bytes. One
    node, so that it lacks every expert's shards (~290 KB of this corpus): several pieces of 64 KiB."""
    limit = 1 << 16
    equal_rates(monkeypatch)
    set_fed(run, rounds=1, piece_bytes=limit, min_nodes=1)  # one node: round 1 waits for no other
    grid = FakeGrid(tmp_path / "nodes", ["a"])
    state = Coordinator(grid, run).main()
    assert all(x.version == 1 for x in state.experts.values())
    for nid, name in ((1000, "a"),):
        mine = [
            m
            for m in grid.sent
            if m.metadata.dst_node_id == nid
            and m.metadata.message_type not in (protocol.QUERY_CAPABILITIES, protocol.QUERY_END)
        ]
        kinds = [m.metadata.message_type for m in mine]
        assert kinds.count(protocol.QUERY_SHARDS) >= 2 and kinds[-1] == protocol.TRAIN, kinds
        for m in mine:
            kind = protocol.KIND_TRAIN if m.metadata.message_type == protocol.TRAIN else protocol.KIND_PIECES
            assert sum(len(p["data"]) for p in protocol.unpack(m.content, kind)["pieces"]) <= limit
        cache = Cache(tmp_path / "nodes" / name)
        held = set(cache.shards())
        needed = {
            h
            for m in mine
            if m.metadata.message_type == protocol.TRAIN
            for t in protocol.unpack(m.content, protocol.KIND_TRAIN)["tasks"]
            for h in t["shards"]
        }
        assert needed <= held and all(cache.get_shard(h) is not None for h in needed)
        assert not any((tmp_path / "nodes" / name / "parts").iterdir())  # every piece joined, nothing left over


def test_a_first_piece_times_an_unmeasured_link_and_the_rest_go_in_pieces_it_allows(run, tmp_path, monkeypatch):
    """Round 1, links not yet measured: a first piece goes alone, sized for the feared 1 Mbit/s (here a slower
    fear, so that the shards make several pieces); its exchange times the link, and the rest of the shards go
    in messages sized for the link it showed, not in a long run of small ones (each costs a process start)."""
    equal_rates(monkeypatch)
    first = heartbeat_mod.MIN_PIECE_BYTES  # one node lacks every expert's shards: ~290 KB of this corpus
    monkeypatch.setattr(scheduler, "UNMEASURED_LINK", first / heartbeat_mod.PIECE_SECONDS)
    monkeypatch.setattr(scheduler, "MIN_PROBE_BYTES", first)  # so that one piece times the link
    set_fed(run, rounds=1, min_nodes=1)  # one node: round 1 waits for no other
    grid = FakeGrid(tmp_path / "nodes", ["a"])
    state = Coordinator(grid, run).main()
    assert all(x.version == 1 for x in state.experts.values())
    for nid in (1000,):
        mine = [
            m
            for m in grid.sent
            if m.metadata.dst_node_id == nid and m.metadata.message_type in (protocol.QUERY_SHARDS, protocol.TRAIN)
        ]
        kinds = [m.metadata.message_type for m in mine]
        data = [
            sum(len(p["data"]) for p in protocol.unpack(m.content, kind)["pieces"])
            for m, kind in zip(
                mine, [protocol.KIND_PIECES if k == protocol.QUERY_SHARDS else protocol.KIND_TRAIN for k in kinds]
            )
        ]
        assert kinds[0] == protocol.QUERY_SHARDS and data[0] == first, (kinds, data)  # the first, alone
        assert kinds[-1] == protocol.TRAIN and max(data[1:]) > first, (kinds, data)  # then as the timed link allows
        assert len(mine) < sum(data) / first, (kinds, data)  # fewer messages than the feared link's pieces


def test_group_pieces_keeps_order_and_bounds():
    data = {"a" * 64: bytes(10_000), "b" * 64: bytes(3_000)}
    pieces = [p for m in pieces_mod.split_pieces(data, 2_000) for p in m]
    messages = pieces_mod.group_pieces(pieces, 5_000)
    assert [p for m in messages for p in m] == pieces
    assert all(sum(len(p["data"]) for p in m) <= 5_000 for m in messages) and len(messages) == 3
    assert pieces_mod.group_pieces(pieces, 1_000) == [[p] for p in pieces]  # a piece over the limit goes alone


def test_cache_joins_pieces_in_any_order_and_drops_bad_ones(tmp_path):
    import random

    data = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    sha = hashlib.sha256(data).hexdigest()
    pieces = [p for msg in pieces_mod.split_pieces({sha: data}, 3_000) for p in msg]
    assert len(pieces) == 4 and sum(len(p["data"]) for p in pieces) == len(data)
    random.Random(1).shuffle(pieces)
    cache = Cache(tmp_path / "c")
    done = [cache.put_piece(p["sha256"], p["offset"], p["total"], p["data"]) for p in pieces]
    assert done == [False, False, False, True] and cache.get_shard(sha) == data
    assert not any((tmp_path / "c" / "parts").iterdir())
    # One flipped byte: the piece that completes the shard finds the hash wrong, and every piece is dropped.
    bad = Cache(tmp_path / "bad")
    pieces[0] = {**pieces[0], "data": bytes([pieces[0]["data"][0] ^ 1]) + pieces[0]["data"][1:]}
    for p in pieces[:-1]:
        assert not bad.put_piece(p["sha256"], p["offset"], p["total"], p["data"])
    with pytest.raises(CheckpointError, match="joined from pieces, do not hash to its name"):
        bad.put_piece(pieces[-1]["sha256"], pieces[-1]["offset"], pieces[-1]["total"], pieces[-1]["data"])
    assert bad.get_shard(sha) is None and not any((tmp_path / "bad" / "parts").iterdir())


@pytest.mark.parametrize(
    "piece,why",
    [
        ({"offset": -1}, "do not fit its total"),
        ({"offset": 9_000}, "do not fit its total"),
        ({"total": 2**41}, "do not fit its total"),
        ({"data": "text"}, "lacks its sha256 or its bytes"),
        ({"sha256": "../../etc"}, "lacks its sha256 or its bytes"),
        ({"offset": True}, "do not fit its total"),
    ],
)
def test_malformed_pieces_are_refused(piece, why):
    good = pieces_mod.piece("a" * 64, 0, 10_000, b"x" * 2_000)
    with pytest.raises(ValidationError, match=why):
        pieces_mod.check_pieces([{**good, **piece}])
    with pytest.raises(ValidationError, match="not a list"):
        pieces_mod.check_pieces({"a": 1})


def test_worker_decodes_no_train_request_beyond_its_runs_model(run, tmp_path):
    """The capability query tells the worker the run's model, which bounds every train request it decodes."""
    from soma_edge.expert import params

    set_fed(run, rounds=1)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    Coordinator(grid, run).main()
    cfg = run.load_config()
    limit = Cache(tmp_path / "nodes" / "a").get_json("limit-1")  # the fake grid's Flower run id is 1
    assert (
        limit
        == protocol.train_request_limit(cfg)
        == 5 * (params.count(cfg.model) * 16 + 65536) + protocol.PIECE_BYTES + (1 << 20)
    )
    train = next(m for m in grid.sent if m.metadata.message_type == protocol.TRAIN)
    ctx = Context(
        run_id=1,
        node_id=train.metadata.dst_node_id,
        node_config=grid.nodes[train.metadata.dst_node_id],
        state=RecordDict(),
        run_config={},
    )
    Cache(tmp_path / "nodes" / "a").put_json("limit-1", 100)  # as if the run's model were tiny
    Cache(tmp_path / "nodes" / "b").put_json("limit-1", 100)
    with pytest.raises(CodecError, match="exceeds the limit of 100 bytes"):
        client_app.app(train, ctx)


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
