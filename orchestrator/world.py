"""The offline world: the whole controller on one machine, with real prices and evictions.

A real Redis and a moto server (EC2 and S3) on loopback, the 2020 us-east-1 spot prices
replayed on a clock running `speed`x faster than real time, capacity evictions replayed from
the real 32-node p3 trace (each with its 2-minute notice on the instance's metadata mock), and
the controller exactly as `controller start` builds it (`controller.wiring`: BidBrain, the EC2
adapter, the Redis store, the training host). Every instance moto launches gets a local process
running the same instance agent as an AWS worker (`orchestrator.agent`), which trains the job's
real PyTorch model with AgileML. The API and dashboard are served on loopback.

The demo (`orchestrator.demo`) runs its one job in it; `orchestrator local up` keeps one
running in the background for the user's own jobs.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import SecretStr

from orchestrator.api.app import create_app
from orchestrator.api.serve import BackgroundServer
from orchestrator.artifacts import Folder, S3Folder
from orchestrator.artifacts.code import CACHE_ENV
from orchestrator.artifacts.folders import s3_client
from orchestrator.cloud.local.clock import ReplayClock
from orchestrator.cloud.local.evictions import EvictionReplayer
from orchestrator.cloud.local.fleet import LocalFleet, RecordInstanceWork
from orchestrator.cloud.local.moto_server import MotoEC2Server
from orchestrator.cloud.local.redis_process import LocalRedis, free_port
from orchestrator.controller.core import Controller
from orchestrator.controller.training import TrainingHost
from orchestrator.controller.wiring import build_controller, replay_clock
from orchestrator.market.eviction import AvailabilityTrace
from orchestrator.market.trace_source import bundled_prices_dir
from orchestrator.settings import ApiSettings, ControllerSettings, Settings
from orchestrator.store import InstanceWork, RedisStore, Store

REGION = "us-east-1"
DEFAULT_START = "2020-02-03T00:00:00Z"
#: The moto bucket that holds the world's artifacts (uploaded code, checkpoints, weights).
ARTIFACT_BUCKET = "orchestrator-demo"
#: Real seconds between two steps of the world (ticks of the controller, the replayer and the
#: fleet).
STEP_WALL_S = 0.2
#: Real seconds between two training reports of the training host (to the store, for the
#: dashboard and the job's work done).
TRAINING_EVERY_WALL_S = 2.0
#: Real seconds without a sign of training (its instances running) before they are released
#: (`controller.stall_after_s`; the market clock then counts this times the speed).
STALL_AFTER_WALL_S = 120.0
#: Real seconds an instance's node has to join its job's training after launch, and to come back
#: after it left (its agent died), before the instance is released and replaced
#: (`controller.join_grace_s`, `rejoin_grace_s`; the market clock counts these times the speed).
JOIN_GRACE_WALL_S = STALL_AFTER_WALL_S  # a job whose nodes never join stalls first
REJOIN_GRACE_WALL_S = 5.0
#: Real seconds between two checkpoints of a job.
CHECKPOINT_EVERY_WALL_S = 10.0


def world_settings(*, speed: float, start: str, controller_id: str) -> Settings:
    """The controller's settings: replayed us-east-1 prices from `start` at `speed`, fresh
    API tokens (full and read-only)."""
    return Settings(
        controller_id=controller_id,
        region=REGION,
        api=ApiSettings(
            token=SecretStr(secrets.token_hex(16)), read_token=SecretStr(secrets.token_hex(16))
        ),
        controller=ControllerSettings(
            prices=(bundled_prices_dir(REGION),),
            replay_start=start,
            speed=speed,
            stall_after_s=STALL_AFTER_WALL_S,  # of the training's time (`wiring`)
            join_grace_s=JOIN_GRACE_WALL_S,
            rejoin_grace_s=REJOIN_GRACE_WALL_S,
        ),
    )


@dataclass
class OfflineWorld:
    """The running offline world (see the module docstring)."""

    settings: Settings
    store: RedisStore
    clock: ReplayClock
    client: object  # boto3 EC2 client of the moto server
    controller: Controller
    replayer: EvictionReplayer
    fleet: LocalFleet
    training: TrainingHost
    artifacts: Folder  # the artifact store: a bucket on the moto server
    server: BackgroundServer | None
    redis_url: str
    aws_url: str
    launched: set[str] = field(default_factory=set)  # every instance the controller launched
    next_training_s: float = 0.0

    @property
    def where(self) -> str:
        return f"Redis {self.redis_url}, EC2 and S3 (moto) {self.aws_url}"

    @property
    def api_url(self) -> str | None:
        """Where the API and dashboard are served (None: not served)."""
        return None if self.server is None else f"http://127.0.0.1:{self.server.port}"

    def step(self) -> float:
        """One step: the controller's tick, the replayer's evictions, the fleet's agents and
        (every `TRAINING_EVERY_WALL_S`) the training host's reports; the market time."""
        now = self.clock.now()
        self.launched.update(self.controller.tick(now).launched)
        self.replayer.step()
        self.fleet.step()
        if time.monotonic() >= self.next_training_s:
            self.next_training_s = time.monotonic() + TRAINING_EVERY_WALL_S
            self.training.step(now)
        return now


