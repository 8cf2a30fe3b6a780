"""The `orchestrator` command line: each command parses its options, calls a function of the
package that does the work, and renders what it returns.

User errors (bad files, bad options) print what is wrong and what to do, with no traceback,
and exit with code 2; any other error prints one line and exits 1; `--debug` shows the
traceback.

    console.py     the entry point's work: every command registered, errors to exit codes
    app.py         the typer app, the consoles, option-name mapping for errors
    train.py       train (a user's job on local processes)
    simulate.py    simulate, ledger-check           market.py   risk, catalog
    demo.py        demo                             plan.py     plan
    local.py       local up, local down, local status
    jobs.py        submit, jobs, job, report, cancel, api serve
    logs.py        logs (the job's instances' logs, through the API)
    controller.py  controller start                 deploy.py   deploy, worker start
"""

from __future__ import annotations


def main() -> None:
    """Entry point of the console script (`console.main`). The commands are imported when it
    is called, not with this package: a process that `multiprocessing` starts under the script
    (a node, a stage, an instance agent) imports the script's main module again, and with it
    this package; with every command it took 0.2-0.3 s of CPU in each such process."""
    from orchestrator.cli.console import main as run

    run()
