"""Job commands of the `orchestrator` CLI: `submit`, `jobs`, `job`, `cancel` and `api serve`.

They talk to the controller's HTTP API (`orchestrator.api.client.ApiClient`); the API URL and
token come from `--api`/`--token`, else `Settings` (`ORCHESTRATOR_API__URL`,
`ORCHESTRATOR_API__TOKEN`), else the local world of `orchestrator local up`. Importing this
module registers them on `orchestrator.cli.app`
(`orchestrator.cli.console` does so). Heavy imports (httpx, FastAPI, the catalog) happen inside the
commands, so the rest of the CLI starts as fast as before.

Exit codes: 0 ok; 1 `--wait` saw the job end in another state than the one hoped for;
2 user errors (bad spec, API unreachable or refusing, `--timeout` reached), printed as
`error: ...` and `To fix: ...` without a traceback.
"""

from __future__ import annotations

import json
import sys
import tarfile
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from orchestrator.artifacts import WEIGHTS
from orchestrator.cli.app import app, err, out
from orchestrator.errors import UserError

if TYPE_CHECKING:
    from orchestrator.api.client import ApiClient
    from orchestrator.jobspec import JobSubmission

#: How often `--wait` polls the API. A controller tick is several seconds; 1 s feels live.
WAIT_POLL_S = 1.0
DEFAULT_WAIT_TIMEOUT_S = 24 * 3600.0
_INTERRUPTED_EXIT_CODE = 130

api_app = typer.Typer(
    name="api", help="The controller's HTTP API.", no_args_is_help=True, add_completion=False
)
app.add_typer(api_app, name="api")

ApiOption = Annotated[
    str | None,
    typer.Option(
        "--api",
        help="Controller API URL \\[default: $ORCHESTRATOR_API__URL, else the world of "
        "`orchestrator local up`, else http://127.0.0.1:8750].",
        show_default=False,
    ),
]
TokenOption = Annotated[
    str | None,
    typer.Option(
        "--token",
        help="API token for submit/cancel \\[default: $ORCHESTRATOR_API__TOKEN].",
        show_default=False,
    ),
]
WaitTimeoutOption = Annotated[
    float,
    typer.Option(
        "--timeout", help="With --wait: give up after this many seconds (exit 2).", min=0.0
    ),
]


# -- submit -------------------------------------------------------------------------------


@app.command()
def submit(
    job_file: Annotated[
        Path,
        typer.Argument(
            metavar="JOB.yaml", help="The job: a YAML or JSON mapping of JobSubmission fields."
        ),
    ],
    budget: Annotated[
        float | None,
        typer.Option("--budget", help="Budget in USD (overrides budget_usd in the file)."),
    ] = None,
    api: ApiOption = None,
    token: TokenOption = None,
    wait: Annotated[
        bool,
        typer.Option("--wait", help="Show progress until the job ends (exit 0 if it succeeds)."),
    ] = False,
    timeout: WaitTimeoutOption = DEFAULT_WAIT_TIMEOUT_S,
    check: Annotated[
        bool,
        typer.Option(
            "--check/--no-check",
            help="Run the job's functions once on a few rows before uploading its code.",
        ),
    ] = True,
) -> None:
    """Submit a training job with a budget; prints its id.

    The spec is validated here first (a bad field fails at once, named, exit 2), then again by
    the API. A training job's code (`training.code`: a job file or a directory with job.py,
    relative to JOB.yaml) is checked, packed and uploaded to the controller's artifact store;
    the job's nodes fetch it (and install its requirements.txt) before they join.
    """
    submission = load_submission(job_file, budget)
    with _client(api, token) as client:
        body = submission.model_dump(mode="json")
        if submission.training and submission.training.get("code"):
            body["training"]["code"] = _upload_code(client, submission.training, job_file, check)
            rates = _pipeline_rates(submission, job_file) if check else None
            if rates is not None:
                body["gpu_work_rates"] = rates
        job = client.submit(body)
        job_id = str(job["job_id"])
        typer.echo(job_id)
        sys.stdout.flush()  # a script reading the id must not wait for --wait to finish
        err.print(
            f"submitted {job['name']} as {job_id} (budget ${job['budget_usd']:.2f}); "
            f"watch it with `orchestrator job {job_id}`",
            highlight=False,
        )
        if wait:
            final = _wait_until_ended(client, job_id, timeout_s=timeout)
            _finish(final, hoped="succeeded")


