"""The README and docs/ agree with the three CLIs: every `soma-coord|soma-worker|soma-export SUBCOMMAND` and
every `--flag` written after one exists in that command's --help, every option of every command is in
docs/, and docs/CLI.md lists exactly each subcommand's options. The commands are walked in-process (click's
tree under typer), not run."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
import typer

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_PROG = re.compile(r"(?<![\w/.-])(?:\.venv/bin/)?(soma-coord|soma-worker|soma-export)(?![\w-])")
# Where a command's words end: a subshell's close, a pipe or list operator, a comment, a backtick.
_END = re.compile(r"\)|\s\|\s|;|&&|\s#|`|$")
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_INLINE = re.compile(r"`([^`\n]+)`")


def _tree() -> dict[str, dict[str, set[str]]]:
    """prog -> subcommand -> its option names (both sides of --x/--no-x), from click's command objects."""
    from coordinator.cli import app as coord
    from export.cli import app as export
    from worker.cli import app as worker

    out = {}
    for prog, app in (("soma-coord", coord), ("soma-worker", worker), ("soma-export", export)):
        root = typer.main.get_command(app)
        out[prog] = {
            sub: {o for p in cmd.params if isinstance(p, click.Option) for o in p.opts + p.secondary_opts}
            for sub, cmd in root.commands.items()
        }
        out[prog][""] = {o for p in root.params for o in p.opts + p.secondary_opts}  # --log-level: any command
    return out


TREE = _tree()
SUB_TO_PROG = {sub: prog for prog, subs in TREE.items() for sub in subs if sub}
# The bench scripts' own flags (argparse), which docs/BENCHMARKS.md and docs/RESULTS.md quote on their own.
BENCH_FLAGS = {
    m for f in (ROOT / "bench").glob("*.py") for m in re.findall(r'add_argument\(\s*"(--[\w-]+)', f.read_text())
}


def _snippets(text: str) -> list[str]:
    """Code as a reader would type it: fenced blocks line by line (continuations joined), and inline code."""
    out = []
    for block in _FENCE.findall(text):
        out += block.replace("\\\n", " ").splitlines()
    rest = _FENCE.sub("", text)
    return out + _INLINE.findall(rest)


def _uses(snippet: str) -> list[tuple[str, str, list[str]]]:
    """(prog, subcommand, flags) for each soma command in a snippet: `soma-coord start --run R ...`, or in
    inline code a subcommand alone (`join --heartbeat S`), which names one command since no two share a name."""
    found = []
    starts = [(m.group(1), m.end()) for m in _PROG.finditer(snippet)]
    if not starts:
        words = snippet.split()
        if len(words) > 1 and words[0] in SUB_TO_PROG and words[1].startswith("--"):
            starts = [(SUB_TO_PROG[words[0]], 0)]
    for prog, at in starts:
        tail = snippet[at:]
        if tail.split()[:1] and tail.split()[0].endswith(":"):
            continue  # what a command printed (`soma-worker box1: connected as node ...`), not a command
        words = [w.strip("[]\"'.,:") for w in tail[: _END.search(tail).start()].split()]
        found.append((prog, _first_word(words), [w.split("=", 1)[0] for w in words if w.startswith("--")]))
    return found


def _first_word(words: list[str]) -> str:
    """The subcommand, after any root options (`soma-coord --log-level debug status RUN`)."""
    i = 0
    while i < len(words) and words[i].startswith("--"):
        i += 2 if words[i] == "--log-level" else 1
    return words[i] if i < len(words) else ""


def mismatches(text: str) -> list[str]:
    """Every command, subcommand or flag in the text's code that the CLIs do not have."""
    bad = []
    for snippet in _snippets(text):
        for prog, sub, flags in _uses(snippet):
            subs = TREE[prog]
            if not sub:
                continue  # `soma-coord` alone, or `soma-coord --help`
            if sub not in subs:
                bad.append(f"{prog} {sub}: no such command (in {snippet.strip()!r})")
                continue
            known = subs[sub] | subs[""] | {"--help"}
            bad += [f"{prog} {sub} {f}: no such option (in {snippet.strip()!r})" for f in flags if f not in known]
        words = snippet.split()
        # A flag quoted on its own (`--tls DIR`, `--no-wait`) is some command's.
        if words and words[0].startswith("--") and not _PROG.search(snippet):
            every = {o for subs in TREE.values() for opts in subs.values() for o in opts} | {"--help"}
            flag = words[0].split("=", 1)[0].strip(".,")
            if re.fullmatch(r"--[a-z][a-z0-9-]*", flag) and flag not in every | BENCH_FLAGS:
                bad.append(f"{flag}: no soma command takes it (in {snippet.strip()!r})")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_and_flag_the_docs_name_exists(page):
    assert mismatches(page.read_text()) == []


def test_every_option_of_every_command_is_documented():
    docs = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    missing = [
        f"{prog} {sub} {o}"
        for prog, subs in TREE.items()
        for sub, opts in subs.items()
        for o in sorted(opts)
        if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", docs)
    ]
    assert missing == []


def test_the_cli_reference_lists_exactly_each_commands_options():
    text = (ROOT / "docs" / "CLI.md").read_text()
    listed = {}
    for m in re.finditer(r"^### (soma-\w+) ([\w-]+)\n(.*?)(?=^##|\Z)", text, re.S | re.M):
        rows = re.findall(r"^\| `(--[^` ]+)", m.group(3), re.M)
        listed[(m.group(1), m.group(2))] = {o for r in rows for o in r.split("/")}
    expected = {(prog, sub): opts for prog, subs in TREE.items() for sub, opts in subs.items() if sub}
    assert listed == expected


def test_the_check_catches_what_the_old_readme_got_wrong():
    """The mistakes of the README before issue 25, each caught (a check that finds nothing finds nothing)."""
    assert mismatches("traffic is unencrypted (`--insecure`).") == [
        "--insecure: no soma command takes it (in '--insecure')"
    ]
    assert mismatches("```\nsoma-coord start --run r --tls tls/ --auth --exprts 4\n```") == [
        "soma-coord start --exprts: no such option (in 'soma-coord start --run r --tls tls/ --auth --exprts 4')"
    ]
    assert mismatches("`join --heartbeat auto --insecure`")[0].startswith("soma-worker join --insecure")
    assert mismatches("`soma-coord evaluate RUN`") == [
        "soma-coord evaluate: no such command (in 'soma-coord evaluate RUN')"
    ]
    ok = [
        "```",
        'flwr run "$(soma-coord app-path)" CONN --run-config "x"',
        ".venv/bin/soma-export eval B --data f [--top-k K]",
        "soma-worker box1: connected as node 7",
        "```",
        "`--seconds 90`",
    ]
    assert mismatches("\n".join(ok)) == []
