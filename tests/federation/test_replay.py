"""Update logs: a worker's round of SPSA steps as scalars, replayed bit for bit in another process.

Each variant trains 200 real steps with the worker's loop (`worker.trainer.train`, ORT on the CPU EP) and
records its log; one separate process replays every log from the version it started at, as the
coordinator would, and must land on the same weights and optimizer state byte for byte.
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from soma_edge import checkpoint
from soma_edge.config import Config, from_dict
from soma_edge.errors import CheckpointError
from soma_edge.expert import params, steps
from soma_edge.spsa import log as update_log
from soma_edge.spsa import optim, quant
from soma_edge.wire import protocol
from soma_edge.wire.protocol import ReplyMode
from tests.helpers.fakegrid import SHORT_ROUND  # rounds of the runs about what a reply carries or refuses

STEPS = 200
# The version each log starts from needs a history (optimizer state present, as a second round starts from),
# not a round's worth of it: its 200 steps were half of the setup's training.
WARM_STEPS = 20
BASE = {
    "model": {"embed": 8, "hidden": 16},
    "data": {"batch": 2, "seq_len": 16},
    "device": "cpu",
    "spsa": {"directions": 2, "warmup_steps": 5},
}
VARIANTS = {  # every noise kind and optimizer option the trainer has
    "rademacher-sparse-adam-delta": {},
    "rademacher-dense-rms-momentum": {"density": 1.0, "update": "rms", "momentum": 0.9, "decoder": "spsa"},
    "gaussian-sgd-momentum-wd": {
        "noise": "gaussian",
        "update": "sgd",
        "lr": 1e-4,
        "momentum": 0.5,
        "weight_decay": 1e-3,
        "decoder": "frozen",
    },
    "gaussian-adam-accumulate-delta": {"noise": "gaussian", "accumulate": 2, "total_steps": 150},
    "rms-delta-tied-eps": {"update": "rms", "tie_eps_to_lr": True, "plateau": False},
    "soma-kind-adam-delta": {"model": {"kind": "soma", "embed": 8, "hidden": 8}},
    "rank1-rms-spsa-decoder": {"noise": "rank1", "density": 1.0, "update": "rms", "decoder": "spsa"},
    "rank1-soma-adam-delta": {"noise": "rank1", "density": 1.0, "model": {"kind": "soma", "embed": 8, "hidden": 8}},
}


def _config(name: str) -> Config:
    v = dict(VARIANTS[name])
    model = {**BASE["model"], **v.pop("model", {})}
    return from_dict({**BASE, "model": model, "spsa": {**BASE["spsa"], **v}})


# Delta-rule variants whose log carries the decoder's change in int8 codes (the shipped log_decoder), which
# the worker adopts; the others carry its float32 weights.
CODED = {"gaussian-adam-accumulate-delta", "rms-delta-tied-eps", "soma-kind-adam-delta", "rank1-soma-adam-delta"}
DATA = np.frombuffer(b"".join(bytes([i % 97 + 32]) * (i % 7 + 1) for i in range(4000)), dtype=np.uint8)


def _train(
    cfg: Config, expert: int, start: optim.State, coded: bool = False, n_steps: int = STEPS
) -> tuple[optim.State, update_log.UpdateLog]:
    from soma_edge.engine.evaluator import evaluator_for
    from worker.trainer import train

    state = optim.State(start.weights.copy(), step=start.step, opt=start.opt.copy())
    state.opt.lr_scale = 0.5  # the coordinator's plateau factor for the round: the log carries it
    body = steps.log_body(cfg)
    base_decoder = state.weights[body:].copy()
    rep = train(state, DATA, cfg, evaluator_for(cfg, threads=1, parallel=1), expert=expert, steps=n_steps)
    assert rep.steps == n_steps
    change = update_log.code_decoder(state, body, base_decoder) if coded and body else None
    return state, update_log.record_log(start.step, 0.5, rep.grads, state, body, change)


REPLAY_CHILD = """
import sys
import numpy as np
from soma_edge import checkpoint
from soma_edge.config import from_dict
from soma_edge.expert import params
from soma_edge.spsa.log import UpdateLog, replay
from soma_edge.spsa.optim import OptState, State
jobs = checkpoint.load(sys.argv[1], "replay_jobs")
out = {}
for name, job in jobs.items():
    cfg = from_dict(job["config"])
    lay = params.layout(cfg.model)
    base = State(job["weights"], step=job["step"], opt=OptState.from_record(job["opt"], job["weights"].size))
    log = UpdateLog.from_record(job["log"])
    got = replay(
        cfg.spsa, base, log, seed=cfg.seed, expert=job["expert"], body=lay.body, dense=lay.dense(), shapes=lay.shapes
    )
    out[name] = {"weights": got.weights, "opt": got.opt.to_record(), "step": got.step}
