"""`orchestrator logs`: a job's instances' logs through the controller's API (read token), as
their agents shipped them to the artifact store (`agent.logship`): each node's milestones and
errors with their tracebacks, also once its instance is gone."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from orchestrator.cli.app import app, err, out
from orchestrator.cli.jobs import ApiOption, TokenOption, _client

#: Seconds between two reads of a log with `--follow`.
FOLLOW_POLL_S = 2.0
#: How much of each log's end is printed unless `--tail` says otherwise.
DEFAULT_TAIL_BYTES = 20_000


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
        typer.Option("--tail", help="Bytes of each log's end to print.", min=1, max=1_000_000),
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
        sizes = {}
        for name in names:
            text, sizes[name] = client.node_log(job_id, name, tail)
            if node is None:
                out.rule(f"{name} ({sizes[name]} bytes)")
            out.print(text, end="", markup=False, highlight=False, soft_wrap=True)
        while follow:
            time.sleep(FOLLOW_POLL_S)
            text, size = client.node_log(job_id, names[0], 1_000_000)
            new = size - sizes[names[0]]
            if new > 0:
                out.print(text[-new:], end="", markup=False, highlight=False, soft_wrap=True)
            sizes[names[0]] = size