def _upload_code(client: Any, training: dict[str, Any], job_file: Path, check: bool) -> str:
    """Check, pack and upload the training section's code; returns its reference
    (`sha256:<hex>`), which the submitted spec names instead of the local path.

    Raises:
        UserError: no such file or directory, the job's functions fail the check, or the
            upload is refused.
    """
    from orchestrator.artifacts.code import code_ref, is_code_ref, pack_code

    code = str(training["code"])
    if is_code_ref(code):
        return code  # uploaded before: the API checks that it is there
    path = job_file.parent / Path(code).expanduser()
    if not path.exists():
        raise UserError(
            f"{job_file}: training.code: {code} does not exist (relative to {job_file.parent})",
            field="training.code",
            path=str(job_file),
            fix="name the job file, or a directory holding job.py, relative to the job file",
        )
    data = training.get("data")
    if check and data is not None and not Path(str(data)).is_dir():
        err.print(
            f"not checking the job's functions here: its data ({data}) is fetched on the nodes "
            "(check it with `orchestrator train` on a copy)",
            highlight=False,
        )
        check = False
    if check:
        from orchestrator.agileml.jobcode import check_job_code, load_job_code
        from orchestrator.agileml.spec import validate_training_section
        from orchestrator.artifacts.data import use_data

        use_data(data)  # a local folder: the job's dataset() reads it as on the nodes

        err.print(f"checking {path} ...", highlight=False)
        spec = validate_training_section(training)  # its defaults, as the nodes will see them
        job_code = load_job_code(path, iterations=spec.iterations)
        found = check_job_code(job_code, global_batch=spec.global_batch, seed=spec.seed)
        if spec.eval_every is not None and job_code.evaluate is None:
            raise UserError(
                f"training.eval_every: {path} defines no evaluate(model)",
                field="training.eval_every",
                fix="add an evaluate(model) that returns held-out metrics, or leave it out",
            )
        err.print(f"checked: {found.rows} rows, {found.parameters:,} parameters", highlight=False)
    if path.is_file() and [p for p in path.parent.glob("*.py") if p != path]:
        err.print(
            f"note: only {path.name} (and a requirements.txt beside it) is uploaded; if it "
            f"imports modules beside it, name its directory as training.code (with job.py)",
            highlight=False,
        )
    packed = pack_code(path)
    ref = str(client.upload_code(code_ref(packed), packed)["code"])
    err.print(f"uploaded {path} ({len(packed) / 1024:.0f} KiB) as {ref[:19]}...", highlight=False)
    return ref


