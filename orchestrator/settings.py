"""`Settings`: the orchestrator's configuration, from `ORCHESTRATOR_*` environment variables
and an optional YAML/JSON config file.

One nested model; nested fields use `__` (`ORCHESTRATOR_API__TOKEN`,
`ORCHESTRATOR_BIDBRAIN__MIN_IMPROVEMENT`). Where a value comes from, strongest first: arguments
given to `Settings(...)`, the environment, the config file (`Settings.load(config_file)` or
`ORCHESTRATOR_CONFIG_FILE`), the defaults. Nothing reads it at import time: build it where it is
needed (`Settings.load()` at the edges, `Settings(redis_url=..., api=ApiSettings(...))` in
tests) and pass it down.
"""

from __future__ import annotations

import contextvars
import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from orchestrator.bidbrain.policy import BidBrainSettings
from orchestrator.errors import UserError
from orchestrator.units import MAX_SETTING_S

ENV_PREFIX = "ORCHESTRATOR_"
ENV_NESTED_DELIMITER = "__"
API_TOKEN_ENV = f"{ENV_PREFIX}API{ENV_NESTED_DELIMITER}TOKEN"
API_READ_TOKEN_ENV = f"{ENV_PREFIX}API{ENV_NESTED_DELIMITER}READ_TOKEN"
API_CA_CERT_ENV = f"{ENV_PREFIX}API{ENV_NESTED_DELIMITER}CA_CERT"
#: The config file read when `Settings.load` is given none.
CONFIG_FILE_ENV = f"{ENV_PREFIX}CONFIG_FILE"
#: The config file `Settings.load` reads (a context variable: `Settings()` itself has no
#: parameter for it).
_CONFIG_FILE: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "orchestrator_config_file", default=None
)