@contextlib.contextmanager
def offline_world(
    settings: Settings,
    *,
    seed: int,
    port: int | None,
    true_work_rates: Mapping[str, float] | None = None,
) -> Iterator[OfflineWorld]:
    """Redis, moto, the controller with its training host, the eviction replayer, the local
    fleet (its GPUs at `true_work_rates` where given) and (unless `port` is None) the API
    and dashboard on 127.0.0.1:`port` (0: any free port); everything stopped on exit.

    Raises:
        UserError: redis-server is missing (with the apt-get command), a server cannot start,
            or `port` is taken.
    """
    clock = replay_clock(settings)
    assert clock is not None  # the world's settings replay a trace
    token = secrets.token_bytes(32)
    controller_id = settings.controller_id
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="orchestrator-world-")))
        redis = stack.enter_context(LocalRedis())
        aws = stack.enter_context(MotoEC2Server())
        artifacts = _artifact_store(stack, aws, tmp)
        settings = settings.model_copy(
            update={"training": settings.training.model_copy(update={"store": artifacts.location})}
        )
        store = RedisStore.connect(redis.url, namespace=controller_id)
        stack.callback(store.close)
        training = stack.enter_context(
            TrainingHost(
                store,
                token=token,
                advertise_host="127.0.0.1",
                bind_host="127.0.0.1",
                base_port=free_port(),
                instance_work_from_nodes=False,
                artifacts_root=artifacts,
                checkpoint_every_s=CHECKPOINT_EVERY_WALL_S,
            )  # fmt: skip
        )  # the instances' work (for BidBrain's learned rates) is simulated on the market clock
        client = aws.client()
        controller = build_controller(settings, store=store, client=client, training=training)
        replayer = EvictionReplayer(
            client, controller_id, AvailabilityTrace.bundled(), clock,
            seed=seed, on_notice=controller.notify,
        )  # fmt: skip
        server = None
        if port is not None:
            app = create_app(store, settings, clock=clock.now)
            server = stack.enter_context(BackgroundServer(app, port=port))
        fleet = stack.enter_context(
            LocalFleet(
                redis.url,
                controller_id,
                clock,
                cloud_client=client,
                controller_id=controller_id,
                replayer=replayer,
                log_dir=tmp / "agents",
                training_token=token,
                record_instance_work=instance_work_recorder(store),
                true_work_rates=true_work_rates,
            )  # fmt: skip
        )
        controller.instance_logs = fleet  # a stall's event names the agents' last lines
        yield OfflineWorld(
            settings, store, clock, client, controller, replayer, fleet, training, artifacts,
            server, redis.url, aws.endpoint_url,
        )  # fmt: skip


def instance_work_recorder(store: Store) -> RecordInstanceWork:
    """What the fleet hands a job's work per instance to: the store's `record_instance_work`
    (BidBrain learns the job's work rates from it)."""

    def record(job_id: str, work: Mapping[str, tuple[float, float]]) -> None:
        store.record_instance_work(
            job_id,
            {i: InstanceWork(work_gpu_hours=w, hours=h) for i, (w, h) in work.items()},
        )

    return record


def _artifact_store(stack: contextlib.ExitStack, aws: MotoEC2Server, tmp: Path) -> Folder:
    """The world's artifact store: a bucket on the moto server (S3, as on AWS), and a code
    cache for the agents in the world's temporary folder (they inherit the variable)."""
    s3_client(aws.endpoint_url).create_bucket(Bucket=ARTIFACT_BUCKET)
    saved = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp / "code-cache")
    stack.callback(_restore_env, CACHE_ENV, saved)
    return S3Folder(ARTIFACT_BUCKET, "artifacts", endpoint=aws.endpoint_url)


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
