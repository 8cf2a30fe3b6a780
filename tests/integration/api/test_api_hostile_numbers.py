"""Every number the API takes, hostile (issue #33, item 2): each numeric field of a job
submission (its training section too) and of an interruption notice, and each numeric query
parameter, gets integers past 64 bits, NaN and Infinity (as raw JSON, which Python's parser
accepts), floats at the edge of overflow and a boolean. Each request is refused with a 4xx,
never a 5xx and never stored. The schema walk makes a numeric field added later fail here until
it is covered."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from orchestrator.agileml.spec import TrainingSpec
from orchestrator.api.app import create_app
from orchestrator.settings import ApiSettings, Settings
from orchestrator.store import JobRecord, MemoryStore

AUTH = {"Authorization": "Bearer t", "Content-Type": "application/json"}
HOSTILE = ["1e999", "-1e999", "NaN", "Infinity", "-Infinity", "9" * 400, str(2**63),
           str(-(2**63) - 1), "true", "1e308", "-1e308"]  # fmt: skip
STRAGGLER = {"helper_group_size": 4, "initial_assignment": 0.025, "follow_up_assignment": 0.05,
             "checks_per_iteration": 100, "max_chunk_overhead": 0.1, "trigger_threshold": 0.2,
             "progress_checkpoint": 0.75, "preload_tail_fraction": 0.25,
             "help_timeout_iterations": 2.0, "help_timeout_min_s": 1.0}  # fmt: skip
PATTERNS = [
    {"kind": "slow_worker", "delay_percent": 100, "probability": 0.1, "points_per_iteration": 10,
     "max_period_iterations": 2.0},
    {"kind": "disrupted_machine", "delay_percent": 100, "period_s": 20.0, "probability": 0.2,
     "machines": 4},
    {"kind": "power_law", "alpha": 11.0},
    {"kind": "uneven", "heavy_share": 0.75},
]  # fmt: skip
TRAINING = {"iterations": 100, "global_batch": 64, "lr": 0.05, "samples": 4096, "data_seed": 1,
            "slack": 0, "num_partitions": 4, "seed": 1, "min_nodes": 1, "heartbeat_s": 0.1,
            "failure_timeout_s": 1.0, "horizon_clocks": 8, "checkpoint_every": 10,
            "checkpoint_every_s": 60.0,
            "model": {"kind": "mlp", "features": 8, "classes": 3, "hidden": 4},
            "thresholds": {"stage2_above": 1.0, "stage3_above": 15.0}}  # fmt: skip


def _training(pattern: dict[str, Any], **more: Any) -> dict[str, Any]:
    injected = {"pattern": pattern, "row_ms": 2.0, "seed": 3}
    return {**TRAINING, "straggler": {**STRAGGLER, "injected": injected}, **more}


#: Submissions that between them set every numeric field (`iteration_time` makes the work from
#: the iterations, so it comes without `work_gpu_hours`; a pipeline job names its code).
BODIES: list[dict[str, Any]] = [
    {"name": "every-number", "budget_usd": 100, "work_gpu_hours": 2, "max_gpus": 8,
     "reliable_count": 1, "app": {"phi": 0.5, "add_overhead_s": 60, "eviction_overhead_s": 60},
     "time_value_usd_per_hour": 1, "gpu_work_rates": {"V100": 1}, "deadline_hours": 48,
     "training": _training(PATTERNS[0])},
    {"name": "iteration-time", "budget_usd": 10, "iteration_time": {"seconds_per_iteration": 1},
     "training": _training(PATTERNS[1])},
    {"name": "pipeline", "budget_usd": 10, "work_gpu_hours": 2,
     "training": _training(PATTERNS[2], parallelism="pipeline", stages=2, code="job.py")},
    {"name": "uneven", "budget_usd": 10, "work_gpu_hours": 2,
     "training": _training(PATTERNS[3], accumulate=2, devices_per_node=2)},
    {"name": "evaluated", "budget_usd": 10, "work_gpu_hours": 2,
     "training": _training(PATTERNS[3], code="job.py", eval_every=10, clip_grad_norm=1.0,
                           loader_workers=3)},
]  # fmt: skip
OUTCOMES: Counter[str] = Counter()


@pytest.fixture(scope="module")
def api() -> Iterator[tuple[TestClient, MemoryStore]]:
    store = MemoryStore()
    store.create_job(JobRecord.submit("job-known", {"name": "k", "budget_usd": 5.0,
                                                    "work_gpu_hours": 1.0}, 5.0, 0.0))  # fmt: skip
    app = create_app(store, Settings(api=ApiSettings(token=SecretStr("t"))), clock=lambda: 0.0)
    with TestClient(app) as client:
        yield client, store
    print(f"\nAPI hostile numbers: {sum(OUTCOMES.values())} requests {dict(OUTCOMES)}")


def _numeric_leaves(value: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _numeric_leaves(v, (*path, k))
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield path


def _schema_numbers(schema: dict[str, Any], node: Any, path: tuple[str, ...],
                    seen: frozenset[str]) -> Iterator[tuple[str, ...]]:  # fmt: skip
    """The dotted paths of every integer and number in a schema (`*`: any key of a map)."""
    if not isinstance(node, dict):
        return
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        if name not in seen:
            yield from _schema_numbers(schema, schema[name], path, seen | {name})
        return
    for key in ("anyOf", "oneOf", "allOf"):
        for option in node.get(key, []):
            yield from _schema_numbers(schema, option, path, seen)
    if node.get("type") in ("integer", "number"):
        yield path
    for key, sub in node.get("properties", {}).items():
        yield from _schema_numbers(schema, sub, (*path, key), seen)
    yield from _schema_numbers(schema, node.get("additionalProperties"), (*path, "*"), seen)


def _with(body: dict[str, Any], path: tuple[str, ...], raw: str) -> str:
    """`body` as JSON text with the value at `path` replaced by the raw JSON `raw`."""
    marker = "\u0000hostile\u0000"
    copy = json.loads(json.dumps(body))
    node = copy
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = marker
    return json.dumps(copy).replace(json.dumps(marker), raw)


def _covered() -> set[tuple[str, ...]]:
    leaves = {p for body in BODIES for p in _numeric_leaves(body)}
    return {tuple("*" if k == "V100" else k for k in p) for p in leaves}


def test_the_bodies_set_every_numeric_field(api: tuple[TestClient, MemoryStore]) -> None:
    client, store = api
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    numbers = set(_schema_numbers(schema, schema["JobSubmission"], (), frozenset()))
    training_schema = TrainingSpec.model_json_schema()
    training = _schema_numbers(training_schema.get("$defs", {}), training_schema, (), frozenset())
    numbers |= {("training", *path) for path in training}
    missing = numbers - _covered()
    assert not missing, f"numeric fields no hostile case reaches: {sorted(missing)}"
    for body in BODIES:  # each is a valid submission as it is
        response = client.post("/v1/jobs", content=json.dumps(body), headers=AUTH)
        assert response.status_code == 201, response.text
    OUTCOMES["201 (the valid bodies)"] += len(BODIES)


@pytest.mark.parametrize("raw", HOSTILE)
def test_a_hostile_number_in_any_field_of_a_submission_is_refused(
    api: tuple[TestClient, MemoryStore], raw: str
) -> None:
    client, store = api
    before = len(store.list_jobs())
    accepted = []
    for body in BODIES:
        for path in _numeric_leaves(body):
            response = client.post("/v1/jobs", content=_with(body, path, raw), headers=AUTH)
            OUTCOMES[str(response.status_code)] += 1
            assert response.status_code < 500, (path, raw, response.text[:300])
            if response.status_code < 400:
                accepted.append(".".join(path))
    assert not accepted, f"{raw[:20]} accepted in {accepted}"
    assert len(store.list_jobs()) == before


QUERY_HOSTILE = [*HOSTILE, "-1", "1.5", "", "1" * 20, "1-" + "9" * 20]


@pytest.mark.parametrize("raw", QUERY_HOSTILE)
@pytest.mark.parametrize("param", ["limit", "since"])
def test_a_hostile_number_in_a_query_parameter_is_refused(
    api: tuple[TestClient, MemoryStore], param: str, raw: str
) -> None:
    """`since` is a stream id (`ms` or `ms-seq`, each an unsigned 64-bit number: any 19
    digits are one), so 2^63 is a valid `since`."""
    client, _ = api
    response = client.get(f"/v1/jobs/job-known/events?{param}={raw}", headers=AUTH)
    OUTCOMES[str(response.status_code)] += 1
    assert response.status_code < 500, response.text[:300]
    valid_since = param == "since" and raw.isdigit() and len(raw) <= 19
    assert (response.status_code == 200) == valid_since, (param, raw, response.status_code)


def test_a_hostile_number_in_a_notice_is_refused(api: tuple[TestClient, MemoryStore]) -> None:
    """A notice's time and instance id, as numbers: refused before any controller sees it."""
    client, _ = api
    for raw in HOSTILE:
        detail = f'{{"instance-id": {raw}, "instance-action": "terminate"}}'
        body = (f'{{"detail-type": "EC2 Spot Instance Interruption Warning", '
                f'"source": "aws.ec2", "time": {raw}, "detail": {detail}}}')  # fmt: skip
        response = client.post("/v1/notices", content=body, headers=AUTH)
        OUTCOMES[str(response.status_code)] += 1
        assert 400 <= response.status_code < 500, (raw, response.status_code, response.text)
