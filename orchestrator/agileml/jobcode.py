"""A user's training job: a Python file (or a directory with `job.py`) that defines

    def model() -> torch.nn.Module                  # called on every node under the same seed
    def dataset() -> torch.utils.data.Dataset       # map-style; (input, target) items, or any
                                                    # shape with collate()
    def loss(output, target) -> torch.Tensor        # the mean over the batch (a scalar)
    def optimizer(params) -> torch.optim.Optimizer  # as in plain PyTorch
    def scheduler(optimizer, total_iterations) -> LRScheduler
                                                    # optional; stepped once per iteration
                                                    # (`scheduler(optimizer)` works too)
    def collate(items) -> (inputs, targets)         # optional; default: PyTorch's
    def evaluate(model) -> dict[str, float]         # optional; held-out metrics
    def stages(model) -> list[torch.nn.Module]      # optional; the layers a pipeline splits

`load_job_code` imports it (its directory first on `sys.path`, so sibling modules import);
`check_job_code` runs each function once on a few rows and refuses, naming the function and
the fix, what would fail later on an instance: a missing or misspelt function, a model whose
initial state depends on more than the seed, items that are not pairs, a loss that is not a
finite scalar, an optimizer or scheduler the parameter servers cannot run.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from orchestrator.agileml.batches import DatasetRows
from orchestrator.agileml.control import TrainingSpec
from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.seeding import seeded
from orchestrator.agileml.updates import OptimizerPlan
from orchestrator.agileml.usercode import (
    USER_CODE_ERRORS,
    JobCodeError,
    job_code_call,
    unless_stopping,
)
from orchestrator.artifacts import folder_at
from orchestrator.artifacts.code import fetch_code, is_code_ref
from orchestrator.artifacts.data import use_data

REQUIRED = ("model", "dataset", "loss", "optimizer")
OPTIONAL = ("scheduler", "collate", "evaluate", "stages")
ENTRY_FILE = "job.py"  # the module a job directory must hold
TOTAL = "total_iterations"  # a scheduler's parameter that is always told the run's length
CHECK_ROWS = 4


@dataclass(frozen=True)
class JobCode:
    """The functions of a user's job (see the module docstring)."""

    path: Path
    model: Callable[[], nn.Module]
    dataset: Callable[[], Any]
    loss: Callable[[Any, Any], torch.Tensor]
    optimizer: Callable[[Any], torch.optim.Optimizer]
    scheduler: Callable[..., Any] | None = None  # the job's own, one or two arguments
    collate: Callable[[list[Any]], Any] | None = None
    evaluate: Callable[[nn.Module], dict[str, float]] | None = None
    stages: Callable[[nn.Module], Any] | None = None
    total_iterations: int | None = None  # the run's (`for_run`): what a scheduler is told

    def for_run(self, iterations: int) -> JobCode:
        """This job's functions for a run of `iterations` iterations."""
        return dataclasses.replace(self, total_iterations=iterations)

    @property
    def make_scheduler(self) -> Callable[[torch.optim.Optimizer], Any] | None:
        """The scheduler as the runtime calls it, `make_scheduler(optimizer)` (None: none)."""
        if self.scheduler is None:
            return None
        return with_total_iterations(self.scheduler, self.total_iterations)


def job_file(path: str | Path) -> Path:
    """The job's Python file: `path` itself, or `path/job.py` for a directory.

    Raises:
        JobCodeError: neither exists.
    """
    p = Path(path).expanduser().resolve()
    if p.is_dir():
        p = p / ENTRY_FILE
        if not p.is_file():
            raise JobCodeError(
                f"job directory {p.parent} has no {ENTRY_FILE}. To fix: put the functions "
                f"model, dataset, loss and optimizer in {ENTRY_FILE} at its top level."
            )
        return p
    if not p.is_file():
        raise JobCodeError(f"job file {path} does not exist")
    if p.suffix != ".py":
        raise JobCodeError(f"job file {path} is not a Python file (.py)")
    return p


def code_path(spec: TrainingSpec, *, with_data: bool = True) -> str:
    """Where the spec's job code is on this machine: its `code` path, or, for uploaded code
    (`sha256:<hex>`), the folder it is fetched into from the spec's `code_store`. With
    `with_data`, the job's `data` (if it names any) is fetched first (see `artifacts.data`).

    Raises:
        JobCodeError: no code, or uploaded code without a store.
        CodeError: the uploaded code cannot be fetched (see `artifacts.code.fetch_code`).
    """
    if spec.code is None:
        raise JobCodeError("the job names no code", fix="set the training section's code")
    return resolve_code(spec.code, spec.code_store, spec.data if with_data else None)


