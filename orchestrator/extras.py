"""The package's optional extras, and the one error when a command needs one that is missing.

The core install is what a controller and an instance agent on AWS need. The offline world
(`demo`, `local up`) needs `offline` (moto's EC2 and S3 server, scikit-learn for the bundled
job's digits); `simulate --plot FILE.png` needs `plot` (matplotlib).
"""

from __future__ import annotations

import importlib.util

from orchestrator.errors import UserError

#: Extra -> the modules it installs that commands import.
EXTRAS: dict[str, tuple[str, ...]] = {
    "offline": ("moto", "sklearn"),
    "plot": ("matplotlib",),
}


def missing(extra: str) -> list[str]:
    """The modules of `extra` that are not installed."""
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def require(extra: str, *, what: str, field: str | None = None) -> None:
    """Raise unless every module of `extra` is installed.

    Raises:
        UserError: naming what needs it, the missing modules and the install command.
    """
    absent = missing(extra)
    if absent:
        raise UserError(
            f"{what} needs the {extra!r} extra, which is not installed (no {', '.join(absent)})",
            field=field,
            fix=f"pip install 'orchestrator[{extra}]' (./setup.sh installs it)",
        )
