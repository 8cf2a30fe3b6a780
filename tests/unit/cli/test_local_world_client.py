"""Which controller the job commands reach: `--api`, else the settings' URL (environment or
config file), else the world `orchestrator local up` saved (while its process runs), else the
default URL. A saved world's token goes only to that world."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from orchestrator.cli.jobs import _client
from orchestrator.cli.local import LOCAL_DIR_ENV, _start_time, saved_world
from orchestrator.settings import ApiSettings


@pytest.fixture
def world_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in list(os.environ):
        if name.startswith("ORCHESTRATOR_API__") or name == "ORCHESTRATOR_CONFIG_FILE":
            monkeypatch.delenv(name)
    monkeypatch.setenv(LOCAL_DIR_ENV, str(tmp_path))
    return tmp_path


def _save(folder: Path, pid: int, started: int | None = None) -> None:
    saved = {"api_url": "http://127.0.0.1:45789", "token": "local-token", "pid": pid,
             "started": _start_time(pid) if started is None else started,
             "read_token": "r", "dashboard_url": "http://127.0.0.1:45789/dashboard"}  # fmt: skip
    (folder / "world.json").write_text(json.dumps(saved))


def _auth(client: object) -> str | None:
    return client._http.headers.get("Authorization")  # type: ignore[attr-defined]


def test_a_running_saved_world_is_reached_with_its_token(world_dir: Path) -> None:
    _save(world_dir, os.getpid())
    with _client(None, None) as client:
        assert client.base_url == "http://127.0.0.1:45789"
        assert _auth(client) == "Bearer local-token"
    with _client(None, "mine") as client:  # --token still wins
        assert _auth(client) == "Bearer mine"


def test_the_flag_and_the_settings_url_win_over_a_saved_world(
    world_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(world_dir, os.getpid())
    with _client("http://10.0.0.5:8750", None) as client:
        assert client.base_url == "http://10.0.0.5:8750"
        assert _auth(client) is None  # the local world's token never leaves for elsewhere
    monkeypatch.setenv("ORCHESTRATOR_API__URL", "http://10.0.0.6:8750")
    with _client(None, None) as client:
        assert client.base_url == "http://10.0.0.6:8750"
        assert _auth(client) is None


def test_a_world_whose_process_is_gone_is_not_reached(world_dir: Path) -> None:
    _save(world_dir, 2**22 + 7)  # above Linux's pid_max default: no such process
    assert saved_world() is None
    with _client(None, None) as client:
        assert client.base_url == ApiSettings().url.rstrip("/")


def test_a_world_whose_pid_another_process_took_is_not_reached(world_dir: Path) -> None:
    """The pid alone is not the world: a reboot or a crash frees it for any process."""
    started = _start_time(os.getpid())
    assert started is not None
    _save(world_dir, os.getpid(), started=started + 1)
    assert saved_world() is None


def test_a_torn_or_foreign_world_file_is_ignored(world_dir: Path) -> None:
    (world_dir / "world.json").write_text("{not json")
    assert saved_world() is None
    (world_dir / "world.json").write_text("[1, 2]")
    assert saved_world() is None
    (world_dir / "world.json").write_text(json.dumps({"pid": os.getpid(), "api_url": 5}))
    assert saved_world() is None
