"""What a host of training jobs uses from the runtime: the one interface the controller (on AWS)
and the offline world call, so they know nothing of the runtime's insides.

A host starts a job's elasticity controller (`HostedTraining.start`), tells the job's nodes
where it listens (`endpoint`), reads its progress for the dashboard and for the work done
(`progress`), measures the model's loss when it wants to (`model_loss`), and stops it.

    hosted = HostedTraining.start(spec, token=token, host="0.0.0.0", port=29500)
    hosted.progress()  # TrainingStatus(iteration=..., loss=..., ...)
    hosted.watch_evaluations(checkpoints)  # `eval_every`: evaluate() on them, in the background
    hosted.evaluations()  # [{"iteration": 50, "held_out_accuracy": 0.93}, ...]
    hosted.stop()      # the nodes are told to shut down
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from torch import nn

from orchestrator.agileml import checkpoints
from orchestrator.agileml.control import TrainingSpec, TrainingStatus
from orchestrator.agileml.coordinator import Coordinator
from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.evaluations import EvaluationWatch
from orchestrator.agileml.event_files import event_file_bytes
from orchestrator.agileml.jobcode import load_job_code
from orchestrator.agileml.parts import ModelParts, TrainingParts, model_parts, training_parts
from orchestrator.agileml.spec import validate_training_section
from orchestrator.artifacts import Folder

if TYPE_CHECKING:
    from orchestrator.agileml.pipeline.hosted import HostedPipeline

    #: A hosted job's training: data-parallel (`HostedTraining`) or a pipeline.
    Hosted: TypeAlias = "HostedTraining | HostedPipeline"

__all__ = [
    "AgileMLError",
    "HostedTraining",
    "TrainingSpec",
    "TrainingStatus",
    "evaluate_weights",
    "event_file_bytes",
    "host_training",
    "validate_training_section",
]


log = logging.getLogger(__name__)

#: How often the background evaluation looks for a new checkpoint.
EVALUATION_POLL_S = 1.0
#: A host keeps an ended job until the evaluation of its model at the end is done, at most
#: this long after the final weights were written (`HostedTraining.evaluating`).
END_EVALUATION_WAIT_S = 300.0


class HostedTraining:
    """One job's elasticity controller, hosted (see the module docstring)."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator
        self._built: TrainingParts | None = None
        self._model_built: ModelParts | None = None
        self._watch: EvaluationWatch | None = None
        self._watch_lock = threading.Lock()
        self._watching = threading.Event()  # set: the evaluation thread is to stop
        # the model at the end, for the evaluation thread to evaluate once (`save_weights`);
        # when it was handed over, and whether its evaluation is done
        self._end: tuple[int, nn.Module] | None = None
        self._end_at: float | None = None
        self._end_done = False

    @classmethod
    def start(cls, spec: TrainingSpec, *, token: bytes, host: str, port: int) -> HostedTraining:
        """Bind `host:port` (0: any free port) and start the job's elasticity controller.

        Raises:
            zmq.ZMQError: the port is taken (a host tries the next one).
        """
        coordinator = Coordinator(spec, token=token, host=host, port=port)
        coordinator.start()
        return cls(coordinator)

    @property
    def spec(self) -> TrainingSpec:
        return self._coordinator.spec

    @property
    def endpoint(self) -> str:
        """Where the job's nodes join (`tcp://host:port` as bound)."""
        return self._coordinator.endpoint

    @property
    def error(self) -> str | None:
        """Why the job's training was aborted (None: it was not)."""
        return self._coordinator.error

    def progress(self) -> TrainingStatus:
        """Iteration, loss and counters now."""
        progress = self._coordinator.progress()
        return TrainingStatus(
            iteration=progress.iteration,
            loss=_latest_loss(self._coordinator.node_losses()),
            reassigned_rows=progress.reassigned_rows,
            stage_transitions=progress.stage_transitions,
        )

    def stages(self) -> list[dict[str, Any]]:
        """A pipeline job's stages (see `HostedPipeline.stages`): none for data-parallel."""
        return []

    def members(self) -> frozenset[str]:
        """The nodes (instances) the job's training counts now: joined, heartbeating, not
        failed (the controller releases an instance whose node is not among them)."""
        return self._coordinator.members()

    def node_work(self) -> dict[str, tuple[int, float]]:
        """Each node's rows computed so far and the seconds it spent computing them (the
        instance's speed, for learning the job's work rates)."""
        return self._coordinator.node_work()

    def node_devices(self) -> dict[str, int]:
        """The devices each node trained on (its instance's GPUs it used), as heard."""
        return self._coordinator.node_devices()

    def events(self) -> list[str]:
        """What the elasticity controller did so far, one line each (started, evicted, ...)."""
        return [
            f"{e.kind} {' '.join(e.nodes)} {e.detail}".strip() for e in self._coordinator.events()
        ]

    def model_loss(self, timeout_s: float = 1.0) -> float | None:
        """The model's loss on the training set (see `TrainingParts.loss_of`), from the
        parameters as they are now (None when they cannot be read yet: not started, or an
        owner is moving)."""
        try:
            params = self._coordinator.fetch_parameters(timeout_s=timeout_s, final=False)
        except AgileMLError:
            return None
        parts = self._parts()
        return parts.loss_of(parts.model_with(params))

    @property
    def done(self) -> bool:
        """Every worker finished the job's iterations."""
        return self._coordinator.view().done

    def save_weights(self, folder: checkpoints.Location, timeout_s: float = 10.0) -> int:
        """Write the model as it is now (every iteration in it once the job is `done`) into
        `folder` as `model.safetensors`; returns the iterations in it.

        Raises:
            AgileMLError: the parameters could not be read (no server answered in time), or
                the job was aborted (its nodes were told to shut down with the abort: a
                checkpoint holds its weights, not servers that are going).
        """
        if self.error is not None:
            raise AgileMLError(f"the job was aborted; its servers shut down: {self.error}")
        done = self.done
        params = self._coordinator.fetch_parameters(timeout_s=timeout_s, final=done)
        model = self._model().model_with(params)
        checkpoints.save_weights(model, folder)
        if done and self.error is None:  # `eval_every`: once more at the end, as `train` does
            with self._watch_lock:
                if self._watch is not None and self._end_at is None:
                    self._end, self._end_at = (self.spec.iterations, model), time.monotonic()
        return self.spec.iterations if done else self._coordinator.progress().iteration

    def save_checkpoint_weights(
        self, checkpoint: checkpoints.Location, folder: checkpoints.Location
    ) -> int:
        """Write the model of a complete checkpoint into `folder` as `model.safetensors`;
        returns the iterations in it.

        Raises:
            AgileMLError: not a complete checkpoint of this job's partitioning.
        """
        ckpt = checkpoints.read(checkpoint, self.spec.num_partitions)
        checkpoints.save_weights(self._model().model_with(ckpt.values), folder)
        return ckpt.clock + 1

    def evaluate(self, timeout_s: float = 1.0) -> dict[str, float] | None:
        """The job's `evaluate(model)` on the parameters as they are now (None: the job has
        no evaluate hook, or the parameters cannot be read yet)."""
        parts = self._parts()
        if parts.code is None or parts.code.evaluate is None:
            return None
        try:
            params = self._coordinator.fetch_parameters(timeout_s=timeout_s, final=False)
        except AgileMLError:
            return None
        model = parts.model_with(params)
        model.eval()
        with torch.no_grad():
            return {k: float(v) for k, v in parts.code.evaluate(model).items()}

    def watch_evaluations(self, checkpoints: Folder) -> None:
        """With `spec.eval_every`: run the job's `evaluate(model)` on its checkpoints in
        `checkpoints` at least that many iterations apart, on a thread of its own (a slow
        evaluate() never holds the host up), until `stop`. Once; later calls do nothing."""
        every = self.spec.eval_every
        with self._watch_lock:
            if every is None or self._watch is not None:
                return
            parts = self._model()
            if parts.code is None or parts.code.evaluate is None:
                return
            self._watch = EvaluationWatch(
                checkpoints,
                every,
                parts.code,
                parts,
                since_unix=time.time(),
                iterations=self.spec.iterations,
            )
        threading.Thread(target=self._evaluate_loop, name="evaluations", daemon=True).start()

    def evaluating(self) -> bool:
        """Whether the evaluation of the model at the end is on its way (handed over by
        `save_weights`, not done, `END_EVALUATION_WAIT_S` not passed): its host keeps the
        ended job until then, so that the job's last report and TensorBoard carry it."""
        with self._watch_lock:
            if self._end_at is None or self._end_done or self._watch is None:
                return False
            failed = self._watch.error is not None
            return not failed and time.monotonic() - self._end_at < END_EVALUATION_WAIT_S

    def evaluations(self) -> list[dict[str, Any]]:
        """The evaluations during the run so far, oldest first (`watch_evaluations`)."""
        with self._watch_lock:
            return [] if self._watch is None else list(self._watch.results)

    def _evaluate_loop(self) -> None:
        watch = self._watch
        assert watch is not None
        while not self._watching.wait(EVALUATION_POLL_S):
            try:
                watch.poll()  # appends to `results`; a list append is atomic
            except Exception as exc:  # noqa: BLE001 - a store hiccup: look again later
                log.warning("evaluation poll failed", extra={"error": str(exc)})
            with self._watch_lock:
                end, self._end = self._end, None
            if end is not None:  # after the checkpoints: the last result
                watch.add_end(*end)
                with self._watch_lock:
                    self._end_done = True
            if watch.error is not None:
                log.warning("the job's evaluate() failed; no more evaluations",
                            extra={"job_id": self.spec.job_id, "error": watch.error})  # fmt: skip
                return

    def initial_loss(self) -> float:
        """The model's loss on the training set before any update."""
        parts = self._parts()
        return parts.loss_of(parts.initial_model)

    def _parts(self) -> TrainingParts:
        """Everything a node builds (the job's data included: for the offline demo's loss)."""
        if self._built is None:
            self._built = training_parts(self.spec)
        return self._built

    def _model(self) -> ModelParts:
        """The model only: what assembling weights needs (the data is never fetched here)."""
        if self._built is not None:
            return self._built
        if self._model_built is None:
            self._model_built = model_parts(self.spec)
        return self._model_built

    def stop(self) -> None:
        """Stop the elasticity controller; its nodes are told to shut down."""
        self._watching.set()
        self._coordinator.stop()


