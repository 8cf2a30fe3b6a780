"""`TrainingHost`: the AgileML elasticity controller of every training job, hosted by the
controller (on the controller node on AWS; in the demo's process offline), through the runtime's
hosting interface (`orchestrator.agileml.hosting`).

A job trains when its spec has a `training` section (`TrainingSpec` fields but `job_id`).
When the controller is about to launch the job's first instance, `tags_for(job_id)` starts
the job's elasticity controller on the next free port from `base_port` and returns the launch
tag that tells the instance agents where it is (read from the instance metadata on AWS, from
the instance's tags offline).
Every `step(now_s)` reports each hosted job's training to the store (the dashboard and
/metrics read it), sets its work done to the fraction of iterations done times the job's work
(what BidBrain's cost per unit of work divides by, on AWS and offline alike) and, with
`instance_work_from_nodes`, each node's measured work (BidBrain learns the job's work rates
from it; the offline world's instances report theirs on its market clock instead); a job that
has ended has its elasticity controller stopped (nodes are told to shut down). `outcome`
tells the controller how far a job trained and why it was aborted.

Failure semantics: an elasticity controller that cannot bind tries the next port (up to
`max_jobs`); a store write that fails is logged and the next step writes the (cumulative)
numbers again. Each job's port is kept in the store: a restarted controller's first `step`
hosts every job it hosted before on the same port, so the workers (whose tags name it)
reconnect when systemd restarts them.

Artifacts (with `artifacts_root`, the artifact store: a local directory or an S3 prefix, see
`orchestrator.artifacts`): each job's nodes fetch its uploaded code from it and its reliable
nodes checkpoint into its folder there (every `checkpoint_every_s` unless its spec says
otherwise); `step` assembles the newest checkpoint's weights, and writes the final weights once
the training is done or the job ends (from the live model, else from the newest checkpoint).
A job hosted again after a restart resumes from its newest checkpoint: at most one checkpoint
interval is trained again, and the work counted stays as recorded (the report never lowers
it).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from orchestrator.agileml.hosting import (
    AgileMLError,
    TrainingSpec,
    event_file_bytes,
    host_training,
)
from orchestrator.artifacts import (
    FINAL_INFO,
    WEIGHTS,
    Folder,
    JobArtifacts,
    folder_at,
    folder_name,
)
from orchestrator.cloud.instances import TAG_AGILEML_CONTROLLER, TAG_PARALLELISM
from orchestrator.controller.outcomes import TrainingOutcome
from orchestrator.errors import UserError
from orchestrator.settings import MAX_HOSTED_TRAINING_JOBS
from orchestrator.store import (
    Evaluation,
    InstanceWork,
    JobRecord,
    NotFoundError,
    PipelineStageReport,
    Store,
    TrainingReport,
)
from orchestrator.units import SECONDS_PER_HOUR

if TYPE_CHECKING:
    from orchestrator.agileml.hosting import Hosted

log = logging.getLogger(__name__)

DEFAULT_BASE_PORT = 29500


class NodeWork:
    """Each node's (instance's) work for a job in the job's units, over the hours it spent
    computing (a row is 1 / (global batch x iterations) of the job's work), summed over the
    node's restarts: a node process counts from 0 again when it restarts (its agent restarts
    it, or a restarted controller's nodes join again), so the counts it had are kept as a
    base, from the store's record the first time this host sees the node."""

    def __init__(self, store: Store) -> None:
        self.store = store
        # job -> node -> (the counts of its earlier processes, its process's last counts)
        self._seen: dict[str, dict[str, tuple[InstanceWork, InstanceWork]]] = {}

    def totals(
        self, job_id: str, training: Hosted, work_gpu_hours: float
    ) -> dict[str, InstanceWork]:
        spec = training.spec
        per_row = work_gpu_hours / (spec.global_batch * spec.iterations)
        seen = self._seen.setdefault(job_id, {})
        recorded: dict[str, InstanceWork] | None = None
        out = {}
        devices = training.node_devices()
        for node, (rows, seconds) in training.node_work().items():
            if rows <= 0 or seconds <= 0:
                continue
            gpus = devices.get(node, 1)
            now = _work(rows * per_row, seconds / SECONDS_PER_HOUR, gpus)
            if node not in seen:  # this host's first look: the store has what came before
                recorded = self.store.instance_work(job_id) if recorded is None else recorded
                before = recorded.get(node, _NOTHING)
                # more recorded than counted now: the node restarted since it was recorded
                restarted = before.work_gpu_hours > now.work_gpu_hours
                seen[node] = (before if restarted else _NOTHING, now)
            base, last = seen[node]
            if now.work_gpu_hours < last.work_gpu_hours:  # the node's process restarted
                base = _work(
                    base.work_gpu_hours + last.work_gpu_hours, base.hours + last.hours, gpus
                )
            seen[node] = (base, now)
            out[node] = _work(
                base.work_gpu_hours + now.work_gpu_hours, base.hours + now.hours, gpus
            )
        return out

    def forget(self, job_id: str) -> None:
        self._seen.pop(job_id, None)


def _work(work_gpu_hours: float, hours: float, gpus: int = 1) -> InstanceWork:
    """An AgileML node's work, done on `gpus` devices (its instance's GPUs it trained on:
    BidBrain learns the rate per GPU from them)."""
    return InstanceWork(work_gpu_hours=work_gpu_hours, hours=hours, gpus=gpus)


_NOTHING = _work(0.0, 0.0)


def _evaluations(training: Hosted) -> list[Evaluation]:
    """The hosted job's evaluations so far as reports carry them (a result that cannot be
    one is left out: the job's metrics are its own)."""
    out = []
    for result in training.evaluations():
        try:
            out.append(Evaluation.of(result))
        except (ValueError, TypeError, KeyError):
            log.warning("an evaluation left out", extra={"result": repr(result)[:200]})
    return out


def _reported(reports: list[TrainingReport]) -> list[Evaluation]:
    """The evaluations the stored reports carry, each once."""
    return list({r.evaluation.iteration: r.evaluation for r in reports if r.evaluation}.values())


def training_spec_of(job: JobRecord) -> TrainingSpec | None:
    """The job's `TrainingSpec`, None when its spec has no `training` section.

    Raises:
        UserError: the section is invalid (named field; the submission edge checks it first).
    """
    section = job.spec.get("training")
    if not section:
        return None
    try:
        return TrainingSpec.model_validate({**section, "job_id": job.job_id})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise UserError(
            f"job {job.job_id}: training.{where}: {first['msg']}",
            field=f"training.{where}",
            fix="correct the job spec's training section (agileml TrainingSpec fields)",
        ) from None


class TrainingHost:
    """Runs and reports the elasticity controllers of the store's training jobs."""

    def __init__(
        self,
        store: Store,
        *,
        token: bytes,
        advertise_host: str,
        bind_host: str = "0.0.0.0",
        base_port: int = DEFAULT_BASE_PORT,
        max_jobs: int = MAX_HOSTED_TRAINING_JOBS,
        instance_work_from_nodes: bool = True,
        artifacts_root: Folder | str | Path | None = None,
        checkpoint_every_s: float = 600.0,
        checkpoints: bool = True,
    ) -> None:
        self.store = store
        self.instance_work_from_nodes = instance_work_from_nodes
        self.artifacts_root = None if artifacts_root is None else folder_at(artifacts_root)
        self.checkpoint_every_s = checkpoint_every_s
        # checkpoints (and uploaded code) need a store the job's nodes and this host share:
        # a local directory offline, S3 on AWS; without one the final weights come over the wire
        self.checkpoints = checkpoints
        self._token = token
        self.advertise_host = advertise_host
        self.bind_host = bind_host
        self.base_port = base_port
        self.max_jobs = max_jobs
        self._lock = threading.Lock()
        self._hosted: dict[str, tuple[Hosted, int]] = {}
        self._node_work = NodeWork(store)
        # job -> what its TensorBoard file last held: (evaluations, done, minute)
        self._tensorboard: dict[str, tuple[int, bool, int]] = {}

    def endpoint(self, job_id: str) -> str | None:
        """Where the job's workers join, None when it is not hosted."""
        with self._lock:
            hosted = self._hosted.get(job_id)
        return None if hosted is None else f"tcp://{self.advertise_host}:{hosted[1]}"

    def hosted(self, job_id: str) -> Hosted | None:
        """The job's hosted training, None when it is not hosted."""
        with self._lock:
            hosted = self._hosted.get(job_id)
        return None if hosted is None else hosted[0]

    def tags_for(self, job_id: str) -> Mapping[str, str]:
        """The launch tags of the job's next instance: its elasticity controller's address,
        started now if needed (no tag for a job that does not train)."""
        job = self.store.get_job(job_id)
        if job.state.is_terminal:
            self.store.forget_training_port(job_id)
            return {}
        spec = training_spec_of(job)
        if spec is None:
            return {}
        with self._lock:
            if job_id not in self._hosted:
                self._hosted[job_id] = self._start(spec, self.store.training_ports().get(job_id))
                self.store.set_training_port(job_id, self._hosted[job_id][1])
                artifacts = self.artifacts(job_id)
                if artifacts is not None and self.checkpoints:  # `eval_every`'s checkpoints
                    self._hosted[job_id][0].watch_evaluations(artifacts.checkpoints)
                elif spec.eval_every is not None:
                    log.warning("eval_every needs checkpoints in an artifact store; none here",
                                extra={"job_id": job_id})  # fmt: skip
        endpoint = self.endpoint(job_id)
        if not endpoint:
            return {}
        tags = {TAG_AGILEML_CONTROLLER: endpoint}
        if spec.parallelism == "pipeline":
            tags[TAG_PARALLELISM] = "pipeline"
        return tags

    def step(self, now_s: float) -> None:
        """Host again the jobs hosted before a restart; report every hosted job's training;
        stop the elasticity controllers of ended jobs."""
        for job_id in self.store.training_ports():
            if job_id in self._hosted:
                continue
            try:
                self.tags_for(job_id)
            except NotFoundError:
                self.store.forget_training_port(job_id)
            except Exception as exc:  # noqa: BLE001 - a store hiccup or a bad spec: log, go on
                log.warning("hosting %s again failed: %r", job_id, exc)
        with self._lock:
            hosted = dict(self._hosted)
        for job_id, (training, _) in hosted.items():
            try:
                job = self.store.get_job(job_id)
                # an ended job is kept while its end's evaluation is on its way
                pending = job.state.is_terminal and training.evaluating()
                if not job.state.is_terminal:  # an ended job's numbers stay as they ended
                    self._report(job, training, now_s)
                elif not pending:
                    self._report_end(job, training, now_s)
            except Exception as exc:  # noqa: BLE001 - a store hiccup: report at the next step
                log.warning("training report of %s failed: %r", job_id, exc)
                continue
            self._keep_artifacts(job, training)
            if job.state.is_terminal and not pending:
                self._stop(job_id)

    def _report_end(self, job: JobRecord, training: Hosted, now_s: float) -> None:
        """An ended job's last report, when an evaluation came after its reports did (the
        model at the end's): the same numbers, with that evaluation."""
        evaluations = _evaluations(training)
        last = self.store.latest_training(job.job_id)
        if evaluations and last is not None and last.evaluation != evaluations[-1]:
            self._report(job, training, now_s)

    def outcome(self, job: JobRecord) -> TrainingOutcome | None:
        """How far the job trained (None: it does not train): from its hosted runtime, else
        (not hosted yet, or not again since a restart) the last iteration reported."""
        hosted = self.hosted(job.job_id)
        if hosted is None:  # the job's section is read only when no runtime holds it
            spec = training_spec_of(job)
            if spec is None:
                return None
            last = self.store.latest_training(job.job_id)
            return TrainingOutcome(
                last.iteration if last is not None else 0, spec.iterations, live=False
            )
        error, heard, members = hosted.error, frozenset(hosted.node_work()), hosted.members()
        return TrainingOutcome(
            iterations_done=hosted.progress().iteration,
            iterations=hosted.spec.iterations,
            done=hosted.done and error is None,  # an aborted job is `done` too
            error=error,
            nodes_heard=len(heard),
            members=members,
            heard=heard | members,
        )

    def final_weights(self, job_id: str, iterations: int) -> str | None:
        """Where the job's final weights are, if they hold all its `iterations` (None: not
        written, written from an older checkpoint, or no artifact store)."""
        artifacts = self.artifacts(job_id)
        if artifacts is None or not artifacts.has_final():
            return None
        try:
            info = json.loads(artifacts.final.read_bytes(FINAL_INFO))
            done = int(info.get("iterations_done", 0))
        except (ValueError, TypeError, AttributeError):  # a torn or foreign file: not final
            return None
        if done < iterations:
            return None
        where = artifacts.final.location.split("?", 1)[0]  # an S3 endpoint's query left out
        return f"{where}/{WEIGHTS}"

    def restart(self, job_id: str) -> None:
        """Stop the job's runtime; the next launch hosts it again on its port, from its
        newest checkpoint (`tags_for`)."""
        self._stop(job_id, forget=False)

    def diagnose(self, job_id: str) -> str:
        """What the job's runtime sees: which nodes it heard from, and its last events."""
        hosted = self.hosted(job_id)
        if hosted is None:
            return "its runtime is not hosted here"
        heard = sorted(hosted.node_work())
        text = (
            f"its runtime at {self.endpoint(job_id)} heard from no node"
            if not heard
            else f"its runtime heard from {', '.join(heard)}"
        )
        events = hosted.events()[-3:]
        return text + (f" (last events: {' | '.join(events)})" if events else "")

    def artifacts(self, job_id: str) -> JobArtifacts | None:
        """The job's artifacts folder, None without an artifacts root."""
        return None if self.artifacts_root is None else JobArtifacts(self.artifacts_root, job_id)

    def close(self) -> None:
        """Stop every elasticity controller (their nodes are told to shut down); the ports stay
        recorded, for the next start."""
        for job_id in list(self._hosted):
            self._stop(job_id, forget=False)

    def __enter__(self) -> TrainingHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _with_artifacts(self, spec: TrainingSpec) -> TrainingSpec:
        """The spec with the store its uploaded code comes from and, when the store takes
        checkpoints, the job's checkpoint folder and the newest checkpoint to resume from."""
        artifacts = self.artifacts(spec.job_id)
        if artifacts is None:
            return spec
        update: dict[str, object] = {"code_store": artifacts.root.location}
        if not self.checkpoints:
            return TrainingSpec.model_validate({**spec.model_dump(), **update})
        update["checkpoint_dir"] = artifacts.checkpoints.location
        if not spec.checkpoint_every and not spec.checkpoint_every_s:
            update["checkpoint_every_s"] = self.checkpoint_every_s
        if spec.eval_every is not None:  # evaluated on checkpoints (`watch_evaluations`)
            update["checkpoint_every"] = math.gcd(spec.checkpoint_every, spec.eval_every)
        latest = artifacts.latest_checkpoint()
        if latest is not None:
            update["resume_from"] = latest.location
            log.info("resuming training", extra={"job_id": spec.job_id, "from": latest.location})
        return TrainingSpec.model_validate({**spec.model_dump(), **update})

    def save_final(self, job_id: str) -> None:
        """Write the job's final weights now, once (the controller calls this just before it
        releases a finished job's instances, while its nodes still serve the model)."""
        artifacts, hosted = self.artifacts(job_id), self.hosted(job_id)
        if artifacts is None or hosted is None or artifacts.has_final():
            return
        try:
            iterations = hosted.save_weights(artifacts.final)
            source = "the model at the end"
        except AgileMLError:  # its servers are gone (the job ended with its instances)
            latest = artifacts.latest_checkpoint()
            if latest is None:
                log.warning("no final weights for %s: no server, no checkpoint", job_id)
                return
            iterations = hosted.save_checkpoint_weights(latest, artifacts.final)
            source = f"checkpoint {folder_name(latest)}"
        info = {"source": source, "iterations_done": iterations}
        artifacts.final.write_bytes(FINAL_INFO, (json.dumps(info, indent=2) + "\n").encode())
        log.info("final weights written", extra={"job_id": job_id, **info})

    def _keep_artifacts(self, job: JobRecord, training: Hosted) -> None:
        """Assemble the newest checkpoint's weights; write the final weights once the
        training is done or the job has ended."""
        artifacts = self.artifacts(job.job_id)
        if artifacts is None:
            return
        try:
            latest = artifacts.latest_checkpoint()
            if latest is not None and not latest.exists(WEIGHTS):
                training.save_checkpoint_weights(latest, latest)
            if (training.done and training.error is None) or job.state.is_terminal:
                self.save_final(job.job_id)
            self._write_tensorboard(artifacts, training)
        except Exception as exc:  # noqa: BLE001 - a full disk, a torn file: log, try again
            log.warning("artifacts of %s not written: %r", job.job_id, exc)

    def _start(self, spec: TrainingSpec, preferred: int | None) -> tuple[Hosted, int]:
        spec = self._with_artifacts(spec)
        used = {port for _, port in self._hosted.values()}
        used |= {p for j, p in self.store.training_ports().items() if j != spec.job_id}
        ports = range(self.base_port, self.base_port + self.max_jobs)
        for port in ([preferred] if preferred is not None else []) + list(ports):
            if port in used:
                continue
            try:
                training = host_training(spec, token=self._token, host=self.bind_host, port=port)
            except Exception as exc:  # noqa: BLE001 - the port is taken: try the next one
                log.warning("port busy", extra={"port": port, "error": str(exc)})
                continue
            log.info("hosting agileml controller", extra={"job_id": spec.job_id, "port": port})
            return training, port
        raise UserError(
            f"no free port for job {spec.job_id}'s AgileML controller in "
            f"{self.base_port}-{self.base_port + self.max_jobs - 1}",
            fix="finish or cancel jobs, or raise the runtime port range",
        )

    def _stop(self, job_id: str, forget: bool = True) -> None:
        if forget:
            self.store.forget_training_port(job_id)
        with self._lock:
            hosted = self._hosted.pop(job_id, None)
        if hosted is not None:
            hosted[0].stop()
            log.info("agileml controller stopped", extra={"job_id": job_id})
        if forget:
            self._node_work.forget(job_id)
            self._tensorboard.pop(job_id, None)

    def _write_tensorboard(self, artifacts: JobArtifacts, training: Hosted) -> None:
        """TensorBoard's event file of the job in its artifacts (`tensorboard/`): the loss at
        each iteration reported and every evaluation, rewritten whole when an evaluation came,
        the training ended, or a minute passed (`tensorboard --logdir` on a copy of it)."""
        job_id = artifacts.job_id
        new = _evaluations(training)
        written = self._tensorboard.get(job_id)
        now = (len(new), training.done, int(time.monotonic() // 60))
        if written == now:
            return
        reports = self.store.training(job_id)
        losses = {r.iteration: r.loss for r in reports if r.loss is not None}
        evaluations = {e.iteration: e for e in [*_reported(reports), *new]}  # a restart's too
        scalars = [("train/loss", it, loss) for it, loss in sorted(losses.items()) if it > 0]
        scalars += [
            (f"eval/{metric}", it, value)
            for it, e in sorted(evaluations.items())
            for metric, value in e.metrics.items()
        ]
        job = self.store.get_job(job_id)  # one file per job, whichever process writes it
        name = f"events.out.tfevents.{int(job.submitted_at)}.orchestrator-controller"
        artifacts.tensorboard.write_bytes(name, event_file_bytes(scalars, wall_time=time.time()))
        self._tensorboard[job_id] = now

    def _report(self, job: JobRecord, training: Hosted, now_s: float) -> None:
        status = training.progress()
        evaluations = _evaluations(training)
        self.store.append_training(
            job.job_id,
            TrainingReport(
                at_s=now_s,
                iteration=status.iteration,
                loss=status.loss,
                reassigned=status.reassigned_rows,
                stage_transitions=status.stage_transitions,
                stages=tuple(PipelineStageReport(**st) for st in training.stages()),
                evaluation=evaluations[-1] if evaluations else None,
            ),
        )
        if job.state.is_terminal:
            return
        work = float(job.spec.get("work_gpu_hours", 0.0))
        done = min(1.0, status.iteration / training.spec.iterations) * work
        if done > job.work_done_gpu_hours:
            self.store.update_progress(job.job_id, done, now_s)
        if self.instance_work_from_nodes:
            self.store.record_instance_work(
                job.job_id, self._node_work.totals(job.job_id, training, work)
            )
