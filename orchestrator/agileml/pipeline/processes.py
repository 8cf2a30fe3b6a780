"""Stage worker processes of this machine: `LocalSpawner` starts them (forked from a server
with the imports done: `forked`), `LocalStage` is one of them as `Launch` watches it
(`StageProcess`, which a stage on another node, `pipeline.remote.RemoteStage`, is too)."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from orchestrator.agileml import forked
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
    """Starts stage workers as processes of this machine (see `spawn_local`), forked from a
    server with Python, torch and the runtime imported (`forked`): a stage, and a
    replacement, starts in milliseconds. `prestart()` starts that server ahead and waits for
    its imports (seconds), before a node must heartbeat."""

    def __init__(self, token: bytes, out_dir: Path) -> None:
        self.token, self.out_dir = token, out_dir

    def prestart(self) -> None:
        forked.warm()

    def __call__(self, name: str, config_path: Path) -> StageProcess:
        env = {**os.environ, AGILEML_TOKEN_ENV: self.token.hex(), "OMP_NUM_THREADS": "1"}
        out_path = self.out_dir / f"{secrets.token_hex(6)}.out"
        log_path = self.out_dir / f"{name}.log"
        out_path.write_text("")
        log_path.write_text("")
        proc = forked.start(
            "orchestrator.agileml.pipeline.stage",
            [str(config_path)],
            env=env,
            stdout=out_path,
            stderr=log_path,
        )
        return LocalStage(proc, out_path)


class LocalStage:
    """A stage worker process of this machine (`StageProcess`): a forked one (`forked`) or
    any `subprocess.Popen`. Its output (the result, a JSON line that grows with the
    minibatches it ran) goes to a file: a pipe read only once it exits would block it on a
    large result, and it would never exit."""

    def __init__(self, proc: forked.Forked | subprocess.Popen[str], out_path: Path) -> None:
        self.proc, self.out_path = proc, out_path

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

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
