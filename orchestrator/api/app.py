"""The controller's HTTP API: submit, list, inspect and cancel jobs; health; Prometheus metrics.

Access: (write) needs the API token; (read) the API token or the read-only one, as
`Authorization: Bearer <token>`, or the dashboard's cookie; (open) nothing.

    POST /v1/jobs                     (write) a JobSubmission -> 201, the new queued job
    GET  /v1/jobs[?state=S]           (read) {"jobs": [job, ...]}, oldest submission first
    GET  /v1/jobs/{id}                (read) the job
    POST /v1/jobs/{id}/cancel         (write) queued -> cancelled (200); running -> cancelling
                                      (202: the controller releases its instances, then ends it)
    GET  /v1/jobs/{id}/cost           (read) spent, budget, projected cost, evictions, ledger
    GET  /v1/jobs/{id}/events[?since=ID&limit=N]   (read)
    GET  /v1/jobs/{id}/weights        (write) model.safetensors: final, else the newest
                                      checkpoint's
    GET  /v1/jobs/{id}/checkpoint     (write) the newest checkpoint, a tar of its folder
    POST /v1/jobs/{id}/training       (write) the runtime's progress: iteration, loss, counters
    GET  /v1/dashboard                (read) every job's summary (static/CONTRACT.md)
    GET  /v1/jobs/{id}/dashboard      (read) one job's summary and series (static/CONTRACT.md)
    GET  /dashboard[?token=T]         (open) the live dashboard page (assets under /static);
                                      with a token, sets the read-only cookie and redirects
    GET  /healthz                     (open) 200 when Redis answers, else 503 "degraded"
    GET  /metrics                     (read) Prometheus text, read from the store at scrape time

The routes only parse and render; what a request does to the store is decided in
`operations.py` (the store is the only state: the app keeps none but what it has folded of
the append-only event logs, `views.EventTallies`, so any number of API processes may serve the
same Redis), the metrics are read in `metrics.py`, and every error is
mapped to JSON in `errors.py` (`orchestrator.api.error_body`): 401/403 auth, 404 unknown
job, 409 illegal move or lost race, 422 invalid input naming the field, 400 other user errors,
503 Redis unreachable, 500 anything else.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Path, Query, Request, Response
from fastapi.params import Depends as DependsParam
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from orchestrator import __version__
from orchestrator.api import error_body
from orchestrator.api.errors import (
    COOKIE_MAX_AGE_S,
    READ_COOKIE,
    READ_FIX,
    ApiError,
    TokenAuth,
    as_user,
    install_error_handlers,
    redact_access_log,
)
from orchestrator.api.files import (
    DEFAULT_LOG_TAIL,
    check_code_uploaded,
    checkpoint_tar,
    file_response,
    job_log,
    job_log_names,
    read_limited,
    save_code,
    weights_folder,
)
from orchestrator.api.health import TickHealth
from orchestrator.api.metrics import StoreCollector
from orchestrator.api.operations import cancel_job, job_cost, new_job_id, submit_job
from orchestrator.api.views import EventTallies, fleet, job_dashboard
from orchestrator.artifacts import WEIGHTS, Folder, folder_at
from orchestrator.artifacts.code import MAX_CODE_BYTES
from orchestrator.artifacts.jobs import MAX_LOG_BYTES
from orchestrator.bidbrain.errors import DeadlineError
from orchestrator.cloud.notices import InterruptionNotice
from orchestrator.dashboard.page import STATIC_DIR, dashboard_html
from orchestrator.jobspec import JobSubmission
from orchestrator.settings import Settings
from orchestrator.store import JobRecord, JobState, Store, StoreError

Clock = Callable[[], float]

WEIGHTS_HEADER = "X-Orchestrator-Weights"  # final, or the checkpoint the weights come from
DEFAULT_EVENTS_LIMIT = 1000
MAX_EVENTS_LIMIT = 10_000
#: "-", "<ms>" or "<ms>-<seq>": at most 19 digits each, so always within Redis's 64-bit ids.
_STREAM_ID_RE = re.compile(r"^(-|\d{1,19}(-\d{1,19})?)$")


def create_app(
    store: Store,
    settings: Settings,
    *,
    clock: Clock = time.time,
    new_id: Callable[[], str] = new_job_id,
    on_notice: Callable[[InterruptionNotice], None] | None = None,
    tick_health: Callable[[], TickHealth] | None = None,
) -> FastAPI:
    """The API over `store`. `clock` stamps submissions and cancels; `new_id` draws job ids;
    `on_notice` receives interruption notices posted to `/v1/notices` (the controller's);
    `tick_health` says how the controller's ticks go, when it runs in this process (`/healthz`
    is degraded after a few failed in a row; `/metrics` counts them).

    Raises:
        UserError: `settings.api.token` is not set (the API refuses to run unauthenticated).
    """
    auth = TokenAuth(settings.api.require_token(), settings.api.read_token)  # wall time
    redact_access_log()  # a dashboard link's ?token= never reaches the access log
    writes, reads = [Depends(auth.write)], [Depends(auth.read)]
    app = FastAPI(
        title="orchestrator",
        version=__version__,
        summary="Elastic spot-instance training orchestrator: jobs, budgets, metrics",
    )
    install_error_handlers(app)
    artifacts = folder_at(settings.training.store_location)
    app.include_router(_job_routes(store, clock, new_id, (writes, reads), artifacts))
    app.include_router(_code_routes(writes, artifacts))
    app.include_router(_log_routes(store, reads, artifacts))
    app.include_router(_runtime_routes(store, clock, on_notice, writes))
    tallies = EventTallies()  # the dashboard's and /metrics' reads of the event logs
    app.include_router(_dashboard_routes(store, clock, auth, reads, tallies))
    app.include_router(_health_routes(store, settings, reads, tallies, tick_health))
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app


def _job_json(store: Store, job: JobRecord) -> dict[str, Any]:
    """The job as stored, its `spent_usd` live (billed + accrued on its running instances;
    `billed_usd` is the ledger's sum alone)."""
    return {
        **job.model_dump(mode="json"),
        "spent_usd": store.live_spend_usd(job.job_id),
        "billed_usd": job.spent_usd,
    }


def _job_routes(
    store: Store,
    clock: Clock,
    new_id: Callable[[], str],
    access: tuple[list[DependsParam], list[DependsParam]],
    artifacts_root: Folder,
) -> APIRouter:
    """Submit, list, read, cancel; cost, events; weights and checkpoints."""
    router = APIRouter()
    authorized, reads = access

    @router.post("/v1/jobs", status_code=201, dependencies=authorized)
    def submit(submission: JobSubmission) -> dict[str, Any]:
        """Queue a job. 422 names the first invalid field."""
        check_code_uploaded(artifacts_root, (submission.training or {}).get("code"))
        try:
            return _job_json(store, submit_job(store, submission, now_s=clock(), new_id=new_id))
        except DeadlineError as exc:  # a valid spec the deadline's numbers refuse
            raise ApiError(
                422, f"{exc.field}: {exc.message}", fix=exc.fix, field=exc.field
            ) from None

    @router.get("/v1/jobs", dependencies=reads)
    def list_jobs(state: JobState | None = None) -> dict[str, Any]:
        """Every job, or those in `state`, oldest submission first."""
        jobs = store.list_jobs(None if state is None else [state])
        return {"jobs": [_job_json(store, job) for job in jobs]}

    @router.get("/v1/jobs/{job_id}", dependencies=reads)
    def get_job(job_id: str) -> dict[str, Any]:
        """The job's record: state, budget, spend, work done, version, message, spec."""
        return _job_json(store, store.get_job(job_id))

    @router.post("/v1/jobs/{job_id}/cancel", dependencies=authorized)
    def cancel(job_id: str, response: Response) -> dict[str, Any]:
        """Cancel: 200 when cancelled, 202 when the controller must still release instances."""
        job = cancel_job(store, job_id, now_s=clock())
        response.status_code = 200 if job.state.is_terminal else 202
        return _job_json(store, job)

    @router.get("/v1/jobs/{job_id}/cost", dependencies=reads)
    def cost(job_id: str) -> dict[str, Any]:
        """Spent, budget, remaining, projected cost, evictions and ledger entries."""
        return job_cost(store, job_id)

    @router.get("/v1/jobs/{job_id}/weights", dependencies=authorized, response_model=None)
    def weights(job_id: str) -> Response:
        """The job's weights as safetensors: the final ones, else the newest checkpoint's
        (the `X-Orchestrator-Weights` header says which)."""
        store.get_job(job_id)
        folder, label = weights_folder(artifacts_root, job_id)
        return file_response(folder, WEIGHTS, "application/octet-stream", {WEIGHTS_HEADER: label})

    @router.get("/v1/jobs/{job_id}/checkpoint", dependencies=authorized, response_model=None)
    def checkpoint(job_id: str) -> FileResponse:
        """The job's newest checkpoint (a tar of its ckpt-<clock> folder), to resume from
        (`orchestrator train JOB --resume DIR`) or to keep."""
        store.get_job(job_id)
        path, label = checkpoint_tar(artifacts_root, job_id)
        return FileResponse(
            path,
            media_type="application/x-tar",
            headers={WEIGHTS_HEADER: label},
            background=BackgroundTask(path.unlink, missing_ok=True),
        )

    @router.get("/v1/jobs/{job_id}/events", dependencies=reads)
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

    return router


def _code_routes(authorized: list[DependsParam], artifacts_root: Folder) -> APIRouter:
    """Uploads of job code into the artifact store."""
    router = APIRouter()

    @router.put("/v1/code/{ref}", status_code=201, dependencies=authorized)
    async def upload_code(ref: str, request: Request) -> dict[str, Any]:
        """Store a job's packed code (`orchestrator submit` uploads it) under its digest
        `sha256:<hex>`; a job's training section then names it as its `code`."""
        body = await read_limited(request, MAX_CODE_BYTES)
        stored = await run_in_threadpool(save_code, artifacts_root, ref, body)  # S3: a PUT
        return {"code": stored, "bytes": len(body)}

    return router


def _log_routes(store: Store, reads: list[DependsParam], artifacts_root: Folder) -> APIRouter:
    """The job's instances' logs, as their agents shipped them (`agent.logship`)."""
    router = APIRouter()

    @router.get("/v1/jobs/{job_id}/logs", dependencies=reads)
    def log_names(job_id: str) -> dict[str, Any]:
        """The instances (nodes) whose logs the job's artifact store holds."""
        store.get_job(job_id)
        return {"nodes": job_log_names(artifacts_root, job_id)}

    @router.get("/v1/jobs/{job_id}/logs/{node}", dependencies=reads, response_model=None)
    def node_log(
        job_id: str,
        node: Annotated[str, Path(pattern=r"^[A-Za-z0-9._-]{1,128}$")],
        tail_bytes: Annotated[int, Query(ge=1, le=MAX_LOG_BYTES)] = DEFAULT_LOG_TAIL,
    ) -> Response:
        """The end of one instance's log (`tail_bytes` of it), as text; `X-Log-Bytes` says
        how long the whole is."""
        store.get_job(job_id)
        text, size = job_log(artifacts_root, job_id, node, tail_bytes)
        return Response(
            text, media_type="text/plain; charset=utf-8", headers={"X-Log-Bytes": str(size)}
        )

    return router


def _runtime_routes(
    store: Store,
    clock: Clock,
    on_notice: Callable[[InterruptionNotice], None] | None,
    authorized: list[DependsParam],
) -> APIRouter:
    """What the cloud and the training runtime tell the controller: notices, training."""
    router = APIRouter()

    @router.post("/v1/notices", status_code=202, dependencies=authorized)
    def notice(event: dict[str, Any]) -> dict[str, Any]:
        """An EventBridge spot interruption warning or rebalance recommendation, forwarded by
        the instance agent or an EventBridge rule. 422 names the field at fault; 503 if no
        controller runs in this process."""
        parsed = InterruptionNotice.from_eventbridge(event, received_at_s=clock())
        if on_notice is None:
            raise HTTPException(status_code=503, detail="no controller runs behind this API")
        on_notice(parsed)
        return {"accepted": parsed.instance_id, "kind": parsed.kind}

    return router


def _dashboard_routes(
    store: Store, clock: Clock, auth: TokenAuth, reads: list[DependsParam], tallies: EventTallies
) -> APIRouter:
    """The dashboard's data and page (its assets are mounted under /static)."""
    router = APIRouter()

    @router.get("/v1/dashboard", dependencies=reads)
    def dashboard_fleet() -> dict[str, Any]:
        """Every job's summary for the dashboard (dashboard/static/CONTRACT.md)."""
        return fleet(store, clock(), tallies)

    @router.get("/v1/jobs/{job_id}/dashboard", dependencies=reads)
    def dashboard_job(job_id: str) -> dict[str, Any]:
        """One job's summary and series for the dashboard (dashboard/static/CONTRACT.md)."""
        return job_dashboard(store, job_id, clock())

    @router.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("dashboard")

    @router.get("/dashboard", response_class=HTMLResponse, response_model=None)
    def dashboard_page(
        request: Request, token: Annotated[str | None, Query(max_length=4096)] = None
    ) -> Response:
        """The live dashboard: the fleet, one job's spend, prices, nodes, training, events.
        Opened with `?token=` (the API token or the read-only one), it sets the read-only
        cookie the page's data calls carry, and redirects to itself without the token."""
        if token is None:
            return HTMLResponse(dashboard_html())
        cookie = auth.cookie_for(token)
        if cookie is None:
            raise ApiError(403, "the token in the dashboard's link is wrong", fix=READ_FIX)
        page = RedirectResponse("dashboard", status_code=303)
        page.set_cookie(READ_COOKIE, cookie, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https", max_age=COOKIE_MAX_AGE_S)  # fmt: skip
        return page

    return router


def _health_routes(
    store: Store,
    settings: Settings,
    reads: list[DependsParam],
    tallies: EventTallies,
    tick_health: Callable[[], TickHealth] | None,
) -> APIRouter:
    """Health and Prometheus metrics."""
    router = APIRouter()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store, tallies, tick_health))

    @router.get("/healthz", response_model=None)
    def healthz() -> dict[str, Any] | JSONResponse:
        """200 {"status": "ok"} when Redis answers PING and the controller's ticks work (200
        {"status": "standby"} while another process leads), else 503 {"status": "degraded"}
        with the reason. An API served apart from the controller (`api serve`) cannot see its
        ticks: it says `"controller": "not watched"`."""
        try:
            store.ping()
        except StoreError as exc:
            body = {"status": "degraded", "redis": "unavailable", **error_body(as_user(exc))}
            return JSONResponse(body, status_code=503)
        body = {"status": "ok", "redis": "ok", "controller_id": settings.controller_id}
        health = tick_health() if tick_health is not None else None
        if tick_health is None:
            body["controller"] = "not watched"  # its ticks run where this API cannot see
        if health is not None and health.degraded:
            body.update(status="degraded", controller="failing", reason=health.reason())
            return JSONResponse(body, status_code=503)
        if health is not None and health.standby is not None:
            body.update(status="standby", controller="standby", reason=health.standby)
        return body

    @router.get("/metrics", response_class=Response, dependencies=reads)
    def metrics() -> Response:
        """Prometheus text exposition, read from the store now."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router