checkpoint.save(sys.argv[2], out, "replay_results")
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every variant trained for STEPS steps from a mid-run version (step 37, optimizer state present)."""
    runs = {}
    for i, name in enumerate(VARIANTS):
        cfg = _config(name)
        w0 = params.init(cfg.model, cfg.seed)
        warm, _ = _train(cfg, i, optim.State(w0), n_steps=WARM_STEPS)  # a version with a history
        warm.step = 37  # any step: the keys and the schedule follow it
        end, log = _train(cfg, i, warm, coded=name in CODED)
        runs[name] = (cfg, i, warm, end, log)
    root = tmp_path_factory.mktemp("replay")
    jobs = {
        name: {
            "config": cfg.to_dict(),
            "expert": e,
            "weights": warm.weights,
            "step": warm.step,
            "opt": warm.opt.to_record(),
            "log": log.to_record(),
        }
        for name, (cfg, e, warm, end, log) in runs.items()
    }
    checkpoint.save(root / "jobs.msgpack", jobs, "replay_jobs")
    r = subprocess.run(
        [sys.executable, "-c", REPLAY_CHILD, str(root / "jobs.msgpack"), str(root / "out.msgpack")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    return runs, checkpoint.load(root / "out.msgpack", "replay_results")


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_replay_in_another_process_matches_the_worker_bit_for_bit(trained, name):
    runs, replayed = trained
    cfg, _, warm, end, log = runs[name]
    got = replayed[name]
    assert got["step"] == end.step == warm.step + STEPS
    assert got["weights"].tobytes() == end.weights.tobytes()
    assert not np.array_equal(end.weights, warm.weights)
    body = steps.log_body(cfg) or end.weights.size  # a delta-rule decoder's Adam moments stay on the worker:
    for k in ("momentum", "adam_m", "adam_v"):  # the replay keeps the version's own
        a, b, before = got["opt"][k], getattr(end.opt, k), getattr(warm.opt, k)
        assert (a is None and b is None) or a[:body].tobytes() == b[:body].tobytes(), k
        assert a is None or a[body:].tobytes() == before[body:].tobytes(), k
    assert (log.decoder_codes is not None) == (name in CODED) and log.decoder_m is None
    assert got["opt"]["adam_t"] == end.opt.adam_t and got["opt"]["lr_scale"] == 0.5
    sizes = log.nbytes()
    assert sizes["body"] == STEPS * cfg.spsa.directions * cfg.spsa.accumulate * 4
    dense = cfg.spsa.decoder == "delta"
    assert (sizes["decoder"] > 0) == dense
    if not dense:  # the log is tiny next to the weights and optimizer state it stands for
        assert sizes["body"] * 3 < end.weights.nbytes


def _good(trained, name="rademacher-sparse-adam-delta"):
    runs, _ = trained
    cfg, e, warm, end, log = runs[name]
    return cfg, e, warm, log


@pytest.mark.parametrize(
    "breaker,message",
    [
        (
            lambda log: update_log.UpdateLog(
                log.start, log.grads[:, :1], log.lr_scale, log.decoder, log.decoder_m, log.decoder_v
            ),
            "each step needs 2",
        ),
        (
            lambda log: update_log.UpdateLog(
                log.start,
                np.where(np.arange(log.grads.size).reshape(log.grads.shape) == 7, np.nan, log.grads).astype(np.float32),
                log.lr_scale,
                log.decoder,
                log.decoder_m,
                log.decoder_v,
            ),
            "non-finite scalars",
        ),
        (
            lambda log: update_log.UpdateLog(
                log.start + 1, log.grads, log.lr_scale, log.decoder, log.decoder_m, log.decoder_v
            ),
            "the log starts at step 38, the version is at step 37",
        ),
        (lambda log: update_log.UpdateLog(log.start, log.grads, log.lr_scale, None, None, None), "needs its decoder"),
        (
            lambda log: update_log.UpdateLog(
                log.start, log.grads, log.lr_scale, log.decoder[:-1], log.decoder_m, log.decoder_v
            ),
            "needs its decoder",
        ),
        (
            lambda log: update_log.UpdateLog(
                log.start, log.grads, log.lr_scale, None, None, None, np.zeros(3, np.int8), np.ones(1, np.float32)
            ),
            "codes must be int8",
        ),
    ],
)
def test_replay_refuses_a_log_that_does_not_fit(trained, breaker, message):
    cfg, e, warm, log = _good(trained)
    before = warm.weights.tobytes()
    lay = params.layout(cfg.model)
    with pytest.raises(ValueError, match=message):
        update_log.replay(cfg.spsa, warm, breaker(log), seed=cfg.seed, expert=e, body=lay.body, dense=lay.dense())
    assert warm.weights.tobytes() == before  # nothing changed


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"start": -1}, "is not a step"),
        ({"grads": [1.0]}, "float32 [steps, directions]"),
        ({"lr_scale": 2.0}, "not in (0, 1]"),
        ({"decoder": [1.0]}, "must be float32 vectors"),
        ({"decoder_m": np.zeros(3, np.float32)}, "come both, or neither"),
        ({"decoder_codes": np.zeros(3, np.int8)}, "not an update log record"),  # without its scales
        ({"decoder_codes": np.zeros(3, np.int16), "decoder_scales": np.ones(1, np.float32)}, "int8 vector"),
        ({"decoder_codes": np.zeros(3, np.int8), "decoder_scales": np.ones(1, np.float32)}, "not both"),
        ({"extra": 1}, "not an update log record"),
    ],
)
def test_update_log_records_are_type_checked(trained, edit, message):
    _, _, _, log = _good(trained)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        update_log.UpdateLog.from_record({**log.to_record(), **edit})


def test_the_audit_allows_a_coded_decoder_half_a_code_step_and_refuses_a_flipped_code(trained):
    """The audit rebuilds the decoder from the log's steps with exact clean forwards: an honest coded change
    lands within DECODER_TOLERANCE plus half a code step of it. A worker that flips its largest code (and
    claims the hash its altered log replays to, so the replay alone cannot tell) is refused."""
    from coordinator import replay as audit_mod
    from soma_edge.config import Evaluator
    from soma_edge.engine.evaluator import evaluator_for
    from soma_edge.errors import ValidationError

    runs, _ = trained
    cfg, e, warm, _, log = runs["soma-kind-adam-delta"]
    ev = evaluator_for(cfg, "cpu", threads=1, parallel=1, evaluator=Evaluator.LOOP)
    audit_mod.audit(cfg, warm, log, e, DATA, ev, [0, STEPS - 1])
    lie = update_log.UpdateLog.from_record(log.to_record())
    lie.decoder_codes = log.decoder_codes.copy()
    i = int(np.argmax(np.abs(log.decoder_codes.astype(np.int16))))
    assert abs(int(lie.decoder_codes[i])) == quant.LEVELS and log.decoder_scales[i // quant.BLOCK] > 1e-5
    lie.decoder_codes[i] = -lie.decoder_codes[i]
    with pytest.raises(ValidationError, match=f"differs from the one it sent by .* at weight {i} "):
        audit_mod.audit(cfg, warm, lie, e, DATA, ev, [0])


# --- log replies through the round loop (fake grid, real ClientApp) -------------------------------------


def _round_lines(rd):
    return [m for m in rd.read_metrics() if m["type"] == "round"]


def _expert_lines(rd):
    return [m for m in rd.read_metrics() if m["type"] == "expert"]


def test_log_replies_replay_to_the_workers_weights_at_a_fraction_of_the_bytes(run, tmp_path, monkeypatch):
    """reply = "log" with a decoder that is not dense-updated: every version the coordinator stores is
    its replay, which is bit for bit what the worker computed (the worker cached it under the same
    hash), and the replies carry a small fraction of the bytes that weights mode moves."""
    from coordinator.loop import Coordinator
    from tests.helpers.fakegrid import FakeGrid, equal_rates, set_fed
    from worker.cache import Cache

    equal_rates(monkeypatch)
    cfg = run.load_config()
    cfg.spsa.decoder = "spsa"
    run.save_config(cfg)
    weights_run = type(run)(tmp_path / "weights-run")
    import shutil

    shutil.copytree(run.root, weights_run.root)
    set_fed(run, rounds=2, reply="log")
    # A weights reply's bytes do not depend on how long it trained (the log's do: that run keeps its rounds).
    set_fed(weights_run, rounds=2, reply="weights", round_seconds=SHORT_ROUND)
    state = Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main()
    Coordinator(FakeGrid(tmp_path / "nodes-w", ["a", "b"]), weights_run).main()
    lines = _expert_lines(run)
    assert len(lines) == 8 and all(m["accepted"] and m["weights_bytes_up"] == 0 for m in lines)
    assert all(m["log_bytes_up"]["body"] > 0 and m["log_bytes_up"]["decoder"] == 0 for m in lines)
    for x in state.experts.values():
        stored = checkpoint.load(run.root / x.path, "expert")["weights"]
        node = "a" if x.node == "a" else "b"
        cached = Cache(tmp_path / "nodes" / node).get_weights(x.sha256)
        assert cached is not None and cached["weights"].tobytes() == stored.tobytes()
        assert stored.dtype == np.float32
    up_log = sum(m["bytes_up"] for m in _round_lines(run))
    up_weights = sum(m["bytes_up"] for m in _round_lines(weights_run))
    assert up_log < 0.05 * up_weights, (up_log, up_weights)


@pytest.mark.parametrize("log_decoder,audit", [("int8", 0), ("float32", 0), ("int8", 4)])
def test_a_log_reply_carries_the_decoder_as_its_codes_or_weights_and_moments_only_for_the_audit(
    run, tmp_path, monkeypatch, log_decoder, audit
):
    """With the delta rule, a log reply carries the decoder's change in int8 codes (the default: ~1/4 of
    its float32 weights) or its float32 weights; its Adam moments only where the coordinator audits. The
    coordinator's replay of a coded log hashes to the version the worker adopted and cached."""
    from coordinator.loop import Coordinator
    from tests.helpers.fakegrid import FakeGrid, equal_rates, set_fed
    from worker.cache import Cache

    equal_rates(monkeypatch)
    set_fed(run, rounds=1, reply="log", log_decoder=log_decoder, audit_steps=audit, round_seconds=SHORT_ROUND)
    state = Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"]), run).main()
    lay = params.layout(run.load_config().model)
    n = lay.size - lay.body
    want = (4 * n if log_decoder == "float32" else n + 4 * quant.blocks(n)) + (8 * n if audit else 0)
    lines = _expert_lines(run)
    assert len(lines) == 4 and all(m["accepted"] and m["log_bytes_up"]["decoder"] == want for m in lines)
    for x in state.experts.values():  # the worker cached the version the coordinator stored, by its hash
        assert Cache(tmp_path / "nodes" / x.node).get_weights(x.sha256) is not None


