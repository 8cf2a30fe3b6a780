"""The job token: the shared secret every node of an AgileML job authenticates with.

Light on purpose (no torch), so that processes can check for it before loading the runtime.
"""

from __future__ import annotations

import os

from orchestrator.errors import UserError

#: Environment variable that carries the job token, hex-encoded (never put it on a command line).
AGILEML_TOKEN_ENV = "ORCHESTRATOR_AGILEML_TOKEN"


def token_from_env() -> bytes:
    """The job token from `AGILEML_TOKEN_ENV`.

    Raises:
        UserError: it is missing or not hex (with the fix).
    """
    raw = os.environ.get(AGILEML_TOKEN_ENV, "")
    try:
        token = bytes.fromhex(raw)
    except ValueError:
        token = b""
    if not token:
        raise UserError(
            f"{AGILEML_TOKEN_ENV} must hold the job token in hex",
            fix=f"export {AGILEML_TOKEN_ENV}=<hex> (the same value on every node of the job)",
            field=AGILEML_TOKEN_ENV,
        )
    return token
