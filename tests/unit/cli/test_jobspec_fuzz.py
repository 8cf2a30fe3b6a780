"""Fuzzing job specs (issue #19, item 2): seeded malformed and mutated job files through the
loading path of `orchestrator submit JOB.yaml [--budget USD]` (`load_submission`: YAML/JSON,
then `JobSubmission` with its training section). Wrong types, missing, extra and misspelt
fields, huge, negative, NaN and infinite numbers, unicode, deep nesting, YAML tags and
aliases, truncated and corrupted text, tops that are not mappings, mutated valid specs.

Every case is a valid submission or a `UserError` naming the file (or `--budget`) and the field;
never another exception, and never a hang. An accepted spec is what the CLI can send: strict
JSON (no NaN or infinity), which the API validates again to the same submission, and a spec
BidBrain can plan with."""

from __future__ import annotations

import copy
import datetime as dt
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import yaml
from support.fuzz import Tally

from orchestrator.agileml.spec import validate_training_section
from orchestrator.cli.jobs import load_submission
from orchestrator.errors import UserError
from orchestrator.jobspec import JobSubmission

CASES = 5000
SEED = 19
CASE_LIMIT_S = 30.0  # a hang, not a slow case on a busy machine (tests run two at a time)
MAX_MESSAGE_CHARS = 4000

VALID: list[dict[str, Any]] = [
    {"name": "resnet-sweep-3", "budget_usd": 40, "work_gpu_hours": 64},
    {
        "name": "cifar.full",
        "budget_usd": 40.0,
        "work_gpu_hours": 64,
        "max_gpus": 16,
        "regions": ["us-east-1"],
        "instance_types": ["p3.2xlarge", "g5.xlarge", "g4dn.xlarge"],
        "reliable_type": "m5.xlarge",
        "reliable_count": 1,
        "training": {
            "code": "my_job/",
            "data": "s3://bucket/artifacts/data/cifar10",
            "iterations": 20000,
            "global_batch": 256,
        },
    },
    {
        "name": "bert_v2",
        "budget_usd": 12.5,
        "iteration_time": {"seconds_per_iteration": 0.9, "measured_on": "g4dn.xlarge"},
        "training": {
            "code": "job.py",
            "iterations": 5000,
            "parallelism": "pipeline",
            "schedule": "1f1b",
            "stages": 2,
        },
    },
    {
        "name": "j-1",
        "budget_usd": 3,
        "work_gpu_hours": 0.5,
        "app": {"phi": 0.9, "add_overhead_s": 100, "eviction_overhead_s": 10},
        "time_value_usd_per_hour": 0.5,
        "gpu_work_rates": {"K80": 0.25},
        "training": {
            "model": {"kind": "mlp", "hidden": 32},
            "thresholds": {"stage2_above": 2, "stage3_above": 10},
            "straggler": {"flexrr": False},
            "slack": 2,
            "horizon_clocks": 8,
            "lr": 0.1,
            "checkpoint_every_s": 300,
        },
    },
]

