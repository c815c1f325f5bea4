"""Crash trials: a coordinator (against the fake grid, `tests/helpers/fakegrid.py`) in a subprocess exits at once
(`os._exit`, no cleanup, no finally blocks) at a chosen point of a chosen write phase of a round's commit,
then a fresh process resumes the run to completion. The injection itself is `tests/helpers/crash_child.py`;
both processes of a trial are forked from its zygote (`crash_child --serve`, which has done the imports only).

Every trial is seeded by its index: `plan(i)` draws the round and the k (which matching call) from
`random.Random(i)`; the (phase, point) of the first `len(COMBOS)` trials walk every combination (in an
order shuffled by `random.Random(0)`), the rest draw one. After each resume we check that

* the crash happened where it was meant to (the child's exit code is the injected one),
* what the crash left is resumable: `RunDir.read_state(verify=True)` picks a state no older than the
  last one the child saw committed, and the resumed run starts after exactly that round,
* the resume succeeds, its final state is round N, state.msgpack and state.prev.msgpack both load and
  every expert file that either refers to loads and matches its sha256 (the fallback is usable),
* every file under RUN/experts loads (`checkpoint.load`) and holds the expert/version its name says,
* no committed version is lost: each (expert, version, sha256) of a state the child committed (its
  journal) or left on disk is still on disk with that sha256, or was pruned as keep_versions allows (older
  than the newest `KEEP`, not the best, not in the fallback state), and the final metrics accepted the
  same sha256 for that version,
* metrics.jsonl has one round line per round 1..N and one expert line per expert per round, and each
  expert's accepted versions are 1..its final version, none repeated or skipped,
* the resume leaves no temp file (a crash between writing a temp file and its os.replace leaves one,
  `after_tmp`; the resumed coordinator removes it), and no version that a prune cut short should have
  deleted (it prunes on start too, also when the run was already complete).

os._exit models a process crash (kill -9, OOM kill), not a power cut: the page cache survives, so the
ordering of fsyncs is not what this tests.
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from soma_edge import checkpoint
from soma_edge import config as config_mod
from soma_edge.errors import CheckpointError
from soma_edge.rundir.layout import RunDir, verify_experts
from soma_edge.rundir.state import LOG_KIND
from soma_edge.wire import protocol
from tests.helpers.crash_child import CRASH_CODE, EXPERT_RE, POINTS, state_summary
from tests.helpers.fakegrid import TINY, set_fed

ROOT = Path(__file__).resolve().parents[2]
LOG_RE = re.compile(r"experts/(\d+)/l(\d+)\.msgpack$")  # an update log, kept beside the version it made
CHILD = ("-m", "tests.helpers.crash_child")  # run from ROOT, which puts `tests` on its path
ROUNDS = 3
KEEP = 1  # keep_versions: the smallest, so that every commit from round 2 on prunes, and protection matters
EXPERTS = TINY["federation"]["experts"]
N_TRIALS = 24
PARALLEL = 2
CHILD_TIMEOUT = 180
TRIAL_ROUND_SECONDS = 0.05
COMBOS = [(phase, point) for phase in POINTS for point in POINTS[phase]]
random.Random(0).shuffle(COMBOS)


@dataclass(frozen=True)
class Trial:
    index: int
    phase: str
    point: str
    round: int  # counting starts at this round (0: the start-up writes of version 0 and the first state)
    k: int  # the k-th matching call from that round on

    def __str__(self) -> str:
        return f"t{self.index:02d}-{self.phase}-{self.point}-r{self.round}-k{self.k}"


def plan(i: int) -> Trial:
    """Trial i, reproducible from i alone. Rounds and k are drawn so that the k-th matching call exists
    (every round accepts all 4 experts on the fake grid; from round 2 on every commit prunes, KEEP = 1)."""
    rng = random.Random(i)
    phase, point = COMBOS[i] if i < len(COMBOS) else rng.choice(COMBOS)
    if phase == "experts":  # 4 writes a round, from round 0 (the start-up's versions 0)
        r = rng.randint(0, ROUNDS)
        k = rng.randint(1, min(8, 4 * (ROUNDS - r + 1) - 1))
    elif phase == "metrics":  # one write per commit
        r = rng.randint(1, ROUNDS)
        k = rng.randint(1, ROUNDS - r + 1)
    elif phase == "state":  # one save_state per commit, and one at start-up (which has nothing to rename)
        r = rng.randint(1 if "prev_rename" in point else 0, ROUNDS)
        k = rng.randint(1, ROUNDS - r + 1)
    elif point == "after_prune":
        r = rng.randint(1, ROUNDS)
        k = rng.randint(1, ROUNDS - r + 1)
    else:  # unlinks happen in the commits of rounds 2 and 3, up to 4 each (3 "between" moments)
        r = rng.randint(1, 2)
        k = rng.randint(1, {"before_unlink": 1 if r == 2 else 2, "between_unlinks": 2, "after_unlink": 4}[point])
    return Trial(i, phase, point, r, k)


TRIALS = [plan(i) for i in range(N_TRIALS)]

# One process runs every trial (trial_runs starts them all, PARALLEL at a time, on first use): split across
# pytest-xdist processes, each would run all of them.
CRASH_TRIALS = pytest.mark.xdist_group("crash_trials")

# Trials that reveal a bug stay here, xfail(strict=True), with the reason (none at present).
KNOWN_BUGS: dict[int, str] = {}


# --- running -------------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    # SOMA_BLOCK_TORCH=1, as `soma-worker join` sets it: the fake grid's ClientApp then blocks torch as a real
    # worker's does, and the coordinator in the same child no longer imports torch through tensorboardX (whose
    # board works without it): ~1.4 s of each child's start-up, 50 children, nothing a trial checks.
    return dict(os.environ, OMP_NUM_THREADS="1", SOMA_BLOCK_TORCH="1")


def _child(run: Path, nodes: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *CHILD, str(run), str(nodes), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT, env=_env(), cwd=ROOT)


class Zygote:
    """`crash_child --serve`: each `run` forks a process from one that has imported Flower, numpy and the
    project already (~0.4 s of each of the trials' 48 start-ups), which then runs as `_child` would run it.
    One run at a time: the pool holds PARALLEL of them."""

    def __init__(self) -> None:
        cmd = [sys.executable, *CHILD, "--serve"]
        pipe = subprocess.PIPE
        self.proc = subprocess.Popen(cmd, stdin=pipe, stdout=pipe, text=True, env=_env(), cwd=ROOT)

    def run(self, out: Path, run: Path, nodes: Path, *extra: str) -> subprocess.CompletedProcess:
        argv = [str(run), str(nodes), *extra]
        req = {"argv": argv, "out": f"{out}.out", "err": f"{out}.err", "timeout": CHILD_TIMEOUT}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the zygote ended (exit {self.proc.wait(30)})"
        rc = json.loads(line)["rc"]
        if rc is None:
            raise subprocess.TimeoutExpired(argv, CHILD_TIMEOUT)
        return subprocess.CompletedProcess(argv, rc, Path(req["out"]).read_text(), Path(req["err"]).read_text())

    def close(self) -> None:
        self.proc.stdin.close()  # the end of its stdin ends it
        self.proc.wait(30)


def _new_run(prepared: Path, dest: Path, **fed) -> RunDir:
    shutil.copytree(prepared, dest)
    rd = RunDir(dest)
    rd.save_config(config_mod.from_dict(TINY))
    set_fed(rd, rounds=ROUNDS, keep_versions=KEEP, **fed)
    return rd


def _tmp_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*.tmp"))


def _load_summary(path: Path) -> dict | None:
    try:
        return state_summary(checkpoint.load(path, "run_state"))
    except CheckpointError:
        return None


def snapshot(rd: RunDir, journal: Path) -> dict:
    """What a crash left, read before anything resumes."""
    root = rd.root
    out = {
        "journal": [json.loads(line) for line in journal.read_text().splitlines()] if journal.exists() else [],
        "state": _load_summary(rd.state_path) if rd.state_path.exists() else None,
        "prev": _load_summary(rd.prev_state_path) if rd.prev_state_path.exists() else None,
        "state_exists": rd.state_path.exists(),
        "prev_exists": rd.prev_state_path.exists(),
        "tmp": _tmp_files(root),
        "files": sorted(str(p.relative_to(root)) for p in root.glob("experts/*/v*.msgpack")),
    }
    try:
        chosen = RunDir(root).read_state(verify=True)
        out["resume_from"] = None if chosen is None else int(chosen.round)
        out["load_error"] = None
    except CheckpointError as e:
        out["resume_from"], out["load_error"] = None, str(e)
    out["pending_prune"] = _pending_prune(root, out)
    return out


def _kept(summary: dict | None) -> dict[int, set[int]]:
    if summary is None:
        return {}
    return {int(e): {x["version"], x["best_version"]} for e, x in summary["experts"].items()}


def _pending_prune(root: Path, snap: dict) -> int:
    """How many files the commit of state.msgpack's round would still have unlinked (its prune protects what
    state.msgpack and the state before it refer to)."""
    if snap["state"] is None:
        return 0
    now, before = _kept(snap["state"]), _kept(snap["prev"])
    n = 0
    for p in root.glob("experts/*/v*.msgpack"):
        m = EXPERT_RE.search(str(p))
        e, v = int(m.group(1)), int(m.group(2))
        cur = snap["state"]["experts"][str(e)]["version"]
        if (v > cur or v <= cur - KEEP) and v not in now.get(e, set()) | before.get(e, set()):
            n += 1
    return n


def run_trial(prepared: Path, base: Path, t: Trial, zygotes: queue.Queue) -> dict:
    # What a trial tests is the commit's writes, not the training: each node trains 0.05 s a round (every
    # expert still takes at least one step), ~0.5 s of CPU less per child than TINY's 0.2 s, 48 children.
    rd = _new_run(prepared, base / "run", round_seconds=TRIAL_ROUND_SECONDS)
    zygote = zygotes.get()
    try:
        return _crash_and_resume(zygote, rd, base, t)
    finally:
        zygotes.put(zygote)


def _crash_and_resume(zygote: Zygote, rd: RunDir, base: Path, t: Trial) -> dict:
    nodes, journal, info = base / "nodes", base / "journal.jsonl", base / "crash.json"
    crash = zygote.run(
        base / "crash",
        rd.root,
        nodes,
        "--phase",
        t.phase,
        "--point",
        t.point,
        "--k",
        str(t.k),
        "--round",
        str(t.round),
        "--info",
        str(info),
        "--journal",
        str(journal),
    )
    res = {
        "crash_rc": crash.returncode,
        "crash_err": crash.stderr[-3000:],
        "info": json.loads(info.read_text() or "null") if info.exists() else None,
    }
    if crash.returncode != CRASH_CODE:
        return res
    res["snap"] = snapshot(rd, journal)
    resume = zygote.run(base / "resume", rd.root, nodes)
    res.update(resume_rc=resume.returncode, resume_err=resume.stderr[-3000:])
    return res


# --- checks --------------------------------------------------------------------------------------------


def check_resumed(rd: RunDir, snap: dict, expected_tmp: list[str]) -> None:
    """Everything a resumed, completed run must hold after a crash (see the module docstring)."""
    root = rd.root
    journal = snap["journal"]
    assert snap["load_error"] is None, f"what the crash left does not load: {snap['load_error']}"
    last_committed = journal[-1]["round"] if journal else None
    if last_committed is not None:
        assert snap["resume_from"] is not None and snap["resume_from"] >= last_committed, (
            f"the child committed round {last_committed}, the crash left round {snap['resume_from']}"
        )

    log = (root / "logs" / "coordinator.log").read_text()
    if snap["resume_from"] is not None and snap["resume_from"] >= ROUNDS:  # it crashed after the last commit
        assert log.rstrip().splitlines()[-1].endswith(f"already completed its {ROUNDS} rounds")
    elif snap["resume_from"] is not None:  # the last start-up in the log is the resume
        starts = re.findall(r"run \S+: (?:resuming after|starting,) round (\d+) of", log)
        assert starts and int(starts[-1]) == snap["resume_from"], starts
    if snap["state"] is None and snap["prev"] is not None:
        assert "falling back to the commit before it" in log

    # The final state, and the fallback, load with every file they refer to.
    final = checkpoint.load(rd.state_path, "run_state")
    assert final["round"] == ROUNDS
    assert (rd.read_status() or {}).get("phase") == "done"
    verify_experts(rd, final, rd.state_path)
    assert rd.prev_state_path.exists()
    prev = checkpoint.load(rd.prev_state_path, "run_state")
    verify_experts(rd, prev, rd.prev_state_path)
    assert prev["round"] < ROUNDS
    check = RunDir(root)
    assert check.read_state(verify=True).round == ROUNDS and check.fallback is None
    fs, ps = state_summary(final), state_summary(prev)
    for x in fs["experts"].values():  # the best version loads and matches too
        body = checkpoint.load(root / x["best_path"], "expert")
        assert protocol.weights_sha256(body["weights"]) == x["best_sha256"]

    # Every expert file loads, is what its name says, and is one prune allows to stay.
    final_kept, prev_kept = _kept(fs), _kept(ps)
    on_disk: dict[tuple[int, int], str] = {}
    overdue = []  # files the prune of a commit should have deleted
    for p in sorted(root.glob("experts/*/v*.msgpack")):
        m = EXPERT_RE.search(str(p))
        e, v = int(m.group(1)), int(m.group(2))
        body = checkpoint.load(p, "expert")
        assert body["expert"] == e and body["version"] == v, p
        assert protocol.weights_sha256(body["weights"]) == body["sha256"], p
        on_disk[(e, v)] = body["sha256"]
        cur = fs["experts"][str(e)]["version"]
        if not (cur - KEEP < v <= cur or v in final_kept[e] | prev_kept[e]):
            overdue.append(str(p.relative_to(root)))
    # Even after a crash past the last commit point, before its prune finished: the resume prunes first.
    assert overdue == [], f"should have been pruned: {overdue}"
    # Besides the versions, only the update logs that made them (reply = auto sends logs here), each loading,
    # and none outliving its version's prune.
    for p in (root / "experts").rglob("*"):
        if not p.is_file() or p.name.startswith(".") or EXPERT_RE.search(str(p)):
            continue
        m = LOG_RE.search(str(p))
        assert m and (int(m.group(1)), int(m.group(2))) in on_disk, p
        checkpoint.load(p, LOG_KIND)

    # Metrics: one round line per round, one line per expert per round, accepted versions 1..final.
    lines = rd.read_metrics()
    assert len(lines) == len((root / "metrics.jsonl").read_text().splitlines())  # every line parses
    assert [m["round"] for m in lines if m["type"] == "round"] == list(range(1, ROUNDS + 1))
    for r in range(1, ROUNDS + 1):
        assert sorted(m["expert"] for m in lines if m["type"] == "expert" and m["round"] == r) == list(range(EXPERTS))
    accepted: dict[tuple[int, int], str] = {}
    for m in lines:
        if m["type"] == "expert" and m["accepted"]:
            assert (m["expert"], m["version"]) not in accepted, f"version accepted twice: {m}"
            accepted[(m["expert"], m["version"])] = m["sha256"]
    for e, x in fs["experts"].items():
        assert sorted(v for (ee, v) in accepted if ee == int(e)) == list(range(1, x["version"] + 1))
        assert accepted.get((int(e), x["version"]), x["sha256"]) == x["sha256"]
    for (e, v), sha in accepted.items():  # every accepted version is on disk, or was pruned as allowed
        if (e, v) in on_disk:
            assert on_disk[(e, v)] == sha, (e, v)
        else:
            assert v <= fs["experts"][str(e)]["version"] - KEEP and v not in final_kept[e] | prev_kept[e], (e, v)

    # No committed version lost: every version a state the child committed (or the crash left) refers to.
    committed: dict[tuple[int, int], str] = {}
    for s in journal + [x for x in (snap["state"], snap["prev"]) if x]:
        for e, x in s["experts"].items():
            for v, sha in ((x["version"], x["sha256"]), (x["best_version"], x["best_sha256"])):
                assert committed.setdefault((int(e), v), sha) == sha, f"two sha256 committed for expert {e} v{v}"
    for (e, v), sha in committed.items():
        if v > 0:
            assert accepted.get((e, v)) == sha, f"committed expert {e} v{v} {sha[:12]} became {accepted.get((e, v))}"
        if (e, v) in on_disk:
            assert on_disk[(e, v)] == sha, f"committed expert {e} v{v}: the file on disk has other weights"
        else:
            cur = fs["experts"][str(e)]["version"]
            assert v <= cur - KEEP and v not in final_kept[e] | prev_kept[e], f"committed expert {e} v{v} was lost"

    # Temp files: the crash may have left one (`expected_tmp`); the resume removed it.
    assert snap["tmp"] == expected_tmp and _tmp_files(root) == []


def expected_tmp(t: Trial, info: dict, snap: dict) -> list[str]:
    """A crash between a temp file's write and its os.replace leaves that one temp file; any other crash none."""
    if t.point != "after_tmp":
        assert snap["tmp"] == [], snap["tmp"]
        return []
    src = re.search(r"replace (\S+) -> (\S+)", info["what"])
    tmp, dst = Path(src.group(1)), Path(src.group(2))
    assert tmp.name.startswith(f".{dst.name}.") and tmp.name.endswith(".tmp") and tmp.parent == dst.parent
    assert len(snap["tmp"]) == 1 and snap["tmp"][0].endswith(tmp.name), snap["tmp"]
    return snap["tmp"]