def test_auto_sends_weights_too_every_few_rounds_and_they_must_match_the_replay(run, tmp_path, monkeypatch):
    from coordinator import dispatch
    from coordinator.loop import Coordinator
    from tests.helpers.fakegrid import FakeGrid, equal_rates, set_fed

    equal_rates(monkeypatch)
    # The fake grid's links stay unmeasured (slow, to auto): let the checkpoint fit them regardless.
    monkeypatch.setattr(dispatch, "CHECKPOINT_SHARE", float("inf"))
    set_fed(run, rounds=2, reply="auto", weights_every=2, round_seconds=SHORT_ROUND)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    Coordinator(grid, run).main()
    lines = _expert_lines(run)
    assert all(m["accepted"] for m in lines)
    by_round = {r: [m for m in lines if m["round"] == r] for r in (1, 2)}
    assert all(m["weights_bytes_up"] == 0 and m["log_bytes_up"]["decoder"] > 0 for m in by_round[1])  # delta rule
    assert all(m["weights_bytes_up"] > 0 and m["log_bytes_up"] is not None for m in by_round[2])  # the checkpoint
    # A worker whose weights differ from its own log, in a checkpoint round, is refused.
    set_fed(run, rounds=4)

    def lie(nid, body):
        for res in body["results"]:
            if res.get("weights") is not None and res.get("log") is not None:
                res["weights"] = res["weights"].copy()
                res["weights"][0] += 1
                res["sha256"] = protocol.weights_sha256(res["weights"])
        return body

    Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"], tamper=lie), run).main()
    r4 = [m for m in _round_lines(run) if m["round"] == 4][0]
    assert len(r4["rejected"]) == 4 and all("not what its update log replays to" in x["reason"] for x in r4["rejected"])