def _pipeline_rates(submission: Any, job_file: Path) -> dict[str, float] | None:
    """For a pipeline job without its own `gpu_work_rates`: the catalog's rates times the
    planner's parallel efficiency on `max_gpus` GPUs, from a profile of its layers here, so
    that BidBrain buys for the throughput the pipeline will have (None: not a pipeline job,
    or its data is not here to profile on)."""
    training = submission.training or {}
    if training.get("parallelism") != "pipeline" or submission.gpu_work_rates is not None:
        return None
    data = training.get("data")
    if data is not None and not Path(str(data)).is_dir():
        err.print("not sizing the pipeline here: its data is on the nodes", highlight=False)
        return None
    from orchestrator.agileml.pipeline.trainrun import size_pipeline_submission
    from orchestrator.agileml.spec import validate_training_section
    from orchestrator.market.catalog import Catalog

    spec = validate_training_section(training)
    k = submission.devices_per_node()  # a node's stage workers: whole instances of k GPUs
    workers = max(k, int(submission.max_gpus) // k * k)
    code = str(job_file.parent / Path(str(training["code"])).expanduser())
    sizing = size_pipeline_submission(code, seed=spec.seed, global_batch=spec.global_batch,
                                      workers=workers,
                                      gpu_work_rates=Catalog.load().gpu_work_rates,
                                      devices_per_node=k)  # fmt: skip
    nodes = workers // k
    on = f" ({nodes} instance{'' if nodes == 1 else 's'} of {k})" if k > 1 else ""
    err.print(
        f"pipeline: the planner's parallel efficiency on {workers} GPUs{on} is "
        f"{sizing.parallel_efficiency:.2f}; BidBrain counts each GPU at that share of its "
        "catalog rate (set gpu_work_rates to override)",
        highlight=False,
    )
    return dict(sizing.gpu_work_rates)


def load_submission(job_file: Path, budget: float | None = None) -> JobSubmission:
    """The job file as a validated submission (`budget`, when given, over its budget_usd).

    Raises:
        UserError: the file cannot be read or parsed, or a field is invalid (named).
    """
    from pydantic import ValidationError

    from orchestrator.api import validation_error
    from orchestrator.jobspec import JobSubmission

    data = _read_job_file(job_file)
    if budget is not None:
        data["budget_usd"] = budget
    try:
        return JobSubmission.model_validate(data)
    except ValidationError as exc:
        options = {"budget_usd": "--budget"} if budget is not None else {}
        error = validation_error(exc.errors(), options=options, what=f"job spec {job_file}")
        from_option = error.field in options
        raise UserError(
            error.message if from_option else f"{job_file}: {error.message}",
            fix=error.fix,
            field=error.field,
            path=None if from_option else str(job_file),
        ) from None


def _read_job_file(path: Path) -> dict[str, Any]:
    """The job file's mapping.

    Raises:
        UserError: the file cannot be read, is not YAML/JSON, or is not a mapping.
    """
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise UserError(
            f"cannot read job file {path}: {reason}",
            field="JOB.yaml",
            path=str(path),
            fix="pass an existing YAML or JSON file",
        ) from None
    except yaml.YAMLError as exc:
        raise UserError(
            f"job file {path} is not valid YAML/JSON: {exc}",
            field="JOB.yaml",
            path=str(path),
            fix="fix the syntax at the position shown",
        ) from None
    except RecursionError:  # the YAML parser recurses once per level of nesting
        raise UserError(
            f"job file {path} nests lists or mappings too deeply to read",
            field="JOB.yaml",
            path=str(path),
            fix="a job spec is a flat mapping with a few nested sections "
            "(see docs/controller.md, Job specs)",
        ) from None
    if not isinstance(data, dict):
        raise UserError(
            f"job file {path} must hold a mapping of job fields, not {type(data).__name__}",
            field="JOB.yaml",
            path=str(path),
            fix="write `key: value` lines, e.g. `name: resnet`, `budget_usd: 40`, "
            "`work_gpu_hours: 20`",
        )
    return {str(key): value for key, value in data.items()}


# -- jobs, job ----------------------------------------------------------------------------


@app.command("jobs")
def list_jobs(
    state: Annotated[str | None, typer.Option("--state", help="Only jobs in this state.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list.")] = False,
    api: ApiOption = None,
    token: TokenOption = None,
) -> None:
    """List jobs, oldest first: state, spend against budget, work done."""
    from orchestrator.store.models import JobState

    if state is not None and state not in {s.value for s in JobState}:
        raise UserError(
            f"--state: no job state {state!r}",
            fix=f"use one of {', '.join(s.value for s in JobState)}",
            field="--state",
        )
    with _client(api, token) as client:
        jobs = client.list_jobs(state)
    if as_json:
        sys.stdout.write(json.dumps(jobs) + "\n")
        return
    if not jobs:
        err.print("no jobs" + (f" in state {state}" if state else ""))
        return
    table = Table(title="Jobs")
    for column in ("job id", "name", "state", "spent / budget USD", "work GPU-h", "submitted"):
        table.add_column(column, justify="right" if "USD" in column or "GPU" in column else "left")
    for job in jobs:
        table.add_row(
            job["job_id"],
            job["name"],
            job["state"],
            f"{job['spent_usd']:.2f} / {job['budget_usd']:.2f}",
            f"{job['work_done_gpu_hours']:.2f} / {_total_work(job):g}",
            _when(job["submitted_at"]),
        )
    out.print(table)


@app.command("job")
def show_job(
    job_id: Annotated[str, typer.Argument(metavar="ID", help="The job id, e.g. job-1a2b3c4d.")],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object (the job, with `cost`).")
    ] = False,
    download: Annotated[
        Path | None,
        typer.Option(
            "--download",
            help="Write the job's weights to DIR/model.safetensors (final, else the newest "
            "checkpoint's) and its newest checkpoint to DIR/checkpoint/.",
        ),
    ] = None,
    api: ApiOption = None,
    token: TokenOption = None,
) -> None:
    """One job: state, budget, spend, projected cost, evictions, work done."""
    with _client(api, token) as client:
        job = client.get_job(job_id)
        cost = client.cost(job_id)
        if download is not None:
            _download(client, job_id, download)
    if as_json:
        sys.stdout.write(json.dumps({**job, "cost": cost}) + "\n")
        return
    projected = cost.get("projected_usd")
    table = Table(title=f"Job {job['job_id']}", show_header=False)
    table.add_column("field")
    table.add_column("value")
    rows = {
        "name": job["name"],
        "state": job["state"] + (f" ({job['message']})" if job.get("message") else ""),
        "budget": f"${job['budget_usd']:.2f}",
        "spent": f"${job['spent_usd']:.2f} (remaining ${cost['remaining_usd']:.2f})",
        "projected cost": "-" if projected is None else f"${projected:.2f}",
        "work done": f"{job['work_done_gpu_hours']:.2f} of {_total_work(job):g} GPU-h",
        "evictions": str(cost["evictions"]),
        "ledger entries": str(cost["ledger_entries"]),
        "submitted": _when(job["submitted_at"]),
        "updated": _when(job["updated_at"]),
        "version": str(job["version"]),
    }
    for name, value in rows.items():
        table.add_row(name, value)
    out.print(table)


