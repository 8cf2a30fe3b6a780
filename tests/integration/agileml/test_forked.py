"""Processes forked from the server with the imports done (`forked`): each gets what
`python -m MODULE ARGS` would get from `subprocess.Popen` (arguments, environment, working
folder, output files, exit code, signals), starts in well under the seconds its imports
take, and the exit codes read from several threads at once are the true ones."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.agileml import forked

PROBE = "support.forked_probe"  # tests/ is on the fork server's path (this process's)


def _files(tmp_path: Path) -> tuple[Path, Path]:
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    out.write_text("")
    err.write_text("")
    return out, err


def _run(module: str, args: list[str], tmp_path: Path, env: dict[str, str]) -> forked.Forked:
    out, err = _files(tmp_path)
    return forked.start(module, args, env=env, stdout=out, stderr=err)


def test_a_child_gets_its_arguments_environment_folder_and_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PROBE_LEAK", "not given")
    env = {"PROBE_ENV": "given", "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = _run(PROBE, ["echo", "7"], tmp_path, env)
    assert proc.wait(120) == 7
    child = json.loads((tmp_path / "out.txt").read_text())
    assert child["args"] == ["echo", "7"] and child["argv"] == [PROBE, "echo", "7"]
    assert child["cwd"] == str(tmp_path)
    assert child["env"] == "given" and child["leaked"] is None  # `env` only, as Popen(env=)
    assert child["threads"] == 1
    assert (tmp_path / "err.txt").read_text() == "to stderr\n"
    assert proc.returncode == 7 and proc.poll() == 7
    again = time.monotonic()
    second = _run(PROBE, ["echo", "0"], tmp_path, env)
    assert second.wait(60) == 0
    # the server is up: a start is a fork, not Python and torch imported again
    assert time.monotonic() - again < min(2.0, again - t0 + 1.0)


def test_a_childs_error_is_in_its_stderr_and_its_exit_code_is_1(tmp_path: Path) -> None:
    proc = _run(PROBE, ["raise"], tmp_path, {})
    assert proc.wait(120) == 1
    assert "RuntimeError: the probe failed" in (tmp_path / "err.txt").read_text()


def test_signals_timeouts_and_exit_codes_read_from_many_threads(tmp_path: Path) -> None:
    procs = [_run(PROBE, ["sleep", "60"], tmp_path, {}) for _ in range(4)]
    with pytest.raises(subprocess.TimeoutExpired):
        procs[0].wait(0.2)
    assert all(p.poll() is None for p in procs)
    for p in procs:
        _named(p)
    codes: list[int | None] = []
    stop = threading.Event()

    def poller(p: forked.Forked) -> None:
        while not stop.is_set():
            code = p.poll()
            if code is not None:
                codes.append(code)
                return

    threads = [threading.Thread(target=poller, args=(p,)) for p in procs for _ in range(3)]
    for t in threads:
        t.start()
    procs[0].kill()
    procs[1].terminate()
    procs[2].send_signal(signal.SIGUSR1)  # not handled by the probe: it ends it
    procs[3].kill()
    try:
        assert [p.wait(60) for p in procs] == [
            -signal.SIGKILL,
            -signal.SIGTERM,
            -signal.SIGUSR1,
            -signal.SIGKILL,
        ]
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert sorted(codes) == sorted([-signal.SIGKILL] * 6 + [-signal.SIGTERM] * 3
                                   + [-signal.SIGUSR1] * 3)  # fmt: skip
    procs[0].kill()  # after the exit: nothing happens
    procs[0].send_signal(signal.SIGTERM)
    interrupted = _run(PROBE, ["sleep", "60"], tmp_path, {})
    _named(interrupted)
    interrupted.send_signal(signal.SIGINT)  # as `python -m` would: ended by the signal
    assert interrupted.wait(60) == -signal.SIGINT


def test_a_child_whose_server_died_is_killed_and_reported_killed(tmp_path: Path) -> None:
    """Not the 255 `multiprocessing` says once the server's pipe closes: the child still
    runs then (until it notices), so it is killed, and reported so."""
    from multiprocessing import forkserver

    proc = _run(PROBE, ["sleep", "60"], tmp_path, {})
    _named(proc)
    server = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    assert server is not None
    os.kill(server, signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while Path(f"/proc/{proc.pid}").exists() and not _zombie(proc.pid):
        assert time.monotonic() < deadline, "the child runs on"
        time.sleep(0.05)
    again = _run(PROBE, ["echo", "3"], tmp_path, {})  # a new server
    assert again.wait(120) == 3


def _named(proc: forked.Forked) -> None:
    """Wait until `proc` runs its module (named after it), past its start."""
    deadline = time.monotonic() + 30
    while Path(f"/proc/{proc.pid}/comm").read_text().strip() != "forked_probe":
        assert time.monotonic() < deadline, "the child never took its module's name"
        time.sleep(0.05)


def test_a_child_outlives_no_launcher(tmp_path: Path) -> None:
    """A launcher SIGKILLed with a child running: the server exits, and the child with it
    (`exit_with_parent`, as a stage does)."""
    script = tmp_path / "launcher.py"
    script.write_text(
        "import sys, time\n"
        "from pathlib import Path\n"
        "from orchestrator.agileml import forked\n"
        "if __name__ == '__main__':  # multiprocessing imports it in the child\n"
        "    out = Path(sys.argv[1])\n"
        "    out.write_text('')\n"
        f"    forked.start({PROBE!r}, ['orphan'], env={{}}, stdout=out, stderr=out)\n"
        "    time.sleep(600)\n"
    )
    tests_dir = str(Path(__file__).parents[2])
    launcher = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "child.txt")],
        env={**os.environ, "PYTHONPATH": tests_dir},
    )
    try:
        deadline = time.monotonic() + 120
        while (
            not (tmp_path / "child.txt").read_text().strip()
            if (tmp_path / "child.txt").exists()
            else True
        ):
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.2)
        child = int((tmp_path / "child.txt").read_text().split()[0])
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child}").exists() and not _zombie(child):
        assert time.monotonic() < deadline, "the child outlived its launcher"
        time.sleep(0.2)


def test_a_child_of_the_console_script_does_not_import_the_command_line(tmp_path: Path) -> None:
    """`multiprocessing` runs the launcher's main module again in each child; the console
    script's (`from orchestrator.cli import main`) once imported every command, typer and
    rich with it: 0.2-0.3 s of CPU in each node, stage and agent `orchestrator` started."""
    out, err = _files(tmp_path)
    script = tmp_path / "orchestrator_script.py"
    script.write_text(  # what pip writes for the `orchestrator` console script, and a start
        "import sys\n"
        "from pathlib import Path\n"
        "from orchestrator.cli import main\n"
        "from orchestrator.agileml import forked\n"
        "if __name__ == '__main__':\n"
        f"    proc = forked.start({PROBE!r}, ['modules', 'orchestrator.cli.train', 'typer',"
        " 'rich', 'orchestrator.cli'], env={}, stdout=Path(sys.argv[1]),"
        " stderr=Path(sys.argv[2]))\n"
        "    sys.exit(proc.wait(120))\n"
    )
    run = _launch(script, out, err)
    assert run.returncode == 0, run.stderr[-2000:] + err.read_text()[-2000:]
    assert json.loads(out.read_text()) == ["orchestrator.cli"]  # the package, not a command


def test_a_killed_childs_semaphores_are_its_own_trackers_not_the_launchers(
    tmp_path: Path,
) -> None:
    """A child SIGKILLed holding a named semaphore (a node's DataLoader): its own resource
    tracker cleans it up and warns into the child's stderr; the launcher's tracker once
    printed "leaked semaphore objects" on the user's console at `train`'s exit."""
    out, err = _files(tmp_path)
    script = tmp_path / "launcher.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "from pathlib import Path\n"
        "from orchestrator.agileml import forked\n"
        "if __name__ == '__main__':\n"
        f"    proc = forked.start({PROBE!r}, ['semaphore'], env={{}}, stdout=Path(sys.argv[1]),"
        " stderr=Path(sys.argv[2]))\n"
        "    deadline = time.monotonic() + 120\n"
        "    while not Path(sys.argv[1]).read_text().strip():\n"
        "        assert time.monotonic() < deadline, 'the child never started'\n"
        "        time.sleep(0.05)\n"
        "    proc.kill()\n"
        "    proc.wait(60)\n"
    )
    run = _launch(script, out, err)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "leaked" not in run.stderr, run.stderr[-2000:]
    deadline = time.monotonic() + 30
    while "leaked semaphore" not in err.read_text():  # its own tracker saw it die
        assert time.monotonic() < deadline, err.read_text()[-2000:]
        time.sleep(0.2)


def _launch(script: Path, out: Path, err: Path) -> subprocess.CompletedProcess[str]:
    """`python script out err`, with tests/ on its path (for the probe)."""
    tests_dir = str(Path(__file__).parents[2])
    return subprocess.run([sys.executable, str(script), str(out), str(err)],
                          env={**os.environ, "PYTHONPATH": tests_dir}, capture_output=True,
                          text=True, timeout=180)  # fmt: skip


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_a_child_reads_its_stdin_from_the_launchers_pipe_and_its_own_tmpdir(
    tmp_path: Path,
) -> None:
    """A held `LocalJob` node waits for a line on its stdin (a pipe the launcher writes to;
    its close, or the launcher's death, is EOF), and a child's temporary files go where its
    environment's TMPDIR says (the server's `tempfile` may have settled on another folder)."""
    out, err = _files(tmp_path)
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    proc = forked.start(PROBE, ["read"], env={"TMPDIR": str(own_tmp)}, stdout=out, stderr=err,
                        stdin=True)  # fmt: skip
    assert proc.stdin is not None
    time.sleep(0.5)
    assert proc.poll() is None, err.read_text()  # waits for its line
    proc.stdin.write(b"join\n")
    assert proc.wait(60) == 0, err.read_text()
    proc.stdin.close()
    assert json.loads(out.read_text()) == {"line": "join\n", "tmp": str(own_tmp)}
    # the pipe closed instead: the child reads EOF (a held node the job never released)
    unreleased = forked.start(PROBE, ["read"], env={}, stdout=out, stderr=err, stdin=True)
    assert unreleased.stdin is not None
    time.sleep(0.5)
    unreleased.stdin.close()
    assert unreleased.wait(60) == 0, err.read_text()
    assert json.loads(out.read_text().splitlines()[-1])["line"] == ""
    # and a child without stdin reads EOF at once
    empty = forked.start(PROBE, ["read"], env={}, stdout=out, stderr=err)
    assert empty.stdin is None and empty.wait(60) == 0, err.read_text()


def test_a_childs_exit_handlers_run_as_at_a_python_m_exit(tmp_path: Path) -> None:
    """A job's code may register `atexit` handlers (a tracker finishing its run): they run
    when the child's `main` returns, as at a `python -m` process's end."""
    out, err = _files(tmp_path)
    marker = tmp_path / "atexit"
    proc = forked.start(PROBE, ["atexit", str(marker)], env={}, stdout=out, stderr=err)
    assert proc.wait(60) == 0, err.read_text()
    assert marker.read_text() == "ran"


def test_a_launcher_whose_tmpdir_is_too_long_for_a_socket_still_forks(tmp_path: Path) -> None:
    """The fork server listens on a Unix socket under TMPDIR, and such a path has at most 107
    bytes: a long TMPDIR (a user's, pytest's) once failed `train` with "AF_UNIX path too
    long"."""
    long_tmp = tmp_path / ("t" * 60) / ("u" * 60)
    long_tmp.mkdir(parents=True)
    out, err = _files(tmp_path)
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from orchestrator.agileml import forked\n"
        "if __name__ == '__main__':\n"
        f"    proc = forked.start({PROBE!r}, ['echo', '3'], env={{}}, stdout=Path({str(out)!r}),"
        f" stderr=Path({str(err)!r}))\n"
        "    sys.exit(proc.wait(120))\n"
    )
    tests_dir = str(Path(__file__).parents[2])
    env = {**os.environ, "TMPDIR": str(long_tmp), "PYTHONPATH": tests_dir}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=180)  # fmt: skip
    assert run.returncode == 3, run.stderr[-2000:]
    assert json.loads(out.read_text())["args"] == ["echo", "3"]
    assert list(long_tmp.iterdir()) == []  # nothing of it left in TMPDIR
