"""The offline demo: the whole controller on one machine, with real prices and evictions.

It starts a real Redis and a moto EC2 server on loopback, replays the 2020 us-east-1 spot prices
on a clock running `speed`× faster than real time, replays capacity evictions from the real
32-node p3 trace (each with its 2-minute notice on the instance's metadata mock), and runs the
controller exactly as `controller start` builds it (`controller.wiring`: BidBrain, the EC2
adapter, the Redis store, the training host). Every instance moto launches gets a local process
running the same instance agent as an AWS worker (`orchestrator.agent`), which reads who it is
from its metadata tags and trains a real PyTorch model with AgileML: spot instances are
transient nodes (ActivePSs and workers), the on-demand CPU node is the reliable one (BackupPS,
or ParamServ when no spot node is left). Evictions reach the training as eviction notices. It
submits one job with a budget through the API's submission, prints a live progress line and
ends with a summary that includes the training loss.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr
from rich.console import Console

from orchestrator.agileml.hosting import evaluate_weights
from orchestrator.api.app import create_app
from orchestrator.api.operations import submit_job
from orchestrator.api.serve import BackgroundServer
from orchestrator.artifacts import FINAL_INFO, WEIGHTS, Folder, S3Folder
from orchestrator.artifacts.code import CACHE_ENV, pack_code, store_code
from orchestrator.artifacts.folders import s3_client
from orchestrator.cloud.ec2 import EC2Cloud
from orchestrator.cloud.local.clock import ReplayClock
from orchestrator.cloud.local.evictions import EvictionReplayer
from orchestrator.cloud.local.fleet import LocalFleet, RecordInstanceWork
from orchestrator.cloud.local.moto_server import MotoEC2Server
from orchestrator.cloud.local.redis_process import LocalRedis, free_port
from orchestrator.controller.core import Controller
from orchestrator.controller.training import TrainingHost
from orchestrator.controller.wiring import build_controller, replay_clock
from orchestrator.jobs import DIGITS_CNN
from orchestrator.jobspec import JobSubmission
from orchestrator.market.eviction import AvailabilityTrace
from orchestrator.market.prices import to_datetime
from orchestrator.market.trace_source import bundled_prices_dir
from orchestrator.settings import ApiSettings, ControllerSettings, Settings
from orchestrator.store import (
    InstanceWork,
    JobRecord,
    JobState,
    RedisStore,
    Store,
    WorkRatesEvent,
)
from orchestrator.units import SECONDS_PER_HOUR

if TYPE_CHECKING:
    from orchestrator.agileml.hosting import Hosted

CONTROLLER_ID = "demo"
NAMESPACE = "demo"
JOB_ID = "job-demo"
REGION = "us-east-1"
DEFAULT_START = "2020-02-03T00:00:00Z"
#: Real seconds between loop iterations (ticks of the controller, the replayer and the fleet).
LOOP_WALL_S = 0.2
#: Off a terminal (a log, CI), one progress line per this much simulated time.
PLAIN_LINE_EVERY_SIM_S = 900.0
#: Real seconds between two training reports (to the store, for the dashboard) and two
#: measurements of the model's loss (parameters pulled from the parameter servers, loss over
#: the whole training set).
TRAINING_EVERY_WALL_S = 2.0
#: Where the demo serves the API and dashboard (the API's default port, so the CLI finds it).
DEFAULT_PORT = 8750
#: The demo job: a user job file shipped with the package (a small CNN on scikit-learn's
#: bundled digits, `orchestrator/jobs/digits_cnn.py`), as `TrainingSpec` fields.
DEMO_ITERATIONS = 500
TRAINING: dict[str, Any] = {
    "code": str(DIGITS_CNN),
    "global_batch": 128,
    # the job succeeds once these are trained and its weights stored (its work is counted
    # from them): a run of about half a minute on a quiet 2-core machine
    "iterations": DEMO_ITERATIONS,
    "num_partitions": 4,
    "min_nodes": 2,
    "failure_timeout_s": 3.0,  # many processes on few cores: be patient before "failed"
}
#: The demo job trained as a pipeline (`--pipeline`): the same job file, its layers in two
#: stages (replicated over the instances held; the planner would pick one replicated stage for
#: so small a model).
PIPELINE_TRAINING: dict[str, Any] = {
    **{k: v for k, v in TRAINING.items() if k != "num_partitions"},
    "parallelism": "pipeline",
    "stages": 2,
}
#: The moto bucket that holds the demo's artifacts (uploaded code, checkpoints, weights).
ARTIFACT_BUCKET = "orchestrator-demo"
#: Real seconds without a sign of training (its instances running) before they are released
#: (`controller.stall_after_s`; the market clock then counts this times the speed).
STALL_AFTER_WALL_S = 120.0
#: Real seconds between two checkpoints of the demo job.
CHECKPOINT_EVERY_WALL_S = 10.0


@dataclass
class DemoSummary:
    """What `--json-summary` writes."""

    job_state: str
    budget_usd: float
    spent_usd: float
    evictions: int
    instances_launched: int
    orphans_after: int
    work_done_fraction: float
    sim_hours: float
    wall_seconds: float
    injected_evictions: int
    loss_at_start: float  # the model's loss on the training set before any update
    final_loss: float  # its loss at the last measurement before the job ended (NaN: none)
    training_iterations: int  # clocks completed by the AgileML workers
    training_events: list[str]  # what the elasticity controller did (started, evicted, ...)
    parallelism: str = "data"  # or "pipeline" (`--pipeline`)
    # the returned weights (the job's final model.safetensors) on the held-out digits
    held_out_accuracy: float = math.nan
    held_out_loss: float = math.nan
    weights_source: str = ""  # "the model at the end", or the checkpoint they came from
    weights_path: str = ""  # where they were copied (`weights_out`), "" if not
    # the job's work rate per GPU model that BidBrain learned: {model: {"prior", "learned"}}
    learned_work_rates: dict[str, dict[str, float]] = field(default_factory=dict)
    job_message: str = ""  # why it ended (its weights' place; a failure's error)


def sample_job(budget_usd: float, *, pipeline: bool = False) -> JobSubmission:
    """A 12 reference-GPU-hour job on up to 4 V100s (p3 types) that trains `TRAINING` (or
    `PIPELINE_TRAINING`)."""
    return JobSubmission(
        name="demo-pipeline" if pipeline else "demo-training",
        budget_usd=budget_usd,
        work_gpu_hours=12.0,
        max_gpus=4.0,
        instance_types=("p3.2xlarge", "p3.8xlarge", "p3.16xlarge"),
        training=PIPELINE_TRAINING if pipeline else TRAINING,
    )


def demo_settings(*, speed: float, start: str) -> Settings:
    """The controller's settings: replayed us-east-1 prices from `start` at `speed`, an API
    token nobody is shown (the demo's API is for watching) and a read-only one, in the
    dashboard's link."""
    return Settings(
        controller_id=CONTROLLER_ID,
        region=REGION,
        api=ApiSettings(
            token=SecretStr(secrets.token_hex(16)), read_token=SecretStr(secrets.token_hex(16))
        ),
        controller=ControllerSettings(
            prices=(bundled_prices_dir(REGION),),
            replay_start=start,
            speed=speed,
            stall_after_s=STALL_AFTER_WALL_S,  # of the training's time (`wiring`)
        ),
    )


@dataclass
class _World:
    """The running offline world and what the demo's loop keeps track of."""

    store: RedisStore
    clock: ReplayClock
    client: Any  # boto3 EC2 client of the moto server
    controller: Controller
    replayer: EvictionReplayer
    fleet: LocalFleet
    training: TrainingHost
    artifacts: Folder  # the artifact store: a bucket on the moto server
    server: BackgroundServer | None
    where: str  # the Redis and moto URLs, for the first line
    launched: set[str] = field(default_factory=set)
    injected: int = 0
    hosted: Hosted | None = None
    loss_at_start: float = math.nan
    last_loss: float = math.nan
    next_training_s: float = 0.0


@contextlib.contextmanager
def _offline_world(
    settings: Settings,
    *,
    seed: int,
    port: int | None,
    true_work_rates: Mapping[str, float] | None = None,
) -> Iterator[_World]:
    """Redis, moto, the controller with its training host, the eviction replayer, the local
    fleet (its GPUs at `true_work_rates` where given) and (unless `port` is None) the
    dashboard; everything stopped on exit."""
    clock = replay_clock(settings)
    assert clock is not None  # the demo's settings replay a trace
    token = secrets.token_bytes(32)
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="orchestrator-demo-")))
        redis = stack.enter_context(LocalRedis())
        aws = stack.enter_context(MotoEC2Server())
        artifacts = _artifact_store(stack, aws, tmp)
        settings = settings.model_copy(
            update={"training": settings.training.model_copy(update={"store": artifacts.location})}
        )
        store = RedisStore.connect(redis.url, namespace=NAMESPACE)
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
        controller = build_controller(
            settings,
            store=store,
            client=client,
            training=training,
        )
        replayer = EvictionReplayer(
            client, CONTROLLER_ID, AvailabilityTrace.bundled(), clock,
            seed=seed, on_notice=controller.notify,
        )  # fmt: skip
        server = None
        if port is not None:
            app = create_app(store, settings, clock=clock.now)
            server = stack.enter_context(BackgroundServer(app, port=port))
        fleet = stack.enter_context(
            LocalFleet(
                redis.url,
                NAMESPACE,
                clock,
                cloud_client=client,
                controller_id=CONTROLLER_ID,
                replayer=replayer,
                log_dir=tmp / "agents",
                training_token=token,
                record_progress=store.update_progress,
                record_instance_work=instance_work_recorder(store),
                true_work_rates=true_work_rates,
            )  # fmt: skip
        )
        controller.instance_logs = fleet  # a stall's event names the agents' last lines
        where = f"Redis {redis.url}, EC2 and S3 (moto) {aws.endpoint_url}"
        yield _World(
            store, clock, client, controller, replayer, fleet, training, artifacts, server, where
        )


