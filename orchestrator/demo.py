"""The offline demo: one job with a budget run to the end in the offline world
(`orchestrator.world`: Redis, moto, replayed prices and evictions, the controller as
`controller start` builds it, a local instance agent training for real on every instance).

It submits the bundled job (a small CNN on scikit-learn's digits, `orchestrator/jobs`) as
`orchestrator submit` does, prints a live progress line, evicts a spot node on purpose if the
trace has not by half-way, and ends with a summary: how the job ended, its spend, its
evictions, the training loss and the held-out accuracy of the weights it handed back.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from orchestrator.agileml.hosting import evaluate_weights
from orchestrator.api.operations import submit_job
from orchestrator.api.serve import BackgroundServer
from orchestrator.artifacts import FINAL_INFO, WEIGHTS, Folder
from orchestrator.artifacts.code import pack_code, store_code
from orchestrator.cloud.ec2 import EC2Cloud
from orchestrator.jobs import DIGITS_CNN
from orchestrator.jobspec import JobSubmission
from orchestrator.market.prices import to_datetime
from orchestrator.settings import Settings
from orchestrator.store import JobRecord, JobState, Store, WorkRatesEvent
from orchestrator.units import SECONDS_PER_HOUR
from orchestrator.world import (
    DEFAULT_START,
    REGION,
    STEP_WALL_S,
    OfflineWorld,
    offline_world,
    world_settings,
)

if TYPE_CHECKING:
    from orchestrator.agileml.hosting import Hosted

CONTROLLER_ID = "demo"
JOB_ID = "job-demo"
#: Off a terminal (a log, CI), one progress line per this much simulated time.
PLAIN_LINE_EVERY_SIM_S = 900.0
#: Real seconds between two measurements of the model's loss (parameters pulled from the
#: parameter servers, loss over the whole training set).
LOSS_EVERY_WALL_S = 2.0
#: The longest wait after the job's end for its last report (the end's evaluation).
SETTLE_S = 60.0
#: If the trace has evicted nothing when this fraction of the work is done, one spot node is
#: evicted on purpose: early enough that most of the training (and the dashboard) shows recovery.
INJECT_AT_DONE = 0.25
#: Where the demo serves the API and dashboard (the API's default port, so the CLI finds it).
DEFAULT_PORT = 8750
#: The demo job: a user job file shipped with the package (a small CNN on scikit-learn's
#: bundled digits, `orchestrator/jobs/digits_cnn.py`), as `TrainingSpec` fields.
DEMO_ITERATIONS = 500
TRAINING: dict[str, Any] = {
    "code": str(DIGITS_CNN),
    "global_batch": 128,
    # the job succeeds once these are trained and its weights stored (its work is counted
    # from them): about 15 s of training on a quiet 2-core machine
    "iterations": DEMO_ITERATIONS,
    "num_partitions": 4,
    "min_nodes": 2,
    "failure_timeout_s": 3.0,  # many processes on few cores: be patient before "failed"
}
#: How many times the demo's job evaluates its held-out accuracy during training (`eval_every`:
#: its iterations over this), for the dashboard's curve beside the loss.
EVALUATIONS = 5
#: The demo job trained as a pipeline (`--pipeline`): the same job file, its layers in two
#: stages (replicated over the instances held; the planner would pick one replicated stage for
#: so small a model).
PIPELINE_TRAINING: dict[str, Any] = {
    **{k: v for k, v in TRAINING.items() if k != "num_partitions"},
    "parallelism": "pipeline",
    "stages": 2,
}


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


def sample_job(
    budget_usd: float, *, pipeline: bool = False, iterations: int = DEMO_ITERATIONS
) -> JobSubmission:
    """A 12 reference-GPU-hour job on one V100 at a time (a p3.2xlarge: an AgileML node trains
    on one GPU) that trains `TRAINING` (or `PIPELINE_TRAINING`) for `iterations` (evaluated
    `EVALUATIONS` times on the way, data-parallel)."""
    training = (
        PIPELINE_TRAINING
        if pipeline
        else {**TRAINING, "eval_every": max(1, iterations // EVALUATIONS)}
    )
    return JobSubmission(
        name="demo-pipeline" if pipeline else "demo-training",
        budget_usd=budget_usd,
        work_gpu_hours=12.0,
        max_gpus=1.0,
        instance_types=("p3.2xlarge",),
        training={**training, "iterations": iterations},
    )


def demo_timeout_s(iterations: int) -> float:
    """How long the demo waits for its job: 240 s for the default 500 iterations (about 15 s
    on a quiet 2-core machine), and as much more per iteration for a longer run."""
    return 240.0 * max(1.0, iterations / DEMO_ITERATIONS)


def demo_settings(*, speed: float, start: str) -> Settings:
    """The controller's settings: replayed us-east-1 prices from `start` at `speed`, an API
    token nobody is shown (the demo's API is for watching) and a read-only one, in the
    dashboard's link."""
    return world_settings(speed=speed, start=start, controller_id=CONTROLLER_ID)


@dataclass
class _Watch:
    """What the demo's loop keeps track of besides the world."""

    injected: int = 0
    hosted: Hosted | None = None
    loss_at_start: float = math.nan
    last_loss: float = math.nan
    # until a loss is known the status line shows "-" (a NaN there would read as divergence)
    loss_seen: bool = False
    next_loss_s: float = 0.0
    earlier_events: list[str] = field(default_factory=list)  # of runtimes restarted since


def run_demo(
    *,
    speed: float = 300.0,
    budget_usd: float = 40.0,
    start: str = DEFAULT_START,
    seed: int = 1,
    timeout_s: float | None = None,
    iterations: int = DEMO_ITERATIONS,
    console: Console | None = None,
    port: int | None = DEFAULT_PORT,
    linger_s: float = 0.0,
    weights_out: Path | None = None,
    pipeline: bool = False,
    true_work_rates: Mapping[str, float] | None = None,
) -> DemoSummary:
    """Run the demo, training the sample job for `iterations`, until the job ends or
    `timeout_s` real seconds pass (None: `demo_timeout_s(iterations)`).

    If the replayed trace has not evicted anything by the time a quarter of the work is done, one
    spot node is evicted on purpose (with its notice), so that the demo always shows recovery; the
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
    job = sample_job(budget_usd, pipeline=pipeline, iterations=iterations)
    if timeout_s is None:
        timeout_s = demo_timeout_s(iterations)
    settings = demo_settings(speed=speed, start=start)
    watch = _Watch()
    with offline_world(settings, seed=seed, port=port, true_work_rates=true_work_rates) as world:
        job = with_uploaded_code(job, world.artifacts)
        submit_job(world.store, job, now_s=world.clock.now(), new_id=lambda: JOB_ID)
        _announce(console, world, job, speed, settings)
        ended = _run(world, watch, job, console, deadline=wall0 + timeout_s)
        if not _settle(world, deadline=min(wall0 + timeout_s, time.monotonic() + SETTLE_S)):
            console.print(
                f"The job's last report (its final model's evaluation) did not come within "
                f"{SETTLE_S:g} s; the dashboard shows the one before."
            )
        if console.is_terminal:
            console.print()
        if world.server is not None and linger_s > 0:
            link = _dashboard_link(world.server, settings)
            try:  # the job has ended: after a Ctrl-C its summary still follows
                console.print(
                    f"Serving the dashboard {linger_s:g} s more (Ctrl-C stops it): {link}",
                    highlight=False,
                    soft_wrap=True,
                )
                time.sleep(linger_s)
            except KeyboardInterrupt:
                console.print("Stopped serving the dashboard.")
        summary = _summary(world, watch, job, wall0, ended)
        summary = _with_returned_weights(world, summary, weights_out)
    _print_summary(console, summary)
    return summary


def _dashboard_link(server: BackgroundServer, settings: Settings) -> str:
    """The dashboard's URL with the read-only token (opening it sets the page's cookie)."""
    read = settings.api.read_token
    return f"{server.url}/dashboard" + (f"?token={read.get_secret_value()}" if read else "")


def _announce(
    console: Console, world: OfflineWorld, job: JobSubmission, speed: float, settings: Settings
) -> None:
    console.print(
        f"[bold]Offline demo[/bold]: job {JOB_ID} ({job.work_gpu_hours:g} GPU-hours on "
        f"{_gpus(job.max_gpus)} spot and an on-demand reliable node, budget "
        f"${job.budget_usd:g}) from "
        f"{to_datetime(world.clock.now()):%Y-%m-%d %H:%M} UTC in replayed us-east-1 spot prices, "
        f"{speed:g}x real time. {world.where}.",
        highlight=False,
    )
    if world.server is not None:
        link = _dashboard_link(world.server, settings)
        console.print(f"Dashboard: {link}", highlight=False, soft_wrap=True)  # one line: a link


def _gpus(max_gpus: float) -> str:
    return "one V100" if max_gpus == 1 else f"up to {max_gpus:g} V100s"


def _run(
    world: OfflineWorld, watch: _Watch, job: JobSubmission, console: Console, *, deadline: float
) -> tuple[float, float]:
    """Step the world until the job ends or the deadline; when that was (market time, and
    this process's monotonic clock)."""
    last_line_s = -math.inf
    while time.monotonic() < deadline:
        now = world.step()
        _measure_loss(watch, world)
        record = world.store.get_job(JOB_ID)
        if record.state.is_terminal:
            break
        done = record.work_done_gpu_hours / job.work_gpu_hours
        if done >= INJECT_AT_DONE and not world.replayer.evictions and watch.injected == 0:
            watch.injected += _inject_eviction(world, now)
        if console.is_terminal or now - last_line_s >= PLAIN_LINE_EVERY_SIM_S:
            _progress(console, world, watch, record, job, now)
            last_line_s = now
        time.sleep(STEP_WALL_S)
    return world.clock.now(), time.monotonic()


def _settle(world: OfflineWorld, *, deadline: float) -> bool:
    """Step the world after the job's end until its training host lets the job go (its last
    report written, with the evaluation of the model at the end: the dashboard and the
    API show it; True) or the deadline (False); the agents of the released instances are
    stopped."""
    world.fleet.step()
    while world.training.hosted(JOB_ID) is not None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(STEP_WALL_S)
        world.step()
    return True


def _measure_loss(watch: _Watch, world: OfflineWorld) -> None:
    """Every `LOSS_EVERY_WALL_S`: the model's loss (and, the first time, its loss at start)."""
    if time.monotonic() < watch.next_loss_s:
        return
    watch.next_loss_s = time.monotonic() + LOSS_EVERY_WALL_S
    hosted = world.training.hosted(JOB_ID)  # hosted at the job's first launch
    if hosted is not None and hosted is not watch.hosted:  # first, or restarted (a stall)
        if watch.hosted is None:
            watch.loss_at_start = hosted.initial_loss()
        else:
            watch.earlier_events += watch.hosted.events()
        watch.hosted = hosted
    if watch.hosted is None:
        return
    loss = watch.hosted.model_loss()
    if loss is not None:
        watch.last_loss, watch.loss_seen = loss, True


def _inject_eviction(world: OfflineWorld, now_s: float) -> int:
    alive = world.store.list_instances(JOB_ID, alive_only=True)
    spot = [r for r in alive if r.lifecycle == "spot"]
    if not spot:
        return 0
    return 1 if world.replayer.force_evict(spot[0].instance_id, now_s + 180.0) else 0


def _progress(
    console: Console,
    world: OfflineWorld,
    watch: _Watch,
    record: JobRecord,
    job: JobSubmission,
    now_s: float,
) -> None:
    """One progress line: rewritten in place on a terminal, appended otherwise."""
    alive = world.store.list_instances(JOB_ID, alive_only=True)
    spot = sum(1 for r in alive if r.lifecycle == "spot")
    spent = world.controller.spend_usd(JOB_ID, now_s)
    pct = 100.0 * min(record.work_done_gpu_hours / job.work_gpu_hours, 1.0)
    trained = 0 if watch.hosted is None else watch.hosted.progress().iteration
    loss = f"{watch.last_loss:.3f}" if watch.loss_seen else "-"
    line = (
        f"t+{(now_s - world.clock.start_s) / SECONDS_PER_HOUR:5.2f} h  work {pct:5.1f}%  "
        f"trained {trained}/{(job.training or {}).get('iterations', 0)}  "
        f"spent ${spent:7.2f} / ${job.budget_usd:g}  nodes: {len(alive) - spot} reliable, "
        f"{spot} spot  evictions {len(world.replayer.evictions)}  loss {loss}  "
        f"[{record.state}]"
    )
    if console.is_terminal:
        console.print(f"\r{line}   ", end="", highlight=False, soft_wrap=True, markup=False)
    else:
        console.print(line, highlight=False, markup=False)


def _summary(
    world: OfflineWorld,
    watch: _Watch,
    job: JobSubmission,
    wall0: float,
    ended: tuple[float, float],
) -> DemoSummary:
    """The run's numbers; its durations end where the job did (`ended`: market time and
    monotonic), not after the wait for its last report or the dashboard's linger."""
    final = world.store.get_job(JOB_ID)
    ended_sim_s, ended_wall_s = ended
    hosted = watch.hosted
    return DemoSummary(
        job_state=str(final.state),
        job_message=final.message,
        budget_usd=job.budget_usd,
        spent_usd=round(world.store.spent_usd(JOB_ID), 4),
        evictions=len(world.replayer.evictions),
        instances_launched=len(world.launched),
        orphans_after=len(EC2Cloud(REGION, CONTROLLER_ID, client=world.client).describe()),
        work_done_fraction=round(min(final.work_done_gpu_hours / job.work_gpu_hours, 1.0), 4),
        sim_hours=round((ended_sim_s - world.clock.start_s) / SECONDS_PER_HOUR, 3),
        wall_seconds=round(ended_wall_s - wall0, 1),
        injected_evictions=watch.injected,
        loss_at_start=round(watch.loss_at_start, 4),
        final_loss=round(watch.last_loss, 4),
        training_iterations=_trained(world, hosted),
        training_events=watch.earlier_events + ([] if hosted is None else hosted.events()),
        parallelism=str((job.training or {}).get("parallelism", "data")),
        learned_work_rates=_learned_rates(world.store),
    )


def _trained(world: OfflineWorld, hosted: Hosted | None) -> int:
    """Iterations the job trained: its runtime's progress, or the training host's last report
    to the store (what the controller counted the job's work from) if that says more."""
    report = world.store.latest_training(JOB_ID)
    reported = 0 if report is None else report.iteration
    return max(reported, 0 if hosted is None else hosted.progress().iteration)


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


def with_uploaded_code(job: JobSubmission, artifacts: Folder) -> JobSubmission:
    """The job with its code uploaded to the artifact store and named by its digest, as
    `orchestrator submit` does."""
    training = dict(job.training or {})
    training["code"] = store_code(artifacts, pack_code(training["code"]))
    return job.model_copy(update={"training": training})


def _with_returned_weights(
    world: OfflineWorld, summary: DemoSummary, weights_out: Path | None
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