FIELDS = [
    "name", "budget_usd", "iteration_time", "work_gpu_hours", "max_gpus", "regions",
    "instance_types", "reliable_type", "reliable_count", "app", "time_value_usd_per_hour",
    "gpu_work_rates", "training",
]  # fmt: skip
NESTED = {
    "iteration_time": ["seconds_per_iteration", "measured_on"],
    "app": ["phi", "add_overhead_s", "eviction_overhead_s"],
    "gpu_work_rates": ["V100", "K80", "T4", "A100"],
    "training": [
        "code", "data", "model", "samples", "data_seed", "global_batch", "lr", "slack",
        "iterations", "num_partitions", "seed", "min_nodes", "thresholds", "heartbeat_s",
        "failure_timeout_s", "horizon_clocks", "overlap", "straggler", "checkpoint_dir",
        "checkpoint_every", "checkpoint_every_s", "resume_from", "code_store", "parallelism",
        "schedule", "stages", "job_id",
    ],
}  # fmt: skip
NUMBERS: list[Any] = [
    0, 1, -1, 2, 7, 64, 65, 4096, 4097, 2**31, 2**63, 10**30, 10**400, -(10**400),
    0.0, -0.0, 1e-320, 5e-324, 0.5, 1e-9, 1e300, 1e308, -1e308,
    math.nan, math.inf, -math.inf,
    "0", "40", "-1", "1e400", "nan", "inf", "-inf", "1_000", "0x10", " 3 ",
]  # fmt: skip
STRINGS: list[Any] = [
    "", " ", "x", "x" * 5000, "名前", "🚀" * 10, "résumé", "\u202eevil", "a\x00b", "tab\there",
    "line\nbreak", "p3.2xlarge", "P3.2XLARGE", "p3.2xlarg", "m5.xlarge", "us-east-1",
    "us-east-9", "mars-1", "sha256:" + "0" * 64, "s3://bucket/prefix", "../../etc/passwd",
    "~/job", "-leading-dash", ".hidden", "flush", "2bw", "pipeline", "data", "mlr",
]  # fmt: skip
OTHERS: list[Any] = [
    None, True, False, dt.date(2020, 1, 1), dt.datetime(2020, 2, 3, 4, 5, 6),
    b"\xff\xfe\x00", [], {}, [1, 2], ["us-east-1", None], {"a": 1}, {1: 2}, {None: None},
    {"phi": 1}, [[[]]],
]  # fmt: skip
DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml's: the writing is not tested
PUNCTUATION = list(":-[]{}\"',#&*!|>%@`?\t\n ") + ["\r\n", "\\", "\x00", "\ufeff", "é"]