# --- tests ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trial_runs(request, prepared, tmp_path_factory):
    """The selected trials, started PARALLEL at a time on first use; trial index -> Future of its result."""
    wanted = sorted(
        {
            item.callspec.params["t"].index
            for item in request.session.items
            if getattr(item, "originalname", "") == "test_crash_trial" and hasattr(item, "callspec")
        }
    )
    base = tmp_path_factory.mktemp("crash")
    zygotes: queue.Queue = queue.Queue()
    for _ in range(PARALLEL if wanted else 0):
        zygotes.put(Zygote())
    pool = ThreadPoolExecutor(PARALLEL)
    futures: dict[int, Future] = {
        i: pool.submit(run_trial, prepared, base / str(TRIALS[i]), TRIALS[i], zygotes) for i in wanted
    }
    yield {"base": base, "futures": futures}
    pool.shutdown(wait=True, cancel_futures=True)
    while not zygotes.empty():
        zygotes.get().close()


def test_plan_is_seeded_and_covers_every_phase_and_point():
    assert N_TRIALS >= 20 and N_TRIALS >= len(COMBOS)
    assert [plan(i) for i in range(N_TRIALS)] == TRIALS  # reproducible from the index alone
    assert {(t.phase, t.point) for t in TRIALS} == {(ph, pt) for ph in POINTS for pt in POINTS[ph]}