def evaluate_weights(code: str | Path, weights: Path) -> dict[str, float]:
    """A job's `evaluate(model)` on the weights it handed back (empty: no evaluate hook).

    Raises:
        JobCodeError: the job's code cannot be loaded.
        RuntimeError: the weights do not fit its model.
    """
    from safetensors.torch import load_file

    job = load_job_code(code)
    if job.evaluate is None:
        return {}
    model = job.model()
    model.load_state_dict(load_file(str(weights)))
    model.eval()
    with torch.no_grad():
        return {k: float(v) for k, v in job.evaluate(model).items()}


def host_training(
    spec: TrainingSpec, *, token: bytes, host: str, port: int
) -> HostedTraining | HostedPipeline:
    """Start hosting the job's training on `host:port`: a data-parallel job's elasticity
    controller, or a pipeline job's supervisor (`parallelism: pipeline`).

    Raises:
        zmq.ZMQError: the port is taken (a host tries the next one).
        AgileMLError / JobCodeError: a pipeline job's code cannot be loaded.
    """
    if spec.parallelism == "pipeline":
        from orchestrator.agileml.pipeline.hosted import HostedPipeline  # planner, profiler

        return HostedPipeline.start(spec, token=token, host=host, port=port)
    return HostedTraining.start(spec, token=token, host=host, port=port)


def _latest_loss(losses: Mapping[str, list[tuple[int, float]]]) -> float | None:
    """The mean of the nodes' losses at the latest clock any node reported."""
    latest: dict[int, list[float]] = {}
    for pairs in losses.values():
        for clock, loss in pairs:
            if math.isfinite(loss):
                latest.setdefault(clock, []).append(loss)
    if not latest:
        return None
    values = latest[max(latest)]
    return sum(values) / len(values)
