"""The typer app every command registers on, the consoles they print to, and the mapping from
settings to the options that set them (for error messages)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console

from orchestrator import __version__
from orchestrator.errors import UserError

app = typer.Typer(
    name="orchestrator",
    help="Elastic spot-instance training orchestrator: BidBrain bidding, AgileML runtime, "
    "trace-driven cost simulator.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=200)
# A pipe or a CI log gets a wide table rather than rich's 80-column default.
out = Console() if sys.stdout.isatty() else Console(width=140)
DEBUG = {"on": False}
#: How much of an offending input an error message quotes (as the API's errors do).
MAX_QUOTED_INPUT_CHARS = 80

#: pydantic field -> the CLI option that sets it, for error messages
_OPTION_OF_FIELD = {
    "prices": "--prices",
    "availability": "--availability",
    "job_hours": "--job-hours",
    "nodes": "--nodes",
    "starts": "--starts",
    "seed": "--seed",
    "billing": "--billing",
    "budget_usd": "--budget",
    "deadline_hours": "--deadline-hours",
    "gpu_work_rates": "--gpu-work-rates",
    "true_work_rates": "--true-work-rates",
    "max_scale": "--max-scale",
    "reference_type": "--reference-type",
    "workers": "--workers",
    "strategies": "--strategy",
    "speed": "--speed",
    "replay_start": "--replay-start",
    "endpoint_url": "--endpoint-url",
    "max_running_jobs": "--max-running-jobs",
    "schedule": "--schedule",
    "stages": "--stages",
    "global_batch": "--global-batch",
    "iterations": "--iterations",
}


def _version(value: bool) -> None:
    if value:
        out.print(f"orchestrator {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks of errors.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    DEBUG["on"] = debug


def finite(value: float, option: str, *, low: float, high: float) -> float:
    """`value` if finite and within [low, high] (click's ranges let NaN through).

    Raises:
        UserError: it is not, naming `option`.
    """
    if not (math.isfinite(value) and low <= value <= high):
        raise UserError(
            f"{option}: {value} is not a number from {low:g} to {high:g}",
            field=option,
            fix=f"pass a finite {option} from {low:g} to {high:g}",
        )
    return value


def rates_option(text: str | None, option: str) -> dict[str, str] | None:
    """`MODEL=RATE,...` as a mapping (the caller checks the models and rates).

    Raises:
        UserError: an item is not MODEL=RATE, or a model is given twice (naming `option`).
    """
    if text is None:
        return None
    out: dict[str, str] = {}
    for item in text.split(","):
        model, sep, rate = (part.strip() for part in item.partition("="))
        if not (sep and model and rate) or model in out:
            raise UserError(
                f"{option}: {item.strip()!r} is not MODEL=RATE"
                + (" (the model is given twice)" if model in out else ""),
                field=option,
                fix=f"pass e.g. {option} K80=0.15,T4=0.4 (GPU models of the catalog, V100 = 1.0)",
            )
        out[model] = rate
    return out


def validation_to_user_error(exc: ValidationError, config_file: Path | None = None) -> UserError:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ())]
    field = loc[0] if loc else "input"
    option = _OPTION_OF_FIELD.get(field, ".".join(loc) or "input")
    where = f" (from {config_file} or the command line)" if config_file else ""
    fix = f"pass a valid value for {option}"
    if first.get("type") == "extra_forbidden":
        fix = f"remove {option}: it is not a setting (docs/configuration.md lists them)"
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    got = repr(first.get("input"))
    if len(got) > MAX_QUOTED_INPUT_CHARS:
        got = got[: MAX_QUOTED_INPUT_CHARS - 3] + "..."
    return UserError(
        f"{option}: {msg} (got {got}){where}",
        fix=fix,
        field=option,
    )
