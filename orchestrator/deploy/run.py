"""What `orchestrator deploy` does, as functions the CLI calls: turn its options into validated
parameters, check the rendered template, create or update the stack, tear it down.

Every AWS client comes from `orchestrator.aws` (`endpoint_url`: a moto server offline).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from orchestrator.aws import aws_client
from orchestrator.deploy.checks import lint_problems, policy_problems
from orchestrator.deploy.stack import StackDeployer, StackEvent, secret_name
from orchestrator.deploy.template import OPTION_OF, DeployParams, RenderedStack, load_template
from orchestrator.errors import UserError

OnEvent = Callable[[StackEvent], None]


def port_range(text: str) -> tuple[int, int]:
    """`LOW-HIGH` as two ints.

    Raises:
        UserError: not two integers joined by '-'.
    """
    low, _, high = text.partition("-")
    try:
        return int(low), int(high)
    except ValueError:
        raise UserError(
            f"--runtime-ports {text!r} is not a range",
            field="--runtime-ports",
            fix="pass LOW-HIGH, e.g. 1024-65535",
        ) from None


def deploy_params(fields: Mapping[str, Any]) -> DeployParams:
    """The stack's parameters from `DeployParams` fields (None: not given).

    Raises:
        UserError: a field is missing or invalid, named as the option that sets it.
    """
    try:
        return DeployParams(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        # the one model-level check is the AgileML ports against the runtime range
        name = str(first["loc"][0]) if first["loc"] else "agileml_controller_port"
        option = OPTION_OF.get(name, name)
        missing = first["type"] == "missing"
        raise UserError(
            f"{option}: {'required' if missing else first['msg'].removeprefix('Value error, ')}",
            field=option,
            fix=f"pass {'' if missing else 'a valid '}{option} (see `orchestrator deploy --help`)",
        ) from None


def template_problems(rendered: RenderedStack, region: str) -> list[str]:
    """What the least-privilege and network checks and cfn-lint find in the template."""
    return policy_problems(load_template(rendered.body)) + lint_problems(rendered.body, [region])


def deploy_stack(
    rendered: RenderedStack,
    params: DeployParams,
    *,
    stack: str,
    region: str,
    endpoint_url: str | None = None,
    on_event: OnEvent = lambda event: None,
) -> tuple[dict[str, str], str]:
    """Create the token secrets (once) and create or update the stack; wait for it.

    Returns:
        The stack's outputs, and the API token secret's ARN.

    Raises:
        UserError, CloudError: as `StackDeployer.deploy` says (the stack's failure events).
    """
    secretsmanager = aws_client("secretsmanager", region, endpoint_url=endpoint_url)
    api_arn, worker_arn = StackDeployer.ensure_secrets(secretsmanager, params.controller_id)
    params = params.model_copy(
        update={"api_token_secret_arn": api_arn, "worker_token_secret_arn": worker_arn}
    )
    deployer = StackDeployer(aws_client("cloudformation", region, endpoint_url=endpoint_url), stack)
    return deployer.deploy(rendered, params, on_event=on_event), api_arn


@dataclass(frozen=True)
class TeardownPlan:
    """What `teardown_stack` would remove, read without changing anything."""

    stack: str
    stack_status: str | None  # None: no such stack
    controller_instance: str | None
    workers: tuple[str, ...]  # instances tagged with the controller id, not yet gone
    secrets: tuple[str, ...]  # the token secrets that exist

    @property
    def empty(self) -> bool:
        return self.stack_status is None and not self.workers and not self.secrets


def teardown_plan(
    *, stack: str, controller_id: str, region: str, endpoint_url: str | None = None
) -> TeardownPlan:
    """What a teardown of `stack` would terminate and delete (reads only: describe calls)."""
    from botocore.exceptions import ClientError

    from orchestrator.cloud.ec2 import EC2Cloud

    ec2 = EC2Cloud(
        region, controller_id, client=aws_client("ec2", region, endpoint_url=endpoint_url)
    )
    deployer = StackDeployer(aws_client("cloudformation", region, endpoint_url=endpoint_url), stack)
    status = deployer.status()
    controller = deployer.outputs().get("ControllerInstanceId") if status is not None else None
    workers = tuple(i.instance_id for i in ec2.describe() if not i.state.is_gone)
    secrets = aws_client("secretsmanager", region, endpoint_url=endpoint_url)
    found = []
    for kind in ("api-token", "worker-token"):
        try:
            secrets.describe_secret(SecretId=secret_name(controller_id, kind))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "ResourceNotFoundException":
                continue
            raise UserError(
                f"cannot read secret {secret_name(controller_id, kind)}: {exc}",
                fix="use credentials that may describe the stack's secrets",
            ) from None
        found.append(secret_name(controller_id, kind))
    return TeardownPlan(stack, status, controller, workers, tuple(found))


def teardown_stack(
    *,
    stack: str,
    controller_id: str,
    region: str,
    endpoint_url: str | None = None,
    on_event: OnEvent = lambda event: None,
) -> list[str]:
    """Terminate the controller's workers, delete the stack and its token secrets.

    Returns:
        The ids of the worker instances terminated.
    """
    from orchestrator.cloud.ec2 import EC2Cloud

    ec2 = EC2Cloud(
        region, controller_id, client=aws_client("ec2", region, endpoint_url=endpoint_url)
    )
    deployer = StackDeployer(aws_client("cloudformation", region, endpoint_url=endpoint_url), stack)
    terminated = deployer.teardown(ec2, on_event=on_event)
    StackDeployer.delete_secrets(
        aws_client("secretsmanager", region, endpoint_url=endpoint_url), controller_id
    )
    return terminated


def check_region(region: str, option: str = "--region") -> None:
    """Refuse a region no AWS partition knows (botocore's list), before any call to it.

    Raises:
        UserError: naming `option`, with the regions it knows.
    """
    import botocore.session

    session = botocore.session.get_session()
    known = {
        r
        for partition in session.get_available_partitions()
        for r in session.get_available_regions("ec2", partition_name=partition)
    }
    if region not in known:
        raise UserError(
            f"{option}: {region!r} is not an AWS region (none of botocore's {len(known)})",
            field=option,
            fix="pass one such as us-east-1 or eu-west-1 (aws ec2 describe-regions lists yours)",
        )
