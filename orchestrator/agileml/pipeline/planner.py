"""PipeDream's partitioner: split a layer chain into replicated pipeline stages (seed 001 §3.1).

Cost model, per minibatch, times in ms and bandwidths in bytes/s (`bytes / B * 1000` ms). The
topology has levels k = 1..L from the lowest up; level k joins m_k components of level k-1 by
links of bandwidth B_k, and a level-0 component is one worker (so workers = m_1 * ... * m_L).

* T_l = forward_ms + backward_ms of layer l; A^0(i→j, 1) = Σ T_l.
* T^k(i→j, m) = max(A^{k-1}(i→j, m_{k-1}), 2 (m-1) Σ w_l / B_k) / m: layers i..j as one stage
  run data-parallel by m components (compute and weight sync overlap).
* A^k(i→j, m) = min( T^k(i→j, m),
  min over i <= s < j, 1 <= m' < m of max(A^k(i→s, m-m'), 2 a_s / B_k, T^k(s+1→j, m')) ).
  The first term, the whole range as one replicated stage, is missing from the paper's printed
  recurrence; without it pure data parallelism could never be chosen.

Every worker is used. On a tie (within float noise) one replicated stage beats a split: fewer
stages send fewer activations and stash fewer weight versions. Each level is a memoised table
over (i, j, m), filled with numpy over (s, m', m) at once; the top level needs only i = 0.

With several levels the plan is the physical layout, flattened: a top-level stage replicated over
m' components is replaced by the sub-pipeline each component runs (its lower-level plan), each
sub-stage's replicas multiplied by m'. Replicas still add up to `workers`; when the lower level
chose data parallelism this is one stage with m' * m_{L-1} * ... replicas.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from orchestrator.agileml.pipeline.profiler import ModelProfile
from orchestrator.errors import UserError

if TYPE_CHECKING:
    import numpy as np

MS_PER_S = 1000.0
#: A split must beat one replicated stage by more than this fraction (float noise in the prefix
#: sums would otherwise turn exact ties into needless pipelines).
TIE_RELATIVE = 1e-9


class PlanError(UserError):
    """Planner input that cannot be planned: no layers, workers < 1, a bandwidth <= 0, levels
    whose worker counts do not multiply to `workers`, or an impossible `stages`. `field` names
    the argument (`workers`, `bandwidth_bytes_per_s`, `levels`, `stages`, `layers`)."""


class PlannedStage(BaseModel):
    """Layers first_layer..last_layer (0-based, inclusive) run data-parallel by `replicas`.

    `slots`: where each replica runs, as a worker slot of the plan's topology (0..workers-1;
    a lowest-level component holds consecutive slots, so with levels [(K, ...), (N, ...)]
    replica r is on node `slots[r] // K`). Empty: the stages' replicas take consecutive slots
    in order (one level: every slot is alike)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    first_layer: Annotated[int, Field(ge=0)]
    last_layer: Annotated[int, Field(ge=0)]
    replicas: Annotated[int, Field(ge=1)]
    slots: tuple[Annotated[int, Field(ge=0)], ...] = ()

    @model_validator(mode="after")
    def _ordered(self) -> PlannedStage:
        if self.last_layer < self.first_layer:
            raise ValueError(f"last_layer {self.last_layer} < first_layer {self.first_layer}")
        if self.slots and len(self.slots) != self.replicas:
            raise ValueError(f"{len(self.slots)} slots for {self.replicas} replicas")
        return self


def slots_of(stages: Sequence[PlannedStage]) -> list[tuple[int, ...]]:
    """Each stage's replicas' slots: their own (`PlannedStage.slots`), else consecutive in
    stage order."""
    out, start = [], 0
    for st in stages:
        out.append(st.slots or tuple(range(start, start + st.replicas)))
        start += st.replicas
    return out


