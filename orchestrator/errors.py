"""The root of every exception family in the package.

A `UserError` is something the user can fix (bad input, a missing file, an impossible budget).
The CLI prints its message and `fix` without a traceback and exits with code 2.
"""

from __future__ import annotations


def clip_middle(text: str, limit: int) -> str:
    """`text`, its middle cut out past `limit` characters (a long message keeps its start,
    what failed, and its end, where: a traceback's last lines)."""
    if len(text) <= limit:
        return text
    half = limit // 2 - 3
    return f"{text[:half]}\n…\n{text[-half:]}"


class OrchestratorError(Exception):
    """Base class of all errors raised by the orchestrator."""


class UserError(OrchestratorError):
    """An error caused by input the user controls.

    Attributes:
        message: what is wrong, naming the file or field at fault.
        fix: what to do about it ("To fix: ...").
        field: the offending field or option, when there is one.
        path: the offending file, when there is one.
    """

    exit_code = 2

    def __init__(
        self, message: str, *, fix: str = "", field: str | None = None, path: str | None = None
    ) -> None:
        self.message = message
        self.fix = fix
        self.field = field
        self.path = path
        super().__init__(self.__str__())

    def __str__(self) -> str:
        text = self.message
        if self.fix:
            text += f"\nTo fix: {self.fix}"
        return text