def _param(t: Trial):
    marks = [pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[t.index])] if t.index in KNOWN_BUGS else []
    return pytest.param(t, id=str(t), marks=marks)


@CRASH_TRIALS
@pytest.mark.parametrize("t", [_param(t) for t in TRIALS])
def test_crash_trial(t: Trial, trial_runs):
    res = trial_runs["futures"][t.index].result()
    rd = RunDir(trial_runs["base"] / str(t) / "run")
    assert res["crash_rc"] == CRASH_CODE, f"no crash (exit {res['crash_rc']}): {res['crash_err']}"
    info = res["info"]
    assert info and (info["phase"], info["point"], info["k"]) == (t.phase, t.point, t.k), info
    assert info["crash_round"] >= t.round
    snap = res["snap"]
    if t.phase == "prune":  # where among the commit's unlinks it crashed
        done, pending = info["unlinks_this_commit"], snap["pending_prune"]
        if t.point == "before_unlink":
            assert done == 0 and pending > 0
        elif t.point == "between_unlinks":
            assert done > 0 and pending > 0
        elif t.point == "after_prune":
            assert pending == 0
    tmp = expected_tmp(t, info, snap)
    assert res["resume_rc"] == 0, f"resume failed after {info}: {res['resume_err']}"
    check_resumed(rd, snap, tmp)


