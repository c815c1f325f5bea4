"""What every soma-edge CLI shares: the exit-code contract (0 ok, 2 bad input, 1 internal failure).

0 success; 2 and one `error: ...` line on stderr when the user's input is wrong (any SomaError, or a
usage error from typer/click); 1 for an internal failure. A path on the command line is one from where
the user stands: every path option and argument is declared with `path_option` or `path_argument`, which
make it absolute as the command line is read.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import click
import typer
from rich.console import Console

from soma_edge.errors import ConfigError, SomaError

LOG_LEVELS = ("debug", "info", "warning", "error")
_log_level = ["info"]


def make_app(help: str) -> typer.Typer:
    # rich_markup_mode=None: help strings mention TOML tables like [spsa], which rich would eat as markup.
    # typer 0.20 still escapes "[default: ...]" for rich when rich is importable, and the plain formatter
    # then prints the backslash; it escapes only when it believes rich renders the help.
    typer.core.HAS_RICH = False
    _keep_argument_help()
    app = typer.Typer(
        help=help, pretty_exceptions_enable=False, add_completion=False, no_args_is_help=True, rich_markup_mode=None
    )

    @app.callback()
    def _root(
        log_level: str = typer.Option(
            "info",
            "--log-level",
            help="debug | info | warning | error: what this "
            "command logs; any command takes it, before or after its name.",
        ),
    ) -> None:
        pass  # `run` took it out of the arguments already (typer would accept it only before the command)

    return app


def _keep_argument_help() -> None:
    """Make `--help` show each positional argument's help again, once. typer 0.20's TyperArgument keeps the
    help itself and passes none to click, and click 8.5 gave Argument a help of its own, whose __init__ sets
    it back to None: set it again after. click 8.5 would then also list the arguments in a section of its
    own ("Positional arguments") before typer's ("Arguments", with their defaults): only typer's stays.
    Both are harmless with a click before 8.5, which had neither."""
    init = typer.core.TyperArgument.__init__
    if getattr(init, "keeps_help", False):
        return

    def __init__(self, *args, help: str | None = None, **kwargs) -> None:
        init(self, *args, help=help, **kwargs)
        self.help = help

    def format_arguments(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        pass  # typer's format_options writes the arguments

    __init__.keeps_help = True
    typer.core.TyperArgument.__init__ = __init__
    typer.core.TyperCommand.format_arguments = format_arguments


def absolute(value: Path | Sequence[Path] | None) -> Path | list[Path] | None:
    """The callback of every path option and argument: a relative path means one from where the user
    stands, so it becomes absolute here, once, before a command hands it to a process that runs elsewhere
    (the SuperLink runs in RUN/flwr) or writes it into a file read later from another directory."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [Path(v).absolute() for v in value]
    return Path(value).absolute()


def path_option(default: Any, *param_decls: str, help: str, **kwargs: Any) -> Any:
    """typer.Option for a path: made `absolute` as the command line is read."""
    return typer.Option(default, *param_decls, callback=absolute, help=help, **kwargs)


def path_argument(default: Any = ..., *, help: str, **kwargs: Any) -> Any:
    """typer.Argument for a path: made `absolute` as the command line is read."""
    return typer.Argument(default, callback=absolute, help=help, **kwargs)


def log_level() -> str:
    """This invocation's --log-level."""
    return _log_level[0]


def _take_log_level(argv: list[str]) -> list[str]:
    """The arguments without --log-level LEVEL (anywhere before a `--`), whose value becomes log_level()."""
    out, i = [], 0
    _log_level[0] = "info"
    while i < len(argv):
        a = argv[i]
        if a == "--":
            out += argv[i:]
            break
        if a == "--log-level" or a.startswith("--log-level="):
            if "=" in a:
                value = a.split("=", 1)[1]
            elif i + 1 < len(argv):
                value, i = argv[i + 1], i + 1
            else:
                raise ConfigError("--log-level needs a value: debug, info, warning or error")
            if value not in LOG_LEVELS:
                raise ConfigError(f"--log-level {value!r}: expected debug, info, warning or error")
            _log_level[0] = value
        else:
            out.append(a)
        i += 1
    return out


def console(stderr: bool = False):
    """A rich console for tables and progress: the terminal's width on a terminal; off one (piped, in a
    file) $COLUMNS or 160 columns, where rich would assume 80 and cut the tables."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else int(os.environ.get("COLUMNS", "") or 160)
    return Console(stderr=stderr, width=width, soft_wrap=True)


def run(app: typer.Typer, argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run a typer app under the exit-code contract; returns the exit code."""
    try:
        argv = _take_log_level(sys.argv[1:] if argv is None else list(argv))
        logging.basicConfig(
            level=getattr(logging, log_level().upper()),
            stream=sys.stderr,
            format="%(asctime)s %(name)s %(levelname)s %(message)s",
        )
        result = app(args=argv, prog_name=prog, standalone_mode=False)
        return int(result or 0)
    except SomaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except click.exceptions.UsageError as e:
        print(f"error: {_usage_message(e)}", file=sys.stderr)
        return 2
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.exceptions.Abort:
        print("error: aborted", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


def _usage_message(e: click.exceptions.UsageError) -> str:
    """A usage error's one line, with one suggestion for a mistyped command: typer writes its "Did you mean"
    into the message, and click 8.4+ appends its own when it formats the message."""
    if "Did you mean" in e.message:
        return e.message
    return e.format_message()


def entry(app: typer.Typer, prog: str) -> Callable[[], None]:
    return lambda: sys.exit(run(app, prog=prog))