def _download(client: ApiClient, job_id: str, folder: Path) -> None:
    """The job's weights and newest checkpoint into `folder` (see `show_job`)."""
    from orchestrator.api.client import ApiResponseError

    source = client.download(job_id, "weights", folder / WEIGHTS)
    err.print(f"wrote {folder / WEIGHTS} ({source} weights)", highlight=False)
    with tempfile.TemporaryDirectory() as tmp:
        tar_path = Path(tmp) / "checkpoint.tar"
        try:
            name = client.download(job_id, "checkpoint", tar_path)
        except ApiResponseError as exc:
            if exc.status_code != 404:
                raise
            err.print(f"no checkpoint to download: {exc}", highlight=False)
            return
        target = folder / "checkpoint"
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tar_path) as tar:
            tar.extractall(target, filter="data")  # no absolute paths, links or devices
    err.print(
        f"wrote {target / name} (resume with `orchestrator train JOB --resume {target}`)",
        highlight=False,
    )


# -- report -------------------------------------------------------------------------------


@app.command()
def report(
    job_id: Annotated[str, typer.Argument(metavar="ID", help="The job id, e.g. job-1a2b3c4d.")],
    out_path: Annotated[
        Path, typer.Option("--out", help="The HTML file to write (one self-contained page).")
    ] = Path("report.html"),
    api: ApiOption = None,
    token: TokenOption = None,
) -> None:
    """Write the job's dashboard as one self-contained HTML file to share: spend vs budget,
    cost per work, spot prices, nodes and evictions, training and events, as of now."""
    from orchestrator.dashboard.page import dashboard_html

    if not out_path.parent.is_dir():
        raise UserError(
            f"cannot write {out_path}: folder {out_path.parent} does not exist",
            field="--out",
            fix="create the folder first, or pass another --out",
        )
    with _client(api, token) as client:
        data = {"fleet": client.fleet_dashboard(), "job": client.job_dashboard(job_id)}
    try:
        out_path.write_text(dashboard_html(data))
    except OSError as exc:  # a folder, a full disk, no permission
        raise UserError(
            f"cannot write {out_path}: {exc.strerror or exc}",
            field="--out",
            fix="pass --out a file path you can write (e.g. report.html)",
        ) from None
    out.print(f"wrote {out_path} ({out_path.stat().st_size / 1024:.0f} KiB): job {job_id}")


# -- cancel -------------------------------------------------------------------------------


@app.command()
def cancel(
    job_id: Annotated[str, typer.Argument(metavar="ID", help="The job id.")],
    wait: Annotated[
        bool, typer.Option("--wait", help="Wait until it is cancelled (exit 0 if it is).")
    ] = False,
    timeout: WaitTimeoutOption = DEFAULT_WAIT_TIMEOUT_S,
    api: ApiOption = None,
    token: TokenOption = None,
) -> None:
    """Cancel a job: a queued one at once; a running one once its instances are released."""
    with _client(api, token) as client:
        job = client.cancel(job_id)
        if job["state"] == "cancelling" and not wait:
            out.print(
                f"{job_id}: cancelling (the controller is releasing its instances; "
                "`--wait` waits for it)",
                highlight=False,
            )
            return
        if wait:
            job = _wait_until_ended(client, job_id, timeout_s=timeout)
            _finish(job, hoped="cancelled")
            return
        out.print(f"{job_id}: {job['state']}", highlight=False)


# -- api serve ----------------------------------------------------------------------------