@CRASH_TRIALS
def test_crash_trials_hit_every_unlink_position(trial_runs):
    """Among the prune trials: crashes before a commit's first unlink, between two, and after its last."""
    seen = set()
    for i, fut in trial_runs["futures"].items():
        t, res = TRIALS[i], fut.result()
        if t.phase != "prune" or res.get("snap") is None:
            continue
        done, pending = res["info"]["unlinks_this_commit"], res["snap"]["pending_prune"]
        seen.add("before" if done == 0 and pending else "between" if done and pending else "after" if done else "none")
    if len(trial_runs["futures"]) == N_TRIALS:
        assert {"before", "between", "after"} <= seen, seen


def test_kill_9_of_a_real_coordinator_process_mid_round_resumes(prepared, tmp_path):
    """A real SIGKILL (not an injected os._exit) of the fake-grid coordinator process while it trains round 2,
    then a resume, with the same checks as the crash trials; where it lands is up to the scheduler.
    The full federation (SuperLink, SuperNodes, Flower's ServerApp process) is SIGKILLed mid-round by
    tests/e2e/test_e2e_federation.py::test_coordinator_interrupted_or_killed_mid_run."""
    rd = _new_run(prepared, tmp_path / "run")
    nodes, journal = tmp_path / "nodes", tmp_path / "journal.jsonl"
    cmd = [sys.executable, *CHILD, str(rd.root), str(nodes), "--journal", str(journal)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(), cwd=ROOT)
    try:
        deadline = time.monotonic() + CHILD_TIMEOUT
        while not ((st := rd.read_status() or {}).get("phase") == "round" and st.get("round") == 2):
            assert proc.poll() is None, "the coordinator ended before round 2"
            assert time.monotonic() < deadline, "round 2 never started"
            time.sleep(0.02)
        time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    snap = snapshot(rd, journal)
    assert not rd.is_locked()  # the kernel released the flock
    resume = _child(rd.root, nodes)
    assert resume.returncode == 0, resume.stderr[-3000:]
    assert len(snap["tmp"]) <= 1  # a kill inside an atomic write may leave its temp file
    check_resumed(rd, snap, snap["tmp"])
