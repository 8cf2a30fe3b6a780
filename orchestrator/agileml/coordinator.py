"""The elasticity controller of one AgileML job (seed 002, §4.2.2-4.2.3).

It tracks the job's nodes by tier and lifecycle, and drives every change of the job:

* start: once `min_nodes` are ready, pick the stage and roles (`plan_roles`), give each node its
  initial partitions and backups (`configure`), and publish the first view (epoch 1, clock 0);
* a horizon: servers let workers compute at most a span of clocks (`horizon`) past the fastest
  worker's (the controller moves it on as they go), so a roster change scheduled just past the
  horizon reaches every server before any worker computes a clock it affects;
* scale-up in the background: a joining node loads its data and says `ready`; it enters the
  roster just past the horizon, so nobody waits for it, and partitions move to new ActivePSs by
  hand-off while training goes on;
* eviction with warning (`leaving`, or `notify_eviction` from the instance's notice): the node's
  worker leaves the roster at the next clock, and its partitions are handed to survivors (or,
  when no transient server is left, back to the BackupPSs, which become ParamServs);
* failure without warning (no heartbeat for `failure_timeout_s`): a worker-only node leaves the
  roster from the clock it had not finished; a node that owned partitions triggers a roll-back:
  the BackupPSs restore every partition at the one clock all of them hold (they hold later
  clocks back under a ceiling this controller raises as the horizon moves) to its (new) owner
  under a new epoch, and every worker redoes from that clock + 1, as if the failed worker had
  never computed past it; updates already in a restored partition are deduplicated, so each
  one is applied exactly once;
* checkpoints and resuming from one: see `checkpointing` and `checkpoints`.

Node messages arrive on a ROUTER thread that only records and answers; changes run one at a
time on a reconfiguration thread that calls the nodes' parameter servers (`control` ops, carried
out by `server_calls`; checkpoints by `checkpointing`). The module is about 1,000 lines on
purpose: `Coordinator` is the one owner of the job's membership, view and partition table,
which both threads share under one lock; splitting that state across classes would spread the
lock discipline with it.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq
from pydantic import ValidationError

from orchestrator.agileml import checkpoints, wire
from orchestrator.agileml.checkpointing import Checkpointer
from orchestrator.agileml.control import (
    Adoption,
    ControlClient,
    ControlError,
    Heartbeat,
    JobFailed,
    Join,
    Leaving,
    Left,
    NodeRequest,
    Ready,
    Reply,
    TrainingSpec,
    View,
    dump,
    without_failed,
)
from orchestrator.agileml.drops import DropLog
from orchestrator.agileml.elasticity import (
    AgileMLStage,
    Membership,
    Node,
    NodeState,
    NodeTier,
    RolePlan,
    assign_partitions,
    plan_roles,
)
from orchestrator.agileml.errors import (
    AgileMLError,
    NoReliableNodeError,
    PartitionsLostError,
    RecoveryError,
    WireError,
)
from orchestrator.agileml.horizon import HorizonSpan
from orchestrator.agileml.partitions import PartitionTable
from orchestrator.agileml.peers import PeerInboxes
from orchestrator.agileml.roster import Roster
from orchestrator.agileml.server import HANDOFF_TIMEOUT_SECONDS
from orchestrator.agileml.server_calls import (
    advance_backups,
    configure_all,
    pull_partitions,
    rebalance,
    roll_back,
    settle,
    start_nodes,
    unfinished_clocks,
)
from orchestrator.agileml.usercode import MAX_REPORT_CHARS
from orchestrator.agileml.wire import MessageKind

log = logging.getLogger(__name__)

#: Node states that count as members: heard from, expected to heartbeat.
LIVE_STATES = (NodeState.ACTIVE, NodeState.READY, NodeState.LEAVING)

SENDER = "coordinator"
CONTROL_TIMEOUT_SECONDS = 15.0  # reading the parameters from the servers
#: The longest a control op (configure, hand-off, restore) waits on a node that heartbeats.
LIVE_CALL_CAP_SECONDS = 120.0
#: A control call stops waiting on a node silent for this many failure timeouts: by then the
#: detector has failed it (a busy node that answers late would otherwise be taken for dead).
GONE_AFTER = 3.0
#: Silence is counted up to when the message loop last caught up (see `_heard_until`), but
#: never from further back than this: a loop that never catches up (a flood of messages)
#: must not hide a dead node for good.
MAX_UNHEARD_S = 30.0
ROSTER_RETRIES = 5  # a join scheduled too late is pushed later this many times
POLL_MS = 50


@dataclass
class _NodeInfo:
    tier: NodeTier
    endpoint: str
    joined_at_s: float
    last_seen_s: float
    clock: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)  # (clock, loss) heard
    peer_inboxes: PeerInboxes | None = None
    reassigned_rows: int = 0  # FlexRR: rows of its shares helpers computed, as last heard
    rows_computed: int = 0  # rows it computed, and the seconds it took, as last heard
    compute_s: float = 0.0
    devices: int = 1  # the most devices it trained on, as heard
    loss_scale_exponent: int | None = None  # fp16: its worker's, as last heard


@dataclass(frozen=True)
class TrainingProgress:
    """The job's training as the controller hears it: the furthest clock a node reported,
    FlexRR's reassigned rows (summed over nodes) and the AgileML stage changes so far."""

    iteration: int
    reassigned_rows: int
    stage_transitions: int


