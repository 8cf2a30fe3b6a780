"""PipeDream's planner: balance, pipelining vs data parallelism, optimality against brute force on
small cases, speed, NOAM, levels, forced depth, input errors, and the `plan` command."""

from __future__ import annotations

import itertools
import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from orchestrator.agileml.pipeline import (
    LayerProfile,
    ModelProfile,
    Plan,
    PlanError,
    PlannedStage,
    ProfileError,
    plan,
    stage_time_ms,
)

PLAN_KEYS = {
    "stages",
    "noam",
    "time_per_minibatch_ms",
    "data_parallel_ms",
    "speedup_vs_data_parallel",
}


def profile_of(
    compute_ms: list[float], parameter_bytes: list[int], activation_bytes: list[int]
) -> ModelProfile:
    """Layers with these compute times (1/3 forward, 2/3 backward) and sizes."""
    return ModelProfile(
        layers=tuple(
            LayerProfile(
                name=f"layer{i}",
                forward_ms=t / 3,
                backward_ms=2 * t / 3,
                activation_bytes=a,
                parameter_bytes=w,
            )
            for i, (t, w, a) in enumerate(
                zip(compute_ms, parameter_bytes, activation_bytes, strict=True)
            )
        )
    )


def random_profile(rng: random.Random, layers: int, scale_bytes: float) -> ModelProfile:
    return profile_of(
        [rng.uniform(0.1, 5.0) for _ in range(layers)],
        [int(rng.uniform(0, scale_bytes)) for _ in range(layers)],
        [int(rng.uniform(0, scale_bytes)) for _ in range(layers)],
    )


def cost_ms(profile: ModelProfile, stages: list[tuple[int, int, int]], bandwidth: float) -> float:
    """The cost model, written out independently: slowest replicated stage or activation link."""
    times = []
    for first, last, replicas in stages:
        layers = profile.layers[first : last + 1]
        compute = sum(layer.forward_ms + layer.backward_ms for layer in layers)
        sync = 2 * (replicas - 1) * sum(layer.parameter_bytes for layer in layers) / bandwidth
        times.append(max(compute, sync * 1000) / replicas)
    for _, last, _ in stages[:-1]:
        times.append(2 * profile.layers[last].activation_bytes / bandwidth * 1000)
    return max(times)


def compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """Every way to write `total` as `parts` positive integers, in order."""
    return [
        tuple(b - a for a, b in zip((0, *cuts), (*cuts, total), strict=True))
        for cuts in itertools.combinations(range(1, total), parts - 1)
    ]


def brute_force_ms(
    profile: ModelProfile, workers: int, bandwidth: float, stages: int | None = None
) -> float:
    """The best over every contiguous partition and every replica assignment using all workers."""
    count = len(profile.layers)
    best = math.inf
    for depth in range(1, min(count, workers) + 1):
        if stages is not None and depth != stages:
            continue
        for cuts in itertools.combinations(range(1, count), depth - 1):
            bounds = (0, *cuts, count)
            spans = [(bounds[k], bounds[k + 1] - 1) for k in range(depth)]
            for replicas in compositions(workers, depth):
                layout = [(f, last, r) for (f, last), r in zip(spans, replicas, strict=True)]
                best = min(best, cost_ms(profile, layout, bandwidth))
    return best


def as_tuples(result: Plan) -> list[tuple[int, int, int]]:
    return [(s.first_layer, s.last_layer, s.replicas) for s in result.stages]


def assert_valid_layout(result: Plan, layers: int, workers: int) -> None:
    """Stages cover every layer once, in order, and use every worker."""
    assert result.stages[0].first_layer == 0
    assert result.stages[-1].last_layer == layers - 1
    for before, after in itertools.pairwise(result.stages):
        assert after.first_layer == before.last_layer + 1
    assert sum(stage.replicas for stage in result.stages) == workers


# -- what the planner chooses -----------------------------------------------------------------


