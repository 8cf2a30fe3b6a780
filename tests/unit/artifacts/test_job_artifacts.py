"""A job's artifacts folder: named only by a safe job id; the weights handed back are the final
ones, else the newest complete checkpoint's."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.artifacts import JobArtifacts, latest_checkpoint
from orchestrator.errors import UserError


@pytest.mark.parametrize("job_id", ["../etc", "..", "a/b", "", ".hidden", "x" * 200])
def test_a_job_id_that_could_leave_the_root_names_no_folder(tmp_path: Path, job_id: str) -> None:
    with pytest.raises(UserError, match="cannot name an artifacts folder"):
        JobArtifacts(tmp_path, job_id)


def test_the_weights_handed_back_are_the_final_else_the_newest_complete_checkpoints(
    tmp_path: Path,
) -> None:
    art = JobArtifacts(tmp_path, "job-1")
    assert art.best_weights() is None and art.latest_checkpoint() is None
    for clock, complete in ((9, True), (19, True), (29, False)):
        folder = art.checkpoints.path / f"ckpt-{clock:08d}"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"w")
        if complete:
            (folder / "checkpoint.json").write_text("{}")
    assert latest_checkpoint(art.checkpoints) == art.checkpoints.sub("ckpt-00000019")
    assert art.best_weights() == (art.checkpoints.sub("ckpt-00000019"), "ckpt-00000019")
    art.final.write_bytes("model.safetensors", b"f")
    assert art.best_weights() == (art.final, "final")


@pytest.mark.parametrize("field", ["checkpoint_dir", "resume_from"])
def test_a_submission_cannot_point_the_host_at_its_own_folders(field: str) -> None:
    from orchestrator.jobspec import JobSubmission

    with pytest.raises(ValueError, match=f"{field} is set by the controller"):
        JobSubmission(name="x", budget_usd=1.0, work_gpu_hours=1.0, training={field: "/etc"})