#: YAML and JSON texts that exercise the parser rather than the fields
SPECIAL_TEXTS: list[str | bytes] = [
    "",
    "   \n\n",
    "# only a comment\n",
    "---\n",
    "...\n",
    "---\nname: a\n---\nname: b\n",
    "\ufeffname: bom\nbudget_usd: 1\nwork_gpu_hours: 1\n",
    "name: a\nname: b\nbudget_usd: 1\nwork_gpu_hours: 1\n",
    "name: a\n\tbudget_usd: 1\n",
    "%YAML 2.0\n---\nname: a\n",
    "!!python/object/apply:os.system ['echo fuzz']\n",
    "name: !!python/name:os.system\nbudget_usd: 1\nwork_gpu_hours: 1\n",
    "name: !!binary aGVsbG8=\nbudget_usd: 1\nwork_gpu_hours: 1\n",
    "name: !!binary //79\nbudget_usd: 1\nwork_gpu_hours: 1\n",
    "regions: !!set {us-east-1: null}\nname: a\nbudget_usd: 1\nwork_gpu_hours: 1\n",
    "training: !!omap [{iterations: 5}]\nname: a\nbudget_usd: 1\nwork_gpu_hours: 1\n",
    "name: 2020-01-01\nbudget_usd: 1\nwork_gpu_hours: 1\n",
    "name: a\nbudget_usd: !!float 1\nwork_gpu_hours: !!int 1\n",
    "name: a\nbudget_usd: !!str 1\nwork_gpu_hours: .inf\n",
    "name: a\nbudget_usd: .NaN\nwork_gpu_hours: 1\n",
    "name: a\nbudget_usd: 1\nwork_gpu_hours: 1\ntime_value_usd_per_hour: .inf\n",
    "name: a\nbudget_usd: 1\nwork_gpu_hours: 1\ntraining: {lr: .inf}\n",
    "name: a\nbudget_usd: 1\nwork_gpu_hours: 1\napp: {add_overhead_s: .nan}\n",
    "base: &b {name: a, budget_usd: 1}\n<<: *b\nwork_gpu_hours: 1\n",
    "a: &a [*a]\n",
    "name: &a [*a]\nbudget_usd: 1\nwork_gpu_hours: 1\n",
    "training: &t {iterations: 5, code: *t}\nname: a\nbudget_usd: 1\nwork_gpu_hours: 1\n",
    "name: *undefined\n",
    "? [complex, key]\n: 1\n",
    "? {a: 1}\n: 1\n",
    "1: 2\n3: 4\n",
    "null: 1\n",
    '{"name": "a", "budget_usd": NaN, "work_gpu_hours": 1}',
    '{"name": "a", "budget_usd": 1, "work_gpu_hours": 1,}',
    '{"name": "a", "budget_usd": 1e999, "work_gpu_hours": 1}',
    '["name", "a"]',
    '"just a string"',
    "42",
    "null",
    "true",
    "name: a\r\nbudget_usd: 1\r\nwork_gpu_hours: 1\r\n",
    "name: a\x00\nbudget_usd: 1\n",
    "name: " + "a" * 100_000 + "\nbudget_usd: 1\nwork_gpu_hours: 1\n",
    "name: a\nbudget_usd: 1\nwork_gpu_hours: 1\nregions: [" + "us-east-1, " * 5000 + "]\n",
    "name: a\nbudget_usd: 1\nwork_gpu_hours: 1\ntraining: {iterations: " + "9" * 500 + "}\n",
    "name: a\nbudget_usd: 1\ntraining: {iterations: " + "9" * 400 + "}\n"
    "iteration_time: {seconds_per_iteration: 1}\n",
    "name: a\nbudget_usd: 1\ntraining: {iterations: 1}\n"
    "iteration_time: {seconds_per_iteration: 1e-320}\n",
    "name: a\nbudget_usd: 1\ntraining: {iterations: 5}\n"
    "iteration_time: {seconds_per_iteration: 1}\ngpu_work_rates: [1]\n",
    "name: a\nbudget_usd: 1\ntraining: {iterations: 5}\n"
    "iteration_time: {seconds_per_iteration: 1}\ngpu_work_rates: {V100: null}\n",
    b"\xff\xfe\x00\x00garbage",
    b"name: \xc3\x28\nbudget_usd: 1\n",
    b"\x00" * 64,
]


