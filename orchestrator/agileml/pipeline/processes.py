"""Stage worker processes of this machine: `LocalSpawner` starts them (one kept started ahead),
`LocalStage` is one of them as `Launch` watches it (`StageProcess`, which a stage on another
node, `pipeline.remote.RemoteStage`, is too)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from orchestrator.agileml.token import AGILEML_TOKEN_ENV


class StageProcess(Protocol):
    """A running stage worker, as `Launch` watches it: a local process (`LocalStage`), or a
    stage on another node (`pipeline.remote.RemoteStage`)."""

    @property
    def returncode(self) -> int | None: ...
    def poll(self) -> int | None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def communicate(
        self, input: str | None = None, timeout: float | None = None
    ) -> tuple[str, Any]: ...


#: Starts the stage worker `name` (unique per attempt) with its config file: a local process
#: (`spawn_local`) or one on a node of the job (`pipeline.remote.NodePool.spawn`).
Spawn = Callable[[str, Path], StageProcess]


def spawn_local(token: bytes, out_dir: Path) -> Spawn:
    """Stage workers as processes of this machine; `name.log` in `out_dir` gets stderr."""
    return LocalSpawner(token, out_dir)


class LocalSpawner:
    """Starts stage workers as processes of this machine (see `spawn_local`). After
    `prestart()` one process is kept started ahead (Python, torch and the runtime imported:
    seconds off a replacement's start) and the next worker is handed to it; `close()` stops
    the one not used."""

    def __init__(self, token: bytes, out_dir: Path) -> None:
        self.token, self.out_dir = token, out_dir
        self._ready: tuple[LocalStage, Path] | None = None
        self._standby = False

    def prestart(self) -> None:
        self._standby = True
        self._refill()

    def __call__(self, name: str, config_path: Path) -> StageProcess:
        log_path = self.out_dir / f"{name}.log"
        ready, self._ready = self._ready, None
        if ready is not None and ready[0].poll() is None:
            proc, standby_log = ready
            standby_log.rename(log_path)  # its open log follows the rename
            proc.hand(config_path)
        else:
            proc = self._start(str(config_path), log_path)
        self._refill()
        return proc

    def close(self) -> None:
        ready, self._ready = self._ready, None
        if ready is not None and ready[0].poll() is None:
            ready[0].kill()
            ready[0].wait()

    def _refill(self) -> None:
        if self._standby and self._ready is None:
            log_path = self.out_dir / f"standby-{secrets.token_hex(4)}.log"
            self._ready = (self._start("--standby", log_path), log_path)

    def _start(self, argument: str, log_path: Path) -> LocalStage:
        env = {**os.environ, AGILEML_TOKEN_ENV: self.token.hex(), "OMP_NUM_THREADS": "1"}
        out_path = self.out_dir / f"{secrets.token_hex(6)}.out"
        with log_path.open("w") as log, out_path.open("w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "orchestrator.agileml.pipeline.stage", argument],
                stdin=subprocess.PIPE if argument == "--standby" else subprocess.DEVNULL,
                stdout=out,
                stderr=log,
                text=True,
                env=env,
            )
        return LocalStage(proc, out_path)


class LocalStage:
    """A stage worker process of this machine (`StageProcess`). Its output (the result, a
    JSON line that grows with the minibatches it ran) goes to a file: a pipe read only once
    it exits would block it on a large result, and it would never exit."""

    def __init__(self, proc: subprocess.Popen[str], out_path: Path) -> None:
        self.proc, self.out_path = proc, out_path

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def hand(self, config_path: Path) -> None:
        """Give a standby process its config (it waits on its stdin)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{config_path}\n")
        self.proc.stdin.close()
        self.proc.stdin = None  # closed: nothing more to write

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        self.proc.kill()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def communicate(
        self, input: str | None = None, timeout: float | None = None
    ) -> tuple[str, Any]:
        """Wait for the exit (`subprocess.TimeoutExpired` past `timeout`); its output."""
        self.proc.wait(timeout)
        try:
            return self.out_path.read_text(errors="replace"), None
        finally:
            self.out_path.unlink(missing_ok=True)
