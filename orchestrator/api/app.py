"""The controller's HTTP API: submit, list, inspect and cancel jobs; health; Prometheus metrics.

    POST /v1/jobs                     (token) a JobSubmission -> 201, the new queued job
    GET  /v1/jobs[?state=S]           {"jobs": [job, ...]}, oldest submission first
    GET  /v1/jobs/{id}                the job
    POST /v1/jobs/{id}/cancel         (token) queued -> cancelled (200); running -> cancelling
                                      (202: the controller releases its instances, then ends it)
    GET  /v1/jobs/{id}/cost           spent, budget, projected cost, evictions, ledger entries
    GET  /v1/jobs/{id}/events[?since=ID&limit=N]
    POST /v1/jobs/{id}/training       (token) the runtime's progress: iteration, loss, counters
    GET  /v1/dashboard                every job's summary (static/CONTRACT.md)
    GET  /v1/jobs/{id}/dashboard      one job's summary and series (static/CONTRACT.md)
    GET  /dashboard                   the live dashboard page (assets under /static)
    GET  /healthz                     200 when Redis answers, else 503 "degraded"
    GET  /metrics                     Prometheus text, read from the store at scrape time

The routes only parse and render; what a submission or a cancel does is decided by
`submit_job` and `cancel_job`, which talk to the `Store` (the only state: the app keeps none, so
any number of API processes may serve the same Redis). Every error is JSON
(`orchestrator.api.error_body`): 401/403 auth, 404 unknown job, 409 illegal move or lost race,
422 invalid input naming the field, 400 other user errors, 503 Redis unreachable, 500
anything else.
"""

from __future__ import annotations

import hmac
import logging
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from pydantic import SecretStr
from starlette.exceptions import HTTPException as StarletteHTTPException

from orchestrator import __version__
from orchestrator.api import error_body, validation_error
from orchestrator.api.views import (
    STATIC_DIR,
    JobFacts,
    TrainingBody,
    dashboard_html,
    fleet,
    job_dashboard,
    read_facts,
    tier_of,
)
from orchestrator.cloud.imds import InterruptionNotice
from orchestrator.errors import UserError
from orchestrator.jobspec import JobSubmission
from orchestrator.settings import API_TOKEN_ENV, Settings
from orchestrator.store import (
    ConflictError,
    IllegalTransitionError,
    JobRecord,
    JobState,
    NotFoundError,
    StateEvent,
    Store,
    StoreError,
    StoreUnavailableError,
    TrainingReport,
)

logger = logging.getLogger(__name__)

Clock = Callable[[], float]

#: Re-reads of a job whose version changed under a cancel. Each lost race means the controller
#: moved the job in between (a handful of writes per job per tick), so 5 is plenty.
CANCEL_ATTEMPTS = 5
#: Fresh ids tried when a random job id is taken (2^32 ids: a second collision means a bug).
JOB_ID_ATTEMPTS = 3
DEFAULT_EVENTS_LIMIT = 1000
MAX_EVENTS_LIMIT = 10_000
_STREAM_ID_RE = re.compile(r"^(-|\d+(-\d+)?)$")

#: The state a cancel moves each cancellable state to.
CANCEL_TARGET: dict[JobState, JobState] = {
    JobState.QUEUED: JobState.CANCELLED,  # nothing launched yet: done at once
    JobState.RUNNING: JobState.CANCELLING,  # the controller releases instances, then ends it
}

_AUTH_FIX = f"send `Authorization: Bearer <token>` (CLI: --token or {API_TOKEN_ENV})"