def test_auto_asks_for_weights_on_a_fast_link_and_logs_on_a_slow_or_unmeasured_one():
    """reply = "auto", per node and round, from the node's link: weights where its experts' versions cross
    within WEIGHTS_SHARE of round_seconds, else the log, with a checkpoint (both) every weights_every
    rounds only where the versions cross within CHECKPOINT_SHARE."""
    from coordinator.dispatch import CHECKPOINT_SHARE, WEIGHTS_SHARE, reply_mode
    from coordinator.fleet import Node

    cfg = from_dict({**BASE, "federation": {"reply": "auto", "round_seconds": 60.0, "weights_every": 10}})
    version = 12 * params.count(cfg.model)  # weights and both Adam moments, float32
    fast = version / (WEIGHTS_SHARE * 60.0 / 2)  # bytes/s: two experts' versions cross in exactly 5% of a round

    def mode(link, r=1, experts=2):
        return reply_mode(cfg, cfg, Node(id=1, link=link), r, 100, version, experts)

    assert mode(fast) == mode(2 * fast) == ReplyMode.WEIGHTS
    assert mode(fast, experts=3) == ReplyMode.LOG  # three versions take 7.5% of the round
    assert mode(None) == mode(None, r=10) == ReplyMode.LOG  # unmeasured: a slow link until timed
    middle = version * 2 / (CHECKPOINT_SHARE * 60.0)  # the checkpoint fits exactly
    assert (mode(middle, r=9), mode(middle, r=10), mode(middle / 2, r=10)) == (
        ReplyMode.LOG,
        ReplyMode.BOTH,
        ReplyMode.LOG,
    )
    assert reply_mode(cfg, cfg, Node(id=1, link=None), 1, 10**9, version) == ReplyMode.WEIGHTS  # a longer log