class Plan(BaseModel):
    """A pipeline: stages in order, the in-flight minibatches per input-stage replica (NOAM), the
    slowest stage's time per minibatch and the same for pure data parallelism on all workers
    (T^L(0→N-1, m_L) with every level data-parallel too; one level: T(0→N-1, workers))."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stages: Annotated[tuple[PlannedStage, ...], Field(min_length=1)]
    noam: Annotated[int, Field(ge=1)]
    time_per_minibatch_ms: Annotated[float, Field(gt=0)]
    data_parallel_ms: Annotated[float, Field(gt=0)]
    speedup_vs_data_parallel: Annotated[float, Field(gt=0)]

    def throughput_per_s(self) -> float:
        """Predicted minibatches per second of the whole pipeline in steady state."""
        return MS_PER_S / self.time_per_minibatch_ms

    def as_dict(self) -> dict[str, Any]:
        """The JSON shape `orchestrator plan --json` prints."""
        return self.model_dump(mode="json")


@dataclass(frozen=True)
class _Level:
    devices: int
    bandwidth_bytes_per_s: float


@dataclass(frozen=True)
class _Table:
    """A^k of one level and the choice that reached each entry, indexed [i, j, m]."""

    best_ms: np.ndarray
    split_layer: np.ndarray  # s: last layer before the last stage; -1: i..j is one stage
    split_workers: np.ndarray  # m': components of the last stage


def plan(
    profile: ModelProfile,
    workers: int,
    bandwidth_bytes_per_s: float,
    *,
    levels: Sequence[tuple[int, float]] | None = None,
    stages: int | None = None,
) -> Plan:
    """The fastest pipeline of `profile` on `workers` under PipeDream's cost model.

    Args:
        profile: the layers, in order.
        workers: workers to use, all of them (>= 1).
        bandwidth_bytes_per_s: the link bandwidth when `levels` is None (one flat level).
        levels: [(m_k, B_k)] from the lowest level up, e.g. [(4, 1e10), (2, 1e9)] for two
            servers of four GPUs; replaces `bandwidth_bytes_per_s`. The m_k multiply to workers.
        stages: force exactly this many stages (pipeline depth). With several levels the
            pipeline is then split across top-level components only (each component runs its
            stage data-parallel), so stages <= m_L.

    Raises:
        PlanError: see the class; nothing is planned.
    """
    import numpy as np

    compute = _checked_compute(profile)
    layer_count = len(profile.layers)
    topology = _validated_levels(workers, bandwidth_bytes_per_s, levels)
    if stages is not None:
        _check_stages(stages, workers, layer_count, topology)
    weights = np.array([layer.parameter_bytes for layer in profile.layers], dtype=np.float64)
    activations = np.array([layer.activation_bytes for layer in profile.layers], dtype=np.float64)
    weight_bytes = _range_sums(weights)

    component_ms = _range_sums(compute)  # A^0(i→j, 1)
    tables: list[_Table] = []
    for level in topology[:-1]:
        table = _solve_level(
            _stage_ms(component_ms, weight_bytes, level),
            _comm_ms(activations, level),
            level.devices,
            rows=range(layer_count),
            single_stage=stages is not None,
        )
        tables.append(table)
        component_ms = table.best_ms[:, :, level.devices]
    top, depth, last = topology[-1], len(topology), layer_count - 1
    stage_ms = _stage_ms(component_ms, weight_bytes, top)
    if stages is None:
        table = _solve_level(
            stage_ms, _comm_ms(activations, top), top.devices, rows=[0], single_stage=False
        )
        tables.append(table)
        time_ms = float(table.best_ms[0, last, top.devices])
        pipeline = _expand(tables, topology, depth, 0, last, top.devices, [0])
    else:
        time_ms, top_stages = _forced_depth(
            stage_ms, _comm_ms(activations, top), top.devices, stages
        )
        pipeline, unit, used = [], workers // top.devices, 0
        for first, end, components in top_stages:
            slots = [(used + c) * unit for c in range(components)]
            pipeline += _replicate(tables, topology, depth, first, end, slots)
            used += components
    data_parallel_ms = _data_parallel_ms(float(compute.sum()), float(weights.sum()), topology)
    return Plan(
        stages=tuple(pipeline),
        noam=math.ceil(workers / pipeline[0].replicas),
        time_per_minibatch_ms=time_ms,
        data_parallel_ms=data_parallel_ms,
        speedup_vs_data_parallel=data_parallel_ms / time_ms,
    )


def _checked_compute(profile: ModelProfile) -> Any:
    """Each layer's forward + backward ms, as an array.

    Raises:
        PlanError: no layers, or no layer takes any time.
    """
    import numpy as np

    if not profile.layers:
        raise PlanError(
            "the profile has no layers", fix="profile at least one layer", field="layers"
        )
    compute = np.array([layer.compute_ms for layer in profile.layers], dtype=np.float64)
    if not compute.sum() > 0:
        raise PlanError(
            "every layer of the profile takes 0 ms (forward_ms + backward_ms)",
            fix="profile the model on the target hardware so that times are measured",
            field="layers",
        )
    return compute


def _data_parallel_ms(compute_ms: float, weight_bytes: float, topology: Sequence[Any]) -> float:
    """A minibatch's time under pure data parallelism on every worker: compute split evenly,
    or the weights' all-reduce at each level when it is slower."""
    data_parallel_ms = compute_ms
    for level in topology:
        sync_ms = 2.0 * (level.devices - 1) * weight_bytes / level.bandwidth_bytes_per_s * MS_PER_S
        data_parallel_ms = max(data_parallel_ms, sync_ms) / level.devices
    return data_parallel_ms


