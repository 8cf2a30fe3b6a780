"""Building a controller from `Settings`: the one place the CLI (`controller start`), the offline
demo and the tests get a controller from, so that every setting (BidBrain's included) reaches
it the same way.

    controller = build_controller(settings, store=store)   # EC2 and its prices, from settings
    controller = build_controller(settings, store=MemoryStore(), cloud=fake, prices=trace)

What is not given is made from the settings: the EC2 adapter (`settings.region`,
`controller_id`, `controller.endpoint_url`, the workers' launch template and subnets), the
price source (EC2's price history, or the trace folders of `controller.prices`), the billing
model, BidBrain's knobs and the job concurrency.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from orchestrator.aws import aws_client
from orchestrator.cloud.ec2 import EC2Cloud
from orchestrator.cloud.local.clock import ReplayClock
from orchestrator.cloud.protocol import Cloud
from orchestrator.controller.core import Controller
from orchestrator.controller.lease import (
    FencedCloud,
    FencedStore,
    FleetLease,
    fence_ec2_client,
)
from orchestrator.controller.outcomes import JobTraining
from orchestrator.controller.training_gate import Patience
from orchestrator.errors import UserError
from orchestrator.market.billing import billing_model
from orchestrator.market.catalog import Catalog
from orchestrator.market.prices import PriceSource, to_datetime, to_epoch_seconds
from orchestrator.settings import Settings
from orchestrator.store import Store

Clock = Callable[[], float]
log = logging.getLogger(__name__)


def replay_clock(settings: Settings, *, floor_s: float | None = None) -> ReplayClock | None:
    """The replay clock of a trace replay (`controller.prices`): from `controller.replay_start`
    at `controller.speed`, or from `floor_s` (the store's clock high-water mark: where its
    controller already ran) when that is later; None when the controller runs on EC2's live
    prices.

    Raises:
        UserError: a replay without a valid `controller.replay_start`.
    """
    c = settings.controller
    if not c.prices:
        return None
    if c.replay_start is None:
        raise UserError(
            "replaying a price trace needs the time to start at",
            field="--replay-start",
            fix="pass e.g. --replay-start 2020-02-03T00:00:00Z "
            "(or set ORCHESTRATOR_CONTROLLER__REPLAY_START)",
        )
    try:
        start_s = to_epoch_seconds(c.replay_start)
    except ValueError:
        raise UserError(
            f"replay start {c.replay_start!r} is not ISO-8601",
            field="--replay-start",
            fix="e.g. 2020-02-03T00:00:00Z",
        ) from None
    if floor_s is not None and floor_s > start_s:
        log.warning(
            "the replay continues from %s UTC, where this store's controller left off, not "
            "from --replay-start %s (time never runs back; a fresh store starts anew)",
            f"{to_datetime(floor_s):%Y-%m-%d %H:%M:%S}",
            c.replay_start,
        )
        start_s = floor_s
    return ReplayClock(start_s, c.speed)


def controller_clock(settings: Settings, *, floor_s: float | None = None) -> tuple[Clock, float]:
    """The clock the controller decides on and how many times faster than real time it runs:
    the wall clock, or the replay clock of a trace replay (`replay_clock`; from `floor_s`
    when that is later than its start).

    Raises:
        UserError: a replay without a valid `controller.replay_start`.
    """
    replay = replay_clock(settings, floor_s=floor_s)
    return (time.time, 1.0) if replay is None else (replay.now, replay.speed)


def ec2_client(settings: Settings) -> Any:
    """A boto3 EC2 client for `settings.region` (and `controller.endpoint_url`), with the
    retry policy of every AWS call (`orchestrator.aws`)."""
    return aws_client("ec2", settings.region, endpoint_url=settings.controller.endpoint_url)


def price_source(settings: Settings, *, client: Any) -> PriceSource:
    """The replayed trace of `controller.prices`, else EC2's live price history."""
    if settings.controller.prices:
        from orchestrator.market.trace_source import TracePriceSource

        return TracePriceSource(settings.controller.prices)
    from orchestrator.market.ec2_source import EC2PriceSource

    return EC2PriceSource(settings.region, client=client)


def patience(settings: Settings) -> Patience:
    """`controller.stall_after_s`, `join_grace_s` and `rejoin_grace_s` in the controller's
    clock: a replayed market clock runs `speed` times faster than the training it judges,
    which runs in real time."""
    c = settings.controller
    scale = c.speed if c.prices else 1.0
    return Patience(
        stall_after_s=c.stall_after_s * scale,
        stall_attempts=c.stall_attempts,
        join_grace_s=c.join_grace_s * scale,
        rejoin_grace_s=c.rejoin_grace_s * scale,
    )


def build_controller(
    settings: Settings,
    *,
    store: Store,
    cloud: Cloud | None = None,
    prices: PriceSource | None = None,
    client: Any = None,
    catalog: Catalog | None = None,
    training: JobTraining | None = None,
    lease: FleetLease | None = None,
) -> Controller:
    """A controller over `store` configured by `settings` (see the module docstring).

    Args:
        store: jobs, instances, ledger and events.
        cloud: the cloud to launch in (default: EC2 through `client`).
        prices: where spot prices come from (default: `price_source(settings)`).
        client: the boto3 EC2 client for the defaults (default: `ec2_client(settings)`).
        catalog: instance types and work rates (default: the bundled catalog).
        training: the jobs' training (the training host: launch tags, final weights, how
            far each job trained).
        lease: the fleet's lease this process ticks under: every launch, terminate and
            store write checks it is still held (`controller.lease`).

    Raises:
        UserError: a setting cannot be used (e.g. an unknown billing model).
    """
    if cloud is None or prices is None:
        client = client if client is not None else ec2_client(settings)
    if cloud is None:
        if lease is not None:
            fence_ec2_client(client, lease)
        cloud = EC2Cloud(
            settings.region,
            settings.controller_id,
            client=client,
            launch_template=settings.worker.launch_template,
            subnets=settings.worker.subnet_ids,
        )
    if lease is not None:
        cloud = FencedCloud(cloud, lease)
        store = FencedStore(store, lease).as_store()
    return Controller(
        store=store,
        cloud=cloud,
        prices=prices if prices is not None else price_source(settings, client=client),
        billing=billing_model(settings.controller.billing),
        catalog=catalog,
        settings=settings.bidbrain,
        image_id=settings.controller.image_id,
        training=training,
        patience=patience(settings),
        max_running_jobs=settings.controller.max_running_jobs,
    )
