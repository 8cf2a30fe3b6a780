"""`Settings`: the orchestrator's configuration, read from `ORCHESTRATOR_*` environment variables.

One nested model; nested fields use `__` (`ORCHESTRATOR_API__TOKEN`, `ORCHESTRATOR_API__PORT`).
Nothing reads it at import time: build it where it is needed (`Settings()` reads the
environment, `Settings(redis_url=..., api=ApiSettings(...))` in tests) and pass it down.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from orchestrator.errors import UserError

ENV_PREFIX = "ORCHESTRATOR_"
ENV_NESTED_DELIMITER = "__"
API_TOKEN_ENV = f"{ENV_PREFIX}API{ENV_NESTED_DELIMITER}TOKEN"


class ApiSettings(BaseModel):
    """The HTTP API: where the server listens, its token, and where the CLI finds it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 8750
    token: SecretStr | None = Field(
        None,
        description="bearer token every mutating call must carry; the server refuses to start "
        "without one, the CLI sends it when set",
    )
    url: str = Field("http://127.0.0.1:8750", description="the API the CLI talks to")
    token_secret: str | None = Field(
        None,
        description="a Secrets Manager secret (ARN or name) holding the token, read by "
        "`controller start` when `token` is unset (the AWS deployment sets it)",
    )

    def require_token(self) -> SecretStr:
        """The token, for a server about to start.

        Raises:
            UserError: no token (or an empty one) is configured; nothing was started.
        """
        if self.token is None or not self.token.get_secret_value().strip():
            raise UserError(
                "the API server needs a token and none is set",
                fix=f"set {API_TOKEN_ENV} to a long random string, e.g. "
                f'`export {API_TOKEN_ENV}="$(openssl rand -hex 32)"`, and give the same value '
                "to the CLI (it reads the same variable, or pass --token)",
                field=API_TOKEN_ENV,
            )
        return self.token


#: The most training jobs a controller hosts AgileML controllers for (one port each, from
#: `WorkerSettings.agileml_port`).
MAX_HOSTED_TRAINING_JOBS = 64


class WorkerSettings(BaseModel):
    """How the controller launches workers on AWS (set by the deployment, infra/)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    launch_template: str | None = Field(
        None, description="the workers' EC2 launch template (name); None: launch bare AMIs"
    )
    subnets: str = Field(
        "", description="comma-separated subnet ids workers launch in, at most one per zone"
    )
    token_secret: str | None = Field(
        None,
        description="Secrets Manager secret (ARN or name) of the AgileML worker token; when "
        "set, `controller start` hosts the training jobs' AgileML controllers",
    )
    agileml_port: Annotated[int, Field(ge=1024, le=65535)] = Field(
        29500, description="the first port of the hosted AgileML controllers (one per job)"
    )
    advertise_host: str | None = Field(
        None, description="the address workers reach this node at (default: its private IP)"
    )

    @property
    def subnet_ids(self) -> tuple[str, ...]:
        return tuple(s.strip() for s in self.subnets.split(",") if s.strip())


class Settings(BaseSettings):
    """Everything configurable, from `ORCHESTRATOR_*` variables (init arguments win)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_NESTED_DELIMITER,
        extra="ignore",
        frozen=True,
    )

    redis_url: str = "redis://127.0.0.1:6379/0"
    controller_id: str = "local"
    region: str = "us-east-1"
    api: ApiSettings = ApiSettings()
    worker: WorkerSettings = WorkerSettings()

    @classmethod
    def load(cls) -> Settings:
        """Read the environment.

        Raises:
            UserError: a variable holds an invalid value (named, with what to set instead).
        """
        try:
            return cls()
        except ValidationError as exc:
            first = exc.errors()[0]
            path = [str(p) for p in first.get("loc", ())]
            env = ENV_PREFIX + ENV_NESTED_DELIMITER.join(p.upper() for p in path)
            raise UserError(
                f"{env}: {first.get('msg', 'invalid value')} (got {first.get('input')!r})",
                fix=f"set {env} to a valid value or unset it to use the default",
                field=env,
            ) from None