def test_audit_catches_a_worker_that_invents_one_scalar(run, tmp_path, monkeypatch):
    """Node b alters one scalar of its log and claims the hash its altered log replays to, so the replay
    alone cannot tell; the audit recomputes that step's losses and refuses the reply."""
    from coordinator.loop import Coordinator
    from tests.helpers.fakegrid import FakeGrid, claim_log, equal_rates, set_fed

    equal_rates(monkeypatch)
    # every step: the altered one is surely among them (each one audited: short rounds, short audits)
    set_fed(run, rounds=2, reply="log", audit_steps=1024, round_seconds=SHORT_ROUND)
    box: list = []

    def lie(nid, body):
        coord = box[0]
        for res in body["results"] if nid == 1001 else []:
            log = update_log.UpdateLog.from_record(res["log"])
            log.grads[log.steps // 2, 0] *= 3.0
            claim_log(coord, res, log)
        return body

    coord = Coordinator(FakeGrid(tmp_path / "nodes", ["a", "b"], tamper=lie), run)
    box.append(coord)
    state = coord.main()
    rejected = [x for m in _round_lines(run) for x in m["rejected"]]
    assert rejected and all(x["node"] == "b" and "the losses give" in x["reason"] for x in rejected), rejected
    honest = [m for m in _expert_lines(run) if m["node"] == "a"]
    assert honest and all(m["accepted"] for m in honest)  # the audit passes honest logs (delta rule rebuilt)
    assert state.round == 2 and all(m["version"] <= 2 for m in _expert_lines(run))
    assert state.strikes["node:1001"]["count"] == len(rejected)


def test_a_worker_cannot_tell_which_steps_will_be_audited(run, tmp_path, monkeypatch):
    """Node b knows the run's seed, each result's expert and version: all a predictable key would be drawn
    from. It computes the steps such a key would audit (4 of each log's ~25) and invents every other scalar,
    claiming the hash its log replays to. The coordinator draws its picks from a secret of its own, so
    invented steps are among them and every such reply is refused (all 4 picks among the 4 known ones: 1 in
    C(25, 4) = 12,650 a reply). (The decoder learns by SPSA here: a delta-rule decoder is rebuilt along every
    step in an audit, which would catch the lie on its own.)"""
    from coordinator import replay
    from coordinator.loop import Coordinator
    from tests.helpers.fakegrid import FakeGrid, claim_log, equal_rates, set_fed, step_budgets_bind

    equal_rates(monkeypatch)
    cfg = run.load_config()
    cfg.spsa.decoder = "spsa"
    run.save_config(cfg)
    set_fed(run, rounds=2, reply="log", audit_steps=4)
    box: list = []

    def lie(nid, body):
        for res in body["results"] if nid == 1001 else []:
            log = update_log.UpdateLog.from_record(res["log"])
            known = replay.sample_steps(log.steps, 4, cfg.seed, res["expert"], int(res["version"]))
            log.grads[[i for i in range(log.steps) if i not in known]] *= 3.0
            claim_log(box[0], res, log)
        return body

    grid = FakeGrid(tmp_path / "nodes", ["a", "b"], tamper=lie)
    step_budgets_bind(grid)  # each expert takes its budget of steps, whatever the box's speed
    coord = Coordinator(grid, run)
    box.append(coord)
    coord.main()
    lines = _expert_lines(run)
    liars = [m for m in lines if m["node"] == "b"]
    assert liars and not any(m["accepted"] for m in liars), liars
    rejected = [x for m in _round_lines(run) for x in m["rejected"]]
    assert rejected and all(x["node"] == "b" and "the losses give" in x["reason"] for x in rejected), rejected
    assert all(m["accepted"] and m["steps"] >= 20 for m in lines if m["node"] == "a")


def test_gaussian_noise_falls_back_to_weights_for_another_numpy(run, tmp_path, monkeypatch):
    from flwr.app import Message

    from coordinator.loop import Coordinator
    from tests.helpers.fakegrid import FakeGrid, set_fed
    from worker import client_app

    cfg = run.load_config()
    cfg.spsa.noise = "gaussian"
    run.save_config(cfg)
    set_fed(run, rounds=1, reply="log", round_seconds=SHORT_ROUND)
    real = client_app.capabilities

    def other_numpy(msg, context):  # node b claims another numpy: its Gaussian stream may differ
        body = protocol.unpack(real(msg, context).content, protocol.KIND_CAPS)
        body["numpy"] = body["numpy"] if context.node_id == 1000 else "1.0.0"
        return Message(protocol.pack(body, protocol.KIND_CAPS), reply_to=msg)

    monkeypatch.setitem(client_app.app._registered_funcs, "query.capabilities", other_numpy)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    Coordinator(grid, run).main()
    modes = {
        m.metadata.dst_node_id: {t["reply"] for t in protocol.unpack(m.content, protocol.KIND_TRAIN)["tasks"]}
        for m in grid.sent
        if m.metadata.message_type == protocol.TRAIN
    }
    assert modes == {1000: {"log"}, 1001: {"weights"}}
    assert all(m["accepted"] for m in _expert_lines(run))


def test_a_node_holding_the_version_before_gets_the_log_instead_of_the_weights(run, tmp_path, monkeypatch):
    """Round 1: a trains experts 0 and 2, b trains 1 and 3. Round 2: a is away, b trains all four.
    Round 3: b is away, a is back: it holds version 1 of 0 and 2, so it is sent the log 1 -> 2 (and
    rebuilds version 2 itself, checked against its hash) instead of the weights; 1 and 3 come as weights."""
    from coordinator.loop import Coordinator, Loop
    from tests.helpers.fakegrid import FakeGrid, equal_rates, set_fed

    equal_rates(monkeypatch)
    cfg = run.load_config()
    cfg.spsa.decoder = "spsa"  # a log without the dense decoder: far shorter than the weights
    run.save_config(cfg)
    set_fed(run, rounds=3, reply="log", min_nodes=1)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    coord = Coordinator(grid, run)
    real_start = Loop.start_round

    def start(self, r, ahead=None):
        grid.gone = {1: set(), 2: {1000}, 3: {1001}}[r]
        return real_start(self, r, ahead)

    monkeypatch.setattr(Loop, "start_round", start)
    state = coord.main()
    lines = [m for m in run.read_metrics() if m["type"] == "expert"]
    assert all(m["accepted"] for m in lines) and state.round == 3
    r1 = {m["expert"]: m["node"] for m in lines if m["round"] == 1}
    r3 = {m["expert"]: m for m in lines if m["round"] == 3}
    on_a = [e for e, n in r1.items() if n == "a"]
    to_a = [
        protocol.unpack(m.content, protocol.KIND_TRAIN)
        for m in grid.sent
        if m.metadata.message_type == protocol.TRAIN and m.metadata.dst_node_id == 1000
    ]
    tasks = {t["expert"]: t for t in to_a[-1]["tasks"]}
    assert on_a and all(tasks[e]["weights"] is None and tasks[e]["base_log"] is not None for e in on_a)
    assert all(tasks[e]["weights"] is not None for e in tasks if e not in on_a)
    weights_bytes = max(r3[e]["weights_bytes_down"] for e in tasks if e not in on_a)
    assert all(0 < r3[e]["weights_bytes_down"] < weights_bytes / 10 for e in on_a)


def test_after_a_seed_run_a_node_holding_the_seed_is_sent_version_1_not_a_log_from_version_0(
    run, tmp_path, monkeypatch
):
    """Version 0 of every expert hashes like the seed's final weights, which the node that trained the seed
    holds with the seed's step and optimizer state. Round 1: only a, which trains the seed. Round 2: only b,
    which trains every expert to version 1. Round 3: only a again: the log 0 -> 1 would replay from a's copy
    of the seed (its step and Adam moments, not version 0's), and did not ("the log starts at step 0, the
    version is at step 4", seen in the secure seed e2e run): a is sent version 1's weights, and trains it."""
    from coordinator.loop import Coordinator, Loop
    from tests.helpers.fakegrid import FakeGrid, equal_rates, set_fed

    equal_rates(monkeypatch)
    cfg = run.load_config()
    cfg.model.kind, cfg.model.embed, cfg.model.hidden = "soma", 8, 8  # the paper's expert: its E is frozen
    run.save_config(cfg)
    set_fed(run, rounds=3, reply="log", min_nodes=1, seed_steps=4, round_seconds=SHORT_ROUND)
    grid = FakeGrid(tmp_path / "nodes", ["a", "b"])
    real_start = Loop.start_round

    def start(self, r, ahead=None):
        grid.gone = {1: {1001}, 2: {1000}, 3: {1001}}[r]
        return real_start(self, r, ahead)

    monkeypatch.setattr(Loop, "start_round", start)
    state = Coordinator(grid, run).main()
    lines = _expert_lines(run)
    assert [m["node"] for m in lines if m["round"] == 1] == ["a"] and state.seed is not None  # a trained the seed
    r3 = [m for m in lines if m["round"] == 3]
    assert r3 and all(m["accepted"] and m["node"] == "a" for m in r3), [(m["expert"], m.get("reason")) for m in r3]
    to_a = [
        protocol.unpack(m.content, protocol.KIND_TRAIN)
        for m in grid.sent
        if m.metadata.message_type == protocol.TRAIN and m.metadata.dst_node_id == 1000
    ]
    # Its first request of round 3 sends the weights: no log that fails to replay, reported, and sent again
    # as weights (in a real federation that costs the round: the secure seed e2e run lost one to it)
    assert len(to_a) == 2 and all(t["base_log"] is None and t["weights"] is not None for t in to_a[1]["tasks"])