def instance_work_recorder(store: Store) -> RecordInstanceWork:
    """What the fleet hands a job's work per instance to: the store's `record_instance_work`
    (BidBrain learns the job's work rates from it)."""

    def record(job_id: str, work: Mapping[str, tuple[float, float]]) -> None:
        store.record_instance_work(
            job_id,
            {i: InstanceWork(work_gpu_hours=w, hours=h) for i, (w, h) in work.items()},
        )

    return record


def run_demo(
    *,
    speed: float = 300.0,
    budget_usd: float = 40.0,
    start: str = DEFAULT_START,
    seed: int = 1,
    timeout_s: float = 240.0,
    console: Console | None = None,
    port: int | None = DEFAULT_PORT,
    linger_s: float = 0.0,
    weights_out: Path | None = None,
    pipeline: bool = False,
    true_work_rates: Mapping[str, float] | None = None,
) -> DemoSummary:
    """Run the demo until the job ends or `timeout_s` real seconds pass.

    If the replayed trace has not evicted anything by the time half the work is done, one spot
    node is evicted on purpose (with its notice), so that the demo always shows recovery; the
    summary counts such injected evictions separately. The controller's API and dashboard are
    served on 127.0.0.1:`port` (0: any free port; None: not served) until the job ends, then
    `linger_s` more seconds. With `true_work_rates` (per GPU model) the world's GPUs work at
    those rates instead of the catalog's, and BidBrain learns them from the instances' work.

    Raises:
        UserError: redis-server is missing (with the apt-get command), a server cannot start,
            or `port` is taken.
    """
    console = console or Console()
    wall0 = time.monotonic()
    job = sample_job(budget_usd, pipeline=pipeline)
    settings = demo_settings(speed=speed, start=start)
    with _offline_world(settings, seed=seed, port=port, true_work_rates=true_work_rates) as world:
        job = _with_uploaded_code(job, world.artifacts)
        submit_job(world.store, job, now_s=world.clock.now(), new_id=lambda: JOB_ID)
        _announce(console, world, job, speed, settings)
        _run(world, job, console, deadline=wall0 + timeout_s)
        world.fleet.step()  # stops the agents of the instances the controller released
        if console.is_terminal:
            console.print()
        if world.server is not None and linger_s > 0:
            link = _dashboard_link(world.server, settings)
            console.print(
                f"Serving the dashboard {linger_s:g} s more: {link}",
                highlight=False,
                soft_wrap=True,
            )
            time.sleep(linger_s)
        summary = _summary(world, job, wall0)
        summary = _with_returned_weights(world, summary, weights_out)
    _print_summary(console, summary)
    return summary