class ApiError(UserError):
    """A refusal of the wire layer itself (authentication), with its HTTP status."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        fix: str = "",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message, fix=fix)
        self.status_code = status_code
        self.headers = headers


class JobEndedError(UserError):
    """A cancel of a job already in a terminal state; nothing changed.

    Attributes:
        job_id: the job.
        state: its terminal state.
    """

    def __init__(self, job_id: str, state: JobState) -> None:
        self.job_id = job_id
        self.state = state
        super().__init__(
            f"job {job_id!r} has already ended ({state.value}): there is nothing to cancel",
            fix="nothing to do; submit it again if you want it to run",
        )


def new_job_id() -> str:
    """A fresh random job id, `job-<8 hex digits>`."""
    return f"job-{secrets.token_hex(4)}"


# --- operations: what a submission and a cancel do to the store


def submit_job(
    store: Store,
    submission: JobSubmission,
    *,
    now_s: float,
    new_id: Callable[[], str] = new_job_id,
) -> JobRecord:
    """Store `submission` as a new queued job (version 0) and log a `state` event.

    The job is created atomically; the event is appended after it and is best effort (if Redis
    fails in between, the job exists without its first event, and the failure is logged).

    Raises:
        ConflictError: `JOB_ID_ATTEMPTS` fresh ids were all taken (nothing created).
        StoreUnavailableError: Redis cannot be reached (the job may or may not exist: a lost
            reply; the client sees 503 and may list jobs to check).
    """
    spec = submission.model_dump(mode="json")
    for attempt in range(1, JOB_ID_ATTEMPTS + 1):
        record = JobRecord.submit(new_id(), spec, submission.budget_usd, now_s)
        try:
            store.create_job(record)
        except ConflictError:
            if attempt == JOB_ID_ATTEMPTS:
                raise
            logger.warning("job id taken, drawing another", extra={"job_id": record.job_id})
            continue
        logger.info(
            "job submitted",
            extra={
                "job_id": record.job_id,
                "job_name": record.name,
                "budget_usd": record.budget_usd,
            },
        )
        _append_state_event(store, record, None, "submitted", now_s)
        return record
    raise AssertionError("unreachable")  # pragma: no cover


def cancel_job(
    store: Store, job_id: str, *, now_s: float, attempts: int = CANCEL_ATTEMPTS
) -> JobRecord:
    """Cancel a job: queued -> cancelled, running -> cancelling; a cancelling job is left as is.

    Each attempt reads the job and moves it with `Store.transition` at the version read, so a
    concurrent move by the controller is never overwritten: the cancel re-reads and decides
    again, up to `attempts` times. A `state` event is logged after a move (best effort).

    Returns:
        The job after the cancel (cancelled, or cancelling for the controller to finish).

    Raises:
        NotFoundError: no such job.
        JobEndedError: the job is in a terminal state (nothing changed).
        ConflictError: the job changed under every one of the `attempts` (nothing changed).
    """
    last_conflict: ConflictError | None = None
    for _ in range(attempts):
        job = store.get_job(job_id)
        if job.state is JobState.CANCELLING:
            return job  # asked before; the controller is finishing it
        target = CANCEL_TARGET.get(job.state)
        if target is None:
            raise JobEndedError(job_id, job.state)
        try:
            updated = store.transition(
                job_id,
                target,
                expected_version=job.version,
                now_s=now_s,
                message="cancelled by the user",
            )
        except ConflictError as exc:
            logger.info("job changed under a cancel; re-reading", extra={"job_id": job_id})
            last_conflict = exc
            continue
        logger.info("job cancel", extra={"job_id": job_id, "to_state": target.value})
        _append_state_event(store, updated, job.state, "cancelled by the user", now_s)
        return updated
    assert last_conflict is not None
    raise last_conflict


def job_cost(store: Store, job_id: str) -> dict[str, Any]:
    """The job's spend, budget, latest projected cost, eviction count and ledger size.

    `projected_usd` is the `projected_cost_usd` field of the latest `decision` event (None if
    there is none, or it carries no number). Reads the job's whole event log.

    Raises:
        NotFoundError: no such job.
    """
    facts = read_facts(store, store.get_job(job_id))
    job = facts.job
    return {
        "job_id": job.job_id,
        "spent_usd": job.spent_usd,
        "budget_usd": job.budget_usd,
        "remaining_usd": max(0.0, job.budget_usd - job.spent_usd),
        "projected_usd": facts.projected_cost_usd,
        "evictions": facts.evictions,
        "ledger_entries": len(store.ledger(job_id)),
    }


def _append_state_event(
    store: Store, job: JobRecord, from_state: JobState | None, reason: str, now_s: float
) -> None:
    """Log the job's move to its current state; a failure is logged, not raised."""
    event = StateEvent(
        job_id=job.job_id,
        at_s=now_s,
        state=job.state,
        from_state=from_state,
        message=reason,
        by="api",
    )
    try:
        store.append_event(event)
    except StoreError:
        logger.warning("could not log a state event", extra={"job_id": job.job_id}, exc_info=True)


