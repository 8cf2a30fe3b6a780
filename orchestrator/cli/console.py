"""The console script's work: every command registered on the typer app (its modules
imported, in the order `--help` lists them) and `main`, which runs it and turns errors into
exit codes. `orchestrator.cli.main` imports this when it is called, not on import."""

from __future__ import annotations

import importlib
import sys

import typer

from orchestrator.cli.app import DEBUG, app, err
from orchestrator.errors import UserError, clip_middle
from orchestrator.lifecycle import exit_on_signals

__all__ = ["app", "main"]

#: Importing a command module registers its commands, in the order `--help` lists them.
COMMAND_MODULES = (
    "train", "simulate", "demo", "local", "market", "controller", "deploy", "jobs", "logs",
    "plan",
)  # fmt: skip
for _module in COMMAND_MODULES:
    importlib.import_module(f"orchestrator.cli.{_module}")


def main() -> None:
    """Entry point of the console script: user errors exit 2 without a traceback; SIGTERM
    and SIGHUP unwind (temporary folders removed, child processes stopped) and exit 143."""
    exit_on_signals()
    try:
        # without standalone mode click returns a command's `typer.Exit(code)` instead of
        # exiting: a command that failed would exit 0
        code = app(standalone_mode=False)
        if isinstance(code, int) and code:
            sys.exit(code)
    except UserError as exc:
        if DEBUG["on"]:
            raise
        err.print(f"[bold red]error:[/bold red] {exc.message}", highlight=False)
        if exc.fix:
            err.print(f"To fix: {exc.fix}", highlight=False)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        err.print("aborted")
        sys.exit(130)
    except _usage_errors() as exc:
        exc.show()  # type: ignore[attr-defined]
        sys.exit(2)
    except Exception as exc:  # noqa: BLE001 - a bug: one line, exit 1 (--debug: the traceback)
        if DEBUG["on"]:
            raise
        what = " ".join(f"{type(exc).__name__}: {exc}".split())
        err.print(f"[bold red]internal error:[/bold red] {clip_middle(what, 300)}", highlight=False)
        err.print("Run again with --debug for the traceback, and report it.", highlight=False)
        sys.exit(1)


def _usage_errors() -> tuple[type[Exception], ...]:
    """The usage-error classes of the click that typer runs on: click's own, or the copy that
    typer 0.29 and later vendor (`typer._click`), whose errors are not click's."""
    import click

    kinds: list[type[Exception]] = [click.ClickException]
    try:
        from typer._click.exceptions import ClickException as VendoredClickException
    except ImportError:
        pass
    else:
        kinds.append(VendoredClickException)
    return tuple(kinds)


if __name__ == "__main__":
    main()
