"""`ApiClient`: the CLI's client of the controller's HTTP API (httpx, synchronous).

Every failure comes back as a `UserError` the CLI prints with its fix (exit 2): the API's JSON
error document keeps its message, field and fix (`ApiResponseError`, with the status code); a
controller that cannot be reached says so and how to start one. Nothing is retried: a timed-out
submit may or may not have been applied, and the message says to check.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx
from pydantic import SecretStr

from orchestrator.errors import UserError
from orchestrator.settings import API_CA_CERT_ENV as CA_CERT_ENV

DOWNLOAD_TIMEOUT_S = 300.0  # weights and checkpoints are large
DEFAULT_TIMEOUT_S = 5.0  # the API answers from Redis in milliseconds; 5 s means it is stuck
_MAX_QUOTED_BODY_CHARS = 200
_START_FIX = (
    "start the controller with `orchestrator controller start` (or only the API: "
    "`orchestrator api serve`), or point --api / ORCHESTRATOR_API__URL at a running one"
)


class ApiResponseError(UserError):
    """The API refused a request (4xx) or failed it (5xx).

    Attributes:
        status_code: the HTTP status.
        (message, field, fix: from the API's error document.)
    """

    def __init__(
        self, status_code: int, message: str, *, fix: str = "", field: str | None = None
    ) -> None:
        self.status_code = status_code
        super().__init__(message, fix=fix, field=field)


class ApiClient:
    """Calls the API at `base_url`, sending `token` as a bearer token when given.

    Use it as a context manager (or call `close`). `transport` replaces the network (tests:
    `httpx.MockTransport(handler)`).

    Every method raises `UserError` when the API cannot be reached or does not answer within
    `timeout_s`, and `ApiResponseError` (a `UserError`) when it answers with an error.
    """

    def __init__(
        self,
        base_url: str,
        token: str | SecretStr | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        ca_cert: Path | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        secret = token.get_secret_value() if isinstance(token, SecretStr) else token
        headers = {"Accept": "application/json"}
        if secret:
            headers["Authorization"] = f"Bearer {secret}"
        try:
            verify = ssl.create_default_context(cafile=ca_cert) if ca_cert else True
        except (OSError, ssl.SSLError) as exc:
            raise UserError(
                f"cannot read the CA certificate {ca_cert}: {exc}",
                fix=f"point {CA_CERT_ENV} at a PEM certificate (for a self-signed API: its own)",
                field=CA_CERT_ENV,
            ) from None
        try:
            self._http = httpx.Client(
                base_url=self.base_url,
                headers=headers,
                timeout=timeout_s,
                transport=transport,
                verify=verify,
            )
        except (httpx.InvalidURL, ValueError) as exc:
            raise _bad_url(self.base_url, exc) from None

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    # --- jobs

    def submit(self, submission: Mapping[str, Any]) -> dict[str, Any]:
        """Queue a job (a `JobSubmission` as JSON); returns the new job record."""
        return dict(self._call("POST", "/v1/jobs", json=dict(submission)))

    def list_jobs(self, state: str | None = None) -> list[dict[str, Any]]:
        """Every job, or those in `state`, oldest submission first."""
        params = {"state": state} if state is not None else None
        return list(self._call("GET", "/v1/jobs", params=params)["jobs"])

    def get_job(self, job_id: str) -> dict[str, Any]:
        """The job record (404 -> `ApiResponseError`)."""
        return dict(self._call("GET", _job_path(job_id)))

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Cancel the job; returns it (cancelled, or cancelling while instances are released).

        A job that has already ended is refused (`ApiResponseError`, 409).
        """
        return dict(self._call("POST", _job_path(job_id, "cancel")))

    def cost(self, job_id: str) -> dict[str, Any]:
        """Spent, budget, remaining and projected USD, evictions and ledger entries."""
        return dict(self._call("GET", _job_path(job_id, "cost")))

    def events(self, job_id: str, since: str = "-", limit: int | None = None) -> dict[str, Any]:
        """`{"events": [...], "next_since": id}`: the job's events after `since`."""
        params: dict[str, str | int] = {"since": since}
        if limit is not None:
            params["limit"] = limit
        return dict(self._call("GET", _job_path(job_id, "events"), params=params))

    def log_names(self, job_id: str) -> list[str]:
        """The instances (nodes) of the job whose logs the artifact store holds."""
        return [str(n) for n in self._call("GET", _job_path(job_id, "logs"))["nodes"]]

    def node_log(self, job_id: str, node: str, tail_bytes: int | None = None) -> tuple[str, int]:
        """The end of one instance's log and the whole log's size in bytes.

        Raises:
            ApiResponseError: 404 when there is no such log (yet).
        """
        params = {"tail_bytes": tail_bytes} if tail_bytes is not None else None
        path = _job_path(job_id, "logs") + f"/{quote(node, safe='')}"
        response = self._send("GET", path, params=params)
        if not response.is_success:
            raise _response_error(response)
        return response.text, int(response.headers.get("X-Log-Bytes", len(response.content)))

    def fleet_dashboard(self) -> dict[str, Any]:
        """Every job's dashboard summary (`GET /v1/dashboard`)."""
        return dict(self._call("GET", "/v1/dashboard"))

    def job_dashboard(self, job_id: str) -> dict[str, Any]:
        """One job's dashboard data: summary and series (`GET /v1/jobs/{id}/dashboard`)."""
        return dict(self._call("GET", _job_path(job_id, "dashboard")))

    def health(self) -> dict[str, Any]:
        """The health document; a degraded controller (503) is returned, not raised."""
        return dict(self._call("GET", "/healthz", accept=(200, 503)))

    # --- internals

    def download(self, job_id: str, what: str, dest: Path) -> str:
        """Write the job's `weights` (safetensors) or newest `checkpoint` (a tar) to `dest`;
        returns where they came from (`final`, or a checkpoint's name).

        Raises:
            ApiResponseError: 404 when the job has none yet (with when there will be).
        """
        response = self._send("GET", _job_path(job_id, what), timeout_s=DOWNLOAD_TIMEOUT_S)
        if not response.is_success:
            raise _response_error(response)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        try:
            tmp.write_bytes(response.content)
            tmp.replace(dest)
        finally:
            tmp.unlink(missing_ok=True)
        return response.headers.get("X-Orchestrator-Weights", "")

    def upload_code(self, ref: str, packed: bytes) -> dict[str, Any]:
        """Store a job's packed code (`artifacts.code.pack_code`) under its digest `ref`."""
        response = self._send(
            "PUT", f"/v1/code/{quote(ref, safe=':')}", content=packed,
            timeout_s=DOWNLOAD_TIMEOUT_S,
        )  # fmt: skip
        if not response.is_success:
            raise _response_error(response)
        return dict(response.json())

    def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str | int] | None = None,
        accept: tuple[int, ...] = (),
    ) -> Any:
        response = self._send(method, path, json=json, params=params)
        if response.is_success or response.status_code in accept:
            try:
                return response.json()
            except ValueError:
                raise _not_ours(response) from None
        raise _response_error(response)

    def _send(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str | int] | None = None,
        timeout_s: float | None = None,
        content: bytes | None = None,
    ) -> httpx.Response:
        """The response, whatever its status; a network failure as a `UserError`."""
        url = f"{self.base_url}{path}"
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        try:
            return self._http.request(
                method, path, json=json, params=params, content=content, timeout=timeout
            )
        except httpx.TimeoutException as exc:
            if isinstance(exc, httpx.ConnectTimeout):
                raise _unreachable(self.base_url, "connection timed out") from None
            maybe = " (it may or may not have been applied)" if method != "GET" else ""
            raise UserError(
                f"the controller API at {url} did not answer within {timeout:g} s{maybe}",
                fix="check the API server's log, and list jobs (`orchestrator jobs`) before "
                "submitting again",
            ) from None
        except httpx.ConnectError as exc:
            if "CERTIFICATE_VERIFY_FAILED" in str(exc):
                raise UserError(
                    f"the controller API at {self.base_url} has a certificate this client does "
                    f"not trust ({exc})",
                    fix=f"set {CA_CERT_ENV} to the CA that signed it (a self-signed "
                    "certificate: the server's own PEM; the AWS stack's: see its outputs)",
                    field=CA_CERT_ENV,
                ) from None
            raise _unreachable(self.base_url, str(exc) or type(exc).__name__) from None
        except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
            raise _bad_url(self.base_url, exc) from None
        except httpx.HTTPError as exc:
            raise UserError(
                f"request to the controller API at {url} failed: {exc}",
                fix="check that --api / ORCHESTRATOR_API__URL points at the orchestrator API",
            ) from None


