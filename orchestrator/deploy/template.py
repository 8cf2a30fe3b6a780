"""The controller stack's template: `infra/controller.yaml` with the boot scripts inlined, and
the user's parameters, validated before anything reaches AWS.

The template keeps its boot scripts in separate files (`infra/*-boot.sh`, so that shellcheck
and a reader see them whole); `render` replaces each `@@include NAME@@` line with the file,
indented to the line's column, inside a YAML block scalar that CloudFormation does not
substitute into (bash's `${VAR}` stays bash's).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from orchestrator.errors import UserError
from orchestrator.settings import MAX_HOSTED_TRAINING_JOBS

#: The templates and boot scripts (a link to the repository's infra/ in a checkout; copied
#: into the wheel by package-data).
INFRA_DIR = Path(__file__).parent / "infra"
TEMPLATE_NAME = "controller.yaml"
BOOT_SCRIPTS = ("controller-boot.sh", "worker-boot.sh")
#: The shortest CIDR prefix the API may be opened to (HTTPS with a bearer token, but a smaller
#: surface is still the better one).
MIN_API_PREFIX = 8
#: CloudFormation's limit for a template passed inline (TemplateBody).
MAX_TEMPLATE_BODY_BYTES = 51_200

_INCLUDE = re.compile(r"^(?P<indent>[ ]*)@@include (?P<name>[\w.-]+)@@[ ]*$", re.MULTILINE)
_ID = r"^{prefix}-[0-9a-f]{{8,17}}$"


class DeployParams(BaseModel):
    """The stack's parameters, as `orchestrator deploy` takes them (CLI names in errors)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    controller_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9-]{1,48}$")] = "prod"
    vpc_id: Annotated[str, Field(pattern=_ID.format(prefix="vpc"))]
    controller_subnet_id: Annotated[str, Field(pattern=_ID.format(prefix="subnet"))]
    worker_subnet_ids: Annotated[tuple[str, ...], Field(min_length=1)]
    api_allowed_cidr: str
    package: Annotated[str, Field(min_length=1, pattern=r"^[^'\n\r]+$")]
    api_port: Annotated[int, Field(ge=1024, le=65535)] = 8750
    runtime_ports: tuple[int, int] = (1024, 65535)  # the runtime binds ephemeral ports
    agileml_controller_port: Annotated[int, Field(ge=1024, le=65535)] = 29500
    controller_instance_type: str = "t3.medium"
    controller_image_parameter: str = "/aws/service/debian/release/12/latest/amd64"
    worker_image_parameter: str = "/aws/service/debian/release/12/latest/amd64"
    redis: Literal["local", "elasticache"] = "local"
    session_manager: bool = True
    #: Secrets Manager ARNs of the tokens (`StackDeployer.ensure_secrets` creates them).
    api_token_secret_arn: str | None = None
    worker_token_secret_arn: str | None = None
    #: The API's certificate and key (None: the controller makes a self-signed one).
    api_tls_secret_arn: Annotated[
        str | None, Field(pattern=r"^arn:aws[a-z-]*:secretsmanager:[^\s]+$")
    ] = None

    @field_validator("worker_subnet_ids")
    @classmethod
    def _subnets(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for subnet in value:
            if not re.match(_ID.format(prefix="subnet"), subnet):
                raise ValueError(f"{subnet!r} is not a subnet id (subnet-0123abcd...)")
        return value

    @field_validator("api_allowed_cidr")
    @classmethod
    def _cidr(cls, value: str) -> str:
        try:
            if "/" not in value:
                raise ValueError("no prefix length")
            network = ipaddress.IPv4Network(value, strict=True)
        except ValueError as exc:
            raise ValueError(
                f"{value!r} is not an IPv4 CIDR such as 203.0.113.7/32 ({exc})"
            ) from None
        if network.prefixlen < MIN_API_PREFIX:
            raise ValueError(
                f"{value} would open the API to much of the internet; give your "
                "own address (e.g. `curl -s https://checkip.amazonaws.com`/32) or your VPN's "
                f"range (a /{MIN_API_PREFIX} or longer prefix)"
            )
        return value

    @model_validator(mode="after")
    def _controller_ports_in_range(self) -> DeployParams:
        low, high = self.runtime_ports
        first = self.agileml_controller_port
        last = first + MAX_HOSTED_TRAINING_JOBS - 1  # one port per hosted training job
        if not low <= first <= last <= high:
            raise ValueError(
                f"the AgileML controller ports {first}-{last} must lie within the runtime "
                f"ports {low}-{high}"
            )
        return self

    @field_validator("runtime_ports")
    @classmethod
    def _ports(cls, value: tuple[int, int]) -> tuple[int, int]:
        low, high = value
        if not 1024 <= low <= high <= 65535:
            raise ValueError(f"{low}-{high} must be a range within 1024-65535, low first")
        return value

    def cloudformation(self) -> list[dict[str, str]]:
        """The parameters as CreateStack takes them (the secret ARNs once known)."""
        values = {
            "ControllerId": self.controller_id,
            "VpcId": self.vpc_id,
            "ControllerSubnetId": self.controller_subnet_id,
            "WorkerSubnetIds": ",".join(self.worker_subnet_ids),
            "ApiAllowedCidr": self.api_allowed_cidr,
            "ApiPort": str(self.api_port),
            "RuntimePortFrom": str(self.runtime_ports[0]),
            "RuntimePortTo": str(self.runtime_ports[1]),
            "AgileMLControllerPort": str(self.agileml_controller_port),
            "ControllerInstanceType": self.controller_instance_type,
            "ControllerImageId": self.controller_image_parameter,
            "WorkerImageId": self.worker_image_parameter,
            "PackageSpec": self.package,
            "RedisMode": self.redis,
            "EnableSessionManager": "true" if self.session_manager else "false",
            "ApiTlsSecretArn": self.api_tls_secret_arn or "",
        }
        if self.api_token_secret_arn and self.worker_token_secret_arn:
            values["ApiTokenSecretArn"] = self.api_token_secret_arn
            values["WorkerTokenSecretArn"] = self.worker_token_secret_arn
        return [{"ParameterKey": k, "ParameterValue": v} for k, v in values.items()]


#: DeployParams field -> the `orchestrator deploy` option that sets it.
OPTION_OF = {
    "controller_id": "--controller-id",
    "vpc_id": "--vpc",
    "controller_subnet_id": "--controller-subnet",
    "worker_subnet_ids": "--worker-subnets",
    "api_allowed_cidr": "--api-cidr",
    "package": "--package",
    "api_port": "--api-port",
    "runtime_ports": "--runtime-ports",
    "agileml_controller_port": "--agileml-port",
    "controller_instance_type": "--controller-type",
    "controller_image_parameter": "--controller-image-parameter",
    "worker_image_parameter": "--worker-image-parameter",
    "redis": "--redis",
    "session_manager": "--no-session-manager",
    "api_token_secret_arn": "--api-token-secret",
    "worker_token_secret_arn": "--worker-token-secret",
    "api_tls_secret_arn": "--api-tls-secret",
}


@dataclass(frozen=True)
class RenderedStack:
    """The template ready for CloudFormation, with the boot scripts it inlined."""

    body: str
    scripts: dict[str, str]

    def write(self, folder: Path, params: DeployParams | None = None) -> list[Path]:
        """Write the template, the boot scripts and (with `params`) `parameters.json`.

        Raises:
            UserError: the folder cannot be written.
        """
        import json

        files = {TEMPLATE_NAME: self.body, **self.scripts}
        if params is not None:
            files["parameters.json"] = json.dumps(params.cloudformation(), indent=2) + "\n"
        written = []
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for name, text in files.items():
                path = folder / name
                path.write_text(text)
                if name.endswith(".sh"):
                    path.chmod(0o755)
                written.append(path)
        except OSError as exc:
            raise UserError(
                f"cannot write the templates to {folder}: {exc.strerror}",
                field="--template-out",
                fix="pass a folder you can write to",
            ) from None
        return written


def render(infra_dir: Path = INFRA_DIR) -> RenderedStack:
    """`controller.yaml` with every `@@include NAME@@` line replaced by `infra_dir/NAME`.

    Raises:
        UserError: the templates are not where they should be (a broken install), or an
            included script would end the here-document that carries it.
    """
    try:
        text = (infra_dir / TEMPLATE_NAME).read_text()
        scripts = {name: (infra_dir / name).read_text() for name in BOOT_SCRIPTS}
    except OSError as exc:
        raise UserError(
            f"the deployment templates are missing ({exc.filename}: {exc.strerror})",
            fix="reinstall the package (`pip install -e .` in a checkout, whose infra/ holds them)",
        ) from None

    def include(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in scripts:
            raise UserError(f"{TEMPLATE_NAME} includes unknown file {name!r}")
        lines = scripts[name].rstrip("\n").split("\n")
        if any(line.strip() == "BOOT" for line in lines):
            raise UserError(f"{name} has a line 'BOOT', which ends the user data's here-document")
        return "\n".join((match["indent"] + line) if line else "" for line in lines)

    body = _INCLUDE.sub(include, text)
    if len(body.encode()) > MAX_TEMPLATE_BODY_BYTES:
        raise UserError(
            f"the rendered template is {len(body.encode())} bytes, over CloudFormation's "
            f"{MAX_TEMPLATE_BODY_BYTES} for an inline template",
            fix="shorten the boot scripts",
        )
    return RenderedStack(body=body, scripts=scripts)


class _CfnLoader(yaml.SafeLoader):
    """YAML with CloudFormation's short forms (`!Ref x` -> `{"Ref": "x"}`, `!Sub` ->
    `{"Fn::Sub": ...}`, `!GetAtt a.b` -> `{"Fn::GetAtt": ["a", "b"]}`)."""


def _short_form(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> dict[str, Any]:
    if isinstance(node, yaml.ScalarNode):
        value: Any = loader.construct_scalar(node)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_mapping(node, deep=True)
    if suffix == "Ref":
        return {"Ref": value}
    if suffix == "GetAtt" and isinstance(value, str):
        value = value.split(".", 1)
    return {f"Fn::{suffix}": value}


_CfnLoader.add_multi_constructor("!", _short_form)


def load_template(body: str) -> dict[str, Any]:
    """Parse a template (JSON or YAML with short forms) into plain dicts and lists.

    Raises:
        UserError: it is not valid YAML or not a mapping.
    """
    try:
        data = yaml.load(body, Loader=_CfnLoader)  # noqa: S506 - SafeLoader plus CFN tags
    except yaml.YAMLError as exc:
        raise UserError(f"the template is not valid YAML: {exc}") from None
    if not isinstance(data, dict) or "Resources" not in data:
        raise UserError("the template is not a CloudFormation template (no Resources)")
    return data