def _dashboard_link(server: BackgroundServer, settings: Settings) -> str:
    """The dashboard's URL with the read-only token (opening it sets the page's cookie)."""
    read = settings.api.read_token
    return f"{server.url}/dashboard" + (f"?token={read.get_secret_value()}" if read else "")


def _announce(
    console: Console, world: _World, job: JobSubmission, speed: float, settings: Settings
) -> None:
    console.print(
        f"[bold]Offline demo[/bold]: job {JOB_ID} ({job.work_gpu_hours:g} GPU-hours on up "
        f"to {job.max_gpus:g} V100s, budget ${job.budget_usd:g}) from "
        f"{to_datetime(world.clock.now()):%Y-%m-%d %H:%M} UTC in replayed us-east-1 spot prices, "
        f"{speed:g}x real time. {world.where}.",
        highlight=False,
    )
    if world.server is not None:
        link = _dashboard_link(world.server, settings)
        console.print(f"Dashboard: {link}", highlight=False, soft_wrap=True)  # one line: a link


def _run(world: _World, job: JobSubmission, console: Console, *, deadline: float) -> None:
    """Tick the controller, the replayer and the fleet until the job ends or the deadline."""
    last_line_s = -math.inf
    while time.monotonic() < deadline:
        now = world.clock.now()
        world.launched.update(world.controller.tick(now).launched)
        world.replayer.step()
        world.fleet.step()
        _training_step(world, now)
        record = world.store.get_job(JOB_ID)
        if record.state.is_terminal:
            break
        done = record.work_done_gpu_hours / job.work_gpu_hours
        if done >= 0.5 and not world.replayer.evictions and world.injected == 0:
            world.injected += _inject_eviction(world, now)
        if console.is_terminal or now - last_line_s >= PLAIN_LINE_EVERY_SIM_S:
            _progress(console, world, record, job, now)
            last_line_s = now
        time.sleep(LOOP_WALL_S)


