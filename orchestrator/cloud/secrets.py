"""Reading the orchestrator's tokens from AWS Secrets Manager (the AWS deployment keeps them
there, never in user data; infra/controller.yaml)."""

from __future__ import annotations

from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from orchestrator.aws import aws_client
from orchestrator.errors import UserError


def read_secret(
    secret_id: str, region: str, *, endpoint_url: str | None = None, client: Any = None
) -> str:
    """The string value of `secret_id` (an ARN or a name).

    Raises:
        UserError: the secret is missing, empty or not readable with this role.
    """
    if client is None:
        client = aws_client("secretsmanager", region, endpoint_url=endpoint_url)
    try:
        value = client.get_secret_value(SecretId=secret_id).get("SecretString") or ""
    except (ClientError, BotoCoreError) as exc:
        raise UserError(
            f"cannot read the secret {secret_id}: {exc}",
            fix="check that the secret exists in this region and that this instance's role "
            "may call secretsmanager:GetSecretValue on it (infra/controller.yaml grants it)",
        ) from None
    if not value.strip():
        raise UserError(f"the secret {secret_id} is empty", fix="put the token in it")
    return value.strip()