def _job_json(job: JobRecord) -> dict[str, Any]:
    return job.model_dump(mode="json")


# --- metrics


def _families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    """The metric families of one scrape, empty; names follow Prometheus conventions (base
    units in the name, `_total` added to counters on exposition)."""
    job = ["job_id"]
    gauge, counter = GaugeMetricFamily, CounterMetricFamily
    return {
        "store_up": gauge("orchestrator_store_up", "1 if Redis answered this scrape, else 0"),
        "jobs": gauge("orchestrator_jobs", "Jobs by lifecycle state", labels=["state"]),
        "spent": gauge(
            "orchestrator_job_spent_usd", "Spend so far (sum of the ledger)", labels=job
        ),
        "budget": gauge("orchestrator_job_budget_usd", "The budget", labels=job),
        "projected": gauge(
            "orchestrator_job_projected_cost_usd",
            "Expected total cost at completion (BidBrain's latest decision)",
            labels=job,
        ),
        "cost_per_work": gauge(
            "orchestrator_job_cost_per_work_usd",
            "Spend per reference-GPU-hour of work done so far",
            labels=job,
        ),
        "expected_cost_per_work": gauge(
            "orchestrator_job_expected_cost_per_work_usd",
            "Expected cost per reference-GPU-hour of the footprint BidBrain chose last",
            labels=job,
        ),
        "work": gauge(
            "orchestrator_job_work_done_gpu_hours",
            "Work done, in reference-GPU-hours",
            labels=job,
        ),
        "work_total": gauge(
            "orchestrator_job_work_gpu_hours", "The job's work, in reference-GPU-hours", labels=job
        ),
        "evictions": counter(
            "orchestrator_job_evictions",
            "Instances the cloud took back; warned: an interruption notice came first",
            labels=["job_id", "warned"],
        ),
        "launches": counter("orchestrator_job_launches", "Instances launched", labels=job),
        "launch_failures": counter(
            "orchestrator_job_launch_failures",
            "Launch requests the cloud refused (capacity errors and others), by error code",
            labels=["job_id", "code"],
        ),
        "alive": gauge(
            "orchestrator_instances_alive",
            "Instances not ended, by job, tier (reliable: on-demand; transient: spot), "
            "lifecycle, type and zone",
            labels=["job_id", "tier", "lifecycle", "instance_type", "zone"],
        ),
        "price": gauge(
            "orchestrator_spot_price_usd_per_hour",
            "Spot price of each market a running job's BidBrain considered (latest seen); "
            "held: some job holds instances there",
            labels=["instance_type", "zone", "held"],
        ),
        "iterations": counter(
            "orchestrator_job_training_iterations",
            "Training iterations (clocks) completed, as the runtime last reported",
            labels=job,
        ),
        "loss": gauge(
            "orchestrator_job_training_loss", "The model's loss, as last reported", labels=job
        ),
        "reassigned": counter(
            "orchestrator_job_reassigned_work",
            "Work units FlexRR moved from stragglers to faster workers",
            labels=job,
        ),
        "transitions": counter(
            "orchestrator_job_stage_transitions",
            "AgileML stage transitions (ParamServ, ActivePS, ... as the footprint changed)",
            labels=job,
        ),
    }


