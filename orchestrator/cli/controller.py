"""`orchestrator controller start`: the controller service and its HTTP API in one process."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any

import typer

from orchestrator.cli.app import app, out
from orchestrator.logfmt import log_to_stderr
from orchestrator.settings import Settings

controller_app = typer.Typer(help="Run the BidBrain controller.", no_args_is_help=True)
app.add_typer(controller_app, name="controller")


ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="YAML or JSON file of settings (any Settings field: bidbrain, controller, "
        "api, worker, ...); the environment and the options here win over it.",
    ),
]
EndpointOption = Annotated[
    str | None, typer.Option("--endpoint-url", help="EC2 endpoint (e.g. a moto server offline).")
]
PricesOption = Annotated[
    list[Path] | None,
    typer.Option(
        "--prices",
        help="Replay spot prices from these trace folders instead of reading them from EC2 "
        "(offline).",
    ),
]
ReplayStartOption = Annotated[
    str | None,
    typer.Option(
        "--replay-start", help="With --prices: the trace time the clock starts at (ISO-8601)."
    ),
]
SpeedOption = Annotated[
    float | None,
    typer.Option(
        "--speed",
        min=0.001,
        help="With --prices: how many times faster than real time the replay clock runs.",
    ),
]
BillingOption = Annotated[
    str | None, typer.Option("--billing", help="per-second (default) or hourly-refund.")
]
MaxRunningJobsOption = Annotated[
    int | None,
    typer.Option(
        "--max-running-jobs",
        min=1,
        help="Run at most this many jobs at once (1: in sequence). Default: all.",
    ),
]


@controller_app.command("start")
def start(
    config_file: ConfigOption = None,
    endpoint_url: EndpointOption = None,
    prices: PricesOption = None,
    replay_start: ReplayStartOption = None,
    speed: SpeedOption = None,
    billing: BillingOption = None,
    no_api: Annotated[bool, typer.Option("--no-api", help="Run without the HTTP API.")] = False,
    max_running_jobs: MaxRunningJobsOption = None,
) -> None:
    """Run the controller: decide every 2 minutes and on every notice, serve the API.

    Settings come from the environment (ORCHESTRATOR_REDIS_URL, ORCHESTRATOR_REGION,
    ORCHESTRATOR_CONTROLLER_ID, ORCHESTRATOR_API__TOKEN, ORCHESTRATOR_BIDBRAIN__*, ...) and the
    --config file; the options here override both. Stops on Ctrl-C or SIGTERM, finishing the
    tick in progress; instances keep running and the next start reconciles.
    """
    from orchestrator.controller.run import (
        running_controller,
        serve_api,
        wait_for_stop,
        with_api_tls_files,
        with_api_token,
    )

    log_to_stderr("%(name)s")  # the project's one formatter: every record's fields shown
    # two lines a tick at INFO; a skipped run's warning is the service's own "took longer" line
    logging.getLogger("apscheduler").setLevel(logging.ERROR)
    settings = _with_options(
        Settings.load(config_file),
        endpoint_url=endpoint_url,
        prices=tuple(prices) if prices else None,
        replay_start=replay_start,
        speed=speed,
        billing=billing,
        max_running_jobs=max_running_jobs,
    )
    if not no_api:
        settings = with_api_tls_files(with_api_token(settings))
    with running_controller(settings, on_tick=_print_tick) as running:
        out.print(
            f"controller {settings.controller_id} running in {settings.region} "
            f"(tick every {running.service.interval_s:g} s real)",
            highlight=False,
        )
        if no_api:
            wait_for_stop()
        else:
            serve_api(running)


def _with_options(settings: Settings, **options: Any) -> Settings:
    """`settings` with the `controller` fields given on the command line (None: not given).

    Raises:
        UserError: an option's value is invalid (named).
    """
    from pydantic import ValidationError

    from orchestrator.settings import ControllerSettings

    given = {k: v for k, v in options.items() if v is not None}
    try:
        section = ControllerSettings.model_validate({**settings.controller.model_dump(), **given})
    except ValidationError as exc:
        from orchestrator.cli.app import validation_to_user_error

        raise validation_to_user_error(exc) from None
    return settings.model_copy(update={"controller": section})


def _print_tick(r: Any) -> None:
    if r.launched or r.terminated or r.evicted or r.finished or r.launch_failures:
        out.print(
            f"tick: launched {len(r.launched)} terminated {len(r.terminated)} "
            f"evicted {len(r.evicted)} failed {len(r.launch_failures)} "
            f"finished {dict(r.finished)}",
            highlight=False,
        )
