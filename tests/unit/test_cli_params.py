"""What every command of soma-coord, soma-worker and soma-export shares (soma_edge/cli.py), walked over the
click command tree of each, so that a command or parameter added later is covered too: `--help` shows each
parameter's help, a mistyped command gets one suggestion, and every path is taken from where the user
stands."""

from __future__ import annotations

import inspect
from pathlib import Path

import click
import pytest
import typer

from coordinator.cli import app as coord_app
from export.cli import app as export_app
from soma_edge import cli
from worker.cli import app as worker_app

APPS = {"soma-coord": coord_app, "soma-worker": worker_app, "soma-export": export_app}


def _commands() -> list[tuple[str, typer.Typer, str, click.Command]]:
    out = []
    for prog, app in APPS.items():
        group = typer.main.get_command(app)
        assert isinstance(group, click.Group)
        out += [(prog, app, name, cmd) for name, cmd in group.commands.items()]
    return out


COMMANDS = _commands()
IDS = [f"{prog} {name}" for prog, _, name, _ in COMMANDS]


def _help_in_code(cmd: click.Command) -> dict[str, str]:
    """Each parameter's help as the code declares it (typer.Option/Argument(help=...)), read from the
    command's function, not from the click objects that click 8.5 emptied for arguments."""
    sig = inspect.signature(cmd.callback)  # follows __wrapped__ to the function the command was declared with
    return {
        name: p.default.help
        for name, p in sig.parameters.items()
        if isinstance(p.default, typer.models.ParameterInfo) and p.default.help
    }


@pytest.mark.parametrize("prog,app,name,cmd", COMMANDS, ids=IDS)
def test_help_shows_every_parameters_help(prog, app, name, cmd, capsys):
    helps = _help_in_code(cmd)
    assert cli.run(app, [name, "--help"], prog) == 0
    shown = " ".join(capsys.readouterr().out.split())  # --help wraps lines: compare words
    for param in cmd.params:
        if param.name in helps:
            assert " ".join(helps[param.name].split()) in shown, f"{prog} {name} --help: {param.name}'s help"
    arguments = [p for p in cmd.params if isinstance(p, click.Argument)]
    # listed once: click 8.5 would add a "Positional arguments" section of its own
    assert shown.count("Arguments:") == (1 if arguments else 0) and "Positional arguments" not in shown, shown


@pytest.mark.parametrize(
    "app,typo,suggestion",
    [(export_app, "evl", "Did you mean 'eval'?"), (coord_app, "stat", "Did you mean 'start', 'status'?")],
)
def test_a_mistyped_command_gets_one_suggestion(app, typo, suggestion, capsys):
    assert cli.run(app, [typo]) == 2
    err = capsys.readouterr().err
    assert err == f"error: No such command '{typo}'. {suggestion}\n"


def _value(param: click.Parameter, path: str) -> str | None:
    """A command-line value for `param`: `path` for a path, something valid for another required one."""
    if isinstance(param.type, click.Path):
        return path
    if not param.required:
        return None
    if isinstance(param.type, (click.IntRange, click.FloatRange)):
        return str(param.type.min if param.type.min is not None else 1)
    if isinstance(param.type, click.Choice):
        return str(param.type.choices[0])
    return "1" if param.type in (click.INT, click.FLOAT) else "x"


@pytest.mark.parametrize("prog,app,name,cmd", COMMANDS, ids=IDS)
def test_every_path_is_made_absolute_from_where_the_user_stands(prog, app, name, cmd, tmp_path, monkeypatch):
    """The SuperLink runs in RUN/flwr, and run.toml and prepare.json are read later from elsewhere: each
    path option and argument must reach the command absolute (soma_edge.cli.absolute), the same file the
    user named. Parsing alone runs the callbacks; nothing of the command runs."""
    monkeypatch.chdir(tmp_path)
    args, positional = [], []
    for p in cmd.params:
        value = _value(p, f"rel/{p.name}")
        if value is None or (isinstance(p, click.Option) and p.is_flag):
            continue
        if isinstance(p, click.Argument):
            positional.append(value)
        else:
            args += [p.opts[0], value]
    ctx = cmd.make_context(name, args + positional)
    paths = [p for p in cmd.params if isinstance(p.type, click.Path)]
    for p in paths:
        want = Path.cwd() / "rel" / p.name
        got = ctx.params[p.name]
        assert got == ([want] if p.multiple else want), f"{prog} {name} {p.opts[0]}: {got}"


def test_a_corpus_path_is_absolute_and_a_corpus_name_stays(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    group = typer.main.get_command(coord_app)
    prepare, start = group.commands["prepare"], group.commands["start"]
    for corpus, want in [("texts/", str(Path.cwd() / "texts")), ("default", "default"), ("debian", "debian")]:
        assert prepare.make_context("prepare", [corpus, "--experts", "2", "--out", "o"]).params["corpus"] == want
        assert start.make_context("start", ["--corpus", corpus]).params["corpus"] == want
    assert start.make_context("start", []).params["run"] == Path.cwd() / "runs" / "default"  # the default too


@pytest.mark.parametrize("order", [0, 1])
def test_start_with_superlink_still_needs_an_absolute_run(order, tmp_path, monkeypatch, capsys):
    """With --superlink, --run names a directory on the SuperLink's host: a relative one is refused as it
    was given, whichever comes first on the command line."""
    monkeypatch.chdir(tmp_path)
    pair = [["--superlink", "127.0.0.1:9"], ["--run", "runs/x"]]
    argv = ["start", *pair[order], *pair[1 - order]]
    assert cli.run(coord_app, argv, "soma-coord") == 2
    assert capsys.readouterr().err.startswith("error: --run runs/x: with --superlink, give the absolute path")
    assert not (tmp_path / "runs").exists()


def test_start_with_superlink_refuses_local_workers(capsys):
    argv = ["start", "--superlink", "127.0.0.1:9", "--run", "/srv/runs/x", "--local-workers", "2"]
    assert cli.run(coord_app, argv, "soma-coord") == 2
    assert capsys.readouterr().err == (
        "error: --local-workers needs the embedded SuperLink; start workers with `soma-worker join`\n"
    )
