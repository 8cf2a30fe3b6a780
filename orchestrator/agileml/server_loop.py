"""The service side of a parameter server: one thread on a ZMQ ROUTER socket that parses,
authenticates and renders messages, and streams updates to BackupPSs over DEALER sockets.

`ServerLoop` runs the thread, answers `hello`, hands `control` ops to the node's handler on a
thread of their own, refuses messages of another job, and passes every other authenticated
request to `_dispatch` (the `ParamServer` decides). Replies made on other threads go through
`_post` (the outbox, sent by the serving thread, which a pipe wakes at once: a control op's
answer or a held pull's does not wait for the next poll); updates for BackupPSs through
`_stream_out`, their acks are counted in `_unacked`.
A push in chunks (`chunks`) is put together per connection (`_on_chunk`): its first chunk is
admitted or refused (`_admit_chunks`) before memory is taken, and the whole is handled as one
message. Malformed or unauthenticated messages never reach `_dispatch`: they get an `error`
reply with the reason in `detail` (to the request's `seq` once the MAC checked out, else to
seq 0: an unauthenticated header is never read), counted, and logged at most every few
seconds. A message whose handling raises is dropped and counted: one message never ends the
loop.

The socket also binds `inproc_endpoint` on the process's shared ZMQ context
(`wire.process_context`): the worker of the same node reaches its own partitions there, without
the loopback's kernel copies (ZMQ hands the frames over by reference). The messages are the same,
MAC included.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Self

import torch
import zmq

from orchestrator.agileml import chunks, wire
from orchestrator.agileml.drops import DropLog
from orchestrator.agileml.errors import HandoffError, ServerError, WireError, WireReason
from orchestrator.agileml.rejections import ROUTINE_REJECTIONS, RejectedError, RejectReason
from orchestrator.agileml.usercode import JobCodeError, failure_report
from orchestrator.agileml.wire import Header, MessageKind
from orchestrator.units import INT64_MAX

MAX_DETAIL_CHARS = 512  # a reply's `detail` (wire.Header)

log = logging.getLogger("orchestrator.agileml.server")

POLL_INTERVAL_MS = 50  # how often the server thread checks for stop() while idle
STOP_TIMEOUT_SECONDS = 5.0  # stop() gives the thread this long to exit

Frames = list[bytes | memoryview]
#: (the requester's identity, the reply's frames or its chunks)
Reply = tuple[bytes, Frames | chunks.ChunkedMessage]


@dataclass(frozen=True)
class ServerStats:
    """Counters of a server since it started."""

    pushes_applied: int = 0
    pushes_duplicate: int = 0
    pulls_answered: int = 0
    pulls_held: int = 0  # held right now, waiting for slower workers
    rejected: int = 0  # got an `error` reply (bad MAC, schema, not owner, ...)
    dropped: int = 0  # unparseable; no reply
    handoffs_sent: int = 0  # partitions handed to another server (acknowledged)
    handoffs_received: int = 0  # partitions taken over from another server
    chunks_streamed: int = 0  # coalesced updates sent to BackupPSs
    chunks_backed: int = 0  # coalesced updates applied to this server's backup copies
    restores: int = 0  # partitions replaced by a BackupPS's copy (roll-back)


class ServerLoop:
    """The message loop of a server (see the module docstring); a subclass decides.

    Use as a context manager, or call `start()` and `stop()`.
    """

    def __init__(
        self,
        node_id: str,
        *,
        job_id: str,
        token: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES,
        control: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        chunk_bytes: int | None = None,
    ) -> None:
        self.node_id = node_id
        self.job_id = job_id
        self._token = token
        self._address = f"tcp://{host}:{port}"
        self._max_message_bytes = max_message_bytes
        self._chunk_bytes = chunk_bytes  # pull replies of larger values go in chunks (None: the
        # runtime's rule: over `chunks.CHUNK_ABOVE_BYTES`, in `chunks.CHUNK_BYTES`)
        self._assembler = chunks.Assembler()  # chunked pushes, one open per connection
        self._control = control  # the AgileML node's handler of `control` ops it owns
        self._outbox: list[Reply] = []  # replies from other threads, sent by the serve thread
        self._wake_fds: tuple[int, int] | None = None  # (read, write): see `_post`
        self._stream_out: list[tuple[str, Frames]] = []  # (backup endpoint, frames)
        self._unacked: dict[int, int] = {}  # replicate seq -> partition
        self._stats = ServerStats()
        self._drops = DropLog(log, "param server dropped a message", node=node_id)
        self.crashed: str | None = None  # why the serving thread ended, if it failed
        self._refusals = DropLog(log, "param server refused a message", node=node_id)
        self._lock = threading.Lock()
        self._acked = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._ctx: zmq.Context[Any] | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._thread: threading.Thread | None = None
        self.endpoint = ""
        self.inproc_endpoint = ""
        # the first error of the job's own code here (its optimizer or scheduler): the job
        # cannot go on, and the node reports it (`usercode.failure_report`) to its controller
        self.job_error: str | None = None

    def start(self) -> Self:
        """Bind the socket and start serving. Raises ServerError if binding fails."""
        if self._thread is not None:
            raise ServerError(f"server {self.node_id} already started")
        self._ctx = wire.process_context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # no limit on messages queued per peer: a ROUTER drops past it without a word, and a
        # large pull reply is many chunks (their memory is the reply copies, not the queue)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        inproc = f"inproc://agileml-ps-{self.node_id}-{secrets.token_hex(8)}"
        try:
            sock.bind(self._address)
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            sock.bind(inproc)
        except zmq.ZMQError as exc:
            sock.close()
            raise ServerError(f"server {self.node_id}: cannot bind {self._address}: {exc}") from exc
        self.inproc_endpoint = inproc
        self._sock = sock
        self._wake_fds = os.pipe()
        for fd in self._wake_fds:
            os.set_blocking(fd, False)
        self._thread = threading.Thread(target=self._serve, name=f"ps-{self.node_id}", daemon=True)
        self._thread.start()
        log.info("param server started", extra={"node": self.node_id, "endpoint": self.endpoint})
        return self

    def stop(self, timeout_s: float = STOP_TIMEOUT_SECONDS) -> None:
        """Stop serving and close the socket. Held pulls are dropped (their workers time out).

        Raises:
            ServerError: the thread did not exit within `timeout_s`.
        """
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise ServerError(f"server {self.node_id} did not stop within {timeout_s}s")
        self._thread = None
        self._ctx = None  # the process's shared context: its sockets are closed, it stays

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve(self) -> None:
        sock = self._sock
        assert sock is not None and self._ctx is not None
        assert self._wake_fds is not None
        wake = self._wake_fds[0]
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        backup_socks: dict[str, zmq.Socket[Any]] = {}
        try:
            while not self._stop.is_set():
                with self._lock:
                    outbox, self._outbox = self._outbox, []
                    stream, self._stream_out = self._stream_out, []
                for identity, frames in outbox:
                    self._send_reply(sock, identity, frames)
                for endpoint, frames in stream:
                    dealer = backup_socks.get(endpoint)
                    if dealer is None:
                        dealer = self._ctx.socket(zmq.DEALER)
                        dealer.setsockopt(zmq.LINGER, 0)
                        dealer.connect(endpoint)
                        poller.register(dealer, zmq.POLLIN)
                        backup_socks[endpoint] = dealer
                    dealer.send_multipart(frames, copy=False)
                events = dict(poller.poll(POLL_INTERVAL_MS))
                if wake in events:  # replies were posted: sent at the top of the loop
                    with contextlib.suppress(BlockingIOError):
                        while os.read(wake, 4096):
                            pass
                for dealer in backup_socks.values():
                    if dealer in events:
                        self._drain_acks(dealer)
                if sock not in events:
                    continue
                while True:
                    try:
                        msg = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        replies = self._handle(msg)
                    except Exception as exc:  # noqa: BLE001 - one message never ends the loop
                        replies = self._drop(f"handling failed: {exc!r}")
                    for identity, frames in replies:
                        self._send_reply(sock, identity, frames)
        except Exception as exc:  # the socket itself failed: its node must fail, not idle on
            log.exception("param server crashed", extra={"node": self.node_id})
            self.crashed = f"this node's parameter server stopped serving: {exc!r}"
        finally:
            self._assembler.clear()
            for dealer in backup_socks.values():
                dealer.close(linger=0)
            sock.close(linger=0)
            self._sock = None
            with self._lock:
                fds, self._wake_fds = self._wake_fds, None
            for fd in fds or ():
                os.close(fd)

    def _send_reply(self, sock: zmq.Socket[Any], identity: bytes, message: Any) -> None:
        """Send one reply (a chunked one is signed chunk by chunk here): a reply that cannot be
        framed is dropped and logged, never the end of the loop."""
        try:
            chunks.send(sock, [identity], message)
        except WireError as exc:
            self._drops.drop(f"reply not sent: {exc}")

    def _post(self, replies: list[Reply]) -> None:
        """Queue replies made off the serving thread and wake it to send them (call under
        `_lock`)."""
        if not replies:
            return
        self._outbox.extend(replies)
        if self._wake_fds is not None:
            with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending anyway
                os.write(self._wake_fds[1], b"!")

    def _drain_acks(self, dealer: zmq.Socket[Any]) -> None:
        while True:
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                header, _ = wire.decode(frames, self._token)
            except WireError:
                continue
            with self._acked:
                self._unacked.pop(header.seq, None)
                if header.kind is MessageKind.ERROR:
                    log.warning(
                        "backup refused a streamed update",
                        extra={"node": self.node_id, "detail": header.detail},
                    )
                self._acked.notify_all()

    def _handle(self, msg: list[zmq.Frame]) -> list[Reply]:
        """Process one ROUTER message; returns the replies to send. Never raises."""
        if len(msg) < 2:
            return self._drop("no frames after identity")
        identity, frames = msg[0].bytes, [f.buffer for f in msg[1:]]
        try:
            header, tensors = wire.decode(
                frames, self._token, max_message_bytes=self._max_message_bytes
            )
        except WireError as exc:
            self._refusals.drop(str(exc))
            seq = 0 if exc.reason in UNAUTHENTICATED else _authenticated_seq(frames)
            if exc.reason not in UNAUTHENTICATED:  # a bad chunk: the rest of its message too
                self._assembler.refuse(identity, seq)
            with self._lock:
                self._stats = replace(self._stats, rejected=self._stats.rejected + 1)
            return [(identity, self._encode(MessageKind.ERROR, seq, detail=str(exc.reason)))]
        if header.chunk is not None:
            return self._on_chunk(identity, header, tensors)
        if header.kind is MessageKind.CONTROL and header.job_id == self.job_id:
            return self._on_control(identity, header, tensors)
        with self._lock:
            return self._answer_locked(identity, header, tensors)

    def _on_chunk(
        self, identity: bytes, header: Header, tensors: dict[str, torch.Tensor]
    ) -> list[Reply]:
        """A chunk of a message (`chunks`): its first is admitted or refused before any memory
        is taken for the whole; the whole is answered as one message once complete."""
        assert header.chunk is not None
        if header.chunk[0] == 0:
            with self._lock:
                try:
                    if header.job_id != self.job_id:
                        raise RejectedError(RejectReason.WRONG_JOB, header.job_id)
                    self._admit_chunks(header)
                except RejectedError as exc:
                    self._assembler.refuse(identity, header.seq)  # its other chunks: no reply
                    return [self._reject_locked(identity, header.seq, exc.wire_detail, header)]
        try:
            whole = self._assembler.add(identity, header, tensors, pool_key=header.partition)
        except WireError as exc:  # out of order: refused once, the rest dropped
            return [self._reject(identity, header.seq, str(exc.reason))]
        if whole is None:
            return []
        try:
            with self._lock:
                return self._answer_locked(identity, *whole)
        finally:
            self._assembler.release(whole[1])  # handlers copy what they keep

    def _admit_chunks(self, header: Header) -> None:
        """Raise `RejectedError` unless a message of this header may come in chunks here (under
        the lock; subclasses say which: none by default)."""
        raise RejectedError(RejectReason.UNEXPECTED_KIND, f"a chunked {header.kind}")

    def _answer_locked(
        self, identity: bytes, header: Header, tensors: dict[str, torch.Tensor]
    ) -> list[Reply]:
        """The replies to an authenticated request (under `_lock`): `_dispatch`'s, or its
        refusal."""
        try:
            if header.job_id != self.job_id:
                raise RejectedError(RejectReason.WRONG_JOB, header.job_id)
            if header.kind is MessageKind.HELLO:
                return [(identity, self._encode(MessageKind.HELLO, header.seq))]
            return self._dispatch(identity, header, tensors)
        except RejectedError as exc:
            return [self._reject_locked(identity, header.seq, exc.wire_detail, header)]
        except JobCodeError as exc:  # deterministic: no retry can fix it; the node reports
            self._job_code_failed(exc)
            detail = f"{RejectReason.JOB_CODE_FAILED}:{exc}"[:MAX_DETAIL_CHARS]
            return [self._reject_locked(identity, header.seq, detail, header)]

    def _job_code_failed(self, exc: JobCodeError) -> None:
        """Keep the first error of the job's code (the server goes on serving: a job's
        controller aborts the job when its node reports it)."""
        if self.job_error is None:
            self.job_error = failure_report(exc)  # the message and the job's traceback
            log.error("the job's code failed:\n%s", self.job_error, extra={"node": self.node_id})

    def _dispatch(
        self, identity: bytes, header: Header, tensors: dict[str, torch.Tensor]
    ) -> list[Reply]:
        """Handle an authenticated request of this job (under the lock); raise
        `RejectedError` to refuse it. Subclasses say what they serve."""
        raise RejectedError(RejectReason.UNEXPECTED_KIND, str(header.kind))

    def _request(
        self,
        endpoint: str,
        kind: MessageKind,
        seq: int,
        fields_and_tensors: tuple[dict[str, Any], dict[str, torch.Tensor]],
        want: MessageKind,
        timeout_s: float,
        p: int,
    ) -> tuple[Header, dict[str, torch.Tensor]]:
        """One request to another server on a private socket; raises HandoffError."""
        fields, tensors = fields_and_tensors
        frames = self._encode(kind, seq, partition=p, tensors=tensors, **fields)
        ctx: zmq.Context[Any] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            sock.send_multipart(frames)
            try:
                got = chunks.await_reply(sock, seq, self._token, timeout_s)
            except WireError as exc:
                raise HandoffError(p, str(exc.reason), outcome_unknown=True) from exc
            if got is None:
                raise HandoffError(p, "timeout", outcome_unknown=True)
            header, reply = got
            if header.kind is MessageKind.ERROR:
                raise HandoffError(p, header.detail or "error")
            if header.kind is not want or header.partition != p:
                raise HandoffError(p, f"unexpected {header.kind} reply", outcome_unknown=True)
            return header, reply
        finally:
            sock.close(linger=0)
            ctx.term()

    def _on_control(
        self, identity: bytes, header: Header, tensors: dict[str, torch.Tensor]
    ) -> list[Reply]:
        """Hand a control op to the AgileML node on a thread of its own (ops may take a while)."""
        try:
            body = wire.parse_json_body(tensors)
        except WireError as exc:
            return [self._reject(identity, header.seq, str(exc.reason))]
        handler = self._control
        if handler is None or not isinstance(body, dict):
            return [self._reject(identity, header.seq, str(RejectReason.UNEXPECTED_KIND))]

        def run() -> None:
            try:
                result = {"ok": True, **handler(body)}
            except JobCodeError as exc:  # the job's optimizer or scheduler, building a partition
                self._job_code_failed(exc)
                result = {"ok": False, "error": str(exc), "job_error": self.job_error}
            except Exception as exc:  # reported to the controller, which decides what next
                log.warning("control op failed", extra={"node": self.node_id, "op": body})
                result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            frames = self._encode(
                MessageKind.CONTROL_REPLY, header.seq, tensors=wire.json_body(result)
            )
            with self._lock:
                self._post([(identity, frames)])

        threading.Thread(target=run, name=f"control-{self.node_id}", daemon=True).start()
        return []

    def _encode(
        self,
        kind: MessageKind,
        seq: int,
        *,
        tensors: dict[str, torch.Tensor] | None = None,
        zero_copy: bool = False,
        **fields: Any,
    ) -> list[bytes | memoryview]:
        header = self._header(kind, seq, **fields)
        return wire.encode(header, tensors or {}, self._token, zero_copy=zero_copy)

    def _header(self, kind: MessageKind, seq: int, **fields: Any) -> dict[str, Any]:
        """The header fields of a message from this server."""
        return {"kind": kind, "job_id": self.job_id, "sender": self.node_id, "seq": seq, **fields}

    def _reject(self, identity: bytes, seq: int, reason: str) -> Reply:
        with self._lock:
            return self._reject_locked(identity, seq, reason, None)

    def _reject_locked(
        self, identity: bytes, seq: int, reason: str, header: Header | None
    ) -> Reply:
        self._stats = replace(self._stats, rejected=self._stats.rejected + 1)
        routine = reason.partition(":")[0] in ROUTINE_REJECTIONS
        log.log(
            logging.DEBUG if routine else logging.WARNING,
            "param server rejected a message",
            extra={"node": self.node_id, "reason": reason, "sender": header and header.sender},
        )
        partition = header.partition if header is not None else None
        return identity, self._encode(MessageKind.ERROR, seq, partition=partition, detail=reason)

    def _drop(self, why: str) -> list[Reply]:
        with self._lock:
            self._stats = replace(self._stats, dropped=self._stats.dropped + 1)
        self._drops.drop(why)
        return []


#: Decode failures before the MAC checked out: the header is not read (its error reply goes
#: to seq 0).
UNAUTHENTICATED = frozenset({WireReason.NO_FRAMES, WireReason.TOO_LARGE, WireReason.BAD_MAC})


def _authenticated_seq(frames: list[Any]) -> int:
    """The `seq` of a header that passed the MAC but not the schema (for the error reply)."""
    try:
        header = wire.parse_json(bytes(frames[1]))
    except WireError:
        return 0
    seq = header.get("seq") if isinstance(header, dict) else None
    return seq if type(seq) is int and 0 <= seq <= INT64_MAX else 0
