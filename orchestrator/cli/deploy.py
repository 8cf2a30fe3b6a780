"""`orchestrator deploy` (the controller stack on AWS) and `orchestrator worker start` (what a
worker instance runs). Importing this module registers both on `orchestrator.cli.app`.

    orchestrator deploy --vpc V --controller-subnet S --worker-subnets S1,S2 \\
        --api-cidr 203.0.113.7/32 --package 'git+https://...'       create or update, wait
    orchestrator deploy ... --dry-run             render and validate only (no AWS call)
    orchestrator deploy ... --template-out DIR    write the template, scripts, parameters
    orchestrator deploy --teardown [--controller-id ID] [--dry-run] [--yes]
                                                  say what goes, ask, terminate, delete

Exit codes: 0 ok; 1 validation found problems (--dry-run); 2 user errors.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from orchestrator.cli.app import app, out
from orchestrator.errors import UserError

worker_app = typer.Typer(help="Run on a worker instance (AWS).", no_args_is_help=True)
app.add_typer(worker_app, name="worker")


VpcOption = Annotated[str | None, typer.Option("--vpc", help="VPC id.")]
ControllerSubnetOption = Annotated[
    str | None, typer.Option("--controller-subnet", help="Subnet of the controller node.")
]
WorkerSubnetsOption = Annotated[
    str | None,
    typer.Option("--worker-subnets", help="Comma-separated worker subnets, one per zone."),
]
ApiCidrOption = Annotated[
    str | None, typer.Option("--api-cidr", help="Who may reach the API, e.g. your IP/32.")
]
PackageOption = Annotated[
    str | None,
    typer.Option("--package", help="What pip installs on the nodes (wheel URL, git+https)."),
]
ControllerIdOption = Annotated[
    str, typer.Option("--controller-id", help="Tag value scoping the controller's IAM.")
]
StackOption = Annotated[
    str | None, typer.Option("--stack", help="Stack name \\[orchestrator-<controller-id>].")
]
RegionOption = Annotated[
    str | None, typer.Option("--region", help="AWS region [ORCHESTRATOR_REGION].")
]
WorkerImageOption = Annotated[
    str | None,
    typer.Option(
        "--worker-image-parameter",
        help="SSM parameter naming the workers' AMI (a baked AMI) [Debian 12].",
    ),
]
ControllerImageOption = Annotated[
    str | None,
    typer.Option(
        "--controller-image-parameter",
        help="SSM parameter naming the controller's AMI [Debian 12].",
    ),
]
RuntimePortsOption = Annotated[
    str, typer.Option("--runtime-ports", help="Ports AgileML may use between our nodes, LOW-HIGH.")
]
AgileMLPortOption = Annotated[
    int, typer.Option("--agileml-port", help="First port of the jobs' AgileML controllers.")
]
NoSessionManagerOption = Annotated[
    bool, typer.Option("--no-session-manager", help="Do not allow Session Manager shells.")
]
TemplateOutOption = Annotated[
    Path | None,
    typer.Option("--template-out", help="Write the rendered templates here; no AWS call."),
]
DryRunOption = Annotated[
    bool, typer.Option("--dry-run", help="Validate (parameters, policies, cfn-lint) only.")
]
TeardownOption = Annotated[
    bool,
    typer.Option(
        "--teardown",
        help="Terminate the controller's workers, delete the stack and its secrets (asks "
        "first; with --dry-run: only says what it would remove).",
    ),
]
YesOption = Annotated[
    bool, typer.Option("--yes", "-y", help="With --teardown: do not ask for confirmation.")
]
EndpointOption = Annotated[
    str | None, typer.Option("--endpoint-url", help="AWS endpoint (a moto server offline).")
]


@app.command()
def deploy(
    vpc: VpcOption = None,
    controller_subnet: ControllerSubnetOption = None,
    worker_subnets: WorkerSubnetsOption = None,
    api_cidr: ApiCidrOption = None,
    package: PackageOption = None,
    controller_id: ControllerIdOption = "prod",
    stack: StackOption = None,
    region: RegionOption = None,
    redis: Annotated[str, typer.Option("--redis", help="local or elasticache.")] = "local",
    controller_type: Annotated[str, typer.Option("--controller-type")] = "t3.medium",
    worker_image_parameter: WorkerImageOption = None,
    controller_image_parameter: ControllerImageOption = None,
    api_port: Annotated[int, typer.Option("--api-port")] = 8750,
    runtime_ports: RuntimePortsOption = "1024-65535",
    agileml_port: AgileMLPortOption = 29500,
    no_session_manager: NoSessionManagerOption = False,
    api_tls_secret: Annotated[
        str | None,
        typer.Option(
            "--api-tls-secret",
            help='Secrets Manager ARN of the API\'s certificate and key, JSON {"certificate": '
            'PEM, "private_key": PEM} \\[default: a self-signed one].',
        ),
    ] = None,
    template_out: TemplateOutOption = None,
    dry_run: DryRunOption = False,
    teardown: TeardownOption = False,
    yes: YesOption = False,
    endpoint_url: EndpointOption = None,
) -> None:
    """Deploy the controller node and the worker launch template on AWS (CloudFormation)."""
    from orchestrator.deploy import render
    from orchestrator.deploy.run import check_region, deploy_params, port_range, template_problems
    from orchestrator.settings import Settings

    region = region or Settings.load().region
    check_region(region, option="--region (or ORCHESTRATOR_REGION)")
    stack = stack or f"orchestrator-{controller_id}"
    if teardown:
        _teardown(stack, controller_id, region, endpoint_url, dry_run=dry_run, yes=yes)
        return
    params = deploy_params(
        {
            "controller_id": controller_id,
            "vpc_id": vpc,
            "controller_subnet_id": controller_subnet,
            "worker_subnet_ids": tuple(s.strip() for s in (worker_subnets or "").split(",") if s),
            "api_allowed_cidr": api_cidr,
            "package": package,
            "api_port": api_port,
            "runtime_ports": port_range(runtime_ports),
            "agileml_controller_port": agileml_port,
            "controller_instance_type": controller_type,
            "redis": redis,
            "session_manager": not no_session_manager,
            "controller_image_parameter": controller_image_parameter,
            "worker_image_parameter": worker_image_parameter,
            "api_tls_secret_arn": api_tls_secret,
        }
    )
    rendered = render()
    if template_out is not None:
        _write_templates(rendered, params, template_out)
    problems = template_problems(rendered, region)
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
    _deploy(rendered, params, stack=stack, region=region, endpoint_url=endpoint_url)


def _write_templates(rendered: Any, params: Any, folder: Path) -> None:
    for path in rendered.write(folder, params):
        out.print(f"wrote {path}", highlight=False)
    out.print(
        "The stack also needs ApiTokenSecretArn and WorkerTokenSecretArn: `orchestrator "
        "deploy` creates both secrets; with the AWS CLI, create them first.",
        highlight=False,
    )


def _deploy(
    rendered: Any, params: Any, *, stack: str, region: str, endpoint_url: str | None
) -> None:
    from orchestrator.deploy.run import deploy_stack

    out.print(f"deploying stack {stack} in {region} (takes a few minutes)...", highlight=False)
    outputs, api_arn = deploy_stack(
        rendered,
        params,
        stack=stack,
        region=region,
        endpoint_url=endpoint_url,
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
        + (
            ""
            if params.api_tls_secret_arn
            else "The API's self-signed certificate, once the controller has started: aws s3 cp "
            f"{outputs.get('ApiCertificateUrl', '')} api-cert.pem; export "
            "ORCHESTRATOR_API__CA_CERT=$PWD/api-cert.pem\n"
        )
        + f"Watch: {outputs.get('ApiUrl', '')}/dashboard?token=<read-only token> (from "
        f"{params.api_allowed_cidr})",
        highlight=False,
    )


def _teardown(
    stack: str,
    controller_id: str,
    region: str,
    endpoint_url: str | None,
    *,
    dry_run: bool,
    yes: bool,
) -> None:
    """Say what the teardown removes; with `dry_run` stop there, else ask (unless `yes`).

    Raises:
        UserError: no terminal to ask on and no --yes (nothing is removed).
        typer.Exit(1): the user said no.
    """
    from orchestrator.deploy.run import teardown_plan, teardown_stack

    plan = teardown_plan(
        stack=stack, controller_id=controller_id, region=region, endpoint_url=endpoint_url
    )
    if plan.empty:
        out.print(
            f"nothing to tear down: no stack {stack}, no instance tagged with controller id "
            f"{controller_id}, no token secrets",
            highlight=False,
        )
        return
    out.print(
        f"teardown of {stack} in {region} removes:\n"
        f"  stack:     {stack} ({plan.stack_status or 'not found'})\n"
        f"  controller node: {plan.controller_instance or 'none'}\n"
        f"  workers:   {len(plan.workers)} instance(s) tagged with controller id "
        f"{controller_id}" + (f": {', '.join(plan.workers)}" if plan.workers else "") + "\n"
        f"  secrets:   {', '.join(plan.secrets) or 'none'}",
        highlight=False,
    )
    if dry_run:
        out.print("--dry-run: nothing was changed", highlight=False)
        return
    if not yes:
        if not sys.stdin.isatty():
            raise UserError(
                "--teardown terminates instances and deletes the stack; no terminal to confirm on",
                field="--yes",
                fix="pass --yes to tear down without asking (or --dry-run to see what it removes)",
            )
        if not typer.confirm("Tear all of this down?", default=False):
            out.print("nothing was changed", highlight=False)
            raise typer.Exit(1)
    out.print(f"tearing down {stack}: workers first, then the stack...", highlight=False)
    terminated = teardown_stack(
        stack=stack,
        controller_id=controller_id,
        region=region,
        endpoint_url=endpoint_url,
        on_event=lambda e: out.print(f"  {e.resource:<28} {e.status}", highlight=False),
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
            help="The job's elasticity controller \\[the instance's tag].",
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
