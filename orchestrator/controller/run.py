"""The controller as one running process: store, training host, controller, its scheduled
service and the HTTP API (`orchestrator controller start`).

    with running_controller(settings, on_tick=print_tick) as running:
        serve_api(running)  # until Ctrl-C or SIGTERM

Everything is built from `Settings` (`wiring.build_controller`). Processes of one controller id
may run side by side on one store: one holds the fleet's lease and acts, the others stand by
and take over when it lapses (`controller.lease`); a controller of another id is refused. On
exit the service finishes the tick in progress, gives the lease up and stops, the hosted
training controllers stop (their ports stay recorded for the next start) and the store is
closed; instances keep running and the next start reconciles them.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import SecretStr

from orchestrator.controller.core import TickReport
from orchestrator.controller.lease import FencedStore, FleetLease
from orchestrator.controller.service import ControllerService
from orchestrator.controller.wiring import Clock, build_controller, controller_clock, ec2_client
from orchestrator.errors import UserError
from orchestrator.settings import Settings
from orchestrator.store import RedisStore, Store

if TYPE_CHECKING:
    from orchestrator.controller.training import TrainingHost

log = logging.getLogger(__name__)

#: The fleet lease lives this many decision intervals unless renewed (by every tick).
LEASE_INTERVALS = 1.5
MIN_LEASE_TTL_S = 2.0


@dataclass
class RunningController:
    """A started controller service and what it runs on."""

    settings: Settings
    store: Store
    service: ControllerService
    clock: Clock
    training: TrainingHost | None


@contextmanager
def running_controller(
    settings: Settings, *, on_tick: Callable[[TickReport], None] | None = None
) -> Iterator[RunningController]:
    """Build and start the controller service (see the module docstring); stop it on exit.

    Raises:
        UserError: a setting cannot be used, a secret cannot be read, or the API token is
            missing (nothing was started).
        StoreUnavailableError: Redis does not answer.
    """
    _, speed = controller_clock(settings)  # a bad replay setting: refused before Redis is asked
    store = RedisStore.connect(settings.redis_url)
    training: TrainingHost | None = None
    service: ControllerService | None = None
    try:
        lease = FleetLease(
            store, controller_id=settings.controller_id, ttl_s=lease_ttl_s(settings, speed)
        )
        lease.bind()  # another controller's store is refused before anything starts
        clock, speed = controller_clock(settings, floor_s=store.clock_high_water())
        # the training host's writes (ports, reports, progress) are fenced as the tick's are
        training = training_host(settings, FencedStore(store, lease).as_store())
        controller = build_controller(
            settings,
            store=store,
            client=ec2_client(settings),
            training=training,
            lease=lease,
        )

        def ticked(report: TickReport) -> None:
            if training is not None:
                training.step(clock())
            if on_tick is not None:
                on_tick(report)

        service = ControllerService(
            controller, clock=clock, speed=speed, on_tick=ticked, lease=lease
        )
        service.start()
        yield RunningController(settings, store, service, clock, training)
    finally:
        if service is not None:
            service.stop()
        if training is not None:
            training.close()
        store.close()


def lease_ttl_s(settings: Settings, speed: float) -> float:
    """The fleet lease's time to live: `LEASE_INTERVALS` decision intervals (real seconds; at
    least `MIN_LEASE_TTL_S`), so a standby takes over within about two of them."""
    return max(LEASE_INTERVALS * settings.bidbrain.decision_interval_s / speed, MIN_LEASE_TTL_S)


def serve_api(running: RunningController) -> None:
    """Serve the HTTP API (and dashboard) of a running controller until Ctrl-C or SIGTERM."""
    import uvicorn

    from orchestrator.api.app import create_app

    settings = running.settings
    tls = settings.api.require_tls()
    service = running.service
    app = create_app(running.store, settings, clock=running.clock, on_notice=service.notify,
                     tick_health=service.health)  # fmt: skip
    uvicorn.run(app, host=settings.api.host, port=settings.api.port, log_level="warning",
                ssl_certfile=tls and tls[0], ssl_keyfile=tls and tls[1])  # fmt: skip


def wait_for_stop() -> None:
    """Block until Ctrl-C or SIGTERM (a controller running without its API)."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass


