"""`orchestrator controller start`: the controller service and its HTTP API in one process."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import SecretStr

from orchestrator.cli import app, out
from orchestrator.errors import UserError
from orchestrator.settings import Settings

controller_app = typer.Typer(help="Run the BidBrain controller.", no_args_is_help=True)
app.add_typer(controller_app, name="controller")


@controller_app.command("start")
def start(
    endpoint_url: Annotated[
        str | None,
        typer.Option("--endpoint-url", help="EC2 endpoint (e.g. a moto server offline)."),
    ] = None,
    prices: Annotated[
        list[Path] | None,
        typer.Option(
            "--prices",
            help="Replay spot prices from these trace folders instead of "
            "reading them from EC2 (offline).",
        ),
    ] = None,
    replay_start: Annotated[
        str | None,
        typer.Option(
            "--replay-start", help="With --prices: the trace time the clock starts at (ISO-8601)."
        ),
    ] = None,
    speed: Annotated[
        float,
        typer.Option(
            "--speed",
            min=0.001,
            help="With --prices: how many times faster than real time the replay clock runs.",
        ),
    ] = 1.0,
    billing: Annotated[str, typer.Option("--billing")] = "per-second",
    no_api: Annotated[bool, typer.Option("--no-api", help="Run without the HTTP API.")] = False,
    max_running_jobs: Annotated[
        int | None,
        typer.Option(
            "--max-running-jobs",
            min=1,
            help="Run at most this many jobs at once (1: in sequence). Default: all.",
        ),
    ] = None,
) -> None:
    """Run the controller: decide every 2 minutes and on every notice, serve the API.

    Settings come from the environment (ORCHESTRATOR_REDIS_URL, ORCHESTRATOR_REGION,
    ORCHESTRATOR_CONTROLLER_ID, ORCHESTRATOR_API__TOKEN, ...). Stops on Ctrl-C or SIGTERM,
    finishing the tick in progress; instances keep running and the next start reconciles.
    """
    import boto3
    from botocore.config import Config

    from orchestrator.cloud.ec2 import EC2Cloud
    from orchestrator.controller.core import Controller, TickReport
    from orchestrator.controller.service import ControllerService
    from orchestrator.market.billing import billing_model
    from orchestrator.market.ec2_source import EC2PriceSource
    from orchestrator.market.prices import PriceSource, to_epoch_seconds
    from orchestrator.market.trace_source import TracePriceSource
    from orchestrator.store import Store

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = Settings.load()
    if not no_api:
        settings = _with_token_from_secret(settings, endpoint_url)
        settings.api.require_token()
    bill = billing_model(billing)
    store = Store.connect(settings.redis_url)
    client = boto3.client(
        "ec2",
        region_name=settings.region,
        endpoint_url=endpoint_url,
        config=Config(retries={"mode": "adaptive", "max_attempts": 8}),
    )
    source: PriceSource
    if prices:
        source = TracePriceSource(prices)
        if replay_start is None:
            raise UserError(
                "--prices replays a trace: give the time to start at",
                field="--replay-start",
                fix="pass e.g. --replay-start 2020-02-03T00:00:00Z",
            )
        try:
            t0 = to_epoch_seconds(replay_start)
        except ValueError:
            raise UserError(
                f"--replay-start {replay_start!r} is not ISO-8601",
                field="--replay-start",
                fix="e.g. 2020-02-03T00:00:00Z",
            ) from None
        m0 = time.monotonic()

        def clock() -> float:
            return t0 + speed * (time.monotonic() - m0)
    else:
        source = EC2PriceSource(settings.region, client=client)
        clock = time.time
        speed = 1.0
    host = _training_host(settings, store, endpoint_url)
    controller = Controller(
        store=store,
        launch_tags=host.tags_for if host is not None else None,
        cloud=EC2Cloud(
            settings.region,
            settings.controller_id,
            client=client,
            launch_template=settings.worker.launch_template,
            subnets=settings.worker.subnet_ids,
        ),
        prices=source,
        billing=bill,
        max_running_jobs=max_running_jobs,
    )

    def report(r: TickReport) -> None:
        if host is not None:
            host.step(clock())
        if r.launched or r.terminated or r.evicted or r.finished or r.launch_failures:
            out.print(
                f"tick: launched {len(r.launched)} terminated {len(r.terminated)} "
                f"evicted {len(r.evicted)} failed {len(r.launch_failures)} "
                f"finished {dict(r.finished)}",
                highlight=False,
            )

    service = ControllerService(controller, clock=clock, speed=speed, on_tick=report)
    service.start()
    out.print(
        f"controller {settings.controller_id} running in {settings.region} "
        f"(tick every {service.interval_s:g} s real)",
        highlight=False,
    )
    try:
        if no_api:
            while True:
                time.sleep(1.0)
        else:
            import uvicorn

            from orchestrator.api.app import create_app

            uvicorn.run(
                create_app(store, settings, clock=clock, on_notice=service.notify),
                host=settings.api.host,
                port=settings.api.port,
                log_level="warning",
            )
    except KeyboardInterrupt:
        pass
    finally:
        service.stop()
        if host is not None:
            host.close()
        store.close()


def _training_host(settings: Settings, store: Any, endpoint_url: str | None) -> Any:
    """On AWS (a worker token secret is configured): the host of the training jobs' AgileML
    elasticity controllers, advertised at this node's private address; None otherwise."""
    if not settings.worker.token_secret:
        return None
    from orchestrator.agileml.host import TrainingHost
    from orchestrator.cloud.imds import IMDS_BASE_URL, LOCAL_IPV4_PATH, read_metadata
    from orchestrator.cloud.secrets import read_secret
    from orchestrator.worker import worker_token

    advertise = settings.worker.advertise_host
    if advertise is None:
        advertise = read_metadata(IMDS_BASE_URL, [LOCAL_IPV4_PATH])[LOCAL_IPV4_PATH]
    if not advertise:
        raise UserError(
            "cannot tell the workers where this controller is",
            field="ORCHESTRATOR_WORKER__ADVERTISE_HOST",
            fix="set ORCHESTRATOR_WORKER__ADVERTISE_HOST to this node's private address",
        )
    secret = read_secret(settings.worker.token_secret, settings.region, endpoint_url=endpoint_url)
    return TrainingHost(
        store,
        token=worker_token(secret),
        advertise_host=advertise,
        base_port=settings.worker.agileml_port,
    )


def _with_token_from_secret(settings: Settings, endpoint_url: str | None) -> Settings:
    """`settings` with the API token read from `api.token_secret` (Secrets Manager) when the
    token itself is unset, as on the AWS deployment (infra/controller.yaml).

    Raises:
        UserError: the secret cannot be read (named, with the permission to check).
    """
    from orchestrator.cloud.secrets import read_secret

    if settings.api.token is not None or not settings.api.token_secret:
        return settings
    token = read_secret(settings.api.token_secret, settings.region, endpoint_url=endpoint_url)
    api = settings.api.model_copy(update={"token": SecretStr(token)})
    return settings.model_copy(update={"api": api})