@pytest.mark.parametrize("workers", [4, 8, 16])
def test_uniform_chain_is_split_into_balanced_stages(workers: int) -> None:
    # Heavy weights make data parallelism slow, so the planner pipelines.
    profile = profile_of([3.0] * 16, [100_000_000] * 16, [4096] * 16)
    result = plan(profile, workers, 1e9)
    times = [stage_time_ms(profile, stage, 1e9) for stage in result.stages]
    assert len(result.stages) > 1
    assert max(times) <= 1.1 * (sum(times) / len(times))
    assert result.time_per_minibatch_ms == pytest.approx(48.0 / workers)


def test_communication_dominated_model_is_pipelined() -> None:
    profile = profile_of(
        [1.0, 4.0, 2.0, 3.0, 1.5, 2.5, 0.5, 3.5], [1_000_000_000] * 8, [100_000] * 8
    )
    result = plan(profile, 4, 1e8)
    assert len(result.stages) > 1
    assert result.speedup_vs_data_parallel > 1
    assert_valid_layout(result, 8, 4)


def test_compute_dominated_model_is_pure_data_parallel() -> None:
    profile = profile_of([1.0, 4.0, 2.0, 3.0, 1.5, 2.5, 0.5, 3.5], [1_000] * 8, [1_000] * 8)
    result = plan(profile, 4, 1e11)
    assert as_tuples(result) == [(0, 7, 4)]
    assert result.noam == 1
    assert result.speedup_vs_data_parallel == pytest.approx(1.0)
    assert result.time_per_minibatch_ms == pytest.approx(18.0 / 4, rel=1e-6)


def test_uniform_compute_dominated_tie_prefers_one_replicated_stage() -> None:
    # 4 stages of 2 layers would be exactly as fast; fewer stages win the tie.
    profile = profile_of([0.3] * 8, [0] * 8, [10] * 8)
    assert as_tuples(plan(profile, 4, 1e12)) == [(0, 7, 4)]


def test_paper_figure8_two_one_configuration() -> None:
    # PlannedStage 1 takes twice as long as stage 2 and is replicated twice (seed 001, Figure 8).
    profile = profile_of([2.0, 1.0], [0, 1_000_000_000], [1_000, 1_000])
    result = plan(profile, 3, 1e9)
    assert as_tuples(result) == [(0, 0, 2), (1, 1, 1)]
    assert result.noam == 2  # ceil(3 workers / 2 input-stage replicas)
    assert result.time_per_minibatch_ms == pytest.approx(1.0)


# -- optimality --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_dp_matches_brute_force_on_small_cases(seed: int) -> None:
    rng = random.Random(seed)
    layers, workers = rng.randint(1, 5), rng.randint(1, 4)
    profile = random_profile(rng, layers, scale_bytes=rng.choice([1e4, 1e6, 1e7, 1e8]))
    result = plan(profile, workers, 1e9)
    assert result.time_per_minibatch_ms == pytest.approx(
        brute_force_ms(profile, workers, 1e9), rel=1e-6
    )
    # The reconstructed stages really cost what the DP says.
    assert cost_ms(profile, as_tuples(result), 1e9) == pytest.approx(
        result.time_per_minibatch_ms, rel=1e-6
    )
    assert_valid_layout(result, layers, workers)
    assert result.noam == math.ceil(workers / result.stages[0].replicas)


def test_dp_matches_brute_force_for_five_layers_three_workers() -> None:
    rng = random.Random(5)
    for scale in (1e4, 1e6, 3e6, 1e8):
        profile = random_profile(rng, 5, scale)
        expected = brute_force_ms(profile, 3, 1e9)
        assert plan(profile, 3, 1e9).time_per_minibatch_ms == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("seed", range(15))
def test_forced_depth_matches_brute_force(seed: int) -> None:
    rng = random.Random(100 + seed)
    layers, workers = rng.randint(2, 5), rng.randint(2, 4)
    stages = rng.randint(1, min(layers, workers))
    profile = random_profile(rng, layers, scale_bytes=rng.choice([1e5, 1e7]))
    result = plan(profile, workers, 1e9, stages=stages)
    assert len(result.stages) == stages
    assert_valid_layout(result, layers, workers)
    expected = brute_force_ms(profile, workers, 1e9, stages=stages)
    assert result.time_per_minibatch_ms == pytest.approx(expected, rel=1e-6)
    assert cost_ms(profile, as_tuples(result), 1e9) == pytest.approx(expected, rel=1e-6)