def stage_time_ms(
    profile: ModelProfile, stage: PlannedStage, bandwidth_bytes_per_s: float
) -> float:
    """T(first→last, replicas) on one flat level: the stage's effective ms per minibatch."""
    layers = profile.layers[stage.first_layer : stage.last_layer + 1]
    compute_ms = sum(layer.compute_ms for layer in layers)
    weight_bytes = sum(layer.parameter_bytes for layer in layers)
    sync_ms = 2.0 * (stage.replicas - 1) * weight_bytes / bandwidth_bytes_per_s * MS_PER_S
    return max(compute_ms, sync_ms) / stage.replicas


def _validated_levels(
    workers: int, bandwidth_bytes_per_s: float, levels: Sequence[tuple[int, float]] | None
) -> list[_Level]:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise PlanError(
            f"workers must be a whole number >= 1, got {workers!r}",
            fix="pass the number of workers (GPUs) to plan for, e.g. 4",
            field="workers",
        )
    if not _positive_finite(bandwidth_bytes_per_s):
        raise PlanError(
            f"bandwidth must be a positive number of bytes/s, got {bandwidth_bytes_per_s!r}",
            fix="pass the link bandwidth in bytes/s, e.g. 1e9 for ~8 Gbit/s",
            field="bandwidth_bytes_per_s",
        )
    if levels is None:
        return [_Level(workers, float(bandwidth_bytes_per_s))]
    fix = (
        "list (workers per component, bandwidth bytes/s) from the lowest level up, "
        "e.g. 4:1e10,2:1e9"
    )
    if not levels:
        raise PlanError("levels is empty", fix=fix, field="levels")
    topology = []
    for index, (devices, bandwidth) in enumerate(levels, start=1):
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise PlanError(
                f"level {index} has {devices!r} components; it needs a whole number >= 1",
                fix=fix,
                field="levels",
            )
        if not _positive_finite(bandwidth):
            raise PlanError(
                f"level {index} has bandwidth {bandwidth!r}; it needs a positive number of bytes/s",
                fix=fix,
                field="levels",
            )
        topology.append(_Level(devices, float(bandwidth)))
    product = math.prod(level.devices for level in topology)
    if product != workers:
        counts = " x ".join(str(level.devices) for level in topology)
        raise PlanError(
            f"levels hold {counts} = {product} workers, but workers is {workers}",
            fix=f"make the level sizes multiply to {workers}, or pass workers {product}",
            field="levels",
        )
    return topology


