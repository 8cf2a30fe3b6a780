"""Processes of this machine forked from a server that has Python, torch and the runtime
imported (`multiprocessing`'s fork server): a process starts in milliseconds instead of the
seconds those imports take (3-4 s of CPU each on a quiet core, several times that on a busy
machine), for every stage worker a pipeline starts or replaces and every node a `LocalJob`
starts.

The child gets what `python -m MODULE ARGS` gets from `subprocess.Popen`: the environment
given, this process's working folder, the arguments, stdout and stderr into files, stdin a
pipe from the launcher (`Forked.stdin`) or empty; it runs `MODULE.main(ARGS)`, then the exit
handlers (`atexit`), and exits with what `main` returned. Unlike at a `python -m` exit, a file
left open and unflushed is not flushed. As in any `multiprocessing` child, the launcher's main
module is imported first (as `__mp_main__`; a package's `__main__` is not), so a script that
starts children guards its start with `if __name__ == "__main__"`. Its command line stays the
server's; its name (`ps -o comm`, `top`) is the module's last part, e.g. `stage` or `node`.
`Forked` has the `Popen` methods the runtime uses. The server never initialises CUDA
(importing torch does not), so a child may. The server exits once this process is gone, and a
child still running then exits with its parent (`lifecycle.exit_with_parent`), as one `Popen`
started did.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import multiprocessing
import multiprocessing.util
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_ready
from pathlib import Path
from typing import IO, Any

#: What the fork server imports once (each child then starts with it imported).
PRELOAD = ["torch", "orchestrator.agileml.pipeline.stage", "orchestrator.agileml.node"]

_CONTEXT = multiprocessing.get_context("forkserver")
#: A child's exit code is read once, from its pipe to the server: two threads reading it at
#: once would make one of them see 255 (what `multiprocessing` says when the pipe is closed).
_EXIT_CODES = threading.Lock()
#: What `multiprocessing` reports for a child whose pipe closed without an exit code.
NO_EXIT_CODE = 255
#: The longest TMPDIR the fork server's socket can be under: an AF_UNIX path has at most 107
#: bytes, and `multiprocessing` puts it at TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX (32 more).
SOCKET_TMPDIR_MAX = 107 - 32
_TEMPDIR = threading.Lock()
_SOCKET_FOLDER_MADE = False


def warm() -> None:
    """Start the fork server and wait until it has its imports (seconds; blocks), so that
    the next `start` is quick: a start waits for the server, and a node that must heartbeat
    meanwhile should not."""
    _prepare_server()
    probe = _CONTEXT.Process(target=_ready, name="forked-warm-up")
    probe.start()
    probe.join()


def _ready() -> None:
    """The warm-up's child: forked once the server has its imports; nothing to do."""


def start(
    module: str,
    args: Sequence[str],
    *,
    env: Mapping[str, str],
    stdout: Path,
    stderr: Path,
    stdin: bool = False,
) -> Forked:
    """`python -m module *args` with `env`, its output appended to `stdout` and `stderr`
    (files that exist), its input a pipe from this process (`stdin`: `Forked.stdin`, whose
    close, or this process's end, is the child's EOF) or empty, forked from the server
    (started first if it is not running: seconds).

    Raises:
        OSError: the server could not fork it (or could not start).
    """
    _prepare_server()
    reader, writer = _CONTEXT.Pipe(duplex=False) if stdin else (None, None)
    process = _CONTEXT.Process(
        target=_child,
        args=(module, list(args), dict(env), os.getcwd(), str(stdout), str(stderr), reader),
        name=f"{module} {' '.join(args)}"[:200],
    )
    try:
        process.start()
    except (EOFError, ConnectionError, ValueError) as exc:  # the server died or never started
        if writer is not None:
            writer.close()
        raise OSError(f"the fork server could not start {module}: {exc!r}") from exc
    finally:
        if reader is not None:
            reader.close()  # the child's now (sent with the start): its EOF is the writer's end
    # not multiprocessing's child to watch: its clean-up of finished children (at any other
    # start, `active_children()`) would read exit codes beside `Forked.poll`, and at this
    # process's exit it would wait for a child that ignores SIGTERM for good. A child left
    # running then exits with its server (`exit_with_parent`), as one `Popen` started would.
    getattr(multiprocessing.process, "_children", set()).discard(process)
    pipe_in = None
    if writer is not None:  # a file, as Popen's stdin is
        pipe_in = os.fdopen(os.dup(writer.fileno()), "wb", buffering=0)
        writer.close()
    return Forked(process, [sys.executable, "-m", module, *args], pipe_in)


def _prepare_server() -> None:
    """What the fork server needs before its (first) start: its imports, read when it starts,
    and a folder short enough for its socket."""
    _CONTEXT.set_forkserver_preload(PRELOAD)
    _short_socket_folder()


