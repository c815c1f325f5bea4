"""What every command of soma-coord, soma-worker and soma-export shares (soma_edge/cli.py), walked over the
click command tree of each, so that a command or parameter added later is covered too: `--help` shows each
parameter's help, a mistyped command gets one suggestion, and every path is taken from where the user
stands."""

from __future__ import annotations

import inspect

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