def _training_step(world: _World, now_s: float) -> None:
    """Every `TRAINING_EVERY_WALL_S`: report the training (the host), measure the loss."""
    if time.monotonic() < world.next_training_s:
        return
    world.next_training_s = time.monotonic() + TRAINING_EVERY_WALL_S
    world.training.step(now_s)
    if world.hosted is None:
        world.hosted = world.training.hosted(JOB_ID)  # hosted at the job's first launch
        if world.hosted is None:
            return
        world.loss_at_start = world.hosted.initial_loss()
    loss = world.hosted.model_loss()
    if loss is not None:
        world.last_loss = loss


def _inject_eviction(world: _World, now_s: float) -> int:
    alive = world.store.list_instances(JOB_ID, alive_only=True)
    spot = [r for r in alive if r.lifecycle == "spot"]
    if not spot:
        return 0
    return 1 if world.replayer.force_evict(spot[0].instance_id, now_s + 180.0) else 0


def _progress(
    console: Console, world: _World, record: JobRecord, job: JobSubmission, now_s: float
) -> None:
    """One progress line: rewritten in place on a terminal, appended otherwise."""
    alive = world.store.list_instances(JOB_ID, alive_only=True)
    spot = sum(1 for r in alive if r.lifecycle == "spot")
    spent = world.controller.spend_usd(JOB_ID, now_s)
    pct = 100.0 * min(record.work_done_gpu_hours / job.work_gpu_hours, 1.0)
    trained = 0 if world.hosted is None else world.hosted.progress().iteration
    line = (
        f"t+{(now_s - world.clock.start_s) / SECONDS_PER_HOUR:5.2f} h  work {pct:5.1f}%  "
        f"trained {trained}/{(job.training or {}).get('iterations', 0)}  "
        f"spent ${spent:7.2f} / ${job.budget_usd:g}  nodes: {len(alive) - spot} reliable, "
        f"{spot} spot  evictions {len(world.replayer.evictions)}  loss {world.last_loss:.3f}  "
        f"[{record.state}]"
    )
    if console.is_terminal:
        console.print(f"\r{line}   ", end="", highlight=False, soft_wrap=True, markup=False)
    else:
        console.print(line, highlight=False, markup=False)


def _summary(world: _World, job: JobSubmission, wall0: float) -> DemoSummary:
    final = world.store.get_job(JOB_ID)
    hosted = world.hosted
    return DemoSummary(
        job_state=str(final.state),
        job_message=final.message,
        budget_usd=job.budget_usd,
        spent_usd=round(world.store.spent_usd(JOB_ID), 4),
        evictions=len(world.replayer.evictions),
        instances_launched=len(world.launched),
        orphans_after=len(EC2Cloud(REGION, CONTROLLER_ID, client=world.client).describe()),
        work_done_fraction=round(min(final.work_done_gpu_hours / job.work_gpu_hours, 1.0), 4),
        sim_hours=round((world.clock.now() - world.clock.start_s) / SECONDS_PER_HOUR, 3),
        wall_seconds=round(time.monotonic() - wall0, 1),
        injected_evictions=world.injected,
        loss_at_start=round(world.loss_at_start, 4),
        final_loss=round(world.last_loss, 4),
        training_iterations=0 if hosted is None else hosted.progress().iteration,
        training_events=[] if hosted is None else hosted.events(),
        parallelism=str((job.training or {}).get("parallelism", "data")),
        learned_work_rates=_learned_rates(world.store),
    )


