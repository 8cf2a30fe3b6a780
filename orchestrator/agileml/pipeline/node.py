"""`PipelineNode`: an instance of a pipeline job, in its instance agent (the counterpart of
`pipeline.remote.NodePool`, whose docstring has the messages).

It registers with the job's supervisor, heartbeats, profiles the job's layers when asked (the
planner's input, measured where the job runs and on its data), and runs the stage workers it is
given as
local `pipeline.stage` processes (each one exits with this process: `exit_with_parent`),
reporting each one's exit code, result line, log tail and final weights. An eviction notice
(`leave()`) passes to its workers as SIGUSR1 (a stage leaves right after its next update is
backed up); once they have exited the node says `gone` and returns.

    node = PipelineNode("i-0abc", "transient", job_id="job-1",
                        controller="tcp://10.0.0.5:29500", token=token, host="10.0.0.7")
    result = node.run()     # blocks until shutdown, leave, or stop()

Failure semantics: a worker that cannot start is reported as exited with code 1 (its error as
the log); the supervisor decides what follows. Registration is retried until the supervisor
answers or the node is stopped. Its temporary folder is removed on every exit path.
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
import zmq

from orchestrator.agileml import wire
from orchestrator.agileml.errors import AgileMLError, WireError
from orchestrator.agileml.jobcode import resolve_code
from orchestrator.agileml.node import NodeResult
from orchestrator.agileml.pipeline.holder import BackupHolder
from orchestrator.agileml.pipeline.processes import LocalSpawner, StageProcess
from orchestrator.agileml.pipeline.remote import LOST_CODE, NAME, file_tensors, tensor_files
from orchestrator.agileml.pipeline.stage import device_for
from orchestrator.agileml.spec import MAX_DEVICES
from orchestrator.agileml.wire import MessageKind

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
REGISTER_RETRY_S = 2.0
LOG_TAIL_LINES = 40


class PipelineNode:
    """One node of a pipeline job (see the module docstring)."""

    def __init__(
        self,
        node_id: str,
        tier: str,
        *,
        job_id: str,
        controller: str,
        token: bytes,
        host: str = "127.0.0.1",
        heartbeat_s: float = HEARTBEAT_S,
    ) -> None:
        self.node_id, self.tier, self.job_id = node_id, tier, job_id
        self.controller, self.host, self.heartbeat_s = controller, host, heartbeat_s
        self._token = token
        self._leave = threading.Event()
        self._stop = threading.Event()
        self._seq = 0
        self.procs: dict[str, tuple[StageProcess, dict[str, Any]]] = {}
        self.ran: list[str] = []  # every worker it was given, in order
        self._profiled: dict[str, Any] | None = None  # a profile to send (see `_profile`)
        self.holder: BackupHolder | None = None  # on a reliable node: the job's backups
        self._spawner: LocalSpawner | None = None
        # the job's artifact store, as the controller's welcome names it (`artifact_store`)
        self.artifact_store: str | None = None

    def leave(self) -> None:
        """The eviction notice: the workers leave after their next backed-up update."""
        self._leave.set()

    def stop(self) -> None:
        """Stop now (workers killed)."""
        self._stop.set()

    def run(self) -> NodeResult:
        ctx: zmq.Context[Any] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        # one identity for the whole run: a TCP reconnect does not make it a stranger
        sock.setsockopt(zmq.ROUTING_ID, f"{self.node_id}-{secrets.token_hex(4)}".encode())
        sock.connect(self.controller)
        workdir = Path(tempfile.mkdtemp(prefix="pipeline-node-"))  # the stages' logs and files
        try:
            # where the job's code and data are; fetched before registering, so that a node
            # taking work has them (and no download outlasts the heartbeat timeout)
            welcome = self._register(sock, "hello")
            if welcome is None:
                return NodeResult(self.node_id, ended="lost_controller")
            store = welcome.get("code_store")
            self.artifact_store = store if isinstance(store, str) else None
            code = resolve_code(str(welcome["code"]), store, welcome.get("data"))
            self._spawner = LocalSpawner(self._token, workdir)
            self._spawner.prestart()  # a replacement's stage starts without waiting on imports
            welcome = self._register(sock, "register")
            if welcome is None:
                return NodeResult(self.node_id, ended="lost_controller")
            return NodeResult(self.node_id, ended=self._serve(sock, welcome, workdir, code))
        finally:
            try:
                self._kill_all(report=False)
                if self.holder is not None:
                    self.holder.stop()
                sock.close()
                ctx.term()
            finally:  # also when one of these raises
                shutil.rmtree(workdir, ignore_errors=True)

    def _send(
        self,
        sock: zmq.Socket[Any],
        detail: str,
        body: dict[str, Any],
        files: dict[str, bytes] | None = None,
        tensors: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self._seq += 1
        fields = {"kind": MessageKind.PIPE, "job_id": self.job_id, "sender": self.node_id,
                  "seq": self._seq, "clock": 0, "detail": detail}  # fmt: skip
        frames = {**wire.json_body(body), **file_tensors(files or {}), **(tensors or {})}
        sock.send_multipart(wire.encode(fields, frames, self._token))

    def _receive(
        self, sock: zmq.Socket[Any], timeout_ms: int
    ) -> tuple[str, dict[str, Any], dict[str, bytes]] | None:
        if not sock.poll(timeout_ms):
            return None
        try:
            header, tensors = wire.decode(sock.recv_multipart(), self._token)
            body = wire.parse_json_body(tensors)
        except WireError:
            return None
        if header.job_id != self.job_id or header.kind is not MessageKind.PIPE:
            return None
        return header.detail or "", body, tensor_files(tensors)

    def _register(self, sock: zmq.Socket[Any], detail: str) -> dict[str, Any] | None:
        """`hello` (the job's welcome only) or `register` (take work), until welcomed."""
        while not self._stop.is_set():
            self._send(sock, detail, {"host": self.host, "tier": self.tier})
            deadline = time.monotonic() + REGISTER_RETRY_S
            while (left := deadline - time.monotonic()) > 0 and not self._stop.is_set():
                got = self._receive(sock, int(min(left, 0.2) * 1000))
                if got is not None and got[0] == "welcome":
                    log.info("pipeline node registered", extra={"node": self.node_id})
                    return got[1]
        return None

    def _serve(
        self, sock: zmq.Socket[Any], welcome: dict[str, Any], workdir: Path, code: str
    ) -> str:
        """Run what the supervisor says until shutdown ("done"), leave ("left") or stop."""
        host = urlparse(self.controller).hostname or "127.0.0.1"
        rendezvous = f"tcp://{host}:{int(welcome['rendezvous_port'])}"
        spawn = self._spawner
        assert spawn is not None  # `run` made it
        next_beat = 0.0
        notified = False
        while not self._stop.is_set():
            if self.holder is not None and self.holder.crashed:
                raise AgileMLError(self.holder.crashed)  # the cut it held is unreachable
            if time.monotonic() >= next_beat:
                self._send(sock, "heartbeat", {})
                next_beat = time.monotonic() + self.heartbeat_s
            got = self._receive(sock, 100)
            if got is not None:
                detail, body, files = got
                if detail == "shutdown":
                    return "done"
                if detail == "reregister":  # a restarted supervisor: what ran here is void
                    self._kill_all(report=False)  # the holder keeps its cut: resumed from there
                    self._send(sock, "register", {"host": self.host, "tier": self.tier})
                elif detail == "welcome":
                    rendezvous = f"tcp://{host}:{int(body['rendezvous_port'])}"
                    if self.holder is not None:
                        self.holder.retarget(rendezvous)
                elif detail == "run":
                    self._start(body, files, workdir, spawn, code=code, rendezvous=rendezvous)
                elif detail == "profile":
                    self._profile(code, body)
                elif detail in ("hold", "begin", "cut"):
                    self._hold(sock, detail, body, rendezvous)
                elif detail in ("signal", "kill") and body.get("name") in self.procs:
                    proc = self.procs[str(body["name"])][0]
                    if proc.poll() is None:
                        proc.send_signal(int(body.get("signal", signal.SIGKILL)))
            if self._leave.is_set() and not notified:
                notified = True
                self._send(sock, "notice", {})  # no new work here; its workers leave soon
                for proc, _ in self.procs.values():
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGUSR1)
            self._report_exits(sock, workdir)
            if self._profiled is not None:
                self._send(sock, "profiled", self._profiled)
                self._profiled = None
            if notified and all(p.poll() is not None for p, _ in self.procs.values()):
                self._report_exits(sock, workdir)
                self._send(sock, "gone", {})
                return "left"
        return "stopped"

    def _hold(
        self, sock: zmq.Socket[Any], detail: str, body: dict[str, Any], rendezvous: str
    ) -> None:
        """The supervisor's requests to this node as the job's backup holder (`holder`)."""
        reply: dict[str, Any] = {"rid": body.get("rid")}
        tensors: dict[str, torch.Tensor] = {}
        if detail == "hold":
            if self.holder is None:
                self.holder = BackupHolder(self._token, self.job_id, self.host, rendezvous)
                self.holder.start()
            self.holder.retarget(rendezvous)
            reply.update(self.holder.state())
        elif self.holder is None:
            return  # not the holder (it restarted): no answer, the supervisor gives up
        elif detail == "begin":
            reply.update(self.holder.begin(body))
        else:
            tensors = self.holder.cut(body)
        self._send(sock, "reply", reply, tensors=tensors)

    def _kill_all(self, *, report: bool) -> None:
        for proc, config in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if not report:
                config["_reported"] = True

    def _profile(self, code: str, body: dict[str, Any]) -> None:
        """Time the job's layers here, on a thread (heartbeats go on); the result is sent
        from the serve loop."""
        from orchestrator.agileml.pipeline.trainrun import profile_job  # the planner's inputs

        def run() -> None:
            try:
                profile = profile_job(code, seed=int(body["seed"]),
                                      global_batch=int(body["global_batch"]),
                                      workers=int(body["workers"]))  # fmt: skip
                self._profiled = {"profile": profile.model_dump(mode="json")}
            except Exception as exc:  # noqa: BLE001 - the job's code failed: the supervisor says so
                self._profiled = {"error": f"{type(exc).__name__}: {exc}"}

        threading.Thread(target=run, name="profile", daemon=True).start()

    def _start(
        self,
        body: dict[str, Any],
        files: dict[str, bytes],
        workdir: Path,
        spawn: Any,
        *,
        code: str,
        rendezvous: str,
    ) -> None:
        name = str(body["name"])
        config = dict(body["config"])
        index = body.get("device", 0)
        if not NAME.match(name):
            log.warning("a malformed run request was refused", extra={"worker": name[:80]})
            return
        if not isinstance(config.get("stage"), int) or type(index) is not int:
            why = "no stage number or device index"
        elif not 0 <= index < MAX_DEVICES:
            why = f"device index {index} out of 0..{MAX_DEVICES - 1}"
        else:
            why = ""
        if why:  # reported as the worker's exit: the supervisor fails the job with it
            log.warning("a malformed run request was refused", extra={"worker": name})
            self.procs[name] = (_Failed(1, f"a malformed run request: {why}"), {})
            return
        for key in ("initial_weights", "initial_optimizer"):
            if config.get(key):  # the supervisor's path: the file came with the message
                local = workdir / f"{name}-{Path(config[key]).name}"
                local.write_bytes(files.get(Path(config[key]).name, b""))
                config[key] = str(local)
        # the stage trains on the instance's GPU of that index, if it has GPUs (its workers
        # share them when it has fewer), else on the CPU
        config.update(code=code, rendezvous=rendezvous, host=self.host, out_dir=str(workdir),
                      device=device_for(index))  # fmt: skip
        path = workdir / f"{name}.json"
        path.write_text(json.dumps(config))
        self.ran.append(name)
        if self._leave.is_set():  # it had its notice: the worker would be lost at once
            self.procs[name] = (_Failed(LOST_CODE, "the node is leaving (eviction notice)"), config)
            return
        try:
            self.procs[name] = (spawn(name, path), config)
        except OSError as exc:
            self.procs[name] = (_Failed(1, f"could not start: {exc}"), config)

    def _report_exits(self, sock: zmq.Socket[Any], workdir: Path) -> None:
        for name, (proc, config) in list(self.procs.items()):
            code = proc.poll()
            if code is None or config.get("_reported"):
                continue
            config["_reported"] = True
            stdout = proc.communicate(timeout=5.0)[0] or ""
            log_file = workdir / f"{name}.log"
            tail = ""
            out: dict[str, bytes] = {}
            if isinstance(proc, _Failed):  # never started (its config may be malformed)
                tail = proc.reason
            else:
                if log_file.exists():
                    tail = "\n".join(
                        log_file.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
                    )
                weights = workdir / f"stage{config['stage']}.npy"
                if code == 0 and int(config.get("replica", 0)) == 0 and weights.exists():
                    out[weights.name] = weights.read_bytes()
                    weights.unlink()
            body = {"name": name, "code": code, "stdout": stdout, "log": tail}
            self._send(sock, "exited", body, out)


class _Failed:
    """A worker that never started: its exit code (1: an error; LOST_CODE: the node is
    going) and why."""

    def __init__(self, code: int, reason: str) -> None:
        self.returncode: int | None = code
        self.reason = reason

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode or 0

    def kill(self) -> None:
        pass

    def send_signal(self, sig: int) -> None:
        pass

    def communicate(
        self, input: str | None = None, timeout: float | None = None
    ) -> tuple[str, Any]:
        return "", None
