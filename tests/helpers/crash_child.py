"""A coordinator against the fake grid, in its own process, that can crash itself mid-commit.

    python -m tests.helpers.crash_child RUN NODES [--phase P --point Q --k K --round R --info FILE] [--journal FILE]

    python -m tests.helpers.crash_child --serve

(from the repository root, which puts `tests` and the project on the path).

--serve starts a zygote (`serve`): it imports what a run needs once, then forks one such process per request,
so that each of the crash trials' ~50 processes skips the ~0.4 s of importing Flower, numpy and the project.

Without --phase it just runs (or resumes) the run in RUN to completion with two fake nodes (their caches
under NODES). With --phase it exits at once with `os._exit(CRASH_CODE)` at the k-th call matching
phase/point counted from the start of round R (later rounds count on: the k-th such call at or after R),
after writing what it crashed on to --info. Phases and points (see `POINTS`):

  experts  (an `atomic_write` of experts/<e>/v<n>.msgpack)
      before_tmp     at the entry of the atomic write: nothing of it on disk yet
      after_tmp      the temp file written, before its os.replace onto the target
      after_replace  right after that os.replace (the version is made durable with the next commit)
      after_write    after the atomic write returned
  metrics  (`RunDir.append_metrics`: a commit's lines appended to metrics.jsonl)
      before_append  nothing of the commit's lines written yet
      torn_append    the first half of their bytes written (a torn last line), the rest never
      after_append   after the append returned
  state  (`RunDir.save_state`)
      before_prev_rename  before os.replace(state.msgpack -> state.prev.msgpack)
      after_prev_rename   after it, before the new state.msgpack is written
      after_tmp           the new state's temp file written, before its os.replace
      after_replace       right after that os.replace (the commit point), before the folder's fsync
      after_save          after save_state returned
  prune  (`Path.unlink` of experts/<e>/v<n>.msgpack by `RunDir.prune`, counted per round's commit)
      before_unlink    before the first unlink of a commit (none of its unlinks done)
      between_unlinks  before an unlink of a commit that already unlinked one (some done, some to do)
      after_unlink     after an unlink (between two, or after the commit's last one)
      after_prune      after the last expert's prune of a commit returned (all of its unlinks done)

Round 0 is the start-up (init of version 0 and the first state.msgpack), before round 1.

--journal appends one JSON line per committed state (after each save_state returns): what this process
saw committed, so the parent can check that none of it is lost.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

CRASH_CODE = 86
POINTS = {
    "experts": ("before_tmp", "after_tmp", "after_replace", "after_write"),
    "metrics": ("before_append", "torn_append", "after_append"),
    "state": ("before_prev_rename", "after_prev_rename", "after_tmp", "after_replace", "after_save"),
    "prune": ("before_unlink", "between_unlinks", "after_unlink", "after_prune"),
}
EXPERT_RE = re.compile(r"experts/(\d+)/v(\d+)\.msgpack$")


def state_summary(state: dict) -> dict:
    """round and, per expert, the current and best (version, sha256, path) of a state."""
    out = {}
    for e, x in state["experts"].items():
        best = x.get("best") or {}
        out[e] = {
            "version": int(x["version"]),
            "sha256": x["sha256"],
            "path": x["path"],
            "best_version": best.get("version"),
            "best_sha256": best.get("sha256"),
            "best_path": best.get("path"),
        }
    return {"round": int(state["round"]), "experts": out}


class Injector:
    def __init__(self, run_root: Path, phase: str, point: str, k: int, round_: int, info: Path) -> None:
        self.root, self.phase, self.point, self.k, self.round, self.info = run_root, phase, point, k, round_, info
        self.current_round = 0  # 0: outside any round (start-up, init)
        self.count = 0
        self.in_save_state = False
        self.unlinks_this_commit = 0
        self.info_fd = os.open(info, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # opened now: no I/O hooks later

    def armed(self) -> bool:
        return self.current_round >= self.round

    def hit(self, what: str) -> None:
        """One call matching the phase and point: crash if it is the k-th."""
        if not self.armed():
            return
        self.count += 1
        if self.count == self.k:
            rec = {
                "phase": self.phase,
                "point": self.point,
                "k": self.k,
                "round": self.round,
                "crash_round": self.current_round,
                "what": what,
                "unlinks_this_commit": self.unlinks_this_commit,
            }
            os.write(self.info_fd, json.dumps(rec).encode())
            os.fsync(self.info_fd)
            os._exit(CRASH_CODE)

    def is_expert_file(self, path) -> bool:
        return EXPERT_RE.match(os.path.relpath(os.path.abspath(path), self.root)) is not None

    def target(self, path) -> bool:
        """Whether an atomic write / replace of `path` belongs to the phase."""
        rel = os.path.relpath(os.path.abspath(path), self.root)
        if self.phase == "experts":
            return self.is_expert_file(path)
        if self.phase == "metrics":
            return rel == "metrics.jsonl"
        if self.phase == "state":
            return rel == "state.msgpack" and self.in_save_state
        return False

    def install(self) -> None:
        from coordinator.loop import Loop
        from soma_edge import checkpoint
        from soma_edge.rundir import layout as rundir
        from soma_edge.rundir.layout import RunDir

        inj = self
        real_round, real_commit = Loop.start_round, Loop.commit
        real_atomic, real_replace = checkpoint._atomic_write, os.replace
        real_save_state, real_prune, real_unlink = RunDir.save_state, RunDir.prune, Path.unlink
        real_append = RunDir.append_metrics

        def _round(self, r, ahead=None):
            inj.current_round = r
            return real_round(self, r, ahead)

        def _commit(self, rnd, t_next):
            inj.unlinks_this_commit = 0
            return real_commit(self, rnd, t_next)

        def _atomic_write(path, data, mode=None, durable=True):
            mine = inj.phase in ("experts", "metrics", "state") and inj.target(path)
            if mine and inj.point == "before_tmp":
                inj.hit(f"atomic_write {path}")
            real_atomic(path, data, mode, durable)
            if mine and inj.point == "after_write":
                inj.hit(f"atomic_write {path} returned")

        def replace(src, dst, *a, **kw):
            src_name = os.path.basename(str(src))
            is_tmp = src_name.startswith(".") and src_name.endswith(".tmp")
            mine = is_tmp and inj.target(dst)
            if mine and inj.point == "after_tmp":
                inj.hit(f"replace {src} -> {dst}")
            to_prev = os.path.basename(str(dst)) == "state.prev.msgpack"
            prev = inj.phase == "state" and inj.in_save_state and not is_tmp and to_prev
            if prev and inj.point == "before_prev_rename":
                inj.hit(f"replace {src} -> {dst}")
            real_replace(src, dst, *a, **kw)
            if mine and inj.point == "after_replace":
                inj.hit(f"replace {src} -> {dst} done")
            if prev and inj.point == "after_prev_rename":
                inj.hit(f"replace {src} -> {dst} done")

        def append_metrics(self, lines):
            if inj.phase == "metrics" and inj.point == "before_append":
                inj.hit("append_metrics")
            if inj.phase == "metrics" and inj.point == "torn_append":
                if inj.armed() and inj.count + 1 == inj.k:  # the call that crashes: half of it first
                    data = rundir.metrics_bytes(lines)
                    with open(self.metrics_path, "ab") as f:
                        f.write(data[: len(data) // 2])
                inj.hit("append_metrics, half written")
            real_append(self, lines)
            if inj.phase == "metrics" and inj.point == "after_append":
                inj.hit("append_metrics returned")

        def save_state(self, state):
            inj.in_save_state = True
            try:
                real_save_state(self, state)
            finally:
                inj.in_save_state = False
            if inj.phase == "state" and inj.point == "after_save":
                inj.hit("save_state returned")

        def prune(self, expert, keep, current, protect=()):
            gone = real_prune(self, expert, keep, current, protect)
            last = max(int(d.name) for d in (inj.root / "experts").iterdir() if d.name.isdigit()) == int(expert)
            if inj.phase == "prune" and inj.point == "after_prune" and last:
                inj.hit(f"prune of expert {expert} (the last) returned")
            return gone

        def unlink(self, missing_ok=False):
            mine = inj.phase == "prune" and inj.is_expert_file(self)
            if mine and inj.point == "before_unlink" and inj.unlinks_this_commit == 0:
                inj.hit(f"unlink {self}")
            if mine and inj.point == "between_unlinks" and inj.unlinks_this_commit > 0:
                inj.hit(f"unlink {self}")
            real_unlink(self, missing_ok=missing_ok)
            if mine:
                inj.unlinks_this_commit += 1
            if mine and inj.point == "after_unlink":
                inj.hit(f"unlink {self} done")

        Loop.start_round = _round
        Loop.commit = _commit
        checkpoint._atomic_write = _atomic_write
        RunDir.append_metrics = append_metrics
        os.replace = replace
        RunDir.save_state = save_state
        RunDir.prune = prune
        Path.unlink = unlink


def install_journal(path: Path) -> None:
    from soma_edge.rundir.layout import RunDir

    real = RunDir.save_state

    def save_state(self, state):
        real(self, state)
        with open(path, "a") as f:
            f.write(json.dumps(state_summary(state)) + "\n")
            f.flush()
            os.fsync(f.fileno())

    RunDir.save_state = save_state


def serve() -> list[str]:
    """The zygote: for each request line on stdin, {"argv": [...], "out": FILE, "err": FILE, "timeout": S},
    fork a child with stdin from /dev/null and stdout/stderr in those files, and return the argv in it (it
    runs `main` and exits as any `python -m tests.helpers.crash_child ARGV` would: the same exit code, the
    same interpreter shutdown). The zygote waits for each child and answers {"rc": its exit code} (None:
    killed at the timeout); it exits at the end of stdin."""
    # Imported before any fork, with no thread running (a fork copies only the thread that calls it, so a
    # lock another thread held would stay held in the child). onnxruntime starts a thread when it loads, so
    # each child imports it itself (~0.03 s).
    import onnx  # noqa: F401

    import coordinator.loop  # noqa: F401
    import soma_edge.expert.graph  # noqa: F401
    import tests.helpers.fakegrid  # noqa: F401  (with SOMA_BLOCK_TORCH=1, it blocks torch)
    import worker.trainer  # noqa: F401
    from coordinator import board

    board._summary_writer()  # tensorboardX, as the coordinator imports it
    if os.path.isdir("/proc/self/task"):  # Linux: count native threads too
        assert len(os.listdir("/proc/self/task")) == 1, "a thread runs in the zygote: its forks could hang"
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _redirect(req["out"], req["err"])
            return req["argv"]
        deadline = time.monotonic() + req["timeout"]
        rc = None
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                rc = os.waitstatus_to_exitcode(status)
                break
            time.sleep(0.005)
        if rc is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        sys.stdout.write(json.dumps({"rc": rc}) + "\n")
        sys.stdout.flush()  # before the next fork: a child must not inherit an unwritten reply
    sys.exit(0)


def _redirect(out: str, err: str) -> None:
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("nodes")
    ap.add_argument("--phase", choices=sorted(POINTS))
    ap.add_argument("--point")
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--round", type=int, default=1)
    ap.add_argument("--info")
    ap.add_argument("--journal")
    a = ap.parse_args(argv)

    # Imported here, after OMP_NUM_THREADS is set above: numpy's BLAS and ORT read it when they load.
    from coordinator import fleet, loop
    from coordinator.loop import Coordinator
    from soma_edge.rundir.layout import RunDir
    from tests.helpers.fakegrid import FakeGrid

    # As tests/federation/conftest.py sets it in-process: the fake grid answers a message as soon as it is
    # pulled, so the 0.5 s between pulls (for a real SuperLink) is dead time here; end_run alone waited it
    # once in every run that completes.
    fleet.POLL_SECONDS = loop.POLL_SECONDS = 0.01

    run = RunDir(a.run)
    if a.journal:
        install_journal(Path(a.journal))  # inside the injector's save_state: "after_save" crashes after the journal
    if a.phase:
        assert a.point in POINTS[a.phase], (a.phase, a.point)
        Injector(run.root, a.phase, a.point, a.k, a.round, Path(a.info)).install()
    state = Coordinator(FakeGrid(Path(a.nodes), ["a", "b"]), run).main()
    print(json.dumps({"round": state.round}))
    return 0


if __name__ == "__main__":
    sys.exit(main(serve() if sys.argv[1:] == ["--serve"] else None))
