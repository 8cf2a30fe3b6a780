"""The offline demo: the whole controller on one machine, with real prices and evictions.

It starts a real Redis and a moto EC2 server on loopback, replays the 2020 us-east-1 spot prices
on a clock running `speed`× faster than real time, replays capacity evictions from the real
32-node p3 trace (each with its 2-minute notice on the node's instance-metadata mock), runs the
unchanged controller (BidBrain, EC2 adapter, Redis store), and starts a local process per
instance moto launches (the node agent). The agents train a real PyTorch model with AgileML:
spot instances are transient nodes (ActivePSs and workers), the on-demand CPU node is the
reliable one (BackupPS, or ParamServ when no spot node is left), and the job's elasticity
controller runs here. Evictions reach the training as eviction notices. It submits one job with
a budget, prints a live progress line and ends with a summary that includes the training loss.
"""

from __future__ import annotations

import contextlib
import json
import math
import secrets
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pydantic import SecretStr
from rich.console import Console

from orchestrator.agileml.control import ModelSpec, TrainingSpec
from orchestrator.agileml.coordinator import Coordinator
from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.examples import build_model, full_loss, initial_model
from orchestrator.agileml.partitions import PartitionLayout
from orchestrator.api.app import create_app
from orchestrator.api.serve import BackgroundServer
from orchestrator.cloud.ec2 import EC2Cloud
from orchestrator.cloud.local.clock import ReplayClock
from orchestrator.cloud.local.evictions import EvictionReplayer
from orchestrator.cloud.local.fleet import LocalFleet, TrainingAccess
from orchestrator.cloud.local.moto_server import MotoEC2Server
from orchestrator.cloud.local.redis_process import LocalRedis
from orchestrator.controller.core import Controller
from orchestrator.jobspec import JobSubmission
from orchestrator.market.billing import PerSecondBilling
from orchestrator.market.eviction import AvailabilityTrace
from orchestrator.market.prices import to_datetime, to_epoch_seconds
from orchestrator.market.trace_source import TracePriceSource, bundled_prices_dir
from orchestrator.settings import ApiSettings, Settings
from orchestrator.store.models import JobRecord, JobState, TrainingReport
from orchestrator.store.protocol import Store
from orchestrator.store.redis_store import RedisStore
from orchestrator.units import SECONDS_PER_HOUR

CONTROLLER_ID = "demo"
NAMESPACE = "demo"
JOB_ID = "job-demo"
REGION = "us-east-1"
DEFAULT_START = "2020-02-03T00:00:00Z"
#: Real seconds between loop iterations (ticks of the controller, the replayer and the fleet).
LOOP_WALL_S = 0.2
#: Off a terminal (a log, CI), one progress line per this much simulated time.
PLAIN_LINE_EVERY_SIM_S = 900.0
#: Real seconds between two measurements of the model's loss (parameters pulled from the
#: parameter servers, loss over the whole training set).
LOSS_EVERY_WALL_S = 2.0
#: Where the demo serves the API and dashboard (the API's default port, so the CLI finds it).
DEFAULT_PORT = 8750


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


def sample_job(budget_usd: float) -> JobSubmission:
    """A 12 reference-GPU-hour job on up to 4 V100s (p3 types), with a budget."""
    return JobSubmission(
        name="demo-training",
        budget_usd=budget_usd,
        work_gpu_hours=12.0,
        max_gpus=4.0,
        instance_types=("p3.2xlarge", "p3.8xlarge", "p3.16xlarge"),
    )


def training_spec() -> TrainingSpec:
    """The demo job's model: multinomial logistic regression on a generated mixture, sized to
    train at a visible pace on a few CPU processes."""
    return TrainingSpec(
        job_id=JOB_ID,
        model=ModelSpec(kind="mlr", features=64, classes=8),
        samples=4096,
        global_batch=128,
        lr=0.5,
        iterations=10_000_000,  # runs until the controller's job ends
        num_partitions=4,
        min_nodes=2,
        failure_timeout_s=3.0,  # many processes on few cores: be patient before "failed"
    )


