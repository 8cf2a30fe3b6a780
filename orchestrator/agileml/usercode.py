"""Calls into a user's job code: what they raise becomes a `JobCodeError` naming the call, and
the end of its traceback (the job's own frames) travels with a failure report, so a mistake in
the user's model, loss, optimizer or scheduler stops the run with the user's error instead of
being retried as if the machine had failed.

    with job_code_call("loss(output, target)"):
        value = code.loss(output, target)
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
import zmq

from orchestrator.agileml.errors import AgileMLError
from orchestrator.errors import UserError, clip_middle
from orchestrator.lifecycle import SIGTERM_EXIT_STATUS

#: What a job's code may raise that becomes a JobCodeError: any Exception, and the SystemExit
#: of a script's habits (sys.exit(), argparse); KeyboardInterrupt goes on unwinding
USER_CODE_ERRORS = (Exception, SystemExit)


class JobCodeError(UserError):
    """The job's code cannot be trained: the message names the function and the fix."""


class ReportedJobCodeError(JobCodeError):
    """The job's code failed in another process of the node (a device process): its message
    is that process's `failure_report`, traceback included."""


#: What goes on as it is from inside a call into the job's code: a nested call's error, and
#: the runtime's own (its hooks in the user's backward: the wire, the sockets) and the device's
#: (out of memory: another instance type may fit), which a retry elsewhere can fix.
RUNTIME_ERRORS: tuple[type[BaseException], ...] = (
    JobCodeError, AgileMLError, zmq.ZMQError, torch.OutOfMemoryError,
)  # fmt: skip
#: Lines of a job's traceback that a failure report keeps (its end: where it raised).
TRACEBACK_LINES = 12
#: Bytes of a failure report (message and traceback) a node sends and a controller keeps.
MAX_REPORT_CHARS = 4000
_RUNTIME_DIR = str(Path(__file__).resolve().parents[1])  # the orchestrator package
_SHIPPED_JOBS_DIR = str(Path(_RUNTIME_DIR) / "jobs")  # job files in it are a user's code


def unless_stopping(exc: BaseException) -> None:
    """Re-raise the SystemExit of SIGTERM or SIGHUP (`lifecycle.exit_on_signals`) that arrived
    while the job's code ran: the process is being stopped, not failing."""
    if isinstance(exc, SystemExit) and exc.code == SIGTERM_EXIT_STATUS:
        raise exc


@contextlib.contextmanager
def job_code_call(what: str, *, verb: str = "raised", fix: str = "") -> Iterator[None]:
    """Run a call into the job's code: what it raises (an Exception, or the SystemExit of
    `sys.exit()`) becomes a JobCodeError "`what` `verb` Type: message`fix`"; the SystemExit
    of a stopping signal goes on unwinding. A JobCodeError raised inside (a nested call) and
    the runtime's own errors (`AgileMLError`: a hook of the runtime's that failed inside the
    user's backward, say) go on as they are."""
    try:
        yield
    except RUNTIME_ERRORS:
        raise
    except USER_CODE_ERRORS as exc:
        unless_stopping(exc)
        raise JobCodeError(f"{what} {verb} {type(exc).__name__}: {exc}{fix}") from exc


def user_traceback(exc: BaseException, lines: int = TRACEBACK_LINES) -> str:
    """The end of the traceback of what the job's code raised (a JobCodeError's cause, else
    `exc` itself), without the runtime's own frames: what a user needs to find the mistake."""
    cause = exc.__cause__ if isinstance(exc, JobCodeError) and exc.__cause__ else exc
    kept: list[str] = []
    for frame in traceback.extract_tb(cause.__traceback__):
        ours = frame.filename.startswith(_RUNTIME_DIR)
        if ours and not frame.filename.startswith(_SHIPPED_JOBS_DIR):
            continue
        kept.append(f'  File "{frame.filename}", line {frame.lineno}, in {frame.name}')
        if frame.line:
            kept.append(f"    {frame.line}")
    kept += [line.rstrip("\n") for line in traceback.format_exception_only(cause)[-1:]]
    tail = "\n".join(kept[-lines:])
    return f"Traceback (the job's frames, most recent call last):\n{tail}"


def failure_report(exc: JobCodeError) -> str:
    """What a node reports of a job-code error: the message, then the traceback's end,
    at most `MAX_REPORT_CHARS` (the message's start and the traceback's end kept)."""
    if isinstance(exc, ReportedJobCodeError):
        return clip_middle(str(exc), MAX_REPORT_CHARS)
    return clip_middle(f"{exc}\n{user_traceback(exc)}", MAX_REPORT_CHARS)
