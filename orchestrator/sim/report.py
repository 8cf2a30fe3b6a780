"""Human-readable output of a simulation: a table and a chart."""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from orchestrator.errors import UserError
from orchestrator.sim.runner import SimReport


def _fmt(v: float, spec: str) -> str:
    return format(v, spec) if math.isfinite(v) else "inf"


def render_table(report: SimReport, console: Console) -> None:
    """One row per strategy, then how BidBrain compares with each, paired by start."""
    c = report.config
    table = Table(
        title=f"{c.starts} starts · {c.job_hours:g} h × {c.nodes} {c.reference_type} of work · "
        f"{c.billing} billing · on-demand job = ${report.ondemand_cost_usd:,.2f}"
    )
    for col in (
        "strategy",
        "cost vs on-demand",
        "runtime vs on-demand",
        "free compute",
        "evictions",
        "cost p50 $",
        "cost p95 $",
        "finished",
        *(("deadline met",) if c.deadline_hours is not None else ()),
    ):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for name, s in report.strategies.items():
        table.add_row(
            name,
            _fmt(s.cost_vs_ondemand, ".3f"),
            _fmt(s.runtime_vs_ondemand, ".3f"),
            f"{s.free_compute_fraction:.1%}",
            f"{s.evictions_mean:.1f}",
            _fmt(s.cost_usd_p50, ",.2f"),
            _fmt(s.cost_usd_p95, ",.2f"),
            f"{s.completed_fraction:.0%}",
            *((f"{s.deadline_met_fraction:.0%}",) if c.deadline_hours is not None else ()),
        )
    console.print(table)
    if report.paired_wins:
        bb = report.strategies["bidbrain"].cost_vs_ondemand
        for name, frac in report.paired_wins.items():
            other = report.strategies[name].cost_vs_ondemand
            console.print(
                f"  bidbrain vs {name:20s} cost per work {bb / other:6.3f}×, "
                f"cheaper at {frac:.0%} of starts"
            )


def save_plot(report: SimReport, path: Path) -> None:
    """Bar charts of cost and runtime relative to on-demand, per strategy.

    Raises:
        UserError: the file cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report.strategies)
    cost = [report.strategies[n].cost_vs_ondemand for n in names]
    runtime = [report.strategies[n].runtime_vs_ondemand for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = [
        "#d62728" if n == "bidbrain" else "#7f7f7f" if n == "oracle" else "#1f77b4" for n in names
    ]
    for ax, values, title in (
        (axes[0], cost, "cost relative to on-demand"),
        (axes[1], runtime, "runtime relative to on-demand"),
    ):
        ax.barh(names, values, color=colors)
        ax.invert_yaxis()
        ax.set_title(title)
        ax.axvline(1.0, color="black", linewidth=0.8)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:.2f}", va="center")
    c = report.config
    fig.suptitle(
        f"{c.job_hours:g} h × {c.nodes} {c.reference_type}, {c.starts} starts, {c.billing} billing"
    )
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise UserError(
            f"cannot write plot {path}: {exc.strerror}",
            field="--plot",
            fix="pass a path in a folder you can write to",
        ) from None
    finally:
        plt.close(fig)
