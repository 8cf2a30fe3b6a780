"""A pipeline node starts each stage worker on the device of its instance the supervisor
chose (`run {name, config, device}`), and a run request it cannot carry out is reported as
that worker's failed exit, with the reason, so the supervisor fails the job instead of waiting
for a worker that never started."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.agileml.pipeline import node as node_module
from orchestrator.agileml.pipeline.node import PipelineNode


class Spawned:
    """A started worker that is still running."""

    def poll(self) -> int | None:
        return None


def _node(monkeypatch: pytest.MonkeyPatch) -> tuple[PipelineNode, list[tuple[str, Any]]]:
    monkeypatch.setattr(node_module, "device_for", lambda index: f"cuda:{index}")
    node = PipelineNode("i-a", "transient", job_id="job-1", controller="tcp://127.0.0.1:1",
                        token=bytes(32))  # fmt: skip
    sent: list[tuple[str, Any]] = []
    monkeypatch.setattr(node, "_send", lambda sock, detail, body, files=None: sent.append(
        (detail, body)))  # fmt: skip
    return node, sent


def _run(node: PipelineNode, tmp_path: Path, name: str, **body: Any) -> None:
    request = {"name": name, "config": {"stage": 1, "replica": 0}, **body}
    node._start(request, {}, tmp_path, lambda n, path: Spawned(), code="job.py",
                rendezvous="tcp://127.0.0.1:2")  # fmt: skip


def test_a_worker_gets_the_device_the_supervisor_chose(monkeypatch, tmp_path) -> None:
    node, sent = _node(monkeypatch)
    _run(node, tmp_path, "stage1.0-1", device=3)
    _run(node, tmp_path, "stage1.1-1")  # an older supervisor: the first device
    assert json.loads((tmp_path / "stage1.0-1.json").read_text())["device"] == "cuda:3"
    assert json.loads((tmp_path / "stage1.1-1.json").read_text())["device"] == "cuda:0"
    node._report_exits(None, tmp_path)  # type: ignore[arg-type]
    assert sent == []  # both running


@pytest.mark.parametrize(
    ("device", "why"),
    [(True, "no stage number or device index"), (1.0, "no stage number or device index"),
     ("1", "no stage number or device index"), (-1, "device index -1 out of 0..15"),
     (16, "device index 16 out of 0..15")],
)  # fmt: skip
def test_a_malformed_run_request_is_reported_as_the_workers_failed_exit(
    monkeypatch, tmp_path, device, why
) -> None:
    node, sent = _node(monkeypatch)
    _run(node, tmp_path, "stage1.0-1", device=device)
    assert not (tmp_path / "stage1.0-1.json").exists()  # nothing started
    node._report_exits(None, tmp_path)  # type: ignore[arg-type]
    node._report_exits(None, tmp_path)  # type: ignore[arg-type]
    assert sent == [("exited", {"name": "stage1.0-1", "code": 1, "stdout": "",
                                "log": f"a malformed run request: {why}"})]  # fmt: skip


def test_a_run_request_with_a_bad_name_is_dropped_and_the_node_goes_on(monkeypatch, tmp_path):
    """A name it cannot report under (not a plain file name) is logged and dropped."""
    node, sent = _node(monkeypatch)
    _run(node, tmp_path, "../escape", device=0)
    node._report_exits(None, tmp_path)  # type: ignore[arg-type]
    assert node.procs == {} and sent == [] and list(tmp_path.iterdir()) == []