#: Every metric name /metrics exports (dashboards/grafana is checked against it).
METRIC_NAMES = tuple(sorted(f.name for f in _families().values()))


class StoreCollector:
    """Prometheus collector reading jobs, instances, events, prices and training reports from
    the store (`views.JobFacts`).

    Each scrape reads every job's event log and series. If Redis cannot be read, the scrape
    still succeeds, with `orchestrator_store_up 0` and no job series.
    """

    def __init__(self, store: Store) -> None:
        self._store = store

    def describe(self) -> Iterator[Metric]:
        """The families, without reading the store (called once at registration)."""
        yield from _families().values()

    def collect(self) -> Iterator[Metric]:
        """Read the store and yield every family with its samples."""
        m = _families()
        try:
            facts = [read_facts(self._store, job) for job in self._store.list_jobs()]
            prices = {
                f.job.job_id: self._store.prices(f.job.job_id)
                for f in facts
                if f.job.state is JobState.RUNNING
            }
        except StoreError:
            logger.warning("metrics scrape could not read the store", exc_info=True)
            m["store_up"].add_metric([], 0.0)
            yield m["store_up"]
            return
        m["store_up"].add_metric([], 1.0)
        by_state = Counter(f.job.state for f in facts)
        for state in JobState:
            m["jobs"].add_metric([state.value], float(by_state[state]))
        held: set[str] = set()
        for f in facts:
            _add_job_samples(m, f)
            held |= {f"{r.instance_type}@{r.zone}" for r in f.alive}
        latest: dict[str, float] = {}
        for snapshots in prices.values():
            if snapshots:
                latest.update(snapshots[-1].prices)
        for market, price in sorted(latest.items()):
            instance_type, _, zone = market.partition("@")
            m["price"].add_metric([instance_type, zone, str(market in held).lower()], price)
        yield from m.values()


def _add_job_samples(m: dict[str, Any], f: JobFacts) -> None:
    job = [f.job.job_id]
    m["spent"].add_metric(job, f.job.spent_usd)
    m["budget"].add_metric(job, f.job.budget_usd)
    m["work"].add_metric(job, f.job.work_done_gpu_hours)
    for family, value in (
        ("work_total", f.work_gpu_hours),
        ("projected", f.projected_cost_usd),
        ("cost_per_work", f.cost_per_work_usd),
        ("expected_cost_per_work", f.expected_cost_per_work_usd),
    ):
        if value is not None:
            m[family].add_metric(job, value)
    m["evictions"].add_metric([*job, "true"], float(f.evictions_warned))
    m["evictions"].add_metric([*job, "false"], float(f.evictions_unwarned))
    m["launches"].add_metric(job, float(f.launches))
    for code, count in sorted(f.launch_failures.items()):
        m["launch_failures"].add_metric([*job, code], float(count))
    alive = Counter((tier_of(r), r.lifecycle, r.instance_type, r.zone) for r in f.alive)
    for labels, count in sorted(alive.items()):
        m["alive"].add_metric([*job, *labels], float(count))
    if f.training is not None:
        m["iterations"].add_metric(job, float(f.training.iteration))
        m["reassigned"].add_metric(job, float(f.training.reassigned))
        m["transitions"].add_metric(job, float(f.training.stage_transitions))
        if f.training.loss is not None:
            m["loss"].add_metric(job, f.training.loss)


# --- the app


