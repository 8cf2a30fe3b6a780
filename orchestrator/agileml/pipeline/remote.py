"""The nodes of a hosted pipeline job and the stage workers they run, seen from its supervisor.

Each instance of the job runs a `pipeline.node.PipelineNode` (in the instance agent) that
connects here (DEALER to this ROUTER), registers, and heartbeats. The supervisor starts a stage
worker on a node with `NodePool.spawn` (the config and its slice of the cut travel in the
message; the node writes them to its own disk and starts `pipeline.stage`), and watches it as a
`RemoteStage`: a `Popen`-like handle whose exit code arrives with the node's `exited` report,
or is -9 once the node stops heartbeating (lost with its instance). The final weights a stage
writes and the end of its log come back in the same report, into the supervisor's folder, so
`launch.Launch` reads them as it does for local processes.

Messages (authenticated `pipe` messages of the job, JSON bodies; files as `f:<name>` blobs):
node -> pool `hello` (answered by `welcome`: it fetches the job's code and data, then) `register
{host, tier}`, `heartbeat`, `exited {name, code, stdout, log}` + files,
`notice` (its instance is being evicted: no new work), `gone` (its workers left), `profiled
{profile | error}`; pool -> node `welcome {rendezvous_port, code, code_store, data}`, `profile
{seed, global_batch, workers}`, `run {name, config, device}` + files, `signal {name, signal}`,
`kill {name}`, `shutdown`, the backup holder's requests `hold`, `begin`, `cut` (answered by
`reply {rid, ...}`; see `holder`), and `reregister` to a node that heartbeats unregistered (after a
supervisor restart, or once declared lost: it registers again with nothing running).

Failure semantics: a node silent for `failure_timeout_s` is lost: its workers' exit codes
become -9 and it gets no more work. Messages that do not authenticate, or come from a node not
registered (but a heartbeat: told to register again), are dropped unread.
"""

from __future__ import annotations

import collections
import logging
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import zmq
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator.agileml import wire
from orchestrator.agileml.drops import DropLog
from orchestrator.agileml.errors import WireError
from orchestrator.agileml.wire import MessageKind

log = logging.getLogger(__name__)

#: The exit code of a worker whose node was lost (as if SIGKILLed with its instance).
LOST_CODE = -9
POLL_MS = 50
#: Seconds a node has to report a worker's exit after it was killed (see `RemoteStage.wait`).
EXIT_REPORT_S = 60.0
#: Worker names the pool hands out (`stage{k}.{r}-{attempt}`): plain file names.
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class Registration(BaseModel):
    """A node's `register` (and `hello`) body."""

    model_config = ConfigDict(extra="ignore")

    host: str = Field(default="", max_length=253)
    tier: Literal["reliable", "transient"] = "transient"


def file_tensors(files: dict[str, bytes]) -> dict[str, torch.Tensor]:
    """Files as message tensors (`f:<name>`, uint8)."""
    return {
        f"f:{name}": torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for name, data in files.items()
        if data
    }