def _short_socket_folder() -> None:
    """Have `multiprocessing`'s folder (where the fork server's socket goes) made under /tmp
    when TMPDIR is too long for a socket's path (`SOCKET_TMPDIR_MAX`); Python 3.11 does not
    fall back by itself, and the start failed with "AF_UNIX path too long". Once a process:
    other threads see `tempfile.tempdir` as /tmp while it is made."""
    global _SOCKET_FOLDER_MADE
    with _TEMPDIR:
        if _SOCKET_FOLDER_MADE:
            return
        _SOCKET_FOLDER_MADE = True
        if len(tempfile.gettempdir()) <= SOCKET_TMPDIR_MAX:
            return
        saved = tempfile.tempdir
        tempfile.tempdir = "/tmp"  # noqa: S108 - the folder is made private (mkdtemp)
        try:
            multiprocessing.util.get_temp_dir()  # made now, and kept for this process
        finally:
            tempfile.tempdir = saved


def release_server_liveness() -> None:
    """In a child of a fork server: close the child's copy of the pipe whose end tells the
    server that its launcher is gone (`multiprocessing` hands one to every child). Held by a
    running child, it kept the server, and so the child (`exit_with_parent` watches the
    server), alive after a SIGKILL of the launcher."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        with contextlib.suppress(OSError):
            os.close(alive)
        server._forkserver_alive_fd = None  # type: ignore[union-attr]


def _child(
    module: str,
    args: list[str],
    env: dict[str, str],
    cwd: str,
    stdout: str,
    stderr: str,
    stdin: Connection | None,
) -> None:
    """In the forked process: become `python -m module *args` and run its `main(args)`. A
    SIGINT at any point ends it as it ends `python -m` (-2), also one that comes while it is
    still becoming the module (once exit code 1: `multiprocessing` caught the interrupt)."""
    interrupted = False
    try:
        _become(module, args, env, cwd, stdout, stderr, stdin)
        code = importlib.import_module(module).main(args)
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        atexit._run_exitfuncs()  # the job's exit handlers, as at a `python -m` process's end
        sys.stdout.flush()
        sys.stderr.flush()
        if interrupted:  # ended by SIGINT, as a `python -m` process would be (-2)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
    sys.exit(code)


def _become(
    module: str,
    args: list[str],
    env: dict[str, str],
    cwd: str,
    stdout: str,
    stderr: str,
    stdin: Connection | None,
) -> None:
    """The forked process takes what `python -m module *args` would have from `Popen`."""
    release_server_liveness()
    with contextlib.suppress(OSError):  # its name in `ps`/`top` (its command line is the server's)
        Path("/proc/self/comm").write_text(module.rsplit(".", 1)[-1][:15])
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # read again from this environment's TMPDIR
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    if stdin is not None:  # `multiprocessing` gave the child os.devnull
        os.dup2(stdin.fileno(), 0)
        stdin.close()
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own, for its life
    _own_resource_tracker()
    _limit_threads(env)
    sys.argv = [module, *args]


def _own_resource_tracker() -> None:
    """A resource tracker of the child's own, started when it first needs one, instead of the
    launcher's: the semaphores of a child SIGKILLed with a DataLoader running (a killed node)
    are then cleaned up by its tracker, which warns into the child's log, not on the
    launcher's console at its exit ("14 leaked semaphore objects")."""
    from multiprocessing import resource_tracker

    # the module's one instance; its private fields (typeshed has none of them): the
    # launcher's tracker's pipe, passed by the server, and no pid: `ensure_running` then
    # starts one for this process
    tracker: Any = resource_tracker._resource_tracker  # noqa: SLF001
    with contextlib.suppress(AttributeError, OSError):
        try:
            if tracker._fd is not None:
                os.close(tracker._fd)
        finally:
            tracker._fd = None
            tracker._pid = None


def _limit_threads(env: Mapping[str, str]) -> None:
    """The thread limits of `env` that the libraries read when the server imported them:
    torch's (OMP_NUM_THREADS) and numpy's BLAS (OPENBLAS_NUM_THREADS, through threadpoolctl
    where it is installed)."""
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    blas = env.get("OPENBLAS_NUM_THREADS", "")
    if blas.isdigit() and int(blas) > 0:
        with contextlib.suppress(ImportError):
            from threadpoolctl import threadpool_limits

            threadpool_limits(int(blas), user_api="blas")


class Forked:
    """A forked process (`start`), with the `subprocess.Popen` methods the runtime uses;
    `returncode` is negative for a signal, as `Popen`'s is. A child whose server died is
    killed and reported as killed (-9), not as an exit of its own."""

    def __init__(
        self,
        process: multiprocessing.process.BaseProcess,
        args: list[str],
        stdin: IO[bytes] | None = None,
    ) -> None:
        self._process = process
        self.args = args
        self.stdin = stdin  # the pipe to the child's stdin (`start(stdin=True)`), or None

    @property
    def pid(self) -> int:
        pid = self._process.pid
        assert pid is not None  # started
        return pid

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        with _EXIT_CODES:
            code = self._process.exitcode
        if code == NO_EXIT_CODE and _running(self.pid):  # its server is gone, not the child
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            return -signal.SIGKILL
        return code

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, waited for (`subprocess.TimeoutExpired` past `timeout`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            wait_ready([self._process.sentinel], left)  # readable once it exits; not read
        return code

    def send_signal(self, sig: int) -> None:
        """As `Popen`'s: nothing once it has exited (also between its exit and its code)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _running(pid: int) -> bool:
    """Whether `pid` runs (not gone, not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"
