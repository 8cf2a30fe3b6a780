"""`orchestrator local up | down | status`: an offline world for your own jobs.

`local up` starts the offline world (`orchestrator.world`: Redis, moto EC2 and S3, replayed
prices and evictions, the controller as `controller start` builds it, a local instance agent
training for real on every instance it launches) as a background process, and saves where its
API is and its tokens (`world.json`, readable by you only, in `$ORCHESTRATOR_LOCAL_DIR`, else
~/.local/share/orchestrator/local). `submit`, `jobs`, `job`, `cancel` and `job --download` then
reach it with no flags (`--api`/`--token`, or the settings' URL and token, still win).
`local down` stops it and everything it started.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from orchestrator.cli.app import app, err, out
from orchestrator.errors import UserError

log = logging.getLogger(__name__)

LOCAL_DIR_ENV = "ORCHESTRATOR_LOCAL_DIR"
#: `local up` waits this long at most for the world to serve (it starts Redis, moto and the
#: controller, and imports torch; while its process lives it is waited for up to this).
UP_TIMEOUT_S = 300.0
#: `local down` waits this long for the world to stop its agents and servers before it kills
#: what is left of its process group.
DOWN_TIMEOUT_S = 60.0
#: The market clock of the local world runs this many times faster than real time: a real
#: minute is a market hour (spend accrues at that rate).
DEFAULT_SPEED = 60.0
CONTROLLER_ID = "local"
#: What `local up --json` prints (and `world.json` holds, with the world's pid and log).
_KEYS = ("api_url", "token", "read_token", "dashboard_url")

local_app = typer.Typer(
    name="local",
    help="An offline world for your own jobs: `local up`, submit, watch, `local down`.",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(local_app, name="local")


def local_dir() -> Path:
    """Where `local up` keeps its state and log."""
    named = os.environ.get(LOCAL_DIR_ENV)
    return Path(named) if named else Path.home() / ".local" / "share" / "orchestrator" / "local"


def saved_world() -> dict[str, Any] | None:
    """The running local world's `world.json` (None: none is up, or its process is gone)."""
    path = local_dir() / "world.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or not all(isinstance(saved.get(k), str) for k in _KEYS):
        return None
    pid = saved.get("pid")
    if not _alive(pid) or saved.get("started") != _start_time(pid):
        return None  # gone, or its pid taken by another process since
    return saved


@local_app.command("up")
def up(
    as_json: Annotated[
        bool,
        typer.Option(
            "--json", help="Print {api_url, token, read_token, dashboard_url} as one JSON line."
        ),
    ] = False,
    port: Annotated[
        int,
        typer.Option("--port", min=0, max=65535, help="Serve the API on 127.0.0.1:PORT (0: any)."),
    ] = 0,
    speed: Annotated[
        float,
        typer.Option(
            "--speed", min=1.0, help="Market time runs this many times faster than real time."
        ),
    ] = DEFAULT_SPEED,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the replayed evictions.")] = 1,
) -> None:
    """Start the offline world in the background (Redis, moto, the controller, local instance
    agents) and save where it is, so `submit`, `jobs`, `job` and `cancel` reach it."""
    from orchestrator.extras import require

    running = saved_world()
    if running is None:
        require("offline", what="the offline world (`local up`)")
        running = _start(port=port, speed=speed, seed=seed)
    else:
        err.print(f"a local world is already up (pid {running['pid']})", highlight=False)
    _show(running, as_json)


@local_app.command("status")
def status(
    as_json: Annotated[bool, typer.Option("--json", help="Print the saved world as JSON.")] = False,
) -> None:
    """Whether a local world is up, and where (exit 1 if none is)."""
    running = saved_world()
    if running is None:
        err.print("no local world is up (start one with `orchestrator local up`)")
        raise typer.Exit(1)
    _show(running, as_json)


@local_app.command("down")
def down() -> None:
    """Stop the local world and every process it started (its jobs end with it)."""
    state = local_dir() / "world.json"
    running = saved_world()
    if running is None:
        state.unlink(missing_ok=True)
        err.print("no local world is up")
        return
    pid = int(running["pid"])
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + DOWN_TIMEOUT_S
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(pid):  # its clean-up hung: what is left of its session goes
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        err.print(f"the local world did not stop in {DOWN_TIMEOUT_S:g} s; killed it")
    state.unlink(missing_ok=True)
    err.print(f"stopped the local world (pid {pid})", highlight=False)