class _LossProbe:
    """Measures the training loss now and then from the parameter servers' current state."""

    def __init__(self, coordinator: Coordinator, spec: TrainingSpec) -> None:
        self.coordinator, self.spec = coordinator, spec
        self.model = initial_model(build_model(spec), spec.seed)
        self.layout = PartitionLayout(self.model, spec.num_partitions)
        self.at_start = full_loss(spec, self.model)
        self.last = math.nan
        self._next = 0.0

    def maybe_measure(self) -> bool:
        """Measure if it is time; True when a new loss was measured."""
        if time.monotonic() < self._next:
            return False
        self._next = time.monotonic() + LOSS_EVERY_WALL_S
        try:
            params = self.coordinator.fetch_parameters(timeout_s=1.0, final=False)
        except AgileMLError:
            return False  # not started yet, or an owner is moving: measure next time
        self.layout.scatter(self.model, params)
        self.last = full_loss(self.spec, self.model)
        return True


def _report_training(store: Store, training: Coordinator, probe: _LossProbe, now_s: float) -> None:
    """What the runtime reports to the controller for the dashboard and /metrics."""
    progress = training.progress()
    report = TrainingReport(
        at_s=now_s,
        iteration=progress.iteration,
        loss=probe.last if math.isfinite(probe.last) else None,
        reassigned=progress.reassigned_rows,
        stage_transitions=progress.stage_transitions,
    )
    store.append_training(JOB_ID, report)


def _dashboard(store: Store, clock: ReplayClock, port: int) -> BackgroundServer:
    """The API and dashboard over the demo's store, on the demo's clock (read-only use: the
    token is random and not shown)."""
    settings = Settings(api=ApiSettings(token=SecretStr(secrets.token_hex(16))))
    return BackgroundServer(create_app(store, settings, clock=clock.now), port=port)


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
) -> DemoSummary:
    """Run the demo until the job ends or `timeout_s` real seconds pass.

    If the replayed trace has not evicted anything by the time half the work is done, one spot
    node is evicted on purpose (with its notice), so that the demo always shows recovery; the
    summary counts such injected evictions separately. The controller's API and dashboard are
    served on 127.0.0.1:`port` (0: any free port; None: not served) until the job ends, then
    `linger_s` more seconds.

    Raises:
        UserError: redis-server is missing (with the apt-get command), a server cannot start,
            or `port` is taken.
    """
    console = console or Console()
    wall0 = time.monotonic()
    job = sample_job(budget_usd)
    spec = training_spec()
    token = secrets.token_bytes(32)
    with (
        tempfile.TemporaryDirectory(prefix="orchestrator-demo-") as tmp,
        LocalRedis() as redis,
        MotoEC2Server() as aws,
        Coordinator(spec, token=token) as training,
        contextlib.ExitStack() as stack,
    ):
        probe = _LossProbe(training, spec)
        store = RedisStore.connect(redis.url, namespace=NAMESPACE)
        client = aws.client()
        clock = ReplayClock(to_epoch_seconds(start), speed)
        server = None if port is None else stack.enter_context(_dashboard(store, clock, port))
        controller = Controller(
            store=store,
            cloud=EC2Cloud(REGION, CONTROLLER_ID, client=client),
            prices=TracePriceSource([bundled_prices_dir(REGION)]),
            billing=PerSecondBilling(),
        )
        replayer = EvictionReplayer(
            client,
            CONTROLLER_ID,
            AvailabilityTrace.bundled(),
            clock,
            seed=seed,
            on_notice=controller.notify,
        )
        store.create_job(
            JobRecord.submit(JOB_ID, job.model_dump(mode="json"), budget_usd, clock.now())
        )
        console.print(
            f"[bold]Offline demo[/bold]: job {JOB_ID} ({job.work_gpu_hours:g} GPU-hours on up "
            f"to {job.max_gpus:g} V100s, budget ${budget_usd:g}) from "
            f"{to_datetime(clock.now()):%Y-%m-%d %H:%M} UTC in replayed us-east-1 spot prices, "
            f"{speed:g}x real time. Redis {redis.url}, EC2 (moto) {aws.endpoint_url}.",
            highlight=False,
        )
        if server is not None:
            console.print(f"Dashboard: {server.url}/dashboard", highlight=False)
        injected = 0
        last_line_s = -float("inf")
        launched: set[str] = set()
        with LocalFleet(
            redis.url,
            NAMESPACE,
            clock,
            cloud_client=client,
            controller_id=CONTROLLER_ID,
            replayer=replayer,
            log_dir=Path(tmp) / "agents",
            training=TrainingAccess(training.endpoint, token),
            record_progress=store.update_progress,
        ) as fleet:
            while time.monotonic() - wall0 < timeout_s:
                now = clock.now()
                report = controller.tick(now)
                launched.update(report.launched)
                replayer.step()
                fleet.step()
                if probe.maybe_measure():
                    _report_training(store, training, probe, now)
                record = store.get_job(JOB_ID)
                if record.state.is_terminal:
                    break
                done = record.work_done_gpu_hours / job.work_gpu_hours
                if done >= 0.5 and not replayer.evictions and injected == 0:
                    injected += _inject_eviction(store, replayer, now)
                if console.is_terminal or now - last_line_s >= PLAIN_LINE_EVERY_SIM_S:
                    _progress(
                        console, controller, record, job, replayer, now, clock.start_s, probe.last
                    )
                    last_line_s = now
                time.sleep(LOOP_WALL_S)
            fleet.step()
        if console.is_terminal:
            console.print()
        if server is not None and linger_s > 0:
            console.print(f"Serving the dashboard {linger_s:g} s more: {server.url}/dashboard")
            time.sleep(linger_s)
        final = store.get_job(JOB_ID)
        orphans = len(EC2Cloud(REGION, CONTROLLER_ID, client=client).describe())
        summary = DemoSummary(
            job_state=str(final.state),
            budget_usd=budget_usd,
            spent_usd=round(store.spent_usd(JOB_ID), 4),
            evictions=len(replayer.evictions),
            instances_launched=len(launched),
            orphans_after=orphans,
            work_done_fraction=round(min(final.work_done_gpu_hours / job.work_gpu_hours, 1.0), 4),
            sim_hours=round((clock.now() - clock.start_s) / SECONDS_PER_HOUR, 3),
            wall_seconds=round(time.monotonic() - wall0, 1),
            injected_evictions=injected,
            loss_at_start=round(probe.at_start, 4),
            final_loss=round(probe.last, 4),
            training_iterations=max(
                (c + 1 for ls in training.node_losses().values() for c, _ in ls), default=0
            ),
            training_events=[
                f"{e.kind} {' '.join(e.nodes)} {e.detail}".strip() for e in training.events()
            ],
        )
        store.close()
    _print_summary(console, summary)
    return summary


