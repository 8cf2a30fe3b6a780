"""The plain PyTorch loop a job's AgileML run must match: one process, the same initial model,
the same global batches (`roster.global_batch_indices`), the user's optimizer and scheduler
stepped once per iteration. Used by the exactness tests and as the single-process baseline."""

from __future__ import annotations

import torch
from torch import nn

from orchestrator.agileml.batches import micro_batch, micro_batches, to_device
from orchestrator.agileml.jobcode import JobCode, dataset_rows, seeded_model
from orchestrator.agileml.precision import LossScale, autocast
from orchestrator.agileml.roster import global_batch_indices


def train_reference(
    code: JobCode,
    *,
    iterations: int,
    global_batch: int,
    seed: int = 0,
    accumulate: int = 1,
    precision: str = "fp32",
    clip_grad_norm: float | None = None,
    device: torch.device | None = None,
) -> tuple[nn.Module, list[float]]:
    """Train the job for `iterations` iterations in this process, each global batch in
    `accumulate` micro-batches (their mean losses weighted by their rows, gradients summed),
    forward and loss in `precision` (fp16: with the workers' dynamic loss scale, a step whose
    gradient is not finite skipped, the scheduler stepped all the same), the gradient clipped
    to `clip_grad_norm` by `clip_grad_norm_` before the step; returns the model and
    the loss of each iteration. `device`: where it computes (the CPU if None); the model
    returned is on the CPU."""
    device = device or torch.device("cpu")
    model = seeded_model(code, seed).to(device)
    model.train()
    rows = dataset_rows(code)
    optimizer = code.optimizer(model.parameters())
    make_scheduler = code.for_run(iterations).make_scheduler
    scheduler = make_scheduler(optimizer) if make_scheduler is not None else None
    losses = []
    scale = LossScale() if precision == "fp16" else None
    for clock in range(iterations):
        batch = rows.take(global_batch_indices(seed, clock, len(rows), global_batch))
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for start, end in micro_batches(global_batch, accumulate):
            x, y = to_device(micro_batch(batch, start, end), device)
            with autocast(precision, device):
                loss = code.loss(model(x), y) * ((end - start) / global_batch)
            (loss * (scale.scale if scale is not None else 1.0)).backward()
            total += float(loss.item())
        finite = scale is None or scale.unscale(list(model.parameters()))
        if scale is not None:
            scale.update(finite)
        if finite and clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        if finite:
            optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(total)
    return model.cpu(), losses


def relative_error(a: nn.Module, b: nn.Module) -> float:
    """max over state_dict entries of |a - b| / max(|b|, 1e-12), by norms."""
    worst = 0.0
    sa, sb = a.state_dict(), b.state_dict()
    for key, ref in sb.items():
        diff = (sa[key].double() - ref.double()).norm().item()
        worst = max(worst, diff / max(ref.double().norm().item(), 1e-12))
    return worst