def test_one_forced_stage_is_data_parallelism() -> None:
    profile = random_profile(random.Random(7), 6, 1e7)
    result = plan(profile, 4, 1e9, stages=1)
    assert as_tuples(result) == [(0, 5, 4)]
    assert result.time_per_minibatch_ms == pytest.approx(result.data_parallel_ms)
    assert result.speedup_vs_data_parallel == pytest.approx(1.0)


def test_plans_forty_layers_for_sixteen_workers_in_under_five_seconds() -> None:
    profile = random_profile(random.Random(40), 40, 1e7)
    timings = {}
    for label, kwargs in {
        "flat": {},
        "stages=8": {"stages": 8},
        "levels 4x4": {"levels": [(4, 1e10), (4, 1e9)]},
    }.items():
        start = time.perf_counter()
        result = plan(profile, 16, 1e9, **kwargs)
        timings[label] = time.perf_counter() - start
        assert_valid_layout(result, 40, 16)
    print(f"40 layers x 16 workers planned in {timings}")
    assert max(timings.values()) < 5.0


# -- levels ------------------------------------------------------------------------------------


def test_trivial_levels_plan_like_one_flat_level() -> None:
    profile = random_profile(random.Random(3), 7, 1e7)
    flat = plan(profile, 6, 1e9)
    for levels in ([(1, 5e9), (6, 1e9)], [(6, 1e9), (1, 1e3)], [(6, 1e9)]):
        nested = plan(profile, 6, 1e9, levels=levels)
        assert nested.time_per_minibatch_ms == pytest.approx(flat.time_per_minibatch_ms)
        assert nested.data_parallel_ms == pytest.approx(flat.data_parallel_ms)


def test_two_servers_on_slow_network_pipeline_across_and_replicate_inside() -> None:
    # Inside a server weights sync almost for free; across servers they would take seconds.
    profile = profile_of([1.0] * 4, [100_000_000] * 4, [1_000] * 4)
    result = plan(profile, 4, 1e8, levels=[(2, 1e13), (2, 1e8)])
    assert as_tuples(result) == [(0, 1, 2), (2, 3, 2)]
    assert result.time_per_minibatch_ms == pytest.approx(1.0)
    assert result.data_parallel_ms == pytest.approx(4000.0)
    assert result.noam == 2
    # each stage on one server: its two GPUs (slots 0-1 and 2-3)
    assert [st.slots for st in result.stages] == [(0, 1), (2, 3)]