def tensor_files(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """The files of a message (see `file_tensors`); names are plain file names."""
    out = {}
    for key, t in tensors.items():
        name = key.removeprefix("f:")
        if key.startswith("f:") and name == Path(name).name and name not in ("", ".", ".."):
            out[name] = t.numpy().tobytes()
    return out


@dataclass
class RemoteNode:
    """A registered node: its ROUTER identity, address and tier, when it was last heard."""

    node_id: str
    identity: bytes
    host: str
    tier: str
    last_seen: float
    registered_at: float = 0.0
    leaving: bool = False  # it had its notice: no new work
    workers: set[str] = field(default_factory=set)


class RemoteStage:
    """A stage worker on a node (see the module docstring); `Popen`'s methods `Launch` uses."""

    def __init__(self, pool: NodePool, node_id: str, name: str) -> None:
        self.pool, self.node_id, self.name = pool, node_id, name
        self.returncode: int | None = None
        self.stdout = ""
        self._exited = threading.Event()

    def exited(self, code: int, stdout: str = "") -> None:
        if not self._exited.is_set():
            self.returncode, self.stdout = code, stdout
            self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code; with no `timeout`, a node that has not reported the exit within
        `EXIT_REPORT_S` is taken as lost (LOST_CODE) rather than waited on forever."""
        if not self._exited.wait(EXIT_REPORT_S if timeout is None else timeout):
            if timeout is not None:
                raise subprocess.TimeoutExpired(self.name, timeout)
            self.exited(LOST_CODE)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            self.pool.command(self.node_id, "kill", {"name": self.name})

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self.pool.command(self.node_id, "signal", {"name": self.name, "signal": int(sig)})

    def communicate(
        self, input: str | None = None, timeout: float | None = None
    ) -> tuple[str, Any]:
        self.wait(timeout)
        return self.stdout, None


class NodePool:
    """The job's nodes (see the module docstring). `start()` binds and runs the pool's thread;
    `welcome` is what a registering node is told (rendezvous port, where the code is)."""

    def __init__(
        self,
        *,
        job_id: str,
        token: bytes,
        host: str,
        port: int,
        out_dir: Path,
        welcome: dict[str, Any],
        failure_timeout_s: float,
    ) -> None:
        self.job_id, self._token, self.out_dir = job_id, token, out_dir
        self.welcome, self.failure_timeout_s = welcome, failure_timeout_s
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            if port:
                self.sock.bind(f"tcp://{host}:{port}")
                self.port = port
            else:
                self.port = self.sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError:
            self.sock.close()
            self.ctx.term()
            raise
        self._lock = threading.Lock()
        self._nodes: dict[str, RemoteNode] = {}  # in registration order
        self._hellos: dict[str, float] = {}  # node -> when it said hello, until it registers
        self._stages: dict[str, RemoteStage] = {}
        self._outbox: collections.deque[tuple[RemoteNode, str, dict[str, torch.Tensor]]] = (
            collections.deque()
        )
        self._seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pipeline-nodes", daemon=True)
        self.events: list[str] = []  # registered / lost / gone, one line each
        self.profiles: dict[str, dict[str, Any]] = {}  # node -> its `profiled` body
        self._waiting: dict[int, threading.Event] = {}  # requests not answered yet
        self._answers: dict[int, tuple[dict[str, Any], dict[str, torch.Tensor]]] = {}
        self._rid = 0
        self._drops = DropLog(log, "pipeline node message dropped", job_id=job_id)
        self.crashed: str | None = None  # why the pool's thread ended, if it failed

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Tell every node (leaving ones too) to stop its workers, then close."""
        for node_id in self.nodes(include_leaving=True):
            self.command(node_id, "shutdown", {})
        deadline = time.monotonic() + 1.0
        while self._outbox and time.monotonic() < deadline:
            time.sleep(0.02)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self.sock.close(linger=500)
        self.ctx.term()

    def nodes(self, *, include_leaving: bool = False) -> list[str]:
        """The live nodes that take work (and those leaving), in registration order."""
        with self._lock:
            return [n.node_id for n in self._nodes.values() if include_leaving or not n.leaving]

    def fetching(self, within_s: float) -> set[str]:
        """Nodes that said hello less than `within_s` ago and have not registered yet: they
        fetch the job's code and data (which sends no heartbeat)."""
        now = time.monotonic()
        with self._lock:
            return {n for n, at in self._hellos.items() if now - at < within_s}

    def registered_for(self, node_id: str) -> float:
        """Seconds since the node registered (0: not registered)."""
        with self._lock:
            node = self._nodes.get(node_id)
            return 0.0 if node is None else time.monotonic() - node.registered_at

    def tiers(self) -> dict[str, str]:
        with self._lock:
            return {n.node_id: n.tier for n in self._nodes.values()}

    def busy(self) -> set[str]:
        """Nodes with a worker still running."""
        with self._lock:
            return {
                n.node_id
                for n in self._nodes.values()
                if any(self._stages[w].returncode is None for w in n.workers if w in self._stages)
            }

    def spawn(
        self,
        node_id: str,
        name: str,
        config: dict[str, Any],
        files: dict[str, bytes],
        *,
        device_index: int = 0,
    ) -> RemoteStage:
        """Start worker `name` on `node_id` with `config` (a StageConfig as JSON) and its
        files, on the node's device `device_index` (its GPU of that index, the CPU on a node
        without); a node that is gone gives a worker already lost."""
        stage = RemoteStage(self, node_id, name)
        with self._lock:
            self._stages[name] = stage
            node = self._nodes.get(node_id)
            if node is None:
                stage.exited(LOST_CODE)
                return stage
            node.workers.add(name)
        body = {"name": name, "config": config, "device": device_index}
        self.command(node_id, "run", body, file_tensors(files))
        return stage

    def request(
        self, node_id: str, detail: str, body: dict[str, Any], timeout_s: float
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
        """Ask a node and wait for its `reply` (its body and tensors); None when it does not
        answer in time or is lost meanwhile."""
        with self._lock:
            self._rid += 1
            rid, done = self._rid, threading.Event()
            self._waiting[rid] = done
        self.command(node_id, detail, {**body, "rid": rid})
        deadline = time.monotonic() + timeout_s
        while not done.wait(0.1):
            if time.monotonic() > deadline or node_id not in self.nodes(include_leaving=True):
                with self._lock:
                    self._waiting.pop(rid, None)
                    self._answers.pop(rid, None)
                return None
        return self._answers.pop(rid)

    def command(
        self,
        node_id: str,
        detail: str,
        body: dict[str, Any],
        files: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Queue a message to a node as registered now (sent by the pool's thread; dropped
        if it registers again before: what was meant for it then is void)."""
        with self._lock:
            node = self._nodes.get(node_id)
        if node is not None:
            self._outbox.append((node, detail, {**wire.json_body(body), **(files or {})}))

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                self._flush()
                if self.sock.poll(POLL_MS):
                    self._receive_all()
                self._expire(time.monotonic())
        except Exception as exc:  # the socket itself failed: the nodes can no longer reach it
            log.exception("pipeline node server crashed", extra={"job_id": self.job_id})
            self.crashed = f"the pipeline's node server stopped serving: {exc!r}"

    def _receive_all(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._receive(frames)
            except Exception as exc:  # noqa: BLE001 - one bad message never ends the loop
                self._drops.drop(f"handling failed: {exc!r}")

    def _flush(self) -> None:
        while self._outbox:
            node, detail, tensors = self._outbox.popleft()
            with self._lock:
                current = self._nodes.get(node.node_id) is node  # not registered again since
            if current:
                self._send(node.identity, detail, tensors)

    def _send(self, identity: bytes, detail: str, tensors: dict[str, torch.Tensor]) -> None:
        self._seq += 1
        fields = {"kind": MessageKind.PIPE, "job_id": self.job_id, "sender": "supervisor",
                  "seq": self._seq, "clock": 0, "detail": detail}  # fmt: skip
        try:
            self.sock.send_multipart([identity, *wire.encode(fields, tensors, self._token)])
        except zmq.ZMQError as exc:
            log.warning("send to a node failed", extra={"detail": detail, "error": str(exc)})

    def _receive(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            self._drops.drop("a frame without a routing identity")
            return
        identity = frames[0]
        try:
            header, tensors = wire.decode(frames[1:], self._token)
            body = wire.parse_json_body(tensors)
        except WireError as exc:
            self._drops.drop(str(exc))  # not ours or malformed: dropped unread
            return
        if not isinstance(body, dict):
            self._drops.drop("a body that is not an object")
            return
        if header.job_id != self.job_id or header.kind is not MessageKind.PIPE:
            return
        node_id, now = header.sender, time.monotonic()
        if header.detail == "hello":  # where the job's code is: no work for it yet
            with self._lock:
                self._hellos[node_id] = now
            self._send(identity, "welcome", wire.json_body(self.welcome))
            return
        if header.detail == "register":
            try:
                registration = Registration.model_validate(body)
            except ValidationError as exc:
                self._drops.drop(f"a malformed register: {exc.errors()[0]['msg']}")
                return
            self._register(node_id, identity, registration, now)
            return
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None or node.identity != identity:
                unknown = node is None and header.detail == "heartbeat"
                if unknown:  # this pool restarted, or declared it lost: it registers again
                    self._send(identity, "reregister", wire.json_body({}))
                return
            node.last_seen = now
            if header.detail == "profiled":
                self.profiles[node_id] = body
            rid = body.get("rid") if header.detail == "reply" else None
            waiting = self._waiting.pop(rid, None) if isinstance(rid, int) else None
            if waiting is not None:
                answer = {k: v for k, v in tensors.items() if k != "body"}
                self._answers[body["rid"]] = (body, answer)
                waiting.set()
            if header.detail in ("notice", "gone"):
                node.leaving = True
                self.events.append(f"{header.detail} {node_id}")
            if header.detail != "exited":
                return
            stage = self._stages.get(str(body.get("name")))
        if stage is None or stage.node_id != node_id:
            return  # not a worker of that node
        for name, data in tensor_files(tensors).items():
            if name.startswith("stage") and name.endswith(".npy"):  # its final weights
                (self.out_dir / name).write_bytes(data)
        if body.get("log"):
            (self.out_dir / f"{stage.name}.log").write_text(str(body["log"]))
        stage.exited(int(body.get("code", 1)), str(body.get("stdout", "")))

    def _register(
        self, node_id: str, identity: bytes, registration: Registration, now: float
    ) -> None:
        with self._lock:
            self._hellos.pop(node_id, None)
            old = self._nodes.pop(node_id, None)
            node = RemoteNode(node_id, identity, registration.host, registration.tier, now)
            node.registered_at = now
            self._nodes[node_id] = node
        if old is not None:  # it restarted: what it ran is gone
            self._lose_workers(old)
        self.events.append(f"registered {node_id}")
        self._send(identity, "welcome", wire.json_body(self.welcome))

    def _expire(self, now: float) -> None:
        with self._lock:
            lost = [n for n in self._nodes.values() if now - n.last_seen > self.failure_timeout_s]
            for node in lost:
                del self._nodes[node.node_id]
        for node in lost:
            self.events.append(f"lost {node.node_id}")
            log.warning("pipeline node lost", extra={"node": node.node_id})
            self._lose_workers(node)

    def _lose_workers(self, node: RemoteNode) -> None:
        for name in node.workers:
            stage = self._stages.get(name)
            if stage is not None:
                stage.exited(LOST_CODE)