def _alias_bomb(levels: int, width: int) -> str:
    """A 'billion laughs' document: `width ** levels` leaves, `levels * width` aliases."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    for k in range(1, levels):
        lines.append(f"l{k}: &l{k} [{', '.join([f'*l{k - 1}'] * width)}]")
    field = ["name", "regions", "training", "app", "gpu_work_rates"][levels % 5]
    lines.append(f"{field}: *l{levels - 1}\nbudget_usd: 1\nwork_gpu_hours: 1")
    return "\n".join(lines) + "\n"


def _deep_text(rng: random.Random) -> str:
    depth = rng.choice([30, 100, 300, 1000])  # the parser recurses per level (and is slow)
    field = rng.choice(["name", "training", "app", "regions", "gpu_work_rates", "zzz"])
    inner = "[" * depth + "]" * depth if rng.random() < 0.5 else "{a: " * depth + "1" + "}" * depth
    return f"name: deep\nbudget_usd: 1\nwork_gpu_hours: 1\n{field}: {inner}\n"


def _deep_value(rng: random.Random) -> Any:
    value: Any = rng.choice([1, "x", None, []])
    for _ in range(rng.randint(20, 120)):
        value = [value] if rng.random() < 0.5 else {rng.choice(["a", "lr", "x"]): value}
    return value


def _value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if roll < 0.35:
        return rng.choice(NUMBERS)
    if roll < 0.6:
        return rng.choice(STRINGS)
    if roll < 0.75 or depth > 2:
        return rng.choice(OTHERS)
    if roll < 0.85:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if roll < 0.95:
        return {_key(rng): _value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return _deep_value(rng)


def _key(rng: random.Random) -> Any:
    roll = rng.random()
    if roll < 0.5:
        return rng.choice(FIELDS + NESTED["training"] + NESTED["app"])
    if roll < 0.8:
        return _typo(rng, rng.choice(FIELDS))
    return rng.choice([1, 0, -1, True, None, 1.5, "", " ", "名前", "🚀", "x" * 300, "$ref"])


def _typo(rng: random.Random, name: str) -> str:
    kind = rng.randrange(5)
    if kind == 0 and len(name) > 1:
        i = rng.randrange(len(name) - 1)
        return name[:i] + name[i + 1] + name[i] + name[i + 2 :]
    if kind == 1:
        return name.replace("_", "-")
    if kind == 2:
        return name.upper()
    if kind == 3:
        return name[:-1]
    return name + rng.choice(["s", "_", " ", "2"])


def _paths(spec: dict[str, Any]) -> list[tuple[str, ...]]:
    """The keys of `spec` and of its nested mappings, as paths."""
    out: list[tuple[str, ...]] = []
    for key, value in spec.items():
        out.append((key,))
        if isinstance(value, dict):
            out.extend((key, *sub) for sub in _paths(value))
    return out


def _set(spec: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = spec
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


def _delete(spec: dict[str, Any], path: tuple[str, ...]) -> None:
    node = spec
    for part in path[:-1]:
        node = node[part]
    node.pop(path[-1], None)


def _mutated(rng: random.Random, kind: str) -> Any:
    """A job spec document (a Python value) for a structural `kind` of mutation."""
    spec = copy.deepcopy(rng.choice(VALID))
    if kind == "valid":
        return spec
    if kind == "mutate_field":
        for _ in range(rng.randint(1, 3)):
            path = rng.choice(_paths(spec))
            _set(spec, path, _value(rng))
        return spec
    if kind == "numbers":
        for _ in range(rng.randint(1, 3)):
            section = rng.choice(["", "", "iteration_time", "app", "training", "gpu_work_rates"])
            if section:
                if not isinstance(spec.get(section), dict):
                    spec[section] = {}
                spec[section][rng.choice(NESTED[section])] = rng.choice(NUMBERS)
            else:
                spec[rng.choice(FIELDS)] = rng.choice(NUMBERS)
        return spec
    if kind == "drop_field":
        for _ in range(rng.randint(1, 3)):
            _delete(spec, rng.choice(_paths(spec)))
        return spec
    if kind == "extra_field":
        section = rng.choice([None, "training", "app", "iteration_time"])
        target = spec.setdefault(section, {}) if section else spec
        if isinstance(target, dict):
            target[_key(rng)] = _value(rng)
        return spec
    if kind == "typo_key":
        path = rng.choice(_paths(spec))
        node = spec
        for part in path[:-1]:
            node = node[part]
        node[_typo(rng, path[-1])] = node.pop(path[-1])
        return spec
    if kind == "deep_value":
        _set(spec, rng.choice(_paths(spec)), _deep_value(rng))
        return spec
    if kind == "random_doc":
        return {_key(rng): _value(rng) for _ in range(rng.randint(0, 8))}
    if kind == "non_mapping_top":
        return rng.choice([[spec], list(spec), "name: a", 3, 2.5, None, True, [], [[spec]]])
    raise AssertionError(kind)


def _dump(rng: random.Random, doc: Any) -> str:
    """`doc` as YAML or JSON text (the writer's own representation of NaN and infinity)."""
    if rng.random() < 0.3:
        try:
            return json.dumps(doc, default=str)
        except (TypeError, ValueError, RecursionError):
            pass
    return yaml.dump(doc, Dumper=DUMPER, sort_keys=False, allow_unicode=rng.random() < 0.5)


def _corrupted(rng: random.Random, text: str, kind: str) -> str | bytes:
    if kind == "truncate":
        return text[: rng.randrange(max(1, len(text)))]
    if kind == "flip_byte":
        data = bytearray(text.encode())
        for _ in range(rng.randint(1, 4)):
            if data:
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)
    chars = list(text)
    for _ in range(rng.randint(1, 6)):
        i = rng.randrange(len(chars) + 1)
        roll = rng.random()
        if roll < 0.4:
            chars.insert(i, rng.choice(PUNCTUATION))
        elif roll < 0.7 and i < len(chars):
            del chars[i]
        elif i < len(chars):
            chars[i] = rng.choice(PUNCTUATION)
    return "".join(chars)