def _inject_eviction(store: Store, replayer: EvictionReplayer, now_s: float) -> int:
    spot = [r for r in store.list_instances(JOB_ID, alive_only=True) if r.lifecycle == "spot"]
    if not spot:
        return 0
    return 1 if replayer.force_evict(spot[0].instance_id, now_s + 180.0) else 0


def _progress(
    console: Console,
    controller: Controller,
    record: JobRecord,
    job: JobSubmission,
    replayer: EvictionReplayer,
    now_s: float,
    start_s: float,
    loss: float,
) -> None:
    """One progress line: rewritten in place on a terminal, appended otherwise."""
    alive = controller.store.list_instances(JOB_ID, alive_only=True)
    spot = sum(1 for r in alive if r.lifecycle == "spot")
    spent = controller.spend_usd(JOB_ID, now_s)
    pct = 100.0 * min(record.work_done_gpu_hours / job.work_gpu_hours, 1.0)
    line = (
        f"t+{(now_s - start_s) / 3600:5.2f} h  work {pct:5.1f}%  spent ${spent:7.2f} / "
        f"${job.budget_usd:g}  nodes: {len(alive) - spot} reliable, {spot} spot  "
        f"evictions {len(replayer.evictions)}  loss {loss:.3f}  [{record.state}]"
    )
    if console.is_terminal:
        console.print(f"\r{line}   ", end="", highlight=False, soft_wrap=True, markup=False)
    else:
        console.print(line, highlight=False, markup=False)


def _print_summary(console: Console, s: DemoSummary) -> None:
    console.print(
        f"[bold]Summary[/bold]: job {s.job_state}; spent ${s.spent_usd:.2f} of ${s.budget_usd:g}; "
        f"{s.work_done_fraction:.0%} of the work in {s.sim_hours:.2f} simulated hours "
        f"({s.wall_seconds:.0f} s real); {s.instances_launched} instances launched, "
        f"{s.evictions} evicted"
        + (f" ({s.injected_evictions} injected)" if s.injected_evictions else "")
        + f"; {s.orphans_after} left running. Training: loss {s.loss_at_start:.3f} -> "
        f"{s.final_loss:.3f} in {s.training_iterations} AgileML iterations.",
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
