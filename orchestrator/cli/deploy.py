"""`orchestrator deploy` (the controller stack on AWS) and `orchestrator worker start` (what a
worker instance runs). Importing this module registers both on `orchestrator.cli.app`.

    orchestrator deploy --vpc V --controller-subnet S --worker-subnets S1,S2 \\
        --api-cidr 203.0.113.7/32 --package 'git+https://...'       create or update, wait
    orchestrator deploy ... --dry-run             render and validate only (no AWS call)
    orchestrator deploy ... --template-out DIR    write the template, scripts, parameters
    orchestrator deploy --teardown [--controller-id ID]   terminate workers, delete the stack

Exit codes: 0 ok; 1 validation found problems (--dry-run); 2 user errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from orchestrator.cli.app import app, out
from orchestrator.errors import UserError

worker_app = typer.Typer(help="Run on a worker instance (AWS).", no_args_is_help=True)
app.add_typer(worker_app, name="worker")


@app.command()
def deploy(
    vpc: Annotated[str | None, typer.Option("--vpc", help="VPC id.")] = None,
    controller_subnet: Annotated[
        str | None, typer.Option("--controller-subnet", help="Subnet of the controller node.")
    ] = None,
    worker_subnets: Annotated[
        str | None,
        typer.Option("--worker-subnets", help="Comma-separated worker subnets, one per zone."),
    ] = None,
    api_cidr: Annotated[
        str | None, typer.Option("--api-cidr", help="Who may reach the API, e.g. your IP/32.")
    ] = None,
    package: Annotated[
        str | None,
        typer.Option("--package", help="What pip installs on the nodes (wheel URL, git+https)."),
    ] = None,
    controller_id: Annotated[
        str, typer.Option("--controller-id", help="Tag value scoping the controller's IAM.")
    ] = "prod",
    stack: Annotated[
        str | None, typer.Option("--stack", help="Stack name [orchestrator-<controller-id>].")
    ] = None,
    region: Annotated[
        str | None, typer.Option("--region", help="AWS region [ORCHESTRATOR_REGION].")
    ] = None,
    redis: Annotated[str, typer.Option("--redis", help="local or elasticache.")] = "local",
    controller_type: Annotated[str, typer.Option("--controller-type")] = "t3.medium",
    worker_image_parameter: Annotated[
        str | None,
        typer.Option(
            "--worker-image-parameter",
            help="SSM parameter naming the workers' AMI (a baked AMI) [Debian 12].",
        ),
    ] = None,
    controller_image_parameter: Annotated[
        str | None,
        typer.Option(
            "--controller-image-parameter",
            help="SSM parameter naming the controller's AMI [Debian 12].",
        ),
    ] = None,
    api_port: Annotated[int, typer.Option("--api-port")] = 8750,
    runtime_ports: Annotated[
        str,
        typer.Option("--runtime-ports", help="Ports AgileML may use between our nodes, LOW-HIGH."),
    ] = "1024-65535",
    agileml_port: Annotated[
        int,
        typer.Option("--agileml-port", help="First port of the jobs' AgileML controllers."),
    ] = 29500,
    no_session_manager: Annotated[
        bool, typer.Option("--no-session-manager", help="Do not allow Session Manager shells.")
    ] = False,
    template_out: Annotated[
        Path | None,
        typer.Option("--template-out", help="Write the rendered templates here; no AWS call."),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Validate (parameters, policies, cfn-lint) only.")
    ] = False,
    teardown: Annotated[
        bool,
        typer.Option("--teardown", help="Terminate the controller's workers, delete the stack."),
    ] = False,
    endpoint_url: Annotated[
        str | None, typer.Option("--endpoint-url", help="AWS endpoint (a moto server offline).")
    ] = None,
) -> None:
    """Deploy the controller node and the worker launch template on AWS (CloudFormation)."""
    from orchestrator.deploy import (
        DeployParams,
        StackDeployer,
        lint_problems,
        load_template,
        policy_problems,
        render,
    )
    from orchestrator.deploy.template import OPTION_OF
    from orchestrator.settings import Settings

    region = region or Settings.load().region
    stack = stack or f"orchestrator-{controller_id}"
    if teardown:
        _teardown(stack, controller_id, region, endpoint_url)
        return

    fields = {
        "controller_id": controller_id,
        "vpc_id": vpc,
        "controller_subnet_id": controller_subnet,
        "worker_subnet_ids": tuple(s.strip() for s in (worker_subnets or "").split(",") if s),
        "api_allowed_cidr": api_cidr,
        "package": package,
        "api_port": api_port,
        "runtime_ports": _port_range(runtime_ports),
        "agileml_controller_port": agileml_port,
        "controller_instance_type": controller_type,
        "redis": redis,
        "session_manager": not no_session_manager,
    }
    if controller_image_parameter:
        fields["controller_image_parameter"] = controller_image_parameter
    if worker_image_parameter:
        fields["worker_image_parameter"] = worker_image_parameter
    try:
        params = DeployParams(**{k: v for k, v in fields.items() if v is not None})
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

    rendered = render()
    if template_out is not None:
        written = rendered.write(template_out, params)
        for path in written:
            out.print(f"wrote {path}", highlight=False)
        out.print(
            "The stack also needs ApiTokenSecretArn and WorkerTokenSecretArn: `orchestrator "
            "deploy` creates both secrets; with the AWS CLI, create them first.",
            highlight=False,
        )
    problems = policy_problems(load_template(rendered.body)) + lint_problems(
        rendered.body, [region]
    )
    for problem in problems:
        out.print(f"problem: {problem}", highlight=False)
    if problems:
        raise typer.Exit(1)
    if dry_run or template_out is not None:
        out.print(
            f"valid: the template ({len(rendered.body)} bytes) passes the least-privilege "
            "checks and cfn-lint; parameters ok",
            highlight=False,
        )
        return

    from orchestrator.aws import aws_client

    secretsmanager = aws_client("secretsmanager", region, endpoint_url=endpoint_url)
    api_arn, worker_arn = StackDeployer.ensure_secrets(secretsmanager, controller_id)
    params = params.model_copy(
        update={"api_token_secret_arn": api_arn, "worker_token_secret_arn": worker_arn}
    )
    deployer = StackDeployer(aws_client("cloudformation", region, endpoint_url=endpoint_url), stack)
    out.print(f"deploying stack {stack} in {region} (takes a few minutes)...", highlight=False)
    outputs = deployer.deploy(
        rendered,
        params,
        on_event=lambda e: out.print(
            f"  {e.at[11:19]} {e.resource:<28} {e.status}" + (f": {e.reason}" if e.reason else ""),
            highlight=False,
        ),
    )
    for key, value in outputs.items():
        out.print(f"{key}: {value}", highlight=False)
    out.print(
        f"The API token: aws secretsmanager get-secret-value --secret-id {api_arn} "
        "--query SecretString --output text\n"
        f"Watch: {outputs.get('ApiUrl', '')}/dashboard (from {params.api_allowed_cidr})",
        highlight=False,
    )


def _port_range(text: str) -> tuple[int, int]:
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


def _teardown(stack: str, controller_id: str, region: str, endpoint_url: str | None) -> None:
    from orchestrator.aws import aws_client
    from orchestrator.cloud.ec2 import EC2Cloud
    from orchestrator.deploy import StackDeployer

    ec2 = EC2Cloud(
        region,
        controller_id,
        client=aws_client("ec2", region, endpoint_url=endpoint_url),
    )
    deployer = StackDeployer(aws_client("cloudformation", region, endpoint_url=endpoint_url), stack)
    out.print(f"tearing down {stack}: workers first, then the stack...", highlight=False)
    terminated = deployer.teardown(
        ec2, on_event=lambda e: out.print(f"  {e.resource:<28} {e.status}", highlight=False)
    )
    StackDeployer.delete_secrets(
        aws_client("secretsmanager", region, endpoint_url=endpoint_url),
        controller_id,
    )
    out.print(
        f"terminated {len(terminated)} worker instance(s); stack {stack} and its token "
        "secrets deleted",
        highlight=False,
    )


@worker_app.command("start")
def worker_start(
    metadata_url: Annotated[
        str, typer.Option("--metadata-url", help="The instance metadata service.")
    ] = "http://169.254.169.254",
    agileml_controller: Annotated[
        str | None,
        typer.Option(
            "--agileml-controller",
            help="The job's elasticity controller [the instance's tag].",
        ),
    ] = None,
    token_secret: Annotated[
        str | None,
        typer.Option(
            "--token-secret", help="Secret of the worker token [ORCHESTRATOR_WORKER__TOKEN_SECRET]."
        ),
    ] = None,
    endpoint_url: Annotated[str | None, typer.Option("--endpoint-url")] = None,
) -> None:
    """Join the job named in this instance's tags and train until it ends or is evicted."""
    from orchestrator.agent.aws import identify, run_worker
    from orchestrator.agileml.token import token_from_hex
    from orchestrator.cloud.secrets import read_secret
    from orchestrator.logfmt import log_to_stderr
    from orchestrator.settings import Settings

    settings = Settings.load()
    identity = identify(metadata_url, agileml_controller)
    secret_id = token_secret or settings.worker.token_secret
    if not secret_id:
        raise UserError(
            "no worker token secret",
            field="--token-secret",
            fix="pass --token-secret ARN or set ORCHESTRATOR_WORKER__TOKEN_SECRET",
        )
    log_to_stderr(f"worker[{identity.instance_id}]")
    secret = read_secret(secret_id, settings.region, endpoint_url=endpoint_url)
    token = token_from_hex(secret, source=f"the secret {secret_id}")
    outcome = run_worker(identity, token=token, metadata_url=metadata_url)
    out.print(
        f"worker {identity.instance_id} of {identity.job_id}: {outcome.ended}", highlight=False
    )
    if outcome.error is not None:
        raise outcome.error
    if outcome.ended == "lost_controller":
        raise typer.Exit(1)  # systemd restarts it: the controller may be back