@dataclass(frozen=True)
class CoordinatorEvent:
    """Something the controller did, for logs, tests and benchmarks."""

    at_s: float
    kind: str  # started | joined | evicted | failed | rolled_back | done | aborted
    nodes: tuple[str, ...]
    detail: str = ""


class Coordinator:
    """The elasticity controller of one job, on a ROUTER socket (`endpoint` after `start`).

    `now` is injectable for tests of the timing rules; by default the monotonic clock.
    Public methods are thread-safe.
    """

    def __init__(
        self,
        spec: TrainingSpec,
        *,
        token: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec = spec
        self._token = token
        self._drops = DropLog(log, "elasticity controller dropped a message")
        self._address = f"tcp://{host}:{port}"
        self._now = now
        self._lock = threading.Lock()
        self._nodes: dict[str, _NodeInfo] = {}
        self._membership = Membership()
        self._view = View()
        self._stage_transitions = 0
        self._error: str | None = None
        self._table = PartitionTable(spec.num_partitions)
        # a resumed job starts past its checkpoint's clock
        resumed = checkpoints.read_manifest(spec.resume_from) if spec.resume_from else None
        self._start_clock = resumed.iterations_done if resumed is not None else 0
        self._horizon = self._start_clock + spec.horizon_clocks
        self._span = HorizonSpan(spec.horizon_clocks, spec.heartbeat_s)
        # BackupPSs apply no clock past it (see advance_backups)
        self._backup_ceiling = self._start_clock - 1
        self._checkpointer = Checkpointer(
            spec,
            start_clock=self._start_clock,
            now_s=now(),
            record=lambda clock, s: self._record("checkpointed", [], f"clock {clock} in {s:.3f} s"),
        )
        self._events: list[CoordinatorEvent] = []
        # when the message loop last found nothing waiting: every message sent before it has
        # been read, so a node's silence up to it is real (see `_silent`)
        self._caught_up_s = now()
        self._lagging = False  # warned that the loop is behind (`_heard_until`)
        self._queue: queue.Queue[tuple[str, str]] = queue.Queue()
        self._stop = threading.Event()
        self._done = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ctx: zmq.Context[Any] | None = None
        self.endpoint = ""

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> Coordinator:
        """Bind and start the message and reconfiguration threads."""
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self._address)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._threads = [
            threading.Thread(target=self._serve, args=(sock,), name="coord-serve", daemon=True),
            threading.Thread(target=self._reconfigure_loop, name="coord-reconf", daemon=True),
        ]
        for t in self._threads:
            t.start()
        log.info("elasticity controller started", extra={"endpoint": self.endpoint})
        return self

    def stop(self) -> None:
        """Tell every node to shut down (in the view), then stop the threads."""
        if self._stop.is_set() or self._ctx is None:
            return
        with self._lock:
            self._view = self._view.model_copy(update={"done": True, "shutdown": True})
        time.sleep(3 * self.spec.heartbeat_s)  # every node's next heartbeat hears it
        self._stop.set()
        for t in self._threads:
            t.join(5)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def __enter__(self) -> Coordinator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- queries and commands -------------------------------------------------------------

    def view(self) -> View:
        with self._lock:
            return self._view

    def events(self) -> list[CoordinatorEvent]:
        with self._lock:
            return list(self._events)

    def node_losses(self) -> dict[str, list[tuple[int, float]]]:
        """The (clock, loss) pairs each node reported in its heartbeats."""
        with self._lock:
            return {n: list(info.losses) for n, info in self._nodes.items()}

    def node_state(self, node_id: str) -> NodeState | None:
        with self._lock:
            return self._membership.state(node_id)

    def notify_eviction(self, node_id: str) -> None:
        """An eviction notice for `node_id` (from the cloud side); as if it said `leaving`."""
        self._queue.put(("leaving", node_id))

    def wait_done(self, timeout_s: float) -> bool:
        """Wait until every worker has finished `spec.iterations` clocks, or the job was
        aborted (then `error` says why)."""
        return self._done.wait(timeout_s)

    @property
    def error(self) -> str | None:
        """Why the job was aborted (None: it was not)."""
        with self._lock:
            return self._error

    def fetch_parameters(
        self, timeout_s: float = CONTROL_TIMEOUT_SECONDS, *, final: bool = True
    ) -> list[torch.Tensor]:
        """Every partition's values, pulled from its owner: once every clock of the job is in
        them (`final`), or as they are now (a snapshot of a running job).

        Raises:
            AgileMLError: a partition could not be pulled within `timeout_s`, or the job has
                not started.
        """
        view = self.view()
        if self._ctx is None or view.epoch == 0:
            raise AgileMLError("the job has not started; no parameters yet")
        if final:
            self._open_horizon(view, timeout_s)
        return pull_partitions(
            self._ctx,
            spec=self.spec,
            view=view,
            owner_of=self._table.owner,
            token=self._token,
            sender=SENDER,
            timeout_s=timeout_s,
            final=final,
        )

    def _open_horizon(self, view: View, timeout_s: float) -> None:
        """Let the pull of the last clock through every owner's horizon. A pull of clock c
        counts as computing clock c + slack + 1, so a horizon that the job ended on held the
        final pull for good ("no answer" from its owner); no clock is computed any more.

        Raises:
            AgileMLError: an owner did not answer.
        """
        client = ControlClient(job_id=self.spec.job_id, sender=SENDER, token=self._token)
        body = {"op": "configure", "horizon": self.spec.iterations + self.spec.slack,
                "slack": self.spec.slack}  # fmt: skip
        try:
            for owner in sorted({self._table.owner(p) for p in range(self.spec.num_partitions)}):
                try:
                    out = client.call(view.endpoints[owner], body, timeout_s)
                except ControlError as exc:
                    raise AgileMLError(f"configure on {owner}: {exc.reason}") from exc
                if not out.get("ok"):
                    raise AgileMLError(f"configure on {owner}: {out.get('error')}")
        finally:
            client.close()

    def _abort(self, reason: str) -> None:
        """The job cannot go on: record why, tell every node to shut down, wake waiters."""
        log.error("agileml job aborted: %s", reason)
        with self._lock:
            self._error = reason
            self._view = self._view.model_copy(update={"done": True, "shutdown": True})
        self._record("aborted", [], reason)
        self._done.set()

    # -- node messages (ROUTER thread) ----------------------------------------------------

    def _serve(self, sock: zmq.Socket[Any]) -> None:
        try:
            while not self._stop.is_set():
                if not sock.poll(0):  # nothing waiting: caught up with every node
                    self._caught_up_s = self._now()
                    if not sock.poll(POLL_MS):
                        continue
                msg = sock.recv_multipart()
                if len(msg) < 2:
                    continue
                try:
                    answer = self._answer(msg[1:])
                except Exception as exc:  # noqa: BLE001 - one message never ends the loop
                    self._drops.drop(f"handling failed: {exc!r}")
                    continue
                if answer is not None:
                    sock.send_multipart([msg[0], *answer])
        except Exception as exc:  # the socket itself failed: nodes can no longer reach it
            log.exception("elasticity controller message loop crashed")
            if not self._done.is_set():
                self._abort(f"the elasticity controller's message loop failed: {exc!r}")
        finally:
            sock.close(linger=0)

    def _answer(self, frames: list[bytes]) -> list[bytes | memoryview] | None:
        """The reply frames to one node message; None (dropped, counted) when it fails
        `wire.decode` (unauthenticated or malformed)."""
        try:
            header, tensors = wire.decode(frames, self._token)
        except WireError as exc:
            self._drops.drop(str(exc))
            return None
        reply = self._on_message(header, tensors)
        fields = {"kind": MessageKind.CONTROL_REPLY, "job_id": self.spec.job_id,
                  "sender": SENDER, "seq": header.seq}  # fmt: skip
        return wire.encode(fields, wire.json_body(dump(reply)), self._token)

    def _on_message(self, header: wire.Header, tensors: dict[str, torch.Tensor]) -> Reply:
        if header.job_id != self.spec.job_id or header.kind is not MessageKind.CONTROL:
            return Reply(ok=False, error=f"not a control message of job {self.spec.job_id}")
        try:
            message = NodeRequest.model_validate({"message": wire.parse_json_body(tensors)})
        except (WireError, ValidationError) as exc:
            return Reply(ok=False, error=f"bad control body: {exc}")
        node, m = header.sender, message.message
        if isinstance(m, JobFailed):
            return self._job_failed(node, m.error, m.cause)
        now = self._now()
        with self._lock:
            info = self._nodes.get(node)
            if isinstance(m, Join):
                if info is not None:
                    return Reply(ok=False, error=f"node {node} already joined; use a new id")
                self._nodes[node] = _NodeInfo(
                    m.tier, m.endpoint, now, now, peer_inboxes=m.peer_inboxes
                )
                self._membership.join(node, now)
                return Reply(
                    spec=self.spec, view=self._view, loss_scale_exponent=self._scale_hint()
                )
            if info is None:
                return Reply(ok=False, error=f"unknown node {node}: send `join` first")
            info.last_seen_s = now
            if isinstance(m, Heartbeat):
                info.clock = m.clock
                info.reassigned_rows = m.reassigned_rows
                info.rows_computed, info.compute_s = m.rows_computed, m.compute_s
                info.devices = max(info.devices, m.devices)
                info.loss_scale_exponent = m.loss_scale_exponent
                if m.loss is not None and (not info.losses or info.losses[-1][0] != m.clock):
                    info.losses.append((m.clock, m.loss))
            elif isinstance(m, Ready):
                self._queue.put(("ready", node))
            elif isinstance(m, Leaving):
                self._queue.put(("leaving", node))
            elif isinstance(m, Left):
                self._queue.put(("left", node))
            return Reply(view=self._view, loss_scale_exponent=self._scale_hint())

    def _scale_hint(self) -> int | None:
        """fp16: the lowest loss scale exponent the live nodes reported (call with the lock)."""
        live = self._membership.in_state(*LIVE_STATES)
        heard = [
            i.loss_scale_exponent
            for n, i in self._nodes.items()
            if n in live and i.loss_scale_exponent is not None
        ]
        return min(heard) if heard else None

    def _job_failed(self, node: str, error: str, cause: str = "job_code") -> Reply:
        """A node's report that the job's code raised (or a server refused its requests for
        good: `JobFailed.cause`): abort the job with that error (the first report stands; the
        nodes are told to shut down in this very reply)."""
        with self._lock:
            known, ended = node in self._nodes, self._view.done  # aborted, or trained
        if not known:
            return Reply(ok=False, error=f"unknown node {node}: send `join` first")
        if not ended:
            what = "the job's code failed" if cause == "job_code" else "a request was refused"
            self._abort(f"{what} on node {node}: {error}")
        return Reply(view=self.view())

    # -- reconfiguration (one change at a time) ---------------------------------------------

    def _reconfigure_loop(self) -> None:
        client = ControlClient(job_id=self.spec.job_id, sender=SENDER, token=self._token)
        try:
            while not self._stop.is_set():
                batch: dict[str, list[str]] = {}
                try:
                    kind, node = self._queue.get(timeout=self.spec.heartbeat_s / 2)
                    batch.setdefault(kind, []).append(node)
                    while True:  # take what else is queued: joins and evictions come in bulk
                        kind, node = self._queue.get_nowait()
                        batch.setdefault(kind, []).append(node)
                except queue.Empty:
                    pass
                try:
                    self._step(client, batch)
                except (NoReliableNodeError, PartitionsLostError, RecoveryError) as exc:
                    self._abort(str(exc))
                    return
                except (AgileMLError, ValidationError) as exc:
                    log.exception("reconfiguration failed", extra={"error": str(exc)})
                except Exception as exc:  # noqa: BLE001 - this thread must not die silently
                    # nothing else detects failures or reconfigures: a stalled job is worse
                    log.exception("reconfiguration crashed")
                    self._abort(f"the elasticity controller failed: {type(exc).__name__}: {exc}")
                    return
        finally:
            client.close()

    def _step(self, client: ControlClient, batch: dict[str, list[str]]) -> None:
        for n in batch.get("left", []):
            if self._move(n, NodeState.GONE):
                self._record("left", [n])
        if self.view().done:
            return  # nodes leave as they finish; nothing is reconfigured any more
        self._drop_silent_joiners()
        started = self.view().epoch > 0
        for n in batch.get("ready", []):
            self._move(n, NodeState.READY)
        if not started:
            heard = self._ready_and_heard()
            reliable = any(n.tier is NodeTier.RELIABLE for n in heard)
            if len(heard) >= self.spec.min_nodes and reliable:
                self._start(client, heard)
            return
        failed = self._detect_failures()
        if failed:
            self._fail(client, failed)
        self._extend_horizon(client)
        leaving = [n for n in batch.get("leaving", []) if self._move(n, NodeState.LEAVING)]
        if leaving:
            self._evict(client, leaving)
        # this batch's ready nodes, and any whose scale-up failed before (else they would stay
        # ready, outside the plans of failures, yet workers in the roster of later joins)
        waiting = [n.node_id for n in self._nodes_in(NodeState.READY)]
        self._check_done()  # a job whose workers are through needs no joiner (nor waits on one)
        try:
            if waiting and not self.view().done:
                self._scale_up(client, waiting)
        finally:
            self._check_done()

    def _drop_silent_joiners(self) -> None:
        """A node silent for GONE_AFTER failure timeouts while it loads (it heartbeats from
        its join on) died there: it holds and computes nothing yet, so it only stops being a
        member (a dead joiner stayed one for good, and its instance was paid for)."""
        with self._lock:
            joining = self._membership.in_state(NodeState.JOINING)
        for n in joining:
            if self._silent(n, GONE_AFTER) and self._move(n, NodeState.FAILED):
                self._move(n, NodeState.GONE)
                self._record("failed", [n], "silent while loading")

    def _ready_and_heard(self) -> list[Node]:
        """The ready nodes the start may call: not silent for `GONE_AFTER` failure timeouts.
        A silent one keeps its state (slow is not dead: it counts again once it heartbeats),
        so that the start does not call a dead node again at every step."""
        return [
            n for n in self._nodes_in(NodeState.READY) if not self._silent(n.node_id, GONE_AFTER)
        ]

    def _start(self, client: ControlClient, nodes: list[Node]) -> None:
        plan = plan_roles(nodes, self.spec.thresholds)
        owners = assign_partitions(self.spec.num_partitions, plan.serving)
        for p, o in owners.items():
            self._table.move(p, o)
        endpoints = self._endpoints()
        backups = self._backups(plan, endpoints)
        roster = Roster.starting(plan.workers)
        start_nodes(
            functools.partial(self._call, client),
            [n.node_id for n in nodes],
            table=self._table,
            backups=backups,
            endpoints=endpoints,
            common={
                "horizon": self._horizon,
                "slack": self.spec.slack,
                "roster": dump(roster),
                "backup_ceiling": self._backup_ceiling,
            },  # fmt: skip
        )
        for n in nodes:
            self._move(n.node_id, NodeState.ACTIVE)
        self._publish(
            epoch=1,
            restart_clock=self._start_clock,
            stage=int(plan.stage),
            roster=roster,
            backups=backups,
        )
        self._record("started", [n.node_id for n in nodes], f"stage {int(plan.stage)}")

    def _scale_up(self, client: ControlClient, ready: list[str]) -> None:
        start = self._replan(client, ready)
        self._record("joined", ready, f"from clock {start}")

    def _evict(self, client: ControlClient, leaving: list[str]) -> None:
        start = self._replan(client)
        self._record("evicted", leaving, f"out from clock {start}")

    def _replan(self, client: ControlClient, joining: tuple[str, ...] | list[str] = ()) -> int:
        """Plan roles for the nodes active or ready now, change the roster past the horizon,
        make `joining` active and move partitions; returns the clock the change starts at."""
        plan = plan_roles(self._nodes_in(NodeState.ACTIVE, NodeState.READY), self.spec.thresholds)
        _, start = self._schedule(client, plan, lambda r, clock: r.with_change(clock, plan.workers))
        for n in joining:
            self._move(n, NodeState.ACTIVE)
        self._rebalance(client, plan)
        return start

    def _extend_horizon(self, client: ControlClient) -> None:
        """Move the horizon on when the fastest worker is within half of its span (see
        `horizon`). Nodes that missed a heartbeat are skipped (a dead one would stall this
        thread)."""
        top = self._max_clock()
        self._span.observe(self._max_clock(live=True), self._now())
        span = self._span.clocks
        ahead = top + span
        if ahead - self._horizon < span // 2:
            return
        call = functools.partial(self._call, client)
        backed_up = len(self.view().backups) == self.spec.num_partitions
        if backed_up:
            self._checkpointer.drop_hold()  # a stage-1 hold does not outlive stage 1
        else:  # stage 1: a checkpoint holds the horizon (see checkpointing)
            owners = sorted({self._table.owner(p) for p in range(self.spec.num_partitions)})
            hold = functools.partial(self._checkpointer.hold_horizon, call, horizon=self._horizon)
            if hold(owners=owners, now_s=self._now()):
                return
        self._horizon = ahead
        fresh = self._heard_until() - 2 * self.spec.heartbeat_s
        serving = self._serving_nodes()
        with self._lock:
            live = [n for n in serving if self._nodes[n].last_seen_s >= fresh]
        body = {"op": "configure", "horizon": ahead, "slack": self.spec.slack}
        configure_all(call, live, body)
        endpoints = self._endpoints()
        backups = sorted({n for n, e in endpoints.items() if e in self.view().backups.values()})
        if backups and set(backups) <= set(live):
            self._backup_ceiling = advance_backups(call, backups, self._backup_ceiling)
            if backed_up:
                self._checkpointer.at_ceiling(
                    call, backups=backups, ceiling=self._backup_ceiling, now_s=self._now()
                )

    def _schedule(
        self, client: ControlClient, plan: RolePlan, change: Callable[[Roster, int], Roster]
    ) -> tuple[Roster, int]:
        """Apply a roster change at a clock no worker has reached; publish it with the plan.

        The change takes effect just past the horizon (no worker can have started that clock);
        should a server still say it comes too late, it moves a horizon further.
        """
        view = self.view()
        assert view.roster is not None
        backups = self._backups(plan, self._endpoints())
        start = self._horizon + 1
        for _ in range(ROSTER_RETRIES):
            roster = change(view.roster, start)
            if self._configure_all(client, roster, backups, view.epoch):
                self._publish(stage=int(plan.stage), roster=roster, backups=backups)
                return roster, start
            start += self._span.clocks
        raise AgileMLError("could not schedule a roster change: workers outran every clock tried")

    def _fail(self, client: ControlClient, failed: list[str]) -> None:
        view = self.view()
        assert view.roster is not None
        failed = list(failed)
        epoch = view.epoch  # a roll-back cut short by another failure is redone under a new one
        for n in failed:
            self._move(n, NodeState.FAILED)
        while True:
            # only active nodes take over: a node ready in the same batch has not had the
            # roster yet (a partition restored on it refused every roster after; the job
            # hung). It joins through `_scale_up` right after, as any joiner.
            plan = plan_roles(self._nodes_in(NodeState.ACTIVE), self.spec.thresholds)
            lost = [p for p in range(self.spec.num_partitions) if self._table.owner(p) in failed]
            try:
                epoch, restart, ranges = self._restore(client, view, failed, plan, lost, epoch)
                break
            except AgileMLError as exc:  # the nodes are FAILED: no later step would restore them
                if isinstance(exc, PartitionsLostError):
                    raise
                # a node the recovery called died meanwhile: recover from both losses
                more = [n for n in self._detect_failures() if n not in failed]
                if not more:
                    raise RecoveryError(f"restoring what {failed} held failed: {exc}") from exc
                log.warning("another node failed during a recovery; recovering from both",
                            extra={"failed": failed, "more": more, "error": str(exc)})  # fmt: skip
                for n in more:
                    self._move(n, NodeState.FAILED)
                failed += more
                if lost:  # partitions may be restored under epoch + 1 already
                    epoch += 1
        backups = self._backups(plan, self._endpoints())
        roster, adoptions, ranges = self._drop_failed(client, view, ranges, backups, epoch)
        self._publish(
            epoch=epoch,
            restart_clock=restart,
            stage=int(plan.stage),
            roster=roster,
            backups=backups,
            adoptions=adoptions,
        )
        for n in failed:
            self._move(n, NodeState.GONE)
        kind = "rolled_back" if lost else "failed"
        detail = f"epoch {epoch}, redo from clock {restart}; " if lost else ""
        self._record(kind, failed, detail + f"shares adopted: {ranges}")
        try:
            if set(roster.members(self._horizon + 1)) != set(plan.workers):
                # the stage changed (e.g. reliable nodes compute again): past the horizon
                self._schedule(client, plan, lambda r, clock: r.with_change(clock, plan.workers))
            self._rebalance(client, plan)
        except AgileMLError as exc:
            if any(self._silent(n) for n in self._live_nodes()):
                # another node went meanwhile: the next step fails it and recovers again
                log.warning("recovery cut short by another failure", extra={"error": str(exc)})
                return
            # the failed nodes are gone: nothing would retry this; a stalled job is worse
            raise RecoveryError(f"recovering from the loss of {failed} failed: {exc}") from exc

    def _drop_failed(
        self,
        client: ControlClient,
        view: View,
        ranges: dict[str, tuple[int, int]],
        backups: dict[int, str],
        epoch: int,
    ) -> tuple[Roster, dict[str, Adoption], dict[str, tuple[int, int]]]:
        """Give every server the roster without the failed nodes of `ranges` (failed node ->
        the clocks [first, end) survivors redo for it). A server refuses it when a push of a
        clock at or past a node's end arrived after the servers were asked (the dead node's
        own, sent before it died, or the survivors' it let through): the end moves past the
        latest push anyone has and the roster is given again, so that every server trains by
        one roster. Returns the roster, adoptions and ranges given.

        Raises:
            RecoveryError: servers refused every end tried.
        """
        assert view.roster is not None
        call = functools.partial(self._call, client)
        for _ in range(ROSTER_RETRIES):
            roster, adoptions = without_failed(view.roster, view.adoptions, ranges)
            if self._configure_all(client, roster, backups, epoch):
                return roster, adoptions, ranges
            log.warning("a server refused the roster without %s; asking again", sorted(ranges))
            try:
                ranges = {
                    f: (first, max(end, unfinished_clocks(call, f, self._table)[1]))
                    for f, (first, end) in ranges.items()
                }
            except AgileMLError as exc:  # servers now disagree on the roster: nothing is safe
                raise RecoveryError(f"asking again what {sorted(ranges)} left: {exc}") from exc
        raise RecoveryError(f"servers refused every roster without {sorted(ranges)}: {ranges}")

    def _restore(
        self,
        client: ControlClient,
        view: View,
        failed: list[str],
        plan: RolePlan,
        lost: list[int],
        epoch: int,
    ) -> tuple[int, int, dict[str, tuple[int, int]]]:
        """What the `failed` nodes held: their `lost` partitions restored from the BackupPSs
        under an epoch after `epoch` (a roll-back), or else the clocks of theirs survivors
        redo. Returns (the epoch, its restart clock, failed node -> clocks to redo)."""
        call = functools.partial(self._call, client)
        if not lost:
            ranges = {f: unfinished_clocks(call, f, self._table) for f in failed}
            return epoch, view.restart_clock, ranges
        epoch, restart, upto = roll_back(
            call, view=view, failed=failed, plan=plan, table=self._table,
            endpoints=self._endpoints(), epoch=epoch + 1,
        )  # fmt: skip
        return epoch, restart, {f: (restart, upto) for f in failed}

    def _rebalance(self, client: ControlClient, plan: RolePlan) -> None:
        """Hand partitions to the plan's serving nodes with as few moves as possible. A
        receiver that never acknowledged a hand-off is failed (fenced off: nobody was told it
        owns the partition) and the old owner serves the partition again; see `rebalance`."""
        call = functools.partial(self._call, client)
        done = rebalance(
            call, plan=plan, table=self._table, endpoints=self._endpoints(), alive=self._receiving
        )
        if done.moved:
            self._publish()
        if not done.unsettled:
            self._drop_backups(client, plan)
            return
        receivers = sorted({n for parts in done.unsettled.values() for n in parts.values()})
        log.error("hand-offs never acknowledged; failing their receivers", extra={
            "unsettled": done.unsettled, "nodes": receivers})  # fmt: skip
        settle(call, done.unsettled)
        with self._lock:
            failed = [n for n in receivers if self._membership.state(n) in LIVE_STATES]
        if failed:
            self._fail(client, failed)
        self._drop_backups(client, plan)

    def _drop_backups(self, client: ControlClient, plan: RolePlan) -> None:
        """Stage 1 with every partition on a reliable node: the BackupPSs kept through the
        hand-offs (see `_backups`) go; their copies would only hold the backup ceiling."""
        view = self.view()
        if plan.stage is not AgileMLStage.PARAMSERV_ONLY or not view.backups or view.roster is None:
            return
        if self._backups(plan, self._endpoints()):
            return  # a transient node still owns a partition
        self._configure_all(client, view.roster, {}, view.epoch)
        self._publish(backups={})

    def _receiving(self, node: str) -> bool:
        """Whether a hand-off to `node` without an ack is sent again rather than the node
        fenced off (failed): a transient node while `_alive`; a reliable one, whose loss
        ends the job, until it is silent for GONE_AFTER failure timeouts (a busy reliable
        node is not taken for dead)."""
        with self._lock:
            info = self._nodes.get(node)
            reliable = info is not None and info.tier is NodeTier.RELIABLE
        if not reliable:
            return self._alive(node)
        return self._membership_live(node) and not self._silent(node, GONE_AFTER)

    def _membership_live(self, node: str) -> bool:
        with self._lock:
            return self._membership.state(node) in LIVE_STATES

    def _alive(self, node: str) -> bool:
        """Heard from within the failure timeout and not failed or gone."""
        with self._lock:
            info = self._nodes.get(node)
            return (
                info is not None
                and self._membership.state(node) in LIVE_STATES
                and self._heard_until() - info.last_seen_s <= self.spec.failure_timeout_s
            )

    def _configure_all(
        self, client: ControlClient, roster: Roster, backups: dict[int, str], epoch: int
    ) -> bool:
        """Give every live node the roster, backups and epoch; False if one refused the
        roster as too late (see `server_calls.configure_all`)."""
        body = {
            "op": "configure",
            "epoch": epoch,
            "roster": dump(roster),
            "backups": backups,
            "horizon": self._horizon,
            "slack": self.spec.slack,
            "backup_ceiling": self._backup_ceiling,  # a reliable node that joined late, too
        }
        return configure_all(functools.partial(self._call, client), self._serving_nodes(), body)

    def _call(self, client: ControlClient, node: str, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            endpoint = self._nodes[node].endpoint
        # slow is not dead: a node is waited on while it heartbeats (a busy machine answers
        # late) and given up on once it is silent for GONE_AFTER failure timeouts (the
        # detector fails it meanwhile); the cap bounds a live node that never answers
        timeout = LIVE_CALL_CAP_SECONDS
        if body["op"] == "handoff":  # each move may wait out its receiver's ack
            timeout += len(body["moves"]) * HANDOFF_TIMEOUT_SECONDS

        def gone() -> bool:  # silent, or the job is over (stopped, aborted): no more waiting
            return self._stop.is_set() or self.view().done or self._silent(node, GONE_AFTER)

        try:
            out = client.call(endpoint, body, timeout, gone=gone)
        except ControlError as exc:
            raise AgileMLError(f"{body['op']} on {node}: {exc.reason}") from exc
        if not out.get("ok"):
            job_error = out.get("job_error")
            if isinstance(job_error, str) and job_error:  # the user's code, building a partition
                self._job_failed(node, job_error[: 2 * MAX_REPORT_CHARS])
            raise AgileMLError(f"{body['op']} on {node}: {out.get('error')}")
        return out

    # -- state helpers ----------------------------------------------------------------------

    def progress(self) -> TrainingProgress:
        """Iterations, reassigned rows and stage transitions so far (for the dashboard)."""
        with self._lock:
            return TrainingProgress(
                iteration=max((i.clock for i in self._nodes.values()), default=0),
                reassigned_rows=sum(i.reassigned_rows for i in self._nodes.values()),
                stage_transitions=self._stage_transitions,
            )

    def members(self) -> frozenset[str]:
        """The nodes that are members now: joined (loading, ready, training or leaving) and
        not failed or gone (the failure detector, on heartbeats, decides when one failed)."""
        with self._lock:
            return frozenset(self._membership.in_state(NodeState.JOINING, *LIVE_STATES))

    def node_work(self) -> dict[str, tuple[int, float]]:
        """Each node's rows computed and seconds spent computing them, as last heard."""
        with self._lock:
            return {n: (i.rows_computed, i.compute_s) for n, i in self._nodes.items()}

    def node_devices(self) -> dict[str, int]:
        """The most devices each node trained on, as its heartbeats said."""
        with self._lock:
            return {n: i.devices for n, i in self._nodes.items()}

    def _publish(self, **changes: Any) -> None:
        with self._lock:
            if "stage" in changes and self._view.epoch > 0 and changes["stage"] != self._view.stage:
                self._stage_transitions += 1
            owners = {
                p: self._table.owner(p)
                for p in range(self.spec.num_partitions)
                if self._table.get(p).owner is not None
            }
            versions = {p: self._table.get(p).version for p in owners}
            endpoints = {n: i.endpoint for n, i in self._nodes.items()}
            peers = {}
            if self.spec.straggler.flexrr:  # nodes bind an inbox before they know the spec
                gone = (NodeState.FAILED, NodeState.GONE)
                peers = {
                    n: i.peer_inboxes
                    for n, i in self._nodes.items()
                    if i.peer_inboxes and self._membership.state(n) not in gone
                }
            self._view = self._view.model_copy(
                update={
                    "owners": owners,
                    "versions": versions,
                    "endpoints": endpoints,
                    "peers": peers,
                    **changes,
                }
            )

    def _backups(self, plan: RolePlan, endpoints: dict[str, str]) -> dict[int, str]:
        """Each partition's BackupPS: the reliable nodes in turn. Stage 1 has none, but only
        once every partition is on a reliable node: until then (a drop from stage 2 whose
        hand-offs to the reliable nodes are under way, cut short or refused) the partitions
        keep their BackupPSs, so that the failure of a transient node still owning some can
        be rolled back (without them its partitions were lost while the reliable node lived).
        `_rebalance` drops them once the hand-offs are done."""
        reliable = plan.backup_ps or plan.param_servs
        if plan.stage is AgileMLStage.PARAMSERV_ONLY:
            owners = {self._table.get(p).owner for p in range(self.spec.num_partitions)}
            if owners <= set(reliable):
                return {}
        return {p: endpoints[reliable[p % len(reliable)]] for p in range(self.spec.num_partitions)}

    def _detect_failures(self) -> list[str]:
        with self._lock:
            live = [n for n in self._nodes if self._membership.state(n) in LIVE_STATES]
        return sorted(n for n in live if self._silent(n))

    def _silent(self, node: str, timeouts: float = 1.0) -> bool:
        """No heartbeat from `node` for `timeouts` x `failure_timeout_s` (1: the detector
        takes it as failed), counted up to when the message loop last caught up: a loop
        that could not run (this process starved on a busy machine) has not heard what the
        nodes sent meanwhile, and their silence is not yet known."""
        limit = timeouts * self.spec.failure_timeout_s
        heard_until = self._heard_until()
        with self._lock:
            info = self._nodes.get(node)
            return info is None or heard_until - info.last_seen_s > limit

    def _heard_until(self) -> float:
        """The time up to which the nodes' messages have been read: when the message loop
        last found nothing waiting (now, normally), at most `MAX_UNHEARD_S` ago. (Messages
        still in the kernel's buffers when it looked are not seen: after a stall of the
        whole process that is a window of microseconds.)"""
        now = self._now()
        lag = now - self._caught_up_s
        if lag > self.spec.failure_timeout_s and not self._lagging:
            self._lagging = True
            log.warning(
                "the elasticity controller's message loop is behind; nodes' silence is "
                "counted from when it last caught up",
                extra={"lag_s": round(lag, 1)},
            )
        elif lag <= self.spec.failure_timeout_s:
            self._lagging = False
        return max(min(now, self._caught_up_s), now - MAX_UNHEARD_S)

    def _check_done(self) -> None:
        view = self.view()
        if view.roster is None or view.done:
            return
        last = self.spec.iterations - 1
        with self._lock:
            live = set(self._membership.in_state(NodeState.ACTIVE, NodeState.LEAVING))
            clocks = [self._nodes[w].clock for w in view.roster.members(last) if w in live]
        if clocks and min(clocks) > last:
            self._publish(done=True)
            self._record("done", ())
            self._done.set()

    def _max_clock(self, *, live: bool = False) -> int:
        """The furthest clock heard from any node (with `live`, from nodes not failed or
        gone: after a roll-back their old clocks are not where the job is)."""
        gone = (NodeState.FAILED, NodeState.GONE)
        with self._lock:
            return max(
                (
                    i.clock
                    for n, i in self._nodes.items()
                    if not live or self._membership.state(n) not in gone
                ),
                default=0,
            )

    def _nodes_in(self, *states: NodeState) -> list[Node]:
        with self._lock:
            ids = self._membership.in_state(*states)
            return [Node(n, self._nodes[n].tier, self._nodes[n].joined_at_s) for n in ids]

    def _live_nodes(self) -> list[str]:
        with self._lock:
            return list(
                self._membership.in_state(NodeState.READY, NodeState.ACTIVE, NodeState.LEAVING)
            )

    def _serving_nodes(self) -> list[str]:
        """Live nodes, less leaving ones that serve nothing any more (they may be gone)."""
        owners = {self._table.owner(p) for p in range(self.spec.num_partitions)}
        with self._lock:
            leaving = set(self._membership.in_state(NodeState.LEAVING))
        return [n for n in self._live_nodes() if n not in leaving or n in owners]

    def _endpoints(self) -> dict[str, str]:
        with self._lock:
            return {n: i.endpoint for n, i in self._nodes.items()}

    def _count(self, state: NodeState) -> int:
        with self._lock:
            return len(self._membership.in_state(state))

    def _move(self, node: str, to: NodeState) -> bool:
        with self._lock:
            try:
                self._membership.transition(node, to, self._now())
            except AgileMLError:
                return False
            return True

    def _record(self, kind: str, nodes: list[str] | tuple[str, ...], detail: str = "") -> None:
        event = CoordinatorEvent(self._now(), kind, tuple(nodes), detail)
        with self._lock:
            self._events.append(event)
        log.info("agileml %s", kind, extra={"nodes": list(nodes), "detail": detail})
