"""`orchestrator logs`: a job's instances' logs through the controller's API (read token), as
their agents shipped them to the artifact store (`agent.logship`): each node's milestones and
errors with their tracebacks, also once its instance is gone."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from orchestrator.artifacts.jobs import MAX_LOG_BYTES
from orchestrator.cli.app import app, err, out
from orchestrator.cli.jobs import ApiOption, TokenOption, _client

#: Seconds between two reads of a log with `--follow`.
FOLLOW_POLL_S = 2.0
#: How much of each log's end is printed unless `--tail` says otherwise.
DEFAULT_TAIL_BYTES = 20_000
#: How much of what `--follow` printed last it looks for in the log read next.
FOLLOW_ANCHOR_CHARS = 400


@app.command("logs")
def logs(
    job_id: Annotated[str, typer.Argument(metavar="ID", help="The job id, e.g. job-1a2b3c4d.")],
    node: Annotated[
        str | None,
        typer.Option("--node", help="One instance's log (its id); default: every one's end."),
    ] = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing the node's new lines.")
    ] = False,
    tail: Annotated[
        int,
        typer.Option("--tail", help="Bytes of each log's end to print.", min=1, max=MAX_LOG_BYTES),
    ] = DEFAULT_TAIL_BYTES,
    api: ApiOption = None,
    token: TokenOption = None,
) -> None:
    """A job's instances' logs: their nodes' milestones, errors and tracebacks."""
    if follow and node is None:
        raise typer.BadParameter("--follow needs --node (one log)", param_hint="--follow")
    with _client(api, token) as client:
        names = [node] if node is not None else client.log_names(job_id)
        if not names:
            err.print(
                f"no logs of {job_id} yet (an instance's agent ships its log every few "
                "seconds once its node has joined)",
                highlight=False,
            )
            return
        text = ""
        for name in names:
            text, size = client.node_log(job_id, name, tail)
            if node is None:
                out.rule(f"{name} ({size} bytes)")
            out.print(text, end="", markup=False, highlight=False, soft_wrap=True)
        while follow:
            time.sleep(FOLLOW_POLL_S)
            latest, _ = client.node_log(job_id, names[0], MAX_LOG_BYTES)
            new = _after(latest, text[-FOLLOW_ANCHOR_CHARS:])
            if new:
                out.print(new, end="", markup=False, highlight=False, soft_wrap=True)
            text = latest


def _after(latest: str, seen_end: str) -> str:
    """What `latest` has after the end of what was printed (`seen_end`): a log kept to its
    last MAX_LOG_BYTES loses its start as it grows, so its size cannot say what is new."""
    if not seen_end:
        return latest
    at = latest.rfind(seen_end)
    return latest if at < 0 else latest[at + len(seen_end) :]