class ApiSettings(BaseModel):
    """The HTTP API: where the server listens, its token, and where the CLI finds it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 8750
    token: SecretStr | None = Field(
        None,
        description="bearer token every call but /healthz must carry (reads may carry "
        "read_token instead); the server refuses to start without one, the CLI sends it",
    )
    read_token: SecretStr | None = Field(
        None,
        description="a read-only token for dashboards, scrapers and watchers: it reads jobs, "
        "costs, events, the dashboard's data and /metrics, and changes nothing (nor downloads "
        "weights); the CLI sends it when `token` is unset",
    )
    url: str = Field("http://127.0.0.1:8750", description="the API the CLI talks to")
    tls_cert: Path | None = Field(
        None,
        description="the server's certificate (PEM, its chain after it): with tls_key, the "
        "API speaks HTTPS only",
    )
    tls_key: Path | None = Field(None, description="the private key of tls_cert (PEM)")
    tls_secret: str | None = Field(
        None,
        description="a Secrets Manager secret (ARN or name) holding the certificate and key "
        'as JSON {"certificate": PEM, "private_key": PEM}, read by `controller start` when '
        "tls_cert is unset",
    )
    tls_self_signed: bool = Field(
        False,
        description="`controller start` makes a self-signed certificate for this node's "
        "addresses (kept, and published to the artifact store as tls/api-cert.pem for the "
        "CLI's ca_cert) when no certificate is given (the AWS deployment's default)",
    )
    ca_cert: Path | None = Field(
        None,
        description="the CLI trusts the API's certificate if this PEM signed it (a "
        "self-signed certificate is its own); None: the system's CAs",
    )
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

    @model_validator(mode="after")
    def _read_token_differs(self) -> ApiSettings:
        token, read = self.token, self.read_token
        if token is None or read is None:
            return self
        if token.get_secret_value().strip() == read.get_secret_value().strip():
            raise ValueError(
                "read_token equals token: every change would be refused as read-only; "
                "give the read-only token a value of its own"
            )
        return self

    @field_validator("tls_secret", "token_secret", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        return None if isinstance(value, str) and not value.strip() else value

    def require_tls(self) -> tuple[Path, Path] | None:
        """The certificate and key files to serve HTTPS with (None: plain HTTP), checked
        readable before a server starts.

        Raises:
            UserError: only one of the two is set, or a file cannot be read.
        """
        if self.tls_cert is None and self.tls_key is None:
            return None
        if self.tls_cert is None or self.tls_key is None:
            missing = "TLS_CERT" if self.tls_cert is None else "TLS_KEY"
            raise UserError(
                "HTTPS needs both a certificate and its key, and only one is set",
                fix=f"set {ENV_PREFIX}API{ENV_NESTED_DELIMITER}{missing} too, or neither "
                "(plain HTTP)",
                field=f"{ENV_PREFIX}API{ENV_NESTED_DELIMITER}{missing}",
            )
        for name, path in (("TLS_CERT", self.tls_cert), ("TLS_KEY", self.tls_key)):
            if not os.access(path, os.R_OK) or not path.is_file():
                raise UserError(
                    f"cannot read {path}",
                    fix="give the path of a PEM file this user can read",
                    field=f"{ENV_PREFIX}API{ENV_NESTED_DELIMITER}{name}",
                )
        return self.tls_cert, self.tls_key

    def client_token(self) -> SecretStr | None:
        """What the CLI sends: the token, else the read-only one."""
        return self.token or self.read_token


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


class TrainingSettings(BaseModel):
    """Where the hosted training jobs keep their code, checkpoints and final weights, and how
    often they checkpoint (see `orchestrator.artifacts`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    artifacts_dir: Path = Field(
        Path.home() / ".local" / "share" / "orchestrator" / "artifacts",
        description="the jobs' checkpoints and final weights, a folder per job",
    )
    store: Annotated[str, Field(min_length=1, max_length=1024)] | None = Field(
        None,
        description="the artifact store the jobs' nodes share with the controller (uploaded "
        "code, checkpoints, weights): s3://BUCKET/PREFIX (on AWS: the deploy stack's bucket) "
        "or a folder every node mounts; None: artifacts_dir, which only nodes on this machine "
        "reach (offline and local runs; on AWS the final weights then come over the wire)",
    )
    checkpoint_every_s: Annotated[float, Field(ge=0, le=MAX_SETTING_S)] = Field(
        600.0,
        description="seconds between two checkpoints of a job whose spec sets no "
        "checkpoint_every / checkpoint_every_s (0: none)",
    )

    @property
    def store_location(self) -> str:
        """The artifact store's location: `store`, else `artifacts_dir`."""
        return self.store or str(self.artifacts_dir)


class ControllerSettings(BaseModel):
    """How the controller runs: where EC2 and prices come from, billing, job concurrency."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    endpoint_url: str | None = Field(
        None, description="the EC2 (and Secrets Manager) endpoint, e.g. a moto server offline"
    )
    prices: tuple[Path, ...] = Field(
        (),
        description="replay spot prices from these trace folders instead of reading EC2's "
        "price history (offline); needs replay_start",
    )
    replay_start: str | None = Field(
        None, description="with prices: the trace time the clock starts at (ISO-8601)"
    )
    speed: Annotated[float, Field(gt=0, le=1e6)] = Field(
        1.0, description="with prices: how many times faster than real time the clock runs"
    )
    billing: str = Field("per-second", description="per-second, or hourly-refund (2016)")
    max_running_jobs: Annotated[int, Field(ge=1)] | None = Field(
        None, description="run at most this many jobs at once (1: in sequence); None: all"
    )
    image_id: str = Field(
        "ami-orchestrator",
        description="the AMI of workers launched without a launch template (moto accepts any)",
    )
    stall_after_s: Annotated[float, Field(gt=0, le=30 * 86400, allow_inf_nan=False)] = Field(
        600.0,
        description="a training job whose instances have run this long without a sign of "
        "training (an iteration, a node joining) has them released (seconds; with replayed "
        "prices, of real time: the market clock counts this times the speed)",
    )
    stall_attempts: Annotated[int, Field(ge=1, le=100)] = Field(
        3, description="the stall that fails the job: after this many releases for no progress"
    )
    join_grace_s: Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False)] = Field(
        900.0,
        description="an instance whose node has not joined its job's training this long after "
        "launch is released and replaced (seconds; of real time, as stall_after_s)",
    )
    rejoin_grace_s: Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False)] = Field(
        180.0,
        description="an instance whose node left its job's training (its agent died, it "
        "stopped heartbeating) and has not come back this long is released and replaced "
        "(seconds; of real time, as stall_after_s)",
    )

    @field_validator("billing")
    @classmethod
    def _known_billing(cls, value: str) -> str:
        from orchestrator.market.billing import BILLING_MODELS

        if value not in BILLING_MODELS:
            raise ValueError(f"unknown billing model; use one of: {', '.join(BILLING_MODELS)}")
        return value


class Settings(BaseSettings):
    """Everything configurable (see the module docstring for where values come from)."""

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
    controller: ControllerSettings = ControllerSettings()
    bidbrain: BidBrainSettings = BidBrainSettings()
    training: TrainingSettings = TrainingSettings()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _ConfigFileSource(settings_cls))

    @classmethod
    def load(cls, config_file: Path | None = None) -> Settings:
        """Read the environment and the config file (`config_file`, else the file named by
        `ORCHESTRATOR_CONFIG_FILE`, else none).

        Raises:
            UserError: the file cannot be read or parsed, or a setting is invalid (named as the
                variable to set, with what to set instead).
        """
        token = _CONFIG_FILE.set(config_file)
        try:
            return cls()
        except ValidationError as exc:
            raise _settings_error(exc, config_file_in_use()) from None
        finally:
            _CONFIG_FILE.reset(token)


def config_file_in_use() -> Path | None:
    """The config file `Settings.load` reads now, if any."""
    given = _CONFIG_FILE.get()
    if given is not None:
        return given
    named = os.environ.get(CONFIG_FILE_ENV)
    return Path(named) if named else None


def read_config_file(path: Path, *, option: str = CONFIG_FILE_ENV) -> dict[str, Any]:
    """A YAML or JSON mapping from `path`.

    Raises:
        UserError: unreadable, not YAML/JSON, or not a mapping (naming the file and `option`).
    """
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise UserError(
            f"cannot read config {path}: {why}",
            field=option,
            fix="pass an existing YAML or JSON file (UTF-8)",
        ) from None
    except RecursionError:
        raise UserError(
            f"config {path} is nested too deeply to read",
            field=option,
            fix="write settings as `key: value` lines, a few levels deep at most",
        ) from None
    except yaml.YAMLError as exc:
        raise UserError(
            f"config {path} is not valid YAML/JSON: {exc}",
            field=option,
            fix="fix the syntax at the position shown",
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(
            f"config {path} must hold a mapping of settings, not {type(data).__name__}",
            field=option,
            fix="write `key: value` lines, e.g. `region: us-east-2`",
        )
    return data


class _ConfigFileSource(PydanticBaseSettingsSource):
    """The config file's values (weaker than the environment)."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._data().get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return self._data()

    def _data(self) -> dict[str, Any]:
        path = config_file_in_use()
        if path is None:
            return {}
        data = read_config_file(path)
        unknown = sorted(set(data) - set(self.settings_cls.model_fields))
        if unknown:
            raise UserError(
                f"config {path}: {unknown[0]} is not a setting",
                field=unknown[0],
                fix="remove it (docs/configuration.md lists the settings)",
            )
        return data


def _settings_error(exc: ValidationError, config_file: Path | None) -> UserError:
    first = exc.errors()[0]
    path = [str(p) for p in first.get("loc", ())]
    env = ENV_PREFIX + ENV_NESTED_DELIMITER.join(p.upper() for p in path)
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    fix = f"set {env} to a valid value or unset it to use the default"
    if config_file is not None:
        fix += f" (or correct {'.'.join(path)} in {config_file})"
    return UserError(f"{env}: {message} (got {first.get('input')!r})", fix=fix, field=env)