@api_app.command("serve")
def serve(
    host: Annotated[
        str | None,
        typer.Option("--host", help="\\[default: $ORCHESTRATOR_API__HOST or 127.0.0.1]"),
    ] = None,
    port: Annotated[
        int | None,
        typer.Option(
            "--port", min=1, max=65535, help="\\[default: $ORCHESTRATOR_API__PORT or 8750]"
        ),
    ] = None,
) -> None:
    """Serve the HTTP API on the store at ORCHESTRATOR_REDIS_URL (needs ORCHESTRATOR_API__TOKEN)."""
    from orchestrator.settings import Settings

    settings = Settings.load()
    settings.api.require_token()  # refuse before touching Redis or binding a port
    settings.api.require_tls()
    import uvicorn

    from orchestrator.api.app import create_app
    from orchestrator.store import RedisStore

    tls = settings.api.require_tls()
    store = RedisStore.connect(settings.redis_url)
    try:
        uvicorn.run(
            create_app(store, settings),
            host=host or settings.api.host,
            port=port or settings.api.port,
            log_level="info",
            ssl_certfile=tls and tls[0],
            ssl_keyfile=tls and tls[1],
        )
    finally:
        store.close()


# -- helpers ------------------------------------------------------------------------------


def _client(api: str | None, token: str | None) -> ApiClient:
    """A client for `--api`/`--token`; else the settings' URL (environment or config file)
    and token; else the local world `orchestrator local up` started; else the default URL."""
    from orchestrator.api.client import ApiClient
    from orchestrator.cli.local import saved_world
    from orchestrator.settings import Settings

    settings = Settings.load()
    if api is None and "url" not in settings.api.model_fields_set:
        local = saved_world()
        if local is not None:  # its own token: the settings' is for another controller
            return ApiClient(str(local["api_url"]), token or str(local["token"]))
    return ApiClient(
        api or settings.api.url, token or settings.api.client_token(), ca_cert=settings.api.ca_cert
    )


def _wait_until_ended(client: ApiClient, job_id: str, *, timeout_s: float) -> dict[str, Any]:
    """Poll the job every `WAIT_POLL_S` until it is in a terminal state; show progress on stderr.

    Raises:
        UserError: `timeout_s` passed first (the job keeps running).
        typer.Exit(130): Ctrl-C (the job keeps running).
    """
    from orchestrator.store.models import TERMINAL_STATES

    terminal = {s.value for s in TERMINAL_STATES}
    deadline = time.monotonic() + timeout_s
    try:
        with _ProgressDisplay(job_id) as show:
            while True:
                job = client.get_job(job_id)
                show(job)
                if job["state"] in terminal:
                    return job
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    raise UserError(
                        f"job {job_id} is still {job['state']} after {timeout_s:g} s (--timeout)",
                        fix=f"the job goes on: watch it with `orchestrator job {job_id}`, or "
                        f"cancel it with `orchestrator cancel {job_id}`",
                        field="--timeout",
                    )
                time.sleep(min(WAIT_POLL_S, left_s))
    except KeyboardInterrupt:
        err.print(f"stopped waiting; job {job_id} keeps running (`orchestrator job {job_id}`)")
        raise typer.Exit(_INTERRUPTED_EXIT_CODE) from None


class _ProgressDisplay:
    """A rich progress bar of work done on an interactive stderr, else a line per state change."""

    def __init__(self, job_id: str) -> None:
        self._job_id = job_id
        self._last_state: str | None = None
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> _ProgressDisplay:
        if err.is_terminal:
            from rich.progress import (
                BarColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.fields[detail]}"),
                TimeElapsedColumn(),
                console=err,
            )
            self._progress.start()
            self._task = self._progress.add_task(self._job_id, total=None, detail="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def __call__(self, job: dict[str, Any]) -> None:
        detail = _summary(job)
        if self._progress is not None:
            total = _total_work(job) or None
            self._progress.update(
                self._task, completed=job["work_done_gpu_hours"], total=total, detail=detail
            )
        elif job["state"] != self._last_state:
            err.print(f"{self._job_id}: {detail}", highlight=False)
        self._last_state = job["state"]


def _finish(job: dict[str, Any], *, hoped: str) -> None:
    """Print the final line on stdout; exit 1 if the job did not end in `hoped`."""
    out.print(f"{job['job_id']}: {_summary(job)}", highlight=False)
    if job["state"] != hoped:
        if job.get("message"):  # why: the user's error, a stall, a missing training section
            err.print(f"{job['job_id']}: {job['message']}", highlight=False, markup=False)
        raise typer.Exit(1)


def _summary(job: dict[str, Any]) -> str:
    return (
        f"{job['state']}, spent ${job['spent_usd']:.2f} of ${job['budget_usd']:.2f}, "
        f"work {job['work_done_gpu_hours']:.2f} of {_total_work(job):g} GPU-h"
    )


def _total_work(job: dict[str, Any]) -> float:
    spec = job.get("spec") or {}
    value = spec.get("work_gpu_hours", 0.0) if isinstance(spec, dict) else 0.0
    return float(value) if isinstance(value, int | float) else 0.0


def _when(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