def _learned_rates(store: Store) -> dict[str, dict[str, float]]:
    """The rates of the job's last `work_rates` event (none: nothing was measured)."""
    latest: dict[str, dict[str, float]] = {}
    for _, event in store.events(JOB_ID):
        if isinstance(event, WorkRatesEvent):
            latest = {
                model: {"prior": r.prior, "learned": round(r.learned, 4)}
                for model, r in sorted(event.rates.items())
            }
    return latest


def _artifact_store(stack: contextlib.ExitStack, aws: MotoEC2Server, tmp: Path) -> Folder:
    """The offline world's artifact store: a bucket on the moto server (S3, as on AWS), and a
    code cache for the agents in the demo's temporary folder (they inherit the variable)."""
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


def _with_uploaded_code(job: JobSubmission, artifacts: Folder) -> JobSubmission:
    """The job with its code uploaded to the artifact store and named by its digest, as
    `orchestrator submit` does."""
    training = dict(job.training or {})
    training["code"] = store_code(artifacts, pack_code(training["code"]))
    return job.model_copy(update={"training": training})


def _with_returned_weights(
    world: _World, summary: DemoSummary, weights_out: Path | None
) -> DemoSummary:
    """The summary with the held-out figures of the weights the job handed back (and where
    they were copied)."""
    artifacts = world.training.artifacts(JOB_ID)
    if artifacts is None or not artifacts.final.exists(WEIGHTS):
        return summary
    info = json.loads(artifacts.final.read_bytes(FINAL_INFO)) if artifacts.has_final() else {}
    with tempfile.TemporaryDirectory(prefix="orchestrator-demo-weights-") as tmp:
        target = weights_out or Path(tmp) / WEIGHTS
        target.parent.mkdir(parents=True, exist_ok=True)
        artifacts.final.copy_to(WEIGHTS, target)
        figures = evaluate_weights(DIGITS_CNN, target)
    return replace(
        summary,
        held_out_accuracy=round(figures.get("held_out_accuracy", math.nan), 4),
        held_out_loss=round(figures.get("held_out_loss", math.nan), 4),
        weights_source=str(info.get("source", "")),
        weights_path=str(weights_out) if weights_out is not None else "",
    )


def _print_summary(console: Console, s: DemoSummary) -> None:
    console.print(
        f"[bold]Summary[/bold]: job {s.job_state}; spent ${s.spent_usd:.2f} of ${s.budget_usd:g}; "
        f"{s.work_done_fraction:.0%} of the work in {s.sim_hours:.2f} simulated hours "
        f"({s.wall_seconds:.0f} s real); {s.instances_launched} instances launched, "
        f"{s.evictions} evicted"
        + (f" ({s.injected_evictions} injected)" if s.injected_evictions else "")
        + f"; {s.orphans_after} left running. Training: loss {s.loss_at_start:.3f} -> "
        f"{s.final_loss:.3f} in {s.training_iterations} "
        + ("pipeline" if s.parallelism == "pipeline" else "AgileML")
        + " iterations.",
        highlight=False,
    )
    if s.job_message:
        console.print(f"The job's last word: {s.job_message}", highlight=False, markup=False)
    if s.learned_work_rates:
        rates = ", ".join(
            f"{model} {r['learned']:.3g} (catalog {r['prior']:.3g})"
            for model, r in s.learned_work_rates.items()
        )
        console.print(f"Work rates BidBrain learned from the instances: {rates}.", highlight=False)
    if not math.isnan(s.held_out_accuracy):
        where = f", copied to {s.weights_path}" if s.weights_path else ""
        console.print(
            f"Returned weights ({s.weights_source}{where}): held-out accuracy "
            f"{s.held_out_accuracy:.1%}, loss {s.held_out_loss:.3f} on the 297 digits it never "
            "trained on.",
            highlight=False,
        )


def write_summary(summary: DemoSummary, path: Path) -> None:
    """Write the JSON summary (the keys issue #3 names, plus timing)."""
    data = asdict(summary)
    path.write_text(
        json.dumps({k: v for k, v in data.items() if not (isinstance(v, float) and math.isnan(v))})
        + "\n"
    )


def job_state_ok(summary: DemoSummary) -> bool:
    return summary.job_state == str(JobState.SUCCEEDED)
