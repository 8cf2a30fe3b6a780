"""The API's refusals: bearer-token authentication and the mapping of every error to the JSON
error document (`orchestrator.api.error_body`) and its HTTP status."""

from __future__ import annotations

import hmac
import logging
import re
import time
from collections.abc import Callable, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import SecretStr
from starlette.exceptions import HTTPException as StarletteHTTPException

from orchestrator.api import error_body, validation_error
from orchestrator.api.operations import JobEndedError
from orchestrator.errors import UserError
from orchestrator.settings import API_READ_TOKEN_ENV, API_TOKEN_ENV
from orchestrator.store import (
    ConflictError,
    IllegalTransitionError,
    NotFoundError,
    StoreError,
    StoreUnavailableError,
)

logger = logging.getLogger(__name__)

AUTH_FIX = f"send `Authorization: Bearer <token>` (CLI: --token or {API_TOKEN_ENV})"


class ApiError(UserError):
    """A refusal of the wire layer itself (authentication), with its HTTP status."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        fix: str = "",
        headers: Mapping[str, str] | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message, fix=fix, field=field)
        self.status_code = status_code
        self.headers = headers


#: The dashboard's cookie: read access only, whichever token opened the page.
READ_COOKIE = "orchestrator_read"
COOKIE_MAX_AGE_S = 7 * 86400
Clock = Callable[[], float]
READ_FIX = (
    f"send `Authorization: Bearer <token>` with the API token or the read-only one "
    f"({API_READ_TOKEN_ENV}); a browser opens the dashboard once as /dashboard?token=<token>"
)


class TokenAuth:
    """The API's two access levels, as FastAPI dependencies: `write` needs the API token
    (`Authorization: Bearer <token>`); `read` the API token, the read-only token, or the
    dashboard's cookie (which `cookie_for` gives for either token and which reads only)."""

    def __init__(
        self, token: SecretStr, read_token: SecretStr | None = None, *, clock: Clock = time.time
    ) -> None:
        self._token = token.get_secret_value().strip().encode()
        self._read = read_token.get_secret_value().strip().encode() if read_token else None
        self._clock = clock

    def write(self, request: Request) -> None:
        given = _bearer(request, AUTH_FIX)
        if given is None:
            raise ApiError(401, "this call needs an API token and none was sent", fix=AUTH_FIX,
                           headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        if self._read is not None and hmac.compare_digest(given, self._read):
            raise ApiError(
                403,
                "the read-only token cannot change anything or download weights",
                fix=f"send the API token ({API_TOKEN_ENV}) for this call",
            )
        if not hmac.compare_digest(given, self._token):
            raise ApiError(
                403,
                "the API token is wrong",
                fix=f"use the token the server was started with ({API_TOKEN_ENV})",
            )

    def read(self, request: Request) -> None:
        given = _bearer(request, READ_FIX)
        if given is None:
            if self._cookie_valid(request.cookies.get(READ_COOKIE, "")):
                return
            raise ApiError(401, "this call needs a token and none was sent", fix=READ_FIX,
                           headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        if not self._reads(given):
            raise ApiError(403, "the token is wrong", fix=READ_FIX)

    def cookie_for(self, given: str) -> str | None:
        """The dashboard's cookie value for a token given in its link (None: a wrong one):
        when it was issued and a MAC over that keyed by the API token and the read-only token,
        so that changing either voids it; it expires after `COOKIE_MAX_AGE_S`."""
        if not self._reads(given.strip().encode()):
            return None
        issued = str(int(self._clock()))
        return f"{issued}.{self._cookie_mac(issued)}"

    def _cookie_mac(self, issued: str) -> str:
        message = b"orchestrator dashboard read|" + (self._read or b"") + b"|" + issued.encode()
        return hmac.new(self._token, message, "sha256").hexdigest()

    def _cookie_valid(self, cookie: str) -> bool:
        issued, _, mac = cookie.partition(".")
        if not issued.isdigit() or not mac:
            return False
        fresh = 0 <= self._clock() - int(issued) <= COOKIE_MAX_AGE_S
        return fresh and hmac.compare_digest(mac.encode(), self._cookie_mac(issued).encode())

    def _reads(self, given: bytes) -> bool:
        ok = hmac.compare_digest(given, self._token)
        if self._read is not None:
            ok = hmac.compare_digest(given, self._read) or ok
        return ok


def _bearer(request: Request, fix: str) -> bytes | None:
    """The bearer token sent (None: no Authorization header).

    Raises:
        ApiError: 401, the header is not `Bearer <token>`.
    """
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise ApiError(401, "the Authorization header is not `Bearer <token>`", fix=fix,
                       headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
    return given.strip().encode()


class RedactTokens(logging.Filter):
    """Blanks `token=` values in the paths uvicorn's access log writes (a dashboard link
    carries one); installed by `create_app` on the `uvicorn.access` logger."""

    _TOKEN = re.compile(r"(?i)(token=)[^&\s\"]*")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                self._TOKEN.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args
            )
        return True


def redact_access_log() -> None:
    """Install `RedactTokens` on uvicorn's access log (once)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactTokens) for f in access.filters):
        access.addFilter(RedactTokens())


def as_user(exc: Exception) -> UserError:
    return exc if isinstance(exc, UserError) else UserError(str(exc))


def _error(
    status_code: int, exc: UserError, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=status_code, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
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
        return _error(400, as_user(exc))

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