def resolve_code(code: str, code_store: str | None, data: str | None = None) -> str:
    """`code_path` from the fields themselves: a path as it is, uploaded code fetched from
    `code_store`; `data` (if given) fetched first and named in $ORCHESTRATOR_DATA_DIR."""
    if data is not None:
        use_data(data)
    if not is_code_ref(code):
        return code
    if code_store is None:
        raise JobCodeError(
            f"the job's code is {code} but no artifact store was given to fetch it from",
            fix="run the job through the controller (it sets code_store), or name a file",
        )
    return str(fetch_code(folder_at(code_store), code))


def load_job_code(path: str | Path, *, iterations: int | None = None) -> JobCode:
    """Import the job's file and collect its functions; a `scheduler(optimizer,
    total_iterations)` is told the run's `iterations` (see `with_total_iterations`).

    Raises:
        JobCodeError: no such file, importing it failed, or a function is missing or not
            callable (with a close name if one exists: a misspelling).
    """
    file = job_file(path)
    module = _import(file)
    found: dict[str, Any] = {}
    for name in (*REQUIRED, *OPTIONAL):
        fn = getattr(module, name, None)
        if fn is None:
            if name in REQUIRED:
                raise JobCodeError(_missing(file, module, name))
            continue
        if not callable(fn):
            raise JobCodeError(f"{file.name}: `{name}` is a {type(fn).__name__}, not a function")
        found[name] = fn
    return JobCode(path=file, total_iterations=iterations, **found)