def _job_path(job_id: str, action: str | None = None) -> str:
    path = f"/v1/jobs/{quote(job_id, safe='')}"
    return f"{path}/{action}" if action else path


def _unreachable(base_url: str, cause: str) -> UserError:
    return UserError(
        f"the controller API is not reachable at {base_url}: {cause}",
        fix=_START_FIX,
        field="--api",
    )


def _bad_url(base_url: str, exc: Exception) -> UserError:
    return UserError(
        f"{base_url!r} is not a usable API URL: {exc}",
        fix="pass --api (or set ORCHESTRATOR_API__URL) like http://127.0.0.1:8750",
        field="--api",
    )


def _not_ours(response: httpx.Response) -> ApiResponseError:
    body = response.text[:_MAX_QUOTED_BODY_CHARS]
    return ApiResponseError(
        response.status_code,
        f"{response.request.url} answered {response.status_code} {response.reason_phrase} "
        f"without the orchestrator's JSON: {body!r}",
        fix="check that --api / ORCHESTRATOR_API__URL points at the orchestrator API",
    )


def _response_error(response: httpx.Response) -> ApiResponseError:
    """The API's `{"error": {message, field, fix}}` as an exception (or a generic one)."""
    try:
        error = response.json()["error"]
        message = str(error["message"])
    except (ValueError, KeyError, TypeError):
        return _not_ours(response)
    return ApiResponseError(
        response.status_code,
        message,
        fix=str(error.get("fix") or ""),
        field=error.get("field"),
    )