def _check_stages(stages: int, workers: int, layer_count: int, topology: list[_Level]) -> None:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise PlanError(
            f"stages must be a whole number >= 1, got {stages!r}",
            fix="pass a pipeline depth such as 2, or leave stages out to let the planner choose",
            field="stages",
        )
    if stages > workers:
        raise PlanError(
            f"{stages} stages asked for, but there are only {workers} workers (one stage each "
            "at least)",
            fix=f"pass stages <= {workers}, or more workers",
            field="stages",
        )
    if stages > layer_count:
        raise PlanError(
            f"{stages} stages asked for, but the profile has only {layer_count} layers",
            fix=f"pass stages <= {layer_count}",
            field="stages",
        )
    top = topology[-1].devices
    if len(topology) > 1 and stages > top:
        raise PlanError(
            f"{stages} stages asked for, but with levels a forced pipeline splits only across the "
            f"{top} top-level components",
            fix=f"pass stages <= {top}, or leave stages out to pipeline inside components too",
            field="stages",
        )


def _positive_finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < math.inf


def _range_sums(values: np.ndarray) -> np.ndarray:
    """[i, j] = values[i] + ... + values[j], from prefix sums; meaningful for i <= j only."""
    import numpy as np

    prefix = np.concatenate(([0.0], np.cumsum(values)))
    return prefix[None, 1:] - prefix[:-1, None]


def _comm_ms(activation_bytes: np.ndarray, level: _Level) -> np.ndarray:
    """[s]: ms to send layer s's activations forward and their gradients back, 2 a_s / B_k."""
    return 2.0 * activation_bytes / level.bandwidth_bytes_per_s * MS_PER_S


def _stage_ms(component_ms: np.ndarray, weight_bytes: np.ndarray, level: _Level) -> np.ndarray:
    """T^k[i, j, m] for m = 0..m_k (m = 0 is inf): a replicated stage's ms per minibatch."""
    import numpy as np

    m = np.arange(1, level.devices + 1, dtype=np.float64)
    sync_ms = 2.0 * (m - 1) * weight_bytes[:, :, None] / level.bandwidth_bytes_per_s * MS_PER_S
    stage = np.maximum(component_ms[:, :, None], sync_ms) / m
    infinite = np.full(component_ms.shape + (1,), np.inf)
    return np.concatenate((infinite, stage), axis=2)


def _split_index(devices: int) -> np.ndarray:
    """[m'-1, m-2] = m - m' for m' in 1..M-1, m in 2..M; 0 (an inf column) where m' >= m."""
    import numpy as np

    left = np.arange(2, devices + 1)[None, :] - np.arange(1, devices)[:, None]
    return np.where(left >= 1, left, 0)


