"""Helper and helpee groups: which workers may take over part of whose iteration.

Each worker gets `size` helpers: one on its own machine when there is one, the others spread
over the other machines (thesis §3.3.1). A worker's helpees are the workers that list it as a
helper, so the two relations are inverse and usually not identical. Every worker computes the
groups itself from the clock's members and their machines, so all agree without a coordinator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def helper_groups(
    members: Sequence[str], machine_of: Mapping[str, str], size: int
) -> dict[str, tuple[str, ...]]:
    """Each member's helpers (at most `size`, never itself).

    `machine_of` maps a member to its machine (e.g. the host of its endpoint); a member missing
    from it counts as alone on its machine. Deterministic in the sorted members.
    """
    workers = sorted(members)
    machines: dict[str, list[str]] = {}
    for w in workers:
        machines.setdefault(machine_of.get(w, f"?{w}"), []).append(w)
    order = sorted(machines)
    groups: dict[str, tuple[str, ...]] = {}
    for w in workers:
        home = machine_of.get(w, f"?{w}")
        local = machines[home]
        i = local.index(w)
        chosen: list[str] = []
        if len(local) > 1 and size > 0:
            chosen.append(local[(i + 1) % len(local)])  # the next worker on the same machine
        # then one worker from each other machine in ring order, at the same offset (so the
        # helpers of one machine's workers land on different workers elsewhere), round after
        # round; only when the other machines run out, more from this one
        ring = order[order.index(home) + 1 :] + order[: order.index(home)]
        remote = [
            machines[m][(i + r) % len(machines[m])]
            for r in range(max((len(machines[m]) for m in ring), default=0))
            for m in ring
        ]
        spare_local = [local[(i + k) % len(local)] for k in range(2, len(local))]
        for candidate in remote + spare_local:
            if len(chosen) >= size:
                break
            if candidate != w and candidate not in chosen:
                chosen.append(candidate)
        groups[w] = tuple(chosen)
    return groups


def helpee_groups(helpers: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    """The inverse relation: for each worker, the workers it may help."""
    out: dict[str, list[str]] = {w: [] for w in helpers}
    for helpee, group in helpers.items():
        for helper in group:
            out.setdefault(helper, []).append(helpee)
    return {w: tuple(sorted(v)) for w, v in out.items()}
