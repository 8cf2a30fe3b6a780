"""`remove_run_dir`: a run's temporary folder goes on every exit; a failed run's stays with
ORCHESTRATOR_KEEP_LOGS=1, and stderr says where."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.lifecycle import KEEP_LOGS_ENV, remove_run_dir


def _run_dir(tmp_path: Path, name: str = "agileml-run") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "t0.log").write_text("a node's log\n")
    return folder


@pytest.mark.parametrize("failed", [False, True])
def test_removed_after_success_and_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failed: bool
) -> None:
    monkeypatch.delenv(KEEP_LOGS_ENV, raising=False)
    folder = _run_dir(tmp_path)
    remove_run_dir(folder, failed=failed)
    assert not folder.exists()


def test_a_failed_runs_logs_stay_with_keep_logs_and_stderr_says_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(KEEP_LOGS_ENV, "1")
    kept, done = _run_dir(tmp_path), _run_dir(tmp_path, "agileml-ok")
    remove_run_dir(kept, failed=True)
    remove_run_dir(done, failed=False)  # a run that succeeded has no logs worth keeping
    assert (kept / "t0.log").exists()
    assert not done.exists()
    assert capsys.readouterr().err.splitlines() == [
        f"{KEEP_LOGS_ENV}=1: the failed run's logs are kept in {kept}"
    ]


def test_a_folder_already_gone_is_no_error(tmp_path: Path) -> None:
    remove_run_dir(tmp_path / "never-made", failed=False)