def test_servers_that_pipeline_inside_run_the_same_sub_pipeline_side_by_side() -> None:
    # Weights sync slowly inside a server and at once across: each server runs both stages,
    # and a minibatch stays on one server (replica b % 2 of each stage is on server b % 2).
    profile = profile_of([1.0] * 4, [100_000_000] * 4, [1_000] * 4)
    result = plan(profile, 4, 1e8, levels=[(2, 1e8), (2, 1e13)])
    assert as_tuples(result) == [(0, 1, 2), (2, 3, 2)]
    assert [st.slots for st in result.stages] == [(0, 2), (1, 3)]
    servers = [[slot // 2 for slot in st.slots] for st in result.stages]
    assert servers == [[0, 1], [0, 1]]


def test_nested_plan_uses_every_worker_once() -> None:
    profile = random_profile(random.Random(11), 12, 3e6)
    for levels in ([(2, 1e10), (3, 1e9)], [(2, 1e11), (2, 1e10), (2, 1e8)]):
        workers = math.prod(m for m, _ in levels)
        result = plan(profile, workers, 1e9, levels=levels)
        assert_valid_layout(result, 12, workers)
        forced = plan(profile, workers, 1e9, levels=levels, stages=2)
        assert len(forced.stages) == 2
        assert_valid_layout(forced, 12, workers)
        for p in (result, forced):  # every slot once, each stage's as many as its replicas
            slots = [slot for st in p.stages for slot in st.slots]
            assert sorted(slots) == list(range(workers))
            assert all(len(st.slots) == st.replicas for st in p.stages)


# -- results and errors ------------------------------------------------------------------------


def test_throughput_is_minibatches_per_second() -> None:
    result = plan(profile_of([2.0, 3.0], [0, 0], [0, 0]), 1, 1e9)
    assert as_tuples(result) == [(0, 1, 1)]
    assert result.throughput_per_s() == pytest.approx(200.0)
    assert set(result.as_dict()) == PLAN_KEYS


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"workers": 0}, "workers"),
        ({"bandwidth_bytes_per_s": 0.0}, "bandwidth_bytes_per_s"),
        ({"bandwidth_bytes_per_s": -1e9}, "bandwidth_bytes_per_s"),
        ({"bandwidth_bytes_per_s": math.nan}, "bandwidth_bytes_per_s"),
        ({"levels": [(2, 1e10), (3, 1e9)]}, "levels"),
        ({"levels": []}, "levels"),
        ({"levels": [(0, 1e9), (4, 1e9)]}, "levels"),
        ({"levels": [(2, 1e9), (2, -5.0)]}, "levels"),
        ({"stages": 5}, "stages"),
        ({"stages": 0}, "stages"),
        ({"workers": 8, "stages": 7}, "stages"),
        ({"levels": [(2, 1e10), (2, 1e9)], "stages": 3}, "stages"),
    ],
)
def test_bad_planner_input_names_the_argument(kwargs: dict, field: str) -> None:
    profile = profile_of([1.0] * 6, [10] * 6, [10] * 6)
    arguments = {"workers": 4, "bandwidth_bytes_per_s": 1e9} | kwargs
    with pytest.raises(PlanError) as caught:
        plan(profile, **arguments)
    assert caught.value.field == field
    assert caught.value.fix


def test_profile_without_time_is_refused() -> None:
    with pytest.raises(PlanError, match="0 ms"):
        plan(profile_of([0.0, 0.0], [10, 10], [10, 10]), 2, 1e9)


def test_profile_without_layers_or_with_negative_sizes_is_invalid(tmp_path: Path) -> None:
    good = {"name": "fc", "forward_ms": 1, "backward_ms": 2, "activation_bytes": 8}
    with pytest.raises(ValidationError):
        ModelProfile.model_validate({"layers": []})
    with pytest.raises(ValidationError):
        ModelProfile.model_validate({"layers": [good | {"parameter_bytes": -1}]})
    path = tmp_path / "PROFILE.json"
    path.write_text(
        json.dumps({"layers": [good | {"parameter_bytes": 4}, good | {"parameter_bytes": -4}]})
    )
    with pytest.raises(ProfileError) as caught:
        ModelProfile.from_json(path)
    assert caught.value.field == "layers[1].parameter_bytes"
    assert str(path) in caught.value.message


def test_stage_rejects_reversed_layers() -> None:
    with pytest.raises(ValidationError):
        PlannedStage(first_layer=3, last_layer=2, replicas=1)


# -- the command -------------------------------------------------------------------------------


def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def write_profile(folder: Path, body: object, name: str = "PROFILE.json") -> Path:
    path = folder / name
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    return path


GOOD_PROFILE = {
    "layers": [
        {
            "name": f"layer{i}",
            "forward_ms": 1.0 + i,
            "backward_ms": 2.0,
            "activation_bytes": 4096,
            "parameter_bytes": 50_000_000,
        }
        for i in range(6)
    ]
}