STRUCTURAL = [
    "mutate_field", "numbers", "drop_field", "extra_field", "typo_key", "deep_value",
    "random_doc", "non_mapping_top", "valid",
]  # fmt: skip
TEXTUAL = ["truncate", "flip_byte", "noise"]


def _cases(rng: random.Random) -> Any:
    """(kind, file contents, --budget or None) forever."""
    while True:
        roll = rng.random()
        budget = None
        if roll < 0.6:
            kind = rng.choice(STRUCTURAL)
            content: str | bytes = _dump(rng, _mutated(rng, kind))
        elif roll < 0.85:
            kind = rng.choice(TEXTUAL)
            content = _corrupted(rng, _dump(rng, _mutated(rng, "valid")), kind)
        elif roll < 0.92:
            kind = "special_text"
            content = rng.choice(SPECIAL_TEXTS)
        elif roll < 0.93:
            kind = "deep_text"
            content = _deep_text(rng)
        elif roll < 0.95:
            kind = "alias_bomb"
            content = _alias_bomb(rng.randint(3, 7), rng.randint(3, 6))
        else:
            kind = "budget_option"
            content = _dump(rng, _mutated(rng, rng.choice(["valid", "mutate_field"])))
            budget = rng.choice([1.0, 0.0, -1.0, 1e-300, 1e308, math.nan, math.inf, -math.inf])
        yield kind, content, budget


def _unclear(exc: UserError, path: Path, budget: float | None) -> str | None:
    """What is wrong with an error message, if anything: it must say where (the file, or
    `--budget`), name the field it blames, and be short, with no traceback."""
    message = exc.message
    if not message.strip():
        return "empty message"
    if len(message) > MAX_MESSAGE_CHARS:
        return f"{len(message)} characters"
    if "Traceback" in message:
        return "a traceback"
    if str(path) not in message and not (budget is not None and "--budget" in message):
        return "names neither the file nor --budget"
    if exc.field and exc.field != "JOB.yaml" and exc.field not in message:
        return f"does not name its field {exc.field}"
    return None


def _unusable(submission: JobSubmission) -> str | None:
    """What is wrong with an accepted submission, if anything."""
    body = submission.model_dump(mode="json")
    try:
        json.dumps(body, allow_nan=False)  # what the CLI's HTTP client sends
    except ValueError as exc:
        return f"not strict JSON: {exc}"
    if JobSubmission.model_validate(body) != submission:
        return "the API would read another submission from the body the CLI sends"
    submission.job_spec()
    if submission.training is not None:
        validate_training_section(submission.training)
    return None


def test_malformed_and_mutated_job_specs_are_accepted_or_refused_by_name(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    tally = Tally("job spec fuzz")
    path = tmp_path / "job.yaml"
    started = time.monotonic()
    for _, (kind, content, budget) in zip(range(CASES), _cases(rng), strict=False):
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
        tally.judge(
            kind,
            content,
            lambda budget=budget: _unusable(load_submission(path, budget)),
            lambda exc, budget=budget: _unclear(exc, path, budget),
            CASE_LIMIT_S,
        )
    print(f"\njob spec fuzz took {time.monotonic() - started:.1f} s")
    tally.check(min_cases=CASES)
    # the mix reaches both sides: valid specs and their mutations do get accepted
    assert tally.outcomes["accepted"] > CASES // 20, tally.summary()
