"""A pipeline stage trains on its device: the launcher gives each worker one of the machine's
GPUs (the CPU without them), a node its instance's first, and a device that is not there is
refused with the reason rather than trained on the CPU unsaid."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from orchestrator.agileml.errors import AgileMLError
from orchestrator.agileml.pipeline.stage import StageConfig, device_for, stage_device

CONFIG = dict(job_id="j", stage=0, stages=1, first_layer=0, last_layer=0, minibatches=4,
              rendezvous="tcp://127.0.0.1:1", out_dir="/tmp")  # fmt: skip


@pytest.mark.parametrize("name", ["cpu", "cuda:0", "cuda:7"])
def test_a_stage_config_takes_the_cpu_or_a_numbered_gpu(name: str) -> None:
    assert StageConfig(**CONFIG, device=name).device == name


@pytest.mark.parametrize("name", ["gpu", "cuda", "cuda:-1", "cpu;rm", "mps:0", ""])
def test_a_stage_config_refuses_any_other_device(name: str) -> None:
    with pytest.raises(ValidationError, match="device"):
        StageConfig(**CONFIG, device=name)


def test_workers_on_a_machine_with_gpus_take_them_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [device_for(w) for w in range(5)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]


def test_without_gpus_every_worker_trains_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert {device_for(w) for w in range(4)} == {"cpu"}
    assert stage_device("cpu") == torch.device("cpu")


def test_a_gpu_that_is_not_there_is_refused_with_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert stage_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(AgileMLError, match="cuda:2 is not here: this machine has 2 GPUs"):
        stage_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(AgileMLError, match="has 0 GPUs"):
        stage_device("cuda:0")