def test_plan_command_prints_one_json_plan(tmp_path: Path) -> None:
    profile = write_profile(tmp_path, GOOD_PROFILE)
    proc = run_cli("plan", "--profile", profile, "--workers", "4", "--bandwidth", "1e9", "--json")
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    assert set(body) == PLAN_KEYS
    stage_keys = {"first_layer", "last_layer", "replicas", "slots"}
    assert body["stages"] and set(body["stages"][0]) == stage_keys
    assert sum(stage["replicas"] for stage in body["stages"]) == 4
    assert sorted(slot for stage in body["stages"] for slot in stage["slots"]) == [0, 1, 2, 3]
    table = run_cli("plan", "--profile", profile, "--workers", "4", "--bandwidth", "1e9")
    assert table.returncode == 0, table.stderr
    assert "NOAM" in table.stdout and "layer0" in table.stdout


@pytest.mark.parametrize(
    ("body", "extra", "needles"),
    [
        (None, (), ("cannot read profile", "missing.json")),
        ('{"layers": [', (), ("not valid JSON", "PROFILE.json")),
        ({"layers": []}, (), ("layers", "is empty")),
        (
            {"layers": [GOOD_PROFILE["layers"][0] | {"activation_bytes": -5}]},
            (),
            ("layers[0].activation_bytes", "greater than or equal to 0"),
        ),
        (GOOD_PROFILE, ("--stages", "5"), ("--stages", "only 4 workers")),
        (GOOD_PROFILE, ("--levels", "2:1e10,3:1e9"), ("--levels", "= 6 workers")),
    ],
)
def test_plan_command_bad_input_exits_2_without_traceback(
    tmp_path: Path, body: object, extra: tuple[str, ...], needles: tuple[str, ...]
) -> None:
    profile = tmp_path / "missing.json" if body is None else write_profile(tmp_path, body)
    proc = run_cli("plan", "--profile", profile, "--workers", "4", "--bandwidth", "1e9", *extra)
    stderr = " ".join(proc.stderr.split())
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert "error:" in stderr and "To fix:" in stderr
    for needle in needles:
        assert needle in stderr, (needle, proc.stderr)


def test_bidbrain_rates_for_a_pipeline_job_come_from_the_planned_throughput(tmp_path: Path) -> None:
    """Holding `workers` V100s, BidBrain's Σ k·ν is the planner's T(N)/T(1); the job's work is
    what one V100 needs for the minibatches; the fields make a valid job submission."""
    from orchestrator.agileml.pipeline.sizing import size_pipeline_job
    from orchestrator.bidbrain.model import Footprint, HeldAllocation
    from orchestrator.jobspec import JobSubmission
    from orchestrator.market.catalog import Catalog
    from orchestrator.market.prices import Market

    # communication-heavy: 8 workers give far less than 8x
    profile = profile_of([10.0] * 8, [40_000_000] * 8, [40_000_000] * 8)
    catalog = Catalog.load()
    sizing = size_pipeline_job(profile, 8, 1e9, 36_000, catalog.gpu_work_rates)
    one = plan(profile, 1, 1e9).throughput_per_s()
    eight = plan(profile, 8, 1e9).throughput_per_s()
    assert sizing.work_gpu_hours == pytest.approx(36_000 / one / 3600)
    assert sizing.parallel_efficiency == pytest.approx(eight / (8 * one)) and eight < 8 * one
    spec = JobSubmission(name="pipe", budget_usd=100, **sizing.job_fields()).job_spec()
    rate = catalog.work_rate("p3.2xlarge", spec.gpu_work_rates)  # one V100
    held = Footprint([HeldAllocation("a", Market("p3.2xlarge", "us-east-1a"), 8, rate, 3.0, 0.0)])
    assert held.work_rate == pytest.approx(eight / one)
    assert spec.max_work_rate == 8

    path = write_profile(tmp_path, GOOD_PROFILE)
    proc = run_cli("plan", "--profile", path, "--workers", "4", "--bandwidth", "1e9",
                   "--minibatches", "1000", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    fields = json.loads(proc.stdout)["bidbrain"]
    assert set(fields) == {"work_gpu_hours", "max_gpus", "gpu_work_rates", "parallel_efficiency",
                           "single_worker_per_s"}  # fmt: skip
    assert fields["max_gpus"] == 4 and 0 < fields["parallel_efficiency"] <= 1