@local_app.command("serve", hidden=True)
def serve(
    port: Annotated[int, typer.Option("--port")] = 0,
    speed: Annotated[float, typer.Option("--speed")] = DEFAULT_SPEED,
    seed: Annotated[int, typer.Option("--seed")] = 1,
) -> None:
    """The background process of `local up`: run the world until SIGTERM."""
    from orchestrator.world import DEFAULT_START, STEP_WALL_S, offline_world, world_settings

    settings = world_settings(speed=speed, start=DEFAULT_START, controller_id=CONTROLLER_ID)
    state = local_dir() / "world.json"
    with offline_world(settings, seed=seed, port=port) as world:
        assert world.api_url is not None
        token, read = settings.api.token, settings.api.read_token
        assert token is not None and read is not None
        saved = {
            "api_url": world.api_url,
            "token": token.get_secret_value(),
            "read_token": read.get_secret_value(),
            "dashboard_url": f"{world.api_url}/dashboard?token={read.get_secret_value()}",
            "pid": os.getpid(),
            "started": _start_time(os.getpid()),  # with the pid: this process, not a reuse
            "speed": speed,
            "log": str(local_dir() / "world.log"),
            "where": world.where,
        }
        _write_private(state, json.dumps(saved, indent=2) + "\n")
        print(f"serving at {world.api_url}; {world.where}", flush=True)
        try:
            stop = threading.Event()
            while not stop.is_set():
                try:
                    world.step()
                except Exception:  # noqa: BLE001 - a failed step (Redis, moto): the next one
                    log.exception("a step of the local world failed")
                stop.wait(STEP_WALL_S)
        finally:
            with contextlib.suppress(OSError, ValueError):
                if json.loads(state.read_text()).get("pid") == os.getpid():
                    state.unlink()


def _start(*, port: int, speed: float, seed: int) -> dict[str, Any]:
    """Start `local serve` in its own session and wait until it serves.

    Raises:
        UserError: it exited first (with the end of its log), or did not serve within
            `UP_TIMEOUT_S`.
    """
    folder = local_dir()
    folder.mkdir(parents=True, exist_ok=True)
    state, log_path = folder / "world.json", folder / "world.log"
    state.unlink(missing_ok=True)  # a stale one, of a world that is gone
    command = [sys.executable, "-m", "orchestrator", "local", "serve", "--port", str(port),
               "--speed", f"{speed:g}", "--seed", str(seed)]  # fmt: skip
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,  # a closed terminal does not stop it; `down` does
        )  # fmt: skip
    err.print("starting the local world (Redis, moto, the controller) ...")
    deadline = time.monotonic() + UP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise UserError(
                f"the local world exited (code {proc.returncode}) before it served:\n"
                + _tail(log_path),
                fix=f"see {log_path}; `orchestrator demo` checks the same parts",
            )
        saved = saved_world()
        if saved is not None and saved.get("pid") == proc.pid:
            return saved
        time.sleep(0.2)
    _stop_session(proc)
    raise UserError(
        f"the local world did not serve within {UP_TIMEOUT_S:g} s:\n" + _tail(log_path),
        fix=f"see {log_path}; try again when the machine is less busy",
    )


def _show(saved: dict[str, Any], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps({k: saved[k] for k in _KEYS}) + "\n")
        return
    out.print(
        f"local world up (pid {saved['pid']}, market time {saved['speed']:g}x real time)\n"
        f"  API:       {saved['api_url']}\n"
        f"  dashboard: {saved['dashboard_url']}\n"
        f"  log:       {saved['log']}\n"
        "submit a job with `orchestrator submit JOB.yaml --wait`; stop the world with "
        "`orchestrator local down`",
        highlight=False,
        soft_wrap=True,
    )


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path` atomically, readable by this user only (it holds the token)."""
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _stop_session(proc: subprocess.Popen[bytes]) -> None:
    """Stop the world's session: SIGTERM (it cleans up), then SIGKILL what is left."""
    for sig, wait_s in ((signal.SIGTERM, DOWN_TIMEOUT_S), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _proc_stat(pid: object) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (None: no such process)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_time(pid: object) -> int | None:
    """When process `pid` started (clock ticks since boot; None: unknown)."""
    fields = _proc_stat(pid)
    try:
        return None if fields is None else int(fields[19])  # field 22 of stat
    except (IndexError, ValueError):
        return None


def _alive(pid: object) -> bool:
    """Whether process `pid` runs (a zombie, exited but not reaped yet, does not)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _proc_stat(pid)
    return fields is None or fields[0] != "Z"  # no /proc (not Linux): kill's answer


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