def _solve_level(
    stage_ms: np.ndarray,
    comm_ms: np.ndarray,
    devices: int,
    *,
    rows: Sequence[int],
    single_stage: bool,
) -> _Table:
    """A^k[i, j, m] for i in rows, all j >= i, m = 1..devices (inf elsewhere)."""
    import numpy as np

    layer_count = stage_ms.shape[0]
    best = np.full(stage_ms.shape, np.inf)
    split_layer = np.full(stage_ms.shape, -1, dtype=np.int64)
    split_workers = np.zeros(stage_ms.shape, dtype=np.int64)
    index = _split_index(devices)
    widths = devices - 1
    for i in rows:
        for j in range(i, layer_count):
            best[i, j, 1:] = stage_ms[i, j, 1:]
            if single_stage or j == i or devices == 1:
                continue
            # candidates[s - i, m' - 1, m - 2] for the last stage s+1..j on m' of m components
            candidates = np.maximum(
                np.maximum(best[i, i:j][:, index], comm_ms[i:j, None, None]),
                stage_ms[i + 1 : j + 1, j, 1:devices][:, :, None],
            ).reshape(-1, widths)
            pick = np.argmin(candidates, axis=0)
            split_ms = candidates[pick, np.arange(widths)]
            whole_ms = stage_ms[i, j, 2:]
            better = split_ms < whole_ms * (1.0 - TIE_RELATIVE)
            best[i, j, 2:] = np.where(better, split_ms, whole_ms)
            split_layer[i, j, 2:] = np.where(better, i + pick // widths, -1)
            split_workers[i, j, 2:] = np.where(better, pick % widths + 1, 0)
    return _Table(best, split_layer, split_workers)


def _forced_depth(
    stage_ms: np.ndarray, comm_ms: np.ndarray, devices: int, stages: int
) -> tuple[float, list[tuple[int, int, int]]]:
    """The best pipeline of layers 0..N-1 with exactly `stages` stages on `devices` components:
    its time and its (first, last, components) stages."""
    import numpy as np

    layer_count = stage_ms.shape[0]
    index = _split_index(devices)
    widths = devices - 1
    depth_ms = [stage_ms[0, :, :].copy()]  # [n-1][j, m]: layers 0..j as n stages on m
    splits: list[tuple[np.ndarray, np.ndarray]] = []
    for _ in range(2, stages + 1):
        previous = depth_ms[-1]
        current = np.full(previous.shape, np.inf)
        split_layer = np.full(previous.shape, -1, dtype=np.int64)
        split_workers = np.zeros(previous.shape, dtype=np.int64)
        for j in range(1, layer_count):
            candidates = np.maximum(
                np.maximum(previous[:j][:, index], comm_ms[:j, None, None]),
                stage_ms[1 : j + 1, j, 1:devices][:, :, None],
            ).reshape(-1, widths)
            pick = np.argmin(candidates, axis=0)
            current[j, 2:] = candidates[pick, np.arange(widths)]
            split_layer[j, 2:] = pick // widths
            split_workers[j, 2:] = pick % widths + 1
        depth_ms.append(current)
        splits.append((split_layer, split_workers))
    last, m = layer_count - 1, devices
    time_ms = float(depth_ms[stages - 1][last, m])
    result: list[tuple[int, int, int]] = []
    for n in range(stages, 1, -1):
        split_layer, split_workers = splits[n - 2]
        s, width = int(split_layer[last, m]), int(split_workers[last, m])
        result.append((s + 1, last, width))
        last, m = s, m - width
    result.append((0, last, m))
    return time_ms, result[::-1]


def _expand(
    tables: list[_Table], topology: list[_Level], k: int, i: int, j: int, m: int, bases: list[int]
) -> list[PlannedStage]:
    """The stages of A^k(i→j, m), run over by one group of m level-(k-1) components at each
    slot of `bases` (a copy per higher-level component running this sub-plan)."""
    table = tables[k - 1]
    unit = math.prod(level.devices for level in topology[: k - 1])  # slots of a component

    def components(lo: int, hi: int) -> list[int]:
        # interleaved over the copies: replica r of the stage is in copy r % len(bases), so
        # minibatch b (replica b % replicas at every stage) stays in copy b % len(bases)
        return [base + c * unit for c in range(lo, hi) for base in bases]

    s = int(table.split_layer[i, j, m])
    if s < 0:
        return _replicate(tables, topology, k, i, j, components(0, m))
    width = int(table.split_workers[i, j, m])
    return _expand(tables, topology, k, i, s, m - width, bases) + _replicate(
        tables, topology, k, s + 1, j, components(m - width, m)
    )


def _replicate(
    tables: list[_Table], topology: list[_Level], k: int, i: int, j: int, slots: list[int]
) -> list[PlannedStage]:
    """One level-k stage i..j on the level-(k-1) components at `slots`, as physical stages."""
    if k == 1:
        return [PlannedStage(first_layer=i, last_layer=j, replicas=len(slots), slots=tuple(slots))]
    below = topology[k - 2].devices
    return _expand(tables, topology, k - 1, i, j, below, slots)
