"""The job's `evaluate(model)`: on the trained model at the end of a run, and during a local
run at least every N iterations apart (`train --eval-every N`).

During a run the evaluation reads each checkpoint the parameter servers write: one is due N
iterations after the last, and is taken at a clock every partition has reached (with backup
servers, their next common clock, which may come some iterations later), so each result is
of the weights after an exact, recorded number of iterations
(never a mix of partitions one iteration apart), and the workers go on training while the
launcher evaluates. With `--checkpoint-every` too, checkpoints come at the greatest common
divisor of the two intervals, and one is evaluated once N iterations have passed since the
last evaluated. A checkpoint pruned before it was read (an evaluation slower than N
iterations) is left out: the results say which iterations were evaluated.

    watch = EvaluationWatch(root, every=50, code=code, parts=parts, since_unix=time.time(),
                            iterations=300)
    watch.poll()        # while the run goes on
    watch.results       # [{"iteration": 53, "held_out_accuracy": 0.91}, ...]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from orchestrator.agileml import checkpoints
from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.jobcode import JobCode
from orchestrator.agileml.parts import ModelParts
from orchestrator.agileml.usercode import JobCodeError, failure_report, job_code_call
from orchestrator.artifacts import CHECKPOINT_PREFIX, MANIFEST, Folder, folder_at


def evaluate_trained(code: JobCode, model: nn.Module) -> tuple[dict[str, float], str | None]:
    """The job's `evaluate(model)` of the trained model ({} without one), and what it raised
    (None when it did not): a mistake there must not lose the weights trained before it."""
    if code.evaluate is None:
        return {}, None
    model.eval()
    try:
        with torch.no_grad(), job_code_call("evaluate(model)"):
            found = code.evaluate(model)
            return {str(k): float(v) for k, v in found.items()}, None
    except JobCodeError as exc:
        return {}, failure_report(exc)


@dataclass
class EvaluationWatch:
    """Evaluates the run's checkpoints, at least `every` iterations apart (see the module
    docstring); `results` in the order evaluated, `error` what evaluate() raised
    (then it is not called again)."""

    root: Path | Folder  # the run's checkpoints (a local folder, or the artifact store's)
    every: int
    code: JobCode
    parts: ModelParts
    # this run's checkpoints only: written since `since_unix`, at most `iterations` done (not
    # an earlier run's in the same folder, nor the one it resumed from)
    since_unix: float
    iterations: int
    results: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    _settled: set[str] = field(default_factory=set)  # checkpoints evaluated or passed over

    def poll(self) -> None:
        """Evaluate the complete checkpoints of this run at least `every` iterations past the
        last one evaluated (checkpoints may come more often: `--checkpoint-every`)."""
        if self.error is not None:
            return
        base = folder_at(self.root)
        for name in sorted(base.names()):  # ckpt-<zero-padded clock>: oldest first
            if name in self._settled or not name.startswith(CHECKPOINT_PREFIX):
                continue
            if not base.sub(name).exists(MANIFEST):
                continue  # still being written
            last = max((int(r["iteration"]) for r in self.results), default=0)
            try:
                manifest = checkpoints.read_manifest(base.sub(name))
                iterations = manifest.clock + 1
                ours = manifest.created_unix >= self.since_unix
                if not ours or iterations > self.iterations or iterations < last + self.every:
                    self._settled.add(name)  # never evaluated: `last` only grows
                    continue
                ckpt = checkpoints.read(base.sub(name), self.parts.layout.num_partitions)
            except (AgileMLError, OSError):
                continue  # pruned while read: the next one is evaluated
            self._settled.add(name)
            self.add(iterations, self.parts.model_with(ckpt.values))

    def add(self, iterations: int, model: nn.Module) -> None:
        """Evaluate `model`, the weights after `iterations` (once per iteration count)."""
        if self.error is not None or any(r["iteration"] == iterations for r in self.results):
            return
        metrics, self.error = evaluate_trained(self.code, model)
        if self.error is None:  # a metric the job named `iteration` does not replace it
            self.results.append({**metrics, "iteration": iterations})

    def add_end(self, iterations: int, model: nn.Module) -> None:
        """Evaluate the model at the end (`add_final`), unless evaluate() failed before."""
        if self.error is not None:
            return
        metrics, self.error = evaluate_trained(self.code, model)
        if self.error is None:
            self.add_final(iterations, metrics)

    def add_final(self, iterations: int, metrics: dict[str, float]) -> None:
        """The evaluation of the model at the end (`evaluate_trained`'s), once, and last."""
        kept = [r for r in self.results if r["iteration"] != iterations]
        self.results = [*kept, {**metrics, "iteration": iterations}]  # one swap: readers see all