def create_app(
    store: Store,
    settings: Settings,
    *,
    clock: Clock = time.time,
    new_id: Callable[[], str] = new_job_id,
    on_notice: Callable[[InterruptionNotice], None] | None = None,
) -> FastAPI:
    """The API over `store`. `clock` stamps submissions and cancels; `new_id` draws job ids;
    `on_notice` receives interruption notices posted to `/v1/notices` (the controller's).

    Raises:
        UserError: `settings.api.token` is not set (the API refuses to run unauthenticated).
    """
    token = settings.api.require_token()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store))
    app = FastAPI(
        title="orchestrator",
        version=__version__,
        summary="Elastic spot-instance training orchestrator: jobs, budgets, metrics",
    )
    _install_error_handlers(app)
    authorized = [Depends(_bearer_auth(token))]

    @app.post("/v1/jobs", status_code=201, dependencies=authorized)
    def submit(submission: JobSubmission) -> dict[str, Any]:
        """Queue a job. 422 names the first invalid field."""
        return _job_json(submit_job(store, submission, now_s=clock(), new_id=new_id))

    @app.get("/v1/jobs")
    def list_jobs(state: JobState | None = None) -> dict[str, Any]:
        """Every job, or those in `state`, oldest submission first."""
        jobs = store.list_jobs(None if state is None else [state])
        return {"jobs": [_job_json(job) for job in jobs]}

    @app.get("/v1/jobs/{job_id}")
    def get_job(job_id: str) -> dict[str, Any]:
        """The job's record: state, budget, spend, work done, version, message, spec."""
        return _job_json(store.get_job(job_id))

    @app.post("/v1/jobs/{job_id}/cancel", dependencies=authorized)
    def cancel(job_id: str, response: Response) -> dict[str, Any]:
        """Cancel: 200 when cancelled, 202 when the controller must still release instances."""
        job = cancel_job(store, job_id, now_s=clock())
        response.status_code = 200 if job.state.is_terminal else 202
        return _job_json(job)

    @app.get("/v1/jobs/{job_id}/cost")
    def cost(job_id: str) -> dict[str, Any]:
        """Spent, budget, remaining, projected cost, evictions and ledger entries."""
        return job_cost(store, job_id)

    @app.get("/v1/jobs/{job_id}/events")
    def events(
        job_id: str,
        since: Annotated[str, Query(pattern=_STREAM_ID_RE.pattern)] = "-",
        limit: Annotated[int, Query(ge=1, le=MAX_EVENTS_LIMIT)] = DEFAULT_EVENTS_LIMIT,
    ) -> dict[str, Any]:
        """Events strictly after `since` (a previous `next_since`), oldest first."""
        store.get_job(job_id)  # 404 for an unknown job rather than an empty list
        entries = store.events(job_id, since_id=since, count=limit)
        return {
            "events": [{"id": eid, **e.model_dump(mode="json")} for eid, e in entries],
            "next_since": entries[-1][0] if entries else since,
        }

    @app.post("/v1/notices", status_code=202, dependencies=authorized)
    def notice(event: dict[str, Any]) -> dict[str, Any]:
        """An EventBridge spot interruption warning or rebalance recommendation, forwarded by
        the node agent or an EventBridge rule. 422 names the field at fault; 503 if no
        controller runs in this process."""
        parsed = InterruptionNotice.from_eventbridge(event, received_at_s=clock())
        if on_notice is None:
            raise HTTPException(status_code=503, detail="no controller runs behind this API")
        on_notice(parsed)
        return {"accepted": parsed.instance_id, "kind": parsed.kind}

    @app.post("/v1/jobs/{job_id}/training", status_code=202, dependencies=authorized)
    def training(job_id: str, body: TrainingBody) -> dict[str, Any]:
        """The job's training runtime reports its progress (iteration, loss, FlexRR and
        AgileML counters); stamped with the controller's clock."""
        store.get_job(job_id)  # 404 for an unknown job
        report = TrainingReport(at_s=clock(), **body.model_dump())
        store.append_training(job_id, report)
        return {"accepted": job_id, "at_s": report.at_s}

    @app.get("/v1/dashboard")
    def dashboard_fleet() -> dict[str, Any]:
        """Every job's summary for the dashboard (static/CONTRACT.md)."""
        return fleet(store, clock())

    @app.get("/v1/jobs/{job_id}/dashboard")
    def dashboard_job(job_id: str) -> dict[str, Any]:
        """One job's summary and series for the dashboard (static/CONTRACT.md)."""
        return job_dashboard(store, job_id, clock())

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("dashboard")

    @app.get("/dashboard", response_class=HTMLResponse)
    def dashboard_page() -> HTMLResponse:
        """The live dashboard: the fleet, one job's spend, prices, nodes, training, events."""
        return HTMLResponse(dashboard_html())

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/healthz", response_model=None)
    def healthz() -> dict[str, Any] | JSONResponse:
        """200 {"status": "ok"} when Redis answers PING, else 503 {"status": "degraded"}."""
        try:
            store.ping()
        except StoreError as exc:
            body = {"status": "degraded", "redis": "unavailable", **error_body(_as_user(exc))}
            return JSONResponse(body, status_code=503)
        return {"status": "ok", "redis": "ok", "controller_id": settings.controller_id}

    @app.get("/metrics", response_class=Response)
    def metrics() -> Response:
        """Prometheus text exposition, read from the store now."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _bearer_auth(token: SecretStr) -> Callable[[Request], None]:
    """A dependency refusing requests without `Authorization: Bearer <token>` (401/403)."""
    expected = token.get_secret_value().encode()

    def check(request: Request) -> None:
        header = request.headers.get("authorization")
        if header is None:
            raise ApiError(
                401,
                "this call needs an API token and none was sent",
                fix=_AUTH_FIX,
                headers={"WWW-Authenticate": "Bearer"},
            )
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise ApiError(
                401,
                "the Authorization header is not `Bearer <token>`",
                fix=_AUTH_FIX,
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not hmac.compare_digest(given.strip().encode(), expected):
            raise ApiError(
                403,
                "the API token is wrong",
                fix=f"use the token the server was started with ({API_TOKEN_ENV})",
            )

    return check


def _as_user(exc: Exception) -> UserError:
    return exc if isinstance(exc, UserError) else UserError(str(exc))


def _error(
    status_code: int, exc: UserError, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=status_code, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    """Map every error to the JSON error document and its status code."""

    def api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return _error(exc.status_code, exc, exc.headers)

    def invalid(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = list(exc.errors())
        in_body = bool(errors) and tuple(errors[0].get("loc", ()))[:1] == ("body",)
        return _error(
            422, validation_error(errors, skip_loc=1, what="job spec" if in_body else "request")
        )

    def not_found(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, NotFoundError)
        fix = "list jobs with GET /v1/jobs (`orchestrator jobs`)" if exc.kind == "job" else ""
        return _error(404, UserError(str(exc), fix=fix))

    def unavailable(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StoreUnavailableError)
        return _error(503, exc)

    def job_ended(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, JobEndedError)
        return _error(409, exc)

    def illegal(_: Request, exc: Exception) -> JSONResponse:
        return _error(409, UserError(str(exc), fix="read the job's state and try again"))

    def conflict(_: Request, exc: Exception) -> JSONResponse:
        return _error(
            409,
            UserError(
                "the job kept changing while this request was handled; nothing was changed",
                fix="try again",
            ),
        )

    def user_error(_: Request, exc: Exception) -> JSONResponse:
        return _error(400, _as_user(exc))

    def store_error(_: Request, exc: Exception) -> JSONResponse:
        logger.error("store error", exc_info=exc)
        return _error(500, UserError(f"store error: {exc}"))

    def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return _error(exc.status_code, UserError(str(exc.detail)), exc.headers)

    def internal(_: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error in the API", exc_info=exc)
        return _error(500, UserError("internal server error", fix="see the API server's log"))

    handlers: dict[type[Exception], Callable[[Request, Exception], JSONResponse]] = {
        ApiError: api_error,
        RequestValidationError: invalid,
        NotFoundError: not_found,
        StoreUnavailableError: unavailable,
        JobEndedError: job_ended,
        IllegalTransitionError: illegal,
        ConflictError: conflict,
        StoreError: store_error,
        UserError: user_error,
        StarletteHTTPException: http_error,
        Exception: internal,
    }
    for kind, handler in handlers.items():
        app.add_exception_handler(kind, handler)
