"""A stateless AgileML worker: pull the model, compute a gradient, push the update.

The worker keeps no model state between iterations, only its clock: each iteration pulls every
partition from its owner (waiting, under BSP/SSP, until the others are close enough), loads them
into a scratch model, computes the gradient on a minibatch, and pushes it per partition tagged
with its clock (the servers apply each complete clock with the job's optimizer, see `updates`).
A model's buffers (BatchNorm statistics) travel in the same vector: the worker pushes their
change over its share divided by the clock's worker count, so a clock moves them by the mean of
the workers' changes. The minibatch of clock t is a function of (seed, worker, t), or,
with a `Roster`, the worker's share of the global batch of clock t, so a redone iteration
computes on the same rows, and the server's (worker, clock, partition) deduplication keeps an
update from being applied twice.

Overlap (`streams`, on with `WorkerSpec.overlap` when the model has several partitions): the
forward pass starts once the first pulled partition is in, the others loading when an operation
first reads them, and each partition is pushed from the gradient hooks as soon as backward has
all of its gradients. With FlexRR, pulls load whole (the worker helps its peers while it waits
for them, which it could not do on a half-loaded model), and pushes leave early only when the
worker's share is one chunk (its gradients are then final when that backward ends). On a GPU
the hooks run on autograd's device thread, which then sends (never run on a GPU).

Retries: a partition that is being handed off (`moving`) or a server that has not yet entered
the worker's epoch (`future_epoch`) is asked again shortly; a `moved` reply re-points the
partition to its new owner and asks again. A server that refuses the worker's epoch
(`stale_epoch`), or an `abort` callback returning True while waiting, ends the iteration with
`StaleViewError`: the caller picks up the new view and redoes from its restart clock.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import zmq
from torch import nn

from orchestrator.agileml.batches import (
    Batch,
    RowSource,
    TensorRows,
    micro_batch,
    micro_batches,
    to_device,
)
from orchestrator.agileml.chunks import Assembler
from orchestrator.agileml.errors import AgileMLError, WorkerError
from orchestrator.agileml.loading import AHEAD, LoaderRows
from orchestrator.agileml.partitions import PartitionLayout, PartitionTable
from orchestrator.agileml.precision import LossScale, autocast
from orchestrator.agileml.roster import Roster, global_batch_indices, worker_share
from orchestrator.agileml.staging import PushStaging
from orchestrator.agileml.streams import EarlyPushes, PullStream, streaming_safe
from orchestrator.agileml.usercode import job_code_call
from orchestrator.agileml.wire import VALUE_DTYPES, MessageKind
from orchestrator.agileml.worker_link import Round, ServerRequests, StaleViewError, WorkerSpec

FORWARD = "the model's forward or loss(output, target)"  # user code: see `usercode`
BACKWARD = "backward() through the model and the loss"
DATA = "dataset()[i] or collate(items)"

if TYPE_CHECKING:
    from orchestrator.agileml.devices import DeviceGroup
    from orchestrator.agileml.reassign import Reassigner

LossFn = Callable[[Any, Any], torch.Tensor]


class Worker(ServerRequests):
    """Runs iterations against the parameter servers named by a `PartitionTable`.

    Without a roster, `loss_fn` is a mean over the minibatch of `spec.batch_size` rows. With a
    roster, `spec.batch_size` is the global batch and `loss_fn` must return the *sum* over the
    worker's share (e.g. `cross_entropy(..., reduction="sum")`); see `_compute`.

    Not thread-safe: call `run` from one thread; the ZMQ sockets live only inside `run`.

    Failure semantics: if a server refuses a request or does not answer within
    `request_timeout_s`, `run` raises `WorkerError` and the clock stays at the failed
    iteration. Pushes already acknowledged for that clock are applied; calling `run` again
    redoes the iteration with the same minibatch, and the servers ignore the repeated pushes.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        token: bytes,
        layout: PartitionLayout,
        table: PartitionTable,
        endpoints: Mapping[str, str],
        model_factory: Callable[[], nn.Module],
        data: tuple[torch.Tensor, torch.Tensor] | RowSource,
        loss_fn: LossFn,
        roster: Roster | None = None,
        epoch: int | None = None,
        abort: Callable[[], bool] | None = None,
        phase_hook: Callable[[str, int], None] | None = None,
        device: torch.device | None = None,
        local_endpoints: Mapping[str, str] | None = None,
        devices: DeviceGroup | None = None,
    ) -> None:
        if spec.batch_size < 1 or spec.slack < 0 or spec.accumulate < 1:
            raise ValueError(f"invalid worker spec: {spec}")
        if spec.clip_grad_norm is not None and spec.slack:
            raise ValueError("clipping by the global norm needs slack 0")
        self.spec = spec
        torch.set_num_threads(1)  # as `step`: the warm-up and FlexRR's calibration time it so
        self._token = token
        self.layout = layout
        self.table = table
        self.endpoints = dict(endpoints)
        # a server endpoint -> the `inproc://` one of the same server in this process
        self.local_endpoints = dict(local_endpoints or {})
        self.device = device or torch.device("cpu")
        self._model = model_factory()
        layout.gather(self._model)  # raises PartitionError if the factory does not fit
        self._model.to(self.device)
        self._model.train()
        self._rows: RowSource = TensorRows(*data) if isinstance(data, tuple) else data
        # the node's other devices (`devices`): every batch of rows is split across them and
        # their gradients summed into this model; None: this worker computes alone
        self.devices = devices
        self._state_version = 0  # of the loaded parameters: a pull changes them
        # fp16: the loss is scaled before backward, the gradients unscaled before the push
        self._loss_scale = LossScale() if spec.precision == "fp16" else None
        self.skipped_clocks: set[int] = set()  # fp16: clocks whose gradient here overflowed
        # the own share the rows loader fetched (`loading`), while it is computed: (key, rows)
        self._loaded: tuple[tuple[int, int], Batch | None] | None = None
        self._overflowed = False  # fp16: a gradient of this iteration was not finite
        # on a GPU, gradients leave through reused pinned host vectors (`staging`)
        cuda = self.device.type == "cuda"
        self.staging = PushStaging(layout, self.device, pin=True) if cuda else None
        self._loss_fn = loss_fn
        self.roster = roster  # with a roster, `spec.batch_size` is the global batch
        self.epoch = epoch
        self._abort = abort or (lambda: False)
        # fault injection in tests: called with ("pulled" | "computed" | "pushing", clock);
        # "pushing" comes after half of the iteration's pushes are sent
        self.phase_hook = phase_hook
        # seconds spent per phase, summed over iterations: where an iteration's time goes.
        # "wait": from asking for the parameters to the first reply (under BSP/SSP the servers
        # hold a pull until the slower workers' updates are in; FlexRR help given meanwhile
        # counts here); "pull": the rest of the replies and loading them into the model
        self.timings: dict[str, float] = {"wait": 0.0, "pull": 0.0, "compute": 0.0, "push": 0.0}
        self._first_reply_at: float | None = None  # of the last pull
        # rows computed whole here (not through FlexRR's reassigner) and the seconds it took
        self._plain_rows = 0
        self._plain_busy_s = 0.0
        self.clock = 0
        # failed workers whose shares this one computes: identity -> clocks [from, to)
        self.adoptions: dict[str, tuple[int, int]] = {}
        self._adopted_done: set[tuple[str, int]] = set()
        self._seq = 0
        self._ctx: zmq.Context[Any] | None = None
        self._sockets: dict[str, zmq.Socket[Any]] = {}
        # FlexRR: computes the own share in chunks, trading rows with peers (roster jobs only)
        self.reassigner: Reassigner | None = None
        # (identity, clock, roster version) -> dataset rows of the share
        self._rows_cache: dict[tuple[str, int, int], torch.Tensor] = {}
        # same key -> (first row cached, the batch of the rows from there): helpees' input
        self._preloaded: dict[tuple[str, int, int], tuple[int, Batch]] = {}
        # requests sent and not answered: seq -> (their round, index in it)
        self._outstanding: dict[int, tuple[Round, int]] = {}
        self._assembler = Assembler()  # chunked pull replies (`chunks`), by request seq
        # overlap (see `streams`): only with several partitions and contiguous parameters;
        # streaming pulls only where every read of a parameter is a torch operation we see
        self._params = layout.params(self._model)  # layout order; the model never changes
        overlap = (
            spec.overlap
            and devices is None  # the node's devices need whole batches and a whole model
            and spec.precision != "fp16"  # a gradient is checked whole before it leaves
            and layout.num_partitions > 1
            and all(p.is_contiguous() for p in self._params)
        )
        self._stream_pulls = overlap and streaming_safe(self._model)
        self._early = EarlyPushes(layout, self._model) if overlap else None
        self._stream: PullStream | None = None  # this iteration's pull, while it loads
        self._pushes: Round | None = None  # this iteration's pushes, while they are sent
        self.early_pushes = 0  # partitions pushed while backward was still running

    def run(self, iterations: int) -> list[float]:
        """Run `iterations` iterations; returns each one's minibatch loss (before its update).

        Raises:
            WorkerError: a request was refused or timed out, or a partition's owner has no
                endpoint (see the class docstring).
            StaleViewError: see the module docstring.
            PartitionError: a partition has no owner, or a pulled partition has the wrong size.
        """
        try:
            return [self.step() for _ in range(iterations)]
        finally:
            self.close()

    def step(self) -> float:
        """One iteration at `clock`; on success the clock advances. Returns the loss.

        Besides its own share, the worker computes (under their identities) the shares of the
        failed workers it adopted for this clock, and first catches up on adopted clocks it has
        already passed (on the current parameters: a bounded-staleness update).

        Raises: as `run`; the clock is then unchanged, and calling `step` again redoes it.
        """
        try:
            return self._step()
        finally:
            self._stream, self._pushes = None, None  # given up or done: nothing loads later

    def _step(self) -> float:
        torch.set_num_threads(1)
        if self._ctx is None:
            self._ctx = zmq.Context()
        self._outstanding.clear()  # replies to an abandoned iteration are late now
        self._overflowed = False
        for identity, (first, end) in sorted(self.adoptions.items()):
            for clock in range(first, min(end, self.clock)):
                if self.roster is not None and identity not in self.roster.members(clock):
                    continue  # no share of it there (as for the current clock, below)
                if (identity, clock) not in self._adopted_done:
                    self._pull(-1)
                    pushes = Round(MessageKind.PUSH_ACK, self.layout.num_partitions)
                    self._compute(identity, clock, pushes)
                    self._wait_for(pushes)
                    self._adopted_done.add((identity, clock))
        self._clip_round(self.clock - 1, self.layout.num_partitions)
        if self.reassigner is not None:
            self.reassigner.at_clock(self.clock)
        identities = [self.spec.worker_id] + [
            w for w, (first, end) in sorted(self.adoptions.items()) if first <= self.clock < end
        ]
        computing = [
            w for w in identities if self.roster is None or w in self.roster.members(self.clock)
        ]
        if self.staging is not None:
            self.staging.keep_only(set(self.adoptions) | {self.spec.worker_id})
        t0 = time.perf_counter()
        # with FlexRR the worker helps peers until every partition is in (it could not help
        # on a half-loaded model), so its pulls load whole; its pushes may still leave early
        if self._stream_pulls and self._peer_inbox() is None:
            self._stream = self._start_pull(self.clock - self.spec.slack - 1)
        else:
            self._pull(self.clock - self.spec.slack - 1)
        t1 = time.perf_counter()
        replied = self._first_reply_at if self._first_reply_at is not None else t1
        self._phase("pulled")
        losses = []
        pushes = Round(MessageKind.PUSH_ACK, self.layout.num_partitions * len(computing))
        self._pushes = pushes
        for identity in computing:
            if identity == self.spec.worker_id and self.reassigner is not None:
                losses.append(self._compute_reassigned(self.reassigner, self.clock, pushes))
            else:
                losses.append(self._compute(identity, self.clock, pushes))
        streamed = 0.0
        if self._stream is not None:
            self._stream.finish()  # partitions no operation read (unused parameters)
            streamed, self._stream = self._stream.waited_s, None
        t2 = time.perf_counter()
        self._phase("computed")
        self._wait_for(pushes)
        self._pushes = None
        if self._loss_scale is not None:  # every push went through: the scale may change
            self._loss_scale.update(not self._overflowed)
        if self.reassigner is not None:
            self.reassigner.check(self)  # FlexRR: the offers saved for after our own push
        t3 = time.perf_counter()
        phases = {
            "wait": replied - t0,
            "pull": t1 - replied + streamed,  # with overlap: the waits inside the computation
            "compute": t2 - t1 - streamed,
            "push": t3 - t2,
        }
        for phase, seconds in phases.items():
            self.timings[phase] += seconds
        self._adopted_done.update((w, self.clock) for w in identities[1:])
        self.clock += 1
        return losses[0] if losses else float("nan")

    def settle(self) -> None:
        """With clipping, send the coefficient of the last clock computed: a clock is applied
        only once it has one, which a worker sends as it starts the next clock, and the last
        clock has no next. Raises: as `step`."""
        if self._ctx is None:
            self._ctx = zmq.Context()
        self._outstanding.clear()
        self._clip_round(self.clock - 1, self.layout.num_partitions)

    def _phase(self, name: str) -> None:
        if self.phase_hook is not None:
            self.phase_hook(name, self.clock)

    def _help_peers(self) -> None:
        if self.reassigner is not None:
            self.reassigner.check(self)

    def _peer_inbox(self) -> zmq.Socket[Any] | None:
        return self.reassigner.socket if self.reassigner is not None else None

    def _pull(self, min_clock: int) -> None:
        """Load every partition (as of at least `min_clock`) into the scratch model."""
        self._assembler.reset()  # the last round's pulled values are loaded: buffers to reuse
        n = self.layout.num_partitions
        me = self.spec.worker_id
        replies = self._round_trip(
            [(p, MessageKind.PULL, min_clock, {}, me) for p in range(n)], MessageKind.PULL_REPLY
        )
        parts = [self._pulled_values(p, replies[p]) for p in range(n)]
        self.layout.scatter(self._model, parts)  # raises PartitionError on a wrong size
        self._state_version += 1

    def _pulled_values(self, p: int, reply: dict[str, torch.Tensor]) -> torch.Tensor:
        values = reply.get("values")
        if values is None or values.dtype not in VALUE_DTYPES:
            raise WorkerError(self.spec.worker_id, f"bad pull reply for partition {p}")
        return values

    def _start_pull(self, min_clock: int) -> PullStream:
        """Ask for every partition (as of at least `min_clock`) and wait for the first reply;
        the rest load as the computation reads them. Only without a FlexRR inbox: a worker
        that helps peers while it waits needs a whole model to help on."""
        self._assembler.reset()  # the last round's pulled values are loaded: buffers to reuse
        pulls = Round(MessageKind.PULL_REPLY, self.layout.num_partitions)
        stream = PullStream(self.layout, self._model, lambda done: self._wait(done, pulls))
        # a wrong size raises PartitionError, as `scatter` does without overlap
        pulls.on_reply = lambda p, reply: stream.arrived(p, self._pulled_values(p, reply))
        for p in range(self.layout.num_partitions):
            self._submit(pulls, (p, MessageKind.PULL, min_clock, {}, self.spec.worker_id))
        self._wait(lambda: pulls.first_reply_at is not None or not pulls.waiting, pulls)
        self._first_reply_at = pulls.first_reply_at
        return stream

    def _autocast(self) -> AbstractContextManager[Any]:
        """Around a forward and its loss: the job's precision (`precision.autocast`)."""
        return autocast(self.spec.precision, self.device)

    def _loading(self) -> AbstractContextManager[Any]:
        """Around a forward pass: partitions still on their way load when first read."""
        return self._stream.guard() if self._stream is not None else nullcontext()

    def _buffers_before(self) -> torch.Tensor | None:
        """The buffers as pulled; None while a pull streams in (`_buffer_delta` then takes
        them from the pulled partitions, which may come after the forward pass started)."""
        if self._stream is not None:
            return None
        return self.layout.gather_buffers(self._model)

    def work_done(self) -> tuple[int, float]:
        """The rows this worker computed so far (its own, adopted shares and FlexRR help for
        peers, not rows helpers computed for it) and the seconds it spent computing them: the
        instance's speed, which BidBrain learns the job's work rates from."""
        rows, busy = self._plain_rows, self._plain_busy_s
        if self.reassigner is not None:
            s = self.reassigner.stats
            rows += s.own_rows - s.rows_helped_by_others + s.rows_helped_for_others
            busy += s.busy_s
        return rows, busy

    def _compute(self, identity: str, clock: int, pushes: Round) -> float:
        """`identity`'s minibatch of `clock` on the loaded model: its gradient pushed in
        `pushes` (partitions leave as backward completes them). Returns the loss."""
        stream = self._stream  # waits for streamed partitions are not computing
        started, waited = time.perf_counter(), 0.0 if stream is None else stream.waited_s
        mean = self._compute_share(identity, clock, pushes)
        waited = 0.0 if stream is None else stream.waited_s - waited
        self._plain_busy_s += time.perf_counter() - started - waited
        return mean

    def _compute_share(self, identity: str, clock: int, pushes: Round) -> float:
        """The share's rows in `spec.accumulate` micro-batches, their gradients summed in the
        model (partitions may leave early only from the last one's backward, when they are
        final), then pushed. Returns the share's mean loss."""
        if self.devices is not None:
            return self._compute_share_on_devices(identity, clock, pushes)
        with job_code_call(DATA):
            batch, n = self._minibatch(identity, clock)
        self._plain_rows += n
        self._model.zero_grad(set_to_none=True)
        before = self._buffers_before()
        spans = micro_batches(n, self.spec.accumulate)
        total, sent = 0.0, []
        for i, (start, end) in enumerate(spans):
            x, y = batch if len(spans) == 1 else micro_batch(batch, start, end)
            with self._loading(), self._autocast(), job_code_call(FORWARD):
                loss = self._loss_fn(self._model(x), y)
            # partitions leave early only from the last backward: then their gradients are final
            armed = i == len(spans) - 1 and self._arm_early(identity, clock, pushes)
            try:
                with job_code_call(BACKWARD):
                    if self.roster is not None:
                        # the loss is a sum over the rows: scaled by the global batch, the
                        # workers' updates add up to the global batch's mean gradient whoever
                        # computes what
                        (loss * (self._scale() / self.spec.batch_size)).backward()
                        total += float(loss.item())
                    else:  # a mean over the micro-batch: weighted by its share of the rows
                        (loss * (self._scale() * (end - start) / n)).backward()
                        total += float(loss.item()) * (end - start)
            finally:
                if armed:
                    sent = self._disarm_early(armed)
        delta = self._buffer_delta(before, clock)
        self._push_rest(identity, clock, pushes, sent, delta)
        return total / max(n, 1)

    def _compute_share_on_devices(self, identity: str, clock: int, pushes: Round) -> float:
        """`_compute_share` across the node's devices: each micro-batch's rows split between
        them (`DeviceGroup.backward`). Returns the share's mean loss."""
        rows = self._share_rows(identity, clock)
        n = len(rows)
        self._plain_rows += n
        self._model.zero_grad(set_to_none=True)
        before = self._buffers_before()
        total = sum(
            self._backward_rows(rows[start:end])
            for start, end in micro_batches(n, self.spec.accumulate)
        )
        delta = self._buffer_delta(before, clock)
        self._push_rest(identity, clock, pushes, [], delta)
        return total / max(n, 1)

    def _backward_rows(self, rows: torch.Tensor) -> float:
        """Dataset rows through the loaded model (on every device of the node, if it has
        several); their gradient, scaled by the global batch, accumulates in it. Returns the
        loss sum."""
        if self.devices is not None:
            exponent = self.loss_scale_exponent or 0
            return self.devices.backward(
                self._model, rows, self._take_backward, self._state_version, exponent
            )
        return self._take_backward(rows)

    def _take_backward(self, rows: torch.Tensor) -> float:
        with job_code_call(DATA):
            x, y = self._rows.take(rows)
        return self._backward(x, y)

    def _compute_reassigned(self, reassigner: Reassigner, clock: int, pushes: Round) -> float:
        """The own share of `clock` in chunks, some rows perhaps computed by helpers; pushed
        in `pushes` (early only if the share was one chunk: see `backward_rows`)."""
        self._model.zero_grad(set_to_none=True)
        before = self._buffers_before()
        if self._early is not None:
            self._early.sent = []  # filled if `backward_rows` arms it (one chunk)
        loss_sum, rows, helped = reassigner.compute_own(self, clock)
        sent = list(self._early.sent) if self._early is not None else []
        if sent and helped:
            raise AgileMLError(f"worker {self.spec.worker_id}: helped after an early push")
        delta = self._buffer_delta(before, clock)
        self._push_rest(self.spec.worker_id, clock, pushes, sent, delta, helped)
        return loss_sum / rows

    def _arm_early(self, identity: str, clock: int, pushes: Round) -> bool:
        """Push partitions from the gradient hooks during the coming backward."""
        if self._early is None:
            return False

        def send(p: int) -> None:
            grad = self.layout.partition_grad(self._params, p)
            self._submit(pushes, (p, MessageKind.PUSH, clock, self._delta(p, grad), identity))
            self.early_pushes += 1

        return self._early.arm(send)

    def _disarm_early(self, armed: bool) -> list[int]:
        return self._early.disarm() if armed and self._early is not None else []

    def _push_rest(
        self,
        identity: str,
        clock: int,
        pushes: Round,
        sent: list[int],
        buffer_delta: torch.Tensor | None,
        helped: list[list[torch.Tensor]] | None = None,
    ) -> None:
        """Push the partitions not sent early, each with the helpers' gradients of its rows
        added (in the order they came). fp16: the gradient is unscaled first, and one that is
        not finite goes as NaN (`precision.LossScale`): every server skips the clock's step."""
        if self._loss_scale is not None and not self._loss_scale.unscale(self._params):
            self.skipped_clocks.add(clock)
            self._overflowed = True
        done = set(sent)
        host = None
        if self.staging is not None:  # on a GPU: every gradient to the host at once
            host = self.staging.gradients(identity, self._params, buffer_delta)
        for p in range(self.layout.num_partitions):
            if p in done:
                continue
            if host is not None:
                grad = host[self.layout.slice(p)]  # the staging vector: ours to add to
            else:
                grad = self.layout.partition_grad(self._params, p, buffer_delta)
                if helped:
                    grad = grad.clone()  # it may be a view of the model's gradient
            if helped:
                for parts in helped:
                    grad.add_(parts[p])
            self._submit(pushes, (p, MessageKind.PUSH, clock, self._delta(p, grad), identity))

    def _delta(self, p: int, grad: torch.Tensor) -> dict[str, torch.Tensor]:
        """A push's tensors: partition p's gradient, rounded to bfloat16 where it travels so
        (`_bf16_on_wire`)."""
        if self._bf16_on_wire(p):
            return {"delta": grad.to(torch.bfloat16)}
        return {"delta": grad}

    # -- what the reassigner uses ------------------------------------------------------------

    @property
    def dataset_rows(self) -> int:
        """How many rows the data set has."""
        return len(self._rows)

    @property
    def batch_rows(self) -> int:
        """The rows of a step's batch (with a roster, the global batch that the members share)."""
        return self.spec.batch_size

    @property
    def micro_batches(self) -> int:
        """How many micro-batches a share is computed in (gradient accumulation)."""
        return self.spec.accumulate

    def share_rows(self, identity: str, clock: int) -> int:
        """How many rows of the global batch of `clock` are `identity`'s.

        Raises:
            RosterError: `identity` does not compute `clock`.
        """
        return len(self._share_rows(identity, clock))

    def backward_rows(self, identity: str, clock: int, start: int, end: int) -> tuple[float, bool]:
        """Rows [start, end) of `identity`'s share of `clock` through the loaded model; their
        gradient (scaled by the global batch) accumulates in it. Returns (loss sum, whether the
        input came from the preloaded cache)."""
        if self.devices is not None:  # no early pushes: the devices need whole batches
            return self._backward_rows(self._share_rows(identity, clock)[start:end]), False
        cached = self._preloaded.get((identity, clock, self._roster_version()))
        share = self._loaded_share(identity, clock) if cached is None else None
        if cached is not None and start >= cached[0]:
            first, batch = cached
            x, y = micro_batch(batch, start - first, end - first)
            hit = True
        elif share is not None:  # fetched ahead by the rows loader
            x, y = micro_batch(share, start, end)
            hit = False
        else:
            with job_code_call(DATA):
                x, y = self._rows.take(self._share_rows(identity, clock)[start:end])
            hit = False
        # the own share in one chunk: its gradients are final when this backward ends (no
        # rows were offered, none are left to offer), so partitions may leave as they complete
        whole = (
            identity == self.spec.worker_id
            and self._pushes is not None
            and clock == self.clock
            and start == 0
            and end == self.share_rows(identity, clock)
        )
        armed = whole and self._arm_early(identity, clock, self._pushes)  # type: ignore[arg-type]
        try:
            loss = self._backward(x, y)
        finally:
            self._disarm_early(armed)  # what it sent stays in `_early.sent`
        return loss, hit

    def backward_first_rows(self, n: int) -> float:
        """The first `n` rows of the data set (at most all of them) through the loaded model,
        as `backward_rows` does: for timing and warming up before the first clock, when no
        share is known yet. Returns the loss sum."""
        if self.devices is not None:
            return self._backward_rows(torch.arange(min(n, len(self._rows))))
        x, y = self._rows.take(torch.arange(min(n, len(self._rows))))
        if self._early is None:
            return self._backward(x, y)
        with self._early.probe():  # early pushes off if a gradient accumulates twice
            return self._backward(x, y)

    def warm_up(self, rows: int = 8) -> None:
        """One forward and backward before the first clock, gradients discarded: the first
        pass allocates and faults in what every later one reuses, and a joining node should
        pay that while it loads, not in a clock the running workers wait on. (Accumulating:
        not over a micro-batch of the global batch.)"""
        stash = self.stash_grads()
        try:
            self.backward_first_rows(
                min(rows, math.ceil(self.spec.batch_size / self.spec.accumulate))
            )
        finally:
            self.restore_grads(stash)

    def _backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        x, y = to_device(x, self.device), to_device(y, self.device)
        with self._loading(), self._autocast(), job_code_call(FORWARD):
            loss = self._loss_fn(self._model(x), y)
        with job_code_call(BACKWARD):
            (loss * (self._scale() / self.spec.batch_size)).backward()
            return float(loss.item())

    @property
    def device_count(self) -> int:
        """The devices it trains on now: its node's group's, else its own one."""
        return self.devices.size if self.devices is not None else 1

    @property
    def loss_scale_exponent(self) -> int | None:
        """fp16: the loss scale is 2 ** this (`precision.LossScale`); None otherwise."""
        return self._loss_scale.exponent if self._loss_scale is not None else None

    def start_loss_scale_at(self, exponent: int) -> None:
        """fp16: start from the scale the running workers reached (a joiner), not 2 ** 16."""
        if self._loss_scale is not None:
            self._loss_scale.exponent = exponent

    def _scale(self) -> float:
        """fp16's loss scale (`LossScale`), 1 otherwise."""
        return self._loss_scale.scale if self._loss_scale is not None else 1.0

    def preload(self, identity: str, clock: int, fraction: float) -> None:
        """Cache the last `fraction` of `identity`'s input rows of `clock` (offers are cut from
        the end), keeping the two newest clocks (not with several devices: they take rows)."""
        if self.devices is not None:
            return
        key = (identity, clock, self._roster_version())
        if key in self._preloaded:
            return
        try:
            rows = self._share_rows(identity, clock)
        except AgileMLError:
            return  # not a member at that clock: nothing to help with
        first = len(rows) - math.ceil(len(rows) * fraction)
        with job_code_call(DATA):
            self._preloaded[key] = (first, self._rows.take(rows[first:]))
        for old in [k for k in self._preloaded if k[1] < clock - 1]:
            del self._preloaded[old]

    def stash_grads(self) -> list[torch.Tensor | None]:
        """Set the accumulated gradients aside (the model's gradients are then empty)."""
        params = list(self._model.parameters())
        stash = [p.grad for p in params]
        for p in params:
            p.grad = None
        return stash

    def restore_grads(self, stash: list[torch.Tensor | None]) -> None:
        for p, g in zip(self._model.parameters(), stash, strict=True):
            p.grad = g

    def take_grads(self) -> list[torch.Tensor]:
        """The accumulated gradients as partitions; the model's are emptied."""
        grads = self.layout.gather_grads(self._model)
        self._model.zero_grad(set_to_none=True)
        return grads

    def check_abort(self) -> None:
        """Raise StaleViewError if the caller wants the iteration given up."""
        if self._abort():
            raise StaleViewError(f"worker {self.spec.worker_id}: aborted by its node")

    def _roster_version(self) -> int:
        return self.roster.version if self.roster is not None else -1

    def _share_rows(self, identity: str, clock: int) -> torch.Tensor:
        """The dataset rows of `identity`'s share of `clock` under the current roster.

        Raises:
            AgileMLError: no roster; RosterError: `identity` does not compute `clock`.
        """
        key = (identity, clock, self._roster_version())
        rows = self._rows_cache.get(key)
        if rows is None:
            if self.roster is None:
                raise AgileMLError("row shares need a roster")
            batch = global_batch_indices(
                self.spec.seed, clock, len(self._rows), self.spec.batch_size
            )
            share = worker_share(self.roster.members(clock), identity, self.spec.batch_size)
            rows = batch[share]
            if len(self._rows_cache) > 64:
                self._rows_cache.clear()
            self._rows_cache[key] = rows
        return rows

    def _buffer_delta(self, before: torch.Tensor | None, clock: int) -> torch.Tensor | None:
        """How this computation changed the buffers (`before`: as pulled; None: take them
        from the streaming pull), over the clock's worker count; the buffers are put back as
        pulled (another identity may compute next)."""
        if not self.layout.buffer_sizes:
            return None
        if before is None:
            assert self._stream is not None, "no buffers before and no pull streaming"
            before = self._stream.pulled_buffers()
        after = self.layout.gather_buffers(self._model)
        self.layout.load_buffers(self._model, before)
        workers = len(self.roster.members(clock)) if self.roster is not None else 1
        return (after - before).div_(max(workers, 1))

    def _minibatch(self, identity: str, clock: int) -> tuple[Batch, int]:
        """`identity`'s rows of `clock` as a batch on the worker's device, and their count."""
        if self.roster is not None:
            rows = self._share_rows(identity, clock)
        else:
            key = f"{self.spec.seed}/{identity}/{clock}".encode()
            gen = torch.Generator().manual_seed(zlib.crc32(key))
            rows = torch.randint(0, len(self._rows), (self.spec.batch_size,), generator=gen)
        loaded = self._loaded_share(identity, clock)
        x, y = loaded if loaded is not None else self._rows.take(rows)
        return (to_device(x, self.device), to_device(y, self.device)), len(rows)

    def _loaded_share(self, identity: str, clock: int) -> Batch | None:
        """This worker's own share of `clock` as the rows loader fetched it (`loading`; None
        without one, or when it has none ready); the loader is asked for the next share."""
        loader = self._rows if isinstance(self._rows, LoaderRows) else None
        if loader is None or self.roster is None or identity != self.spec.worker_id:
            return None
        key = (clock, self._roster_version())
        if self._loaded is None or self._loaded[0] != key:
            self._loaded = (key, loader.take_prefetched(key))
            for following in range(clock + 1, min(clock + 1 + AHEAD, self.spec.iterations)):
                if identity in self.roster.members(following):
                    loader.prefetch((following, key[1]), self._share_rows(identity, following))
        return self._loaded[1]
