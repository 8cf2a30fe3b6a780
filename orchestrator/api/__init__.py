"""The controller's HTTP API (`app.create_app`) and the client the CLI uses (`client.ApiClient`).

Every error the API returns has one JSON shape, which `ApiClient` turns back into a `UserError`::

    {"error": {"message": "budget_usd: Input should be greater than 0 (got 0)",
               "field": "budget_usd", "fix": "pass a valid value for budget_usd"}}

This module holds only that shared vocabulary (no FastAPI import, so the CLI stays fast); the
server lives in `orchestrator.api.app`, the client in `orchestrator.api.client`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from orchestrator.errors import UserError

#: How much of an offending input an error message quotes.
MAX_QUOTED_INPUT_CHARS = 80


def validation_error(
    errors: Sequence[Mapping[str, Any]],
    *,
    skip_loc: int = 0,
    options: Mapping[str, str] | None = None,
    what: str = "job spec",
) -> UserError:
    """A `UserError` for the first of pydantic's `errors`, naming the field at fault.

    Args:
        errors: `ValidationError.errors()` (or FastAPI's `RequestValidationError.errors()`).
        skip_loc: leading `loc` parts that are not field names (1 for FastAPI's "body").
        options: field -> the CLI option that set it (e.g. {"budget_usd": "--budget"}), so the
            message names what the user typed.
        what: what was validated, for errors about the whole document.
    """
    if not errors:
        return UserError(f"invalid {what}", fix=f"check the {what}")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ())][skip_loc:]
    field = ".".join(loc) if loc else None
    kind = str(first.get("type", ""))
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    named = field if field is not None else what
    option = (options or {}).get(field or "")
    if option:
        named = f"{field} ({option})"
    if kind == "extra_forbidden":
        return UserError(
            f"{named}: not a field of the {what}",
            fix=f"remove {field} (check its spelling against the documented fields)",
            field=field,
        )
    if kind == "missing":
        return UserError(f"{named}: required", fix=f"add {field}", field=field)
    quoted = repr(first.get("input"))
    if len(quoted) > MAX_QUOTED_INPUT_CHARS:
        quoted = quoted[: MAX_QUOTED_INPUT_CHARS - 3] + "..."
    return UserError(
        f"{named}: {msg} (got {quoted})",
        fix=f"pass a valid value for {option or field}" if field else f"correct the {what}",
        field=field,
    )


def error_body(exc: UserError) -> dict[str, dict[str, str | None]]:
    """The API's JSON error document for `exc`."""
    return {"error": {"message": exc.message, "field": exc.field, "fix": exc.fix or None}}