def with_api_token(settings: Settings) -> Settings:
    """`settings` with the API token read from `api.token_secret` (Secrets Manager) when the
    token itself is unset, as on the AWS deployment (infra/controller.yaml); checked present.

    Raises:
        UserError: no token, or the secret cannot be read (named, with the permission to
            check).
    """
    from orchestrator.cloud.secrets import read_secret

    if settings.api.token is None and settings.api.token_secret:
        token = read_secret(
            settings.api.token_secret,
            settings.region,
            endpoint_url=settings.controller.endpoint_url,
        )
        api = settings.api.model_copy(update={"token": SecretStr(token)})
        settings = settings.model_copy(update={"api": api})
    settings.api.require_token()
    return settings


def with_api_tls_files(settings: Settings) -> Settings:
    """`settings` with the API's certificate and key files: as given, from `api.tls_secret`,
    or self-signed for this node's addresses (see `controller.tls`); checked readable.

    Raises:
        UserError: the secret cannot be read, or a file is missing.
    """
    from orchestrator.artifacts import folder_at
    from orchestrator.cloud.errors import MetadataError
    from orchestrator.cloud.imds import read_metadata
    from orchestrator.cloud.imds_wire import IMDS_BASE_URL, LOCAL_IPV4_PATH, PUBLIC_IPV4_PATH
    from orchestrator.cloud.secrets import read_secret
    from orchestrator.controller.tls import with_api_tls

    def addresses() -> list[str]:
        try:
            found = read_metadata(IMDS_BASE_URL, [LOCAL_IPV4_PATH, PUBLIC_IPV4_PATH])
        except MetadataError:  # not on EC2: this machine's loopback names only
            return []
        return [address for address in found.values() if address]

    settings = with_api_tls(
        settings,
        addresses=addresses,
        artifacts=folder_at(settings.training.store_location),
        read_secret=lambda secret_id: read_secret(
            secret_id, settings.region, endpoint_url=settings.controller.endpoint_url
        ),
    )
    settings.api.require_tls()  # before anything starts: a bad path is refused at once
    return settings


def training_host(settings: Settings, store: Store) -> TrainingHost | None:
    """On AWS (a worker token secret is configured): the host of the training jobs' AgileML
    elasticity controllers, advertised at this node's private address; None otherwise.

    Raises:
        UserError: the address cannot be found or the worker token secret cannot be read.
    """
    if not settings.worker.token_secret:
        return None
    from orchestrator.agileml.token import token_from_hex
    from orchestrator.cloud.imds import read_metadata
    from orchestrator.cloud.imds_wire import IMDS_BASE_URL, LOCAL_IPV4_PATH
    from orchestrator.cloud.secrets import read_secret
    from orchestrator.controller.training import TrainingHost

    advertise = settings.worker.advertise_host
    if advertise is None:
        advertise = read_metadata(IMDS_BASE_URL, [LOCAL_IPV4_PATH])[LOCAL_IPV4_PATH]
    if not advertise:
        raise UserError(
            "cannot tell the workers where this controller is",
            field="ORCHESTRATOR_WORKER__ADVERTISE_HOST",
            fix="set ORCHESTRATOR_WORKER__ADVERTISE_HOST to this node's private address",
        )
    secret_id = settings.worker.token_secret
    secret = read_secret(secret_id, settings.region, endpoint_url=settings.controller.endpoint_url)
    return TrainingHost(
        store,
        token=token_from_hex(secret, source=f"the secret {secret_id}"),
        advertise_host=advertise,
        base_port=settings.worker.agileml_port,
        artifacts_root=settings.training.store_location,
        checkpoint_every_s=settings.training.checkpoint_every_s,
        # the workers reach a configured store (S3), not this node's disk
        checkpoints=settings.training.store is not None,
    )