def with_total_iterations(
    scheduler: Callable[..., Any], iterations: int | None
) -> Callable[[torch.optim.Optimizer], Any]:
    """The job's scheduler as the runtime calls it, `scheduler(optimizer)`: a scheduler whose
    second parameter has no default (or is named `total_iterations`) is given the run's
    iteration count there (OneCycleLR's total_steps, a cosine schedule's length), so it never
    has to hard-code it; `scheduler(opt, warmup=5)` keeps its default."""
    try:
        params = list(inspect.signature(scheduler).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: as it is
        return scheduler
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    second = positional[1] if len(positional) >= 2 else None
    if second is None or (second.default is not second.empty and second.name != TOTAL):
        return scheduler

    def bound(optimizer: torch.optim.Optimizer) -> Any:
        if iterations is None:
            raise JobCodeError(
                "scheduler(optimizer, total_iterations) needs the run's iteration count, "
                "which this run did not give",
                fix="report this: every run gives its iterations (JobCode.for_run)",
            )
        return scheduler(optimizer, iterations)

    return bound


def _import(file: Path) -> ModuleType:
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:12]
    name = f"orchestrator_job_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise JobCodeError(f"job file {file} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    folder = str(file.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    with job_code_call(f"importing {file}", verb="failed:"):
        spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _missing(file: Path, module: ModuleType, name: str) -> str:
    defined = [n for n in vars(module) if not n.startswith("_")]
    close = difflib.get_close_matches(name, defined, n=1, cutoff=0.6)
    hint = f" (it defines `{close[0]}`: a misspelling?)" if close else ""
    return (
        f"{file.name} defines no `{name}()`{hint}. To fix: define `{name}` at the top level; "
        f"a job needs {', '.join(REQUIRED)}."
    )


@dataclass(frozen=True)
class JobCheck:
    """What the check learnt: the data set's size and the model's size."""

    rows: int
    parameters: int
    optimizer: str


def uses_batch_statistics(model: nn.Module) -> bool:
    """Whether a layer's output depends on the batch it is computed in (BatchNorm): then a
    share may not be split into chunks (FlexRR) without changing the gradient."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def seeded_model(code: JobCode, seed: int) -> nn.Module:
    """`code.model()` under `torch.manual_seed(seed)`; the global RNG is left as it was.

    Raises:
        JobCodeError: it raised, or did not return an nn.Module.
    """
    with seeded(seed), job_code_call("model()"):
        model = code.model()
    if not isinstance(model, nn.Module):
        raise JobCodeError(f"model() returned {type(model).__name__}, not a torch.nn.Module")
    return model


def check_job_code(code: JobCode, *, global_batch: int, seed: int = 0) -> JobCheck:
    """Run the job's functions once on a few rows (see the module docstring).

    Raises:
        JobCodeError: naming the function that fails and the fix.
    """
    model = seeded_model(code, seed)
    _check_deterministic(model, seeded_model(code, seed))
    rows = _check_dataset(code, global_batch)
    x, y = rows.take(torch.arange(min(CHECK_ROWS, len(rows))))
    with job_code_call(
        "model()(inputs)", verb=f"raised on a batch of {CHECK_ROWS} collated items:"
    ):
        out = model(x)
    with job_code_call("loss(output, target)"):
        value = code.loss(out, y)
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise JobCodeError(
            f"loss(output, target) returned {shape}, not a scalar tensor. To fix: reduce it "
            f"to the mean over the batch (e.g. `reduction='mean'`)."
        )
    if not torch.isfinite(value.detach()).item():
        raise JobCodeError(f"loss(output, target) is {value.item()} on the first rows")
    if not value.requires_grad:
        raise JobCodeError("loss(output, target) does not depend on the model's parameters")
    plan = optimizer_plan(code, model)
    return JobCheck(
        rows=len(rows),
        parameters=sum(p.numel() for p in model.parameters()),
        optimizer=plan.kind.__name__,
    )


def optimizer_plan(
    code: JobCode, model: nn.Module, buffer_sizes: tuple[int, ...] = ()
) -> OptimizerPlan:
    """The job's optimizer and scheduler as the parameter servers run them.

    Raises:
        JobCodeError: optimizer() or scheduler() raised, or cannot run per partition.
    """
    try:
        plan = OptimizerPlan.from_model(model, code.optimizer, code.make_scheduler, buffer_sizes)
    except AgileMLError as exc:
        raise JobCodeError(f"optimizer(params): {exc}") from exc
    except USER_CODE_ERRORS as exc:
        unless_stopping(exc)
        raise JobCodeError(f"optimizer(params) raised {type(exc).__name__}: {exc}") from exc
    if code.make_scheduler is not None:
        with job_code_call("scheduler(optimizer)"):
            scheduler = code.make_scheduler(code.optimizer(model.parameters()))
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise JobCodeError(
                "scheduler(optimizer) returned ReduceLROnPlateau, which needs a metric; the "
                "servers step the scheduler once per iteration. To fix: use a schedule of the "
                "iteration (CosineAnnealingLR, OneCycleLR, LambdaLR, ...)."
            )
        if not hasattr(scheduler, "step") or not hasattr(scheduler, "state_dict"):
            raise JobCodeError("scheduler(optimizer) must return a torch LR scheduler")
    return plan


def dataset_rows(code: JobCode) -> DatasetRows:
    """The job's training set, addressed by row. Raises JobCodeError."""
    with job_code_call("dataset()"):
        data = code.dataset()
    if not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
        raise JobCodeError(
            f"dataset() returned {type(data).__name__}, not a map-style Dataset "
            f"(__getitem__ and __len__). To fix: return e.g. a TensorDataset."
        )
    try:
        return DatasetRows(data, code.collate)
    except ValueError as exc:  # empty, or a negative __len__
        raise JobCodeError(f"dataset(): {exc}") from exc
    except USER_CODE_ERRORS as exc:  # its __len__ raised, or returned no int
        unless_stopping(exc)
        raise JobCodeError(
            f"len(dataset()) failed: {type(exc).__name__}: {exc}. To fix: make __len__ return "
            "the number of items (an int)."
        ) from exc


def _check_dataset(code: JobCode, global_batch: int) -> DatasetRows:
    rows = dataset_rows(code)
    if len(rows) < global_batch:
        raise JobCodeError(
            f"dataset() has {len(rows)} items, fewer than the global batch ({global_batch}). "
            f"To fix: use a smaller --global-batch."
        )
    with job_code_call("dataset()[0]"):
        item = rows.dataset[0]
    # items of any shape (a dict, say) go through the job's own collate, which the check
    # below holds to (inputs, targets); PyTorch's default one needs the pairs themselves
    if code.collate is None and (not isinstance(item, (tuple, list)) or len(item) != 2):
        raise JobCodeError(
            f"dataset()[0] is a {type(item).__name__}, not an (input, target) pair. To fix: "
            f"make __getitem__ return (input, target), or define collate(items) that returns "
            f"(inputs, targets)."
        )
    who = "collate(items)" if code.collate is not None else "collating dataset items"
    with job_code_call(who, verb="failed:"):
        rows.take(torch.arange(min(CHECK_ROWS, len(rows))))
    return rows


def _check_deterministic(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    if list(sa) != list(sb):
        raise JobCodeError("model() builds different modules on two calls")
    for key in sa:
        if sa[key].shape != sb[key].shape or not torch.equal(sa[key], sb[key]):
            raise JobCodeError(
                f"model() gives `{key}` different values under the same seed, so nodes would "
                f"start from different models. To fix: draw initial values from torch's "
                f"RNG only (not `random`, numpy or the clock)."
            )
