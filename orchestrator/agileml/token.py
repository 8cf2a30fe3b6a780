"""The job token: the shared secret every node of an AgileML job authenticates with, written as
hex wherever it travels (an environment variable offline, a Secrets Manager secret on AWS).

Light on purpose (no torch), so that processes can check for it before loading the runtime.
"""

from __future__ import annotations

import os

from orchestrator.errors import UserError

#: Environment variable that carries the job token, hex-encoded (never put it on a command line).
AGILEML_TOKEN_ENV = "ORCHESTRATOR_AGILEML_TOKEN"
#: A token shorter than this is refused (a guessable secret would let anyone join the job).
MIN_TOKEN_BYTES = 16


def token_from_hex(text: str, *, source: str) -> bytes:
    """The token written as hex in `text` (surrounding white space ignored).

    Raises:
        UserError: not hex, or shorter than `MIN_TOKEN_BYTES` (naming `source`).
    """
    try:
        token = bytes.fromhex(text.strip())
    except ValueError:
        token = b""
    if len(token) < MIN_TOKEN_BYTES:
        raise UserError(
            f"{source} must hold the job token: at least {MIN_TOKEN_BYTES} bytes as hex",
            fix=f"put `python -c 'import secrets; print(secrets.token_hex(32))'` in {source} "
            "(the same value for every node of the job)",
            field=source,
        )
    return token


def token_from_env() -> bytes:
    """The job token from `AGILEML_TOKEN_ENV`.

    Raises:
        UserError: it is missing or not hex (with the fix).
    """
    return token_from_hex(os.environ.get(AGILEML_TOKEN_ENV, ""), source=AGILEML_TOKEN_ENV)
