"""Broken job code (issue #19, item 2): a few dozen job files a user might write, each broken
in one way, through the checks `orchestrator train JOB.py` runs before any process starts
(`check_plan`; `check_pipeline_plan` with --pipeline) and `orchestrator submit` runs before it
uploads the code. Each is refused with a JobCodeError (a UserError: exit 2, no traceback) whose
message names the function or file at fault; no other exception escapes, not even the
SystemExit of a job file that calls sys.exit."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from support.fuzz import CaseTimeout, Tally, time_limit

from orchestrator.agileml.jobcode import JobCodeError
from orchestrator.agileml.pipeline.trainrun import check_pipeline_plan
from orchestrator.agileml.trainrun import TrainPlan, check_plan
from orchestrator.errors import UserError
from orchestrator.lifecycle import SIGTERM_EXIT_STATUS

CASE_LIMIT_S = 20.0
GLOBAL_BATCH = 16

GOOD = """
import torch
from torch import nn

def model():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))

def dataset():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)
    return torch.utils.data.TensorDataset(x, y)

def loss(output, target):
    return nn.functional.cross_entropy(output, target)

def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)
"""

MODEL = "def model():\n    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))\n"
DATASET = "def dataset():\n"
LOSS = "def loss(output, target):\n    return nn.functional.cross_entropy(output, target)\n"
OPTIMIZER = "def optimizer(params):\n    return torch.optim.SGD(params, lr=0.1)\n"


def _swap(old: str, new: str) -> str:
    assert old in GOOD, old
    return GOOD.replace(old, new, 1)


def _dataset(body: str) -> str:
    """GOOD with dataset() returning `body` (an expression using x and y)."""
    return _swap(
        "    return torch.utils.data.TensorDataset(x, y)\n", f"    return {body}\n"
    )  # fmt: skip


def _extra(code: str) -> str:
    return GOOD + "\n" + code


_ITEMS = "\nclass Items:\n    def __len__(self):\n        return {length}\n" \
    "    def __getitem__(self, i):\n        {item}\n"  # fmt: skip


def _items(length: str, item: str) -> str:
    """GOOD with dataset() returning a hand-written map-style dataset."""
    return _extra(_ITEMS.format(length=length, item=item)).replace(
        "    return torch.utils.data.TensorDataset(x, y)\n", "    return Items()\n", 1
    )


#: (case, job source (str, or bytes for a file that is not UTF-8), what the error names)
BROKEN: list[tuple[str, str | bytes, str]] = [
    ("syntax_error", _swap("def model():", "def model(:"), "SyntaxError"),
    ("indentation", _swap("    return torch.optim.SGD", "    x = 1\n      return torch.optim.SGD"),
     "IndentationError"),
    ("not_utf8", b"def model():\n    return '\xff\xfe'\n", "importing"),
    ("missing_import", "import no_such_module_for_fuzz\n" + GOOD, "ModuleNotFoundError"),
    ("raises_at_import", GOOD + "\nraise RuntimeError('top level')\n", "top level"),
    ("sys_exit_at_import", "import sys\n" + GOOD + "\nsys.exit(3)\n", "importing"),
    ("argparse_at_import", "import argparse\n" + GOOD +
     "\nargparse.ArgumentParser().add_argument('--lr', required=True)\n"
     "args = argparse.ArgumentParser().parse_args(['--no-such-flag'])\n", "importing"),
    ("recursion_at_import", GOOD + "\ndef f(n):\n    return f(n + 1)\nf(0)\n", "RecursionError"),
    ("empty_file", "", "defines no `model()`"),
    ("only_comments", "# a job\n", "defines no `model()`"),
    ("no_model", _swap(MODEL, ""), "defines no `model()`"),
    ("misspelt_model", _swap("def model():", "def modle():"), "`modle`: a misspelling"),
    ("no_dataset", _swap(DATASET, "def data():\n"), "`dataset()`"),
    ("no_loss", _swap(LOSS, ""), "`loss()`"),
    ("no_optimizer", _swap(OPTIMIZER, ""), "`optimizer()`"),
    ("model_not_callable", _swap(MODEL, "model = 3\n"), "`model` is a int"),
    ("loss_not_callable", _swap(LOSS, "loss = 'cross_entropy'\n"), "`loss` is a str"),
    ("model_returns_none", _swap("    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), "
                                 "nn.Linear(8, 3))\n", "    pass\n"), "model() returned NoneType"),
    ("model_returns_tensor", _swap(MODEL, "def model():\n    return torch.zeros(3)\n"),
     "model() returned Tensor"),
    ("model_returns_class", _swap(MODEL, "def model():\n    return nn.Linear\n"),
     "model() returned type"),
    ("model_raises", _swap(MODEL, "def model():\n    raise ValueError('no model')\n"),
     "model() raised ValueError"),
    ("model_takes_args", _swap("def model():", "def model(width):"), "model() raised TypeError"),
    ("model_exits", _swap(MODEL, "def model():\n    raise SystemExit(1)\n"), "model()"),
    ("model_not_seeded", "import random\n" + _swap(MODEL, "def model():\n"
     "    m = nn.Linear(4, 3)\n    with torch.no_grad():\n"
     "        m.weight.fill_(random.random())\n    return m\n"), "same seed"),
    ("model_changes_shape", _swap(MODEL, "N = [0]\ndef model():\n    N[0] += 1\n"
     "    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(N[0])], nn.Linear(4, 3))\n"),
     "different modules"),
    ("dataset_raises", _dataset("1 / 0"), "dataset() raised ZeroDivisionError"),
    ("dataset_exits", "import sys\n" + _dataset("sys.exit('no data')"), "dataset()"),
    ("dataset_none", _dataset("None"), "dataset() returned NoneType"),
    ("dataset_int", _dataset("42"), "dataset() returned int"),
    ("dataset_generator", _dataset("((a, b) for a, b in zip(x, y))"),
     "dataset() returned generator"),
    ("dataset_empty", _dataset("torch.utils.data.TensorDataset(x[:0], y[:0])"),
     "the dataset is empty"),
    ("dataset_too_small", _dataset("torch.utils.data.TensorDataset(x[:5], y[:5])"),
     "fewer than the global batch"),
    ("dataset_triples", _dataset("[(a, b, b) for a, b in zip(x, y)]"),
     "not an (input, target) pair"),
    ("dataset_scalars", _dataset("list(range(64))"), "dataset()[0] is a int"),
    ("dataset_ragged", _dataset("[(torch.zeros(i % 3 + 1), b) for i, b in enumerate(y)]"),
     "collating dataset items failed"),
    ("dataset_getitem_raises", _items("64", "raise KeyError(i)"), "dataset()"),
    ("dataset_len_str", _items("'64'", "return torch.zeros(4), 0"), "dataset()"),
    ("dataset_len_negative", _items("-1", "return torch.zeros(4), 0"), "dataset()"),
    ("dataset_len_huge", _items("2**80", "return torch.zeros(4), 0"), "dataset()"),
    ("dataset_len_float", _items("64.0", "return torch.zeros(4), 0"), "dataset()"),
    ("collate_single", _extra("def collate(items):\n"
                              "    return torch.stack([a for a, _ in items])\n"),
     "collate(items) failed"),
    ("collate_raises", _extra("def collate(items):\n    raise RuntimeError('bad batch')\n"),
     "collate(items) failed"),
    ("collate_not_callable", _extra("collate = None\n"), ""),  # None: no collate, as left out
    ("inputs_wrong_width", _swap("nn.Linear(4, 8)", "nn.Linear(5, 8)"),
     "model()(inputs) raised"),
    ("loss_not_scalar", _swap("cross_entropy(output, target)",
                              "cross_entropy(output, target, reduction='none')"),
     "not a scalar tensor"),
    ("loss_python_float", _swap("    return nn.functional.cross_entropy(output, target)\n",
                                "    return 1.5\n"), "returned float"),
    ("loss_nan", _swap("    return nn.functional.cross_entropy(output, target)\n",
                       "    return output.sum() * float('nan')\n"), "is nan"),
    ("loss_detached", _swap("    return nn.functional.cross_entropy(output, target)\n",
                            "    return torch.tensor(1.0)\n"), "does not depend"),
    ("loss_raises", _swap("    return nn.functional.cross_entropy(output, target)\n",
                          "    raise RuntimeError('no loss')\n"), "loss(output, target) raised"),
    ("loss_one_argument", _swap("def loss(output, target):", "def loss(output):"),
     "loss(output, target) raised TypeError"),
    ("model_outputs_tuple", _swap(MODEL, "class Two(nn.Module):\n"
     "    def __init__(self):\n        super().__init__()\n        self.l = nn.Linear(4, 3)\n"
     "    def forward(self, x):\n        return self.l(x), x\n"
     "def model():\n    return Two()\n"), "loss(output, target) raised"),
    ("optimizer_none", _swap("    return torch.optim.SGD(params, lr=0.1)\n", "    pass\n"),
     "optimizer(params)"),
    ("optimizer_raises", _swap("    return torch.optim.SGD(params, lr=0.1)\n",
                               "    raise ValueError('no optimizer')\n"),
     "optimizer(params) raised"),
    ("optimizer_lbfgs", _swap("torch.optim.SGD(params, lr=0.1)",
                              "torch.optim.LBFGS(params)"), "optimizer"),
    ("optimizer_foreign_tensor", _swap("torch.optim.SGD(params, lr=0.1)",
                                       "torch.optim.SGD([torch.zeros(3, requires_grad=True)], "
                                       "lr=0.1)"), "not one of the model's parameters"),
    ("scheduler_none", _extra("def scheduler(opt):\n    return None\n"),
     "scheduler(optimizer) must return"),
    ("scheduler_plateau", _extra("def scheduler(opt):\n"
                                 "    return torch.optim.lr_scheduler.ReduceLROnPlateau(opt)\n"),
     "ReduceLROnPlateau"),
    ("scheduler_raises", _extra("def scheduler(opt):\n    raise RuntimeError('no schedule')\n"),
     "scheduler(optimizer) raised"),
    ("no_parameters", _swap(MODEL, "def model():\n    return nn.Sequential(nn.Identity())\n"),
     ""),  # whichever check comes first: the loss does not depend on it, no parameters
]  # fmt: skip

#: pipeline jobs (`train --pipeline`): the same checks, then the layers to split
BROKEN_PIPELINE: list[tuple[str, str, str]] = [
    ("not_sequential", _swap(MODEL, "class Net(nn.Module):\n"
     "    def __init__(self):\n        super().__init__()\n        self.l = nn.Linear(4, 3)\n"
     "    def forward(self, x):\n        return self.l(x)\n"
     "def model():\n    return Net()\n"), "not an nn.Sequential"),
    ("stages_int", _extra("def stages(model):\n    return 3\n"), "stages(model) raised"),
    ("stages_empty", _extra("def stages(model):\n    return []\n"), "stages(model) must return"),
    ("stages_strings", _extra("def stages(model):\n    return ['a', 'b']\n"),
     "stages(model) must return"),
    ("stages_raises", _extra("def stages(model):\n    raise RuntimeError('no stages')\n"),
     "stages(model) raised"),
    ("stages_exits", _extra("import sys\ndef stages(model):\n    sys.exit(3)\n"),
     "stages(model) raised SystemExit"),
    ("tied_weights", _swap(MODEL, "def model():\n    a = nn.Linear(4, 4)\n"
     "    return nn.Sequential(a, nn.ReLU(), a, nn.Linear(4, 3))\n"), "share the weight"),
]  # fmt: skip


def _check(path: Path, *, pipeline: bool) -> None:
    """What `orchestrator train JOB.py [--pipeline]` checks before it starts a process."""
    plan = TrainPlan(code=str(path), nodes=2, iterations=10, global_batch=GLOBAL_BATCH,
                     pipeline=pipeline)  # fmt: skip
    (check_pipeline_plan if pipeline else check_plan)(plan)


@pytest.mark.parametrize("pipeline", [False, True])
def test_the_good_job_passes_the_checks(tmp_path: Path, pipeline: bool) -> None:
    path = tmp_path / "good.py"
    path.write_text(GOOD)
    _check(path, pipeline=pipeline)


DICT_ITEMS = "return {'features': torch.full((4,), float(i)), 'label': torch.tensor(i % 3)}"
COLLATE_DICTS = (
    "def collate(items):\n"
    "    return (torch.stack([i['features'] for i in items]),\n"
    "            torch.stack([i['label'] for i in items]))\n"
)


def test_items_of_any_shape_pass_with_a_collate_that_makes_pairs(tmp_path: Path) -> None:
    """Dict items (as many PyTorch datasets have) with the job's own collate: the collated
    batch is the (inputs, targets) pair, not each item (once refused as not a pair)."""
    path = tmp_path / "dicts.py"
    path.write_text(_items("64", DICT_ITEMS) + "\n" + COLLATE_DICTS)
    _check(path, pipeline=False)
    bare = tmp_path / "dicts_bare.py"  # PyTorch's default collate makes a dict of them
    bare.write_text(_items("64", DICT_ITEMS))
    with pytest.raises(JobCodeError, match="or define collate"):
        _check(bare, pipeline=False)


def test_broken_job_code_is_refused_naming_what_is_wrong(tmp_path: Path) -> None:
    tally = Tally("job code fuzz")
    started = time.monotonic()
    cases = [(*case, False) for case in BROKEN] + [(*case, True) for case in BROKEN_PIPELINE]
    for i, (name, source, needle, pipeline) in enumerate(cases):
        path = tmp_path / f"job_{i}_{name}.py"  # its own module name (jobcode caches by path)
        if isinstance(source, bytes):
            path.write_bytes(source)
        else:
            path.write_text(source)
        try:
            with time_limit(CASE_LIMIT_S):
                _check(path, pipeline=pipeline)
        except UserError as exc:  # JobCodeError, or a plan the checks refuse
            if needle not in exc.message:
                tally.crashed(name, needle, f"the error does not say {needle!r}: {exc.message}")
            elif not isinstance(exc, JobCodeError):
                tally.crashed(name, needle, f"{type(exc).__name__}, not a JobCodeError: {exc}")
            else:
                tally.rejected(name)
        except (Exception, SystemExit, CaseTimeout) as exc:  # noqa: BLE001 - the finding
            tally.crashed(name, needle, f"{type(exc).__name__}: {str(exc)[:300]}")
        else:
            if name == "collate_not_callable":  # `collate = None` is as if left out
                tally.accepted(name)
            else:
                tally.crashed(name, needle, "accepted")
    # the misses of a directory and of a file's name, as `train` and `submit` see them
    folder = tmp_path / "no_job_here"
    folder.mkdir()
    (folder / "model.py").write_text(GOOD)
    text = tmp_path / "job.txt"
    text.write_text(GOOD)
    for name, path, needle in [
        ("folder_without_job_py", folder, "has no job.py"),
        ("not_a_py_file", text, "not a Python file"),
        ("missing_file", tmp_path / "nowhere.py", "does not exist"),
    ]:
        try:
            _check(path, pipeline=False)
        except JobCodeError as exc:
            assert needle in exc.message, exc.message
            tally.rejected(name)
    print(f"\njob code fuzz took {time.monotonic() - started:.1f} s")
    tally.check(min_cases=len(cases) + 3)
    assert tally.outcomes["rejected"] == len(cases) + 2, tally.summary()


def test_the_exit_of_a_signal_in_job_code_goes_on_unwinding(tmp_path: Path) -> None:
    """SIGTERM raises SystemExit(143) in the main thread (`lifecycle.exit_on_signals`): one that
    arrives while the job's code runs stops the process, and is no error of the job's."""
    path = tmp_path / "stopped.py"
    path.write_text(_swap(MODEL, f"def model():\n    raise SystemExit({SIGTERM_EXIT_STATUS})\n"))
    with pytest.raises(SystemExit) as caught:
        _check(path, pipeline=False)
    assert caught.value.code == SIGTERM_EXIT_STATUS


def test_eval_every_needs_the_job_to_define_evaluate(tmp_path: Path) -> None:
    path = tmp_path / "no_evaluate.py"
    path.write_text(GOOD)
    plan = TrainPlan(code=str(path), nodes=2, iterations=10, global_batch=GLOBAL_BATCH,
                     eval_every=5)  # fmt: skip
    with pytest.raises(UserError, match=r"--eval-every: .* defines no evaluate\(model\)"):
        check_plan(plan)
