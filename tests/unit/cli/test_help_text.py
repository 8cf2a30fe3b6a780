"""Every command's help says what it means: rich reads `[word ...]` written in lower case as
markup and drops it, which once turned "API token [default: $ORCHESTRATOR_API__TOKEN]" into
"API token ." in `--help`. Such brackets must be escaped (`\\[`)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import typer

from orchestrator.cli.console import app

#: What rich's markup parser takes for a tag: `[` then a lower-case letter, `#`, `/` or `@`.
MARKUP_TAG = re.compile(r"(?<!\\)\[[a-z#/@][^\[\]]*\]")


def _commands(command: Any, path: str = "orchestrator") -> Iterator[tuple[str, Any]]:
    """Every command under `command` (typer vendors its own click: duck-typed)."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, f"{path} {name}")


def test_no_help_text_holds_a_bracket_rich_would_swallow() -> None:
    swallowed, commands = [], list(_commands(typer.main.get_command(app)))
    assert len(commands) > 20  # every command, sub-commands too
    for path, command in commands:
        texts = [("(command)", command.help or "")]
        texts += [(p.name or "", getattr(p, "help", None) or "") for p in command.params]
        for name, text in texts:
            swallowed += [f"{path} {name}: {m}" for m in MARKUP_TAG.findall(text)]
    assert not swallowed, swallowed


def test_an_escaped_default_shows_in_the_help() -> None:
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["submit", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "[default: $ORCHESTRATOR_API__TOKEN]" in result.output
    assert "API token for submit/cancel ." not in result.output
