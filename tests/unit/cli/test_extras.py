"""Commands that need an optional extra refuse, before doing anything, with the install command
when it is missing (a worker's core install has no moto, scikit-learn or matplotlib)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from orchestrator.cli.console import app
from orchestrator.errors import UserError
from orchestrator.extras import EXTRAS, missing


@pytest.fixture
def without(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Make the named top-level modules look uninstalled."""
    real = importlib.util.find_spec

    def hide(*modules: str) -> None:
        def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
            return None if name in modules else real(name, *args, **kwargs)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    return hide


def test_every_extra_is_installed_here() -> None:
    assert all(missing(extra) == [] for extra in EXTRAS)


@pytest.mark.parametrize(
    ("args", "module", "extra"),
    [
        (["demo", "--no-dashboard"], "moto", "offline"),
        (["demo", "--no-dashboard"], "sklearn", "offline"),
        (["local", "up"], "moto", "offline"),
    ],
)
def test_the_offline_world_without_its_extra_says_how_to_install_it(
    without: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, args: list[str], module: str,
    extra: str,
) -> None:  # fmt: skip
    monkeypatch.setenv("ORCHESTRATOR_LOCAL_DIR", str(tmp_path))  # no world is up there
    without(module)
    error = _user_error(CliRunner().invoke(app, args))
    assert f"no {module}" in error.message and f"orchestrator[{extra}]" in error.fix
    assert not (tmp_path / "world.json").exists()


def test_a_png_plot_without_matplotlib_says_how_to_install_it(without: Any, tmp_path: Path) -> None:
    without("matplotlib")
    error = _user_error(CliRunner().invoke(app, ["simulate", "--plot", str(tmp_path / "p.png")]))
    assert error.field == "--plot" and "orchestrator[plot]" in error.fix


def _user_error(result: Any) -> UserError:
    """The UserError the command raised (`main` prints it as one line and exits 2)."""
    assert isinstance(result.exception, UserError), result.output
    assert result.exception.exit_code == 2
    return result.exception
