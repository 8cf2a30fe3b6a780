"""Checks on the controller stack's template before it reaches AWS.

`policy_problems` reads the parsed template and names what would make it unsafe:
    * a mutating action of any service (anything but Describe*/Get*/List*) on Resource "*",
      or an EC2 one on instances and volumes without a condition on our controller tag
      (`aws:RequestTag/...` to launch, `aws:ResourceTag/...` to terminate);
    * a wildcard in a mutating action, or NotAction/NotResource;
    * a security group open to the world (0.0.0.0/0 or ::/0) on any port, and any CIDR
      ingress on a port other than the API's.
`lint_problems` runs cfn-lint (AWS's linter, `pip install 'orchestrator[deploy]'`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from orchestrator.cloud.instances import TAG_CONTROLLER
from orchestrator.errors import UserError

READ_ONLY_PREFIXES = ("Describe", "Get", "List")
#: Resource types whose ARNs must be reached only through our tag.
TAGGED_RESOURCE_TYPES = (":instance/", ":volume/")
#: Every S3 statement names the stack's artifact bucket (its Arn, or objects under it).
ARTIFACT_BUCKET_ARN = "${ArtifactBucket.Arn}"
WORLD = ("0.0.0.0/0", "::/0")


def policy_problems(template: dict[str, Any]) -> list[str]:
    """What in the template's IAM policies and security groups breaks least privilege."""
    problems: list[str] = []
    resources = template.get("Resources", {})
    for name, statement in _statements(resources):
        problems += _statement_problems(name, statement)
    for name, rule in _ingress_rules(resources):
        problems += _ingress_problems(name, rule, api_port_ref="ApiPort")
    return problems


def lint_problems(body: str, regions: list[str] | None = None) -> list[str]:
    """cfn-lint's errors and warnings on the template (informational findings dropped).

    Raises:
        UserError: cfn-lint is not installed.
    """
    try:
        from cfnlint.api import ManualArgs, lint
    except ImportError:
        raise UserError(
            "validating the templates needs cfn-lint, which is not installed",
            fix="pip install 'orchestrator[deploy]' (or pip install cfn-lint)",
        ) from None
    matches = lint(body, regions=regions or ["us-east-1"], config=ManualArgs())
    return [
        f"{m.rule.id} {m.message} (line {m.linenumber})"
        for m in matches
        if m.rule.id[:1] in ("E", "W")
    ]


def _statements(resources: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, resource in resources.items():
        props = resource.get("Properties", {})
        documents = []
        if resource.get("Type") in ("AWS::IAM::Policy", "AWS::IAM::ManagedPolicy"):
            documents.append(props.get("PolicyDocument", {}))
        if resource.get("Type") == "AWS::IAM::Role":
            documents += [p.get("PolicyDocument", {}) for p in props.get("Policies", [])]
        for document in documents:
            statements = document.get("Statement", [])
            for statement in statements if isinstance(statements, list) else [statements]:
                yield f"{name}/{statement.get('Sid', '?')}", statement


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _arn_text(resource: Any) -> str:
    """An ARN as written: a string, the template text of a `Fn::Sub`, or `${X.Arn}` for a
    `Fn::GetAtt` of X's Arn."""
    if isinstance(resource, dict) and "Fn::GetAtt" in resource:
        target = resource["Fn::GetAtt"]
        return "${" + (target if isinstance(target, str) else ".".join(target)) + "}"
    if isinstance(resource, dict) and "Fn::Sub" in resource:
        sub = resource["Fn::Sub"]
        return sub if isinstance(sub, str) else str(sub[0])
    return resource if isinstance(resource, str) else ""


def _statement_problems(name: str, statement: dict[str, Any]) -> list[str]:
    if statement.get("Effect") != "Allow":
        return []
    problems = [
        f"{name}: {key} grants everything but a list; name what is allowed instead"
        for key in ("NotAction", "NotResource")
        if key in statement
    ]
    actions = [str(a) for a in _listed(statement.get("Action", []))]
    problems += [f"{name}: wildcard action {a!r}" for a in actions if "*" in a.split(":", 1)[-1]
                 and not a.split(":", 1)[-1].startswith(READ_ONLY_PREFIXES)]  # fmt: skip
    resources = [_arn_text(r) for r in _listed(statement.get("Resource", []))]
    if any(a.startswith("s3:") for a in actions):
        problems += [
            f"{name}: S3 access beyond the artifact bucket ({r or '?'})"
            for r in resources
            if not r.startswith(ARTIFACT_BUCKET_ARN)
        ]
    mutating = [a for a in actions if not a.split(":", 1)[-1].startswith(READ_ONLY_PREFIXES)]
    if not mutating:
        return problems
    conditions = statement.get("Condition", {}).get("StringEquals", {})
    tag_keys = {f"aws:RequestTag/{TAG_CONTROLLER}", f"aws:ResourceTag/{TAG_CONTROLLER}",
                f"ec2:ResourceTag/{TAG_CONTROLLER}"}  # fmt: skip
    tagged = bool(tag_keys & set(conditions))
    launch_tagging = conditions.get("ec2:CreateAction") == "RunInstances"
    for resource in resources:
        if resource == "*":
            problems.append(f"{name}: {', '.join(mutating)} on Resource '*'")
        elif any(kind in resource for kind in TAGGED_RESOURCE_TYPES) and not (
            tagged or launch_tagging
        ):
            problems.append(
                f"{name}: {', '.join(mutating)} on {resource} without a condition on the "
                f"{TAG_CONTROLLER} tag"
            )
    return problems


def _ingress_rules(resources: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, resource in resources.items():
        props = resource.get("Properties", {})
        if resource.get("Type") == "AWS::EC2::SecurityGroup":
            for i, rule in enumerate(props.get("SecurityGroupIngress", [])):
                yield f"{name}[{i}]", rule
        elif resource.get("Type") == "AWS::EC2::SecurityGroupIngress":
            yield name, props


def _ingress_problems(name: str, rule: dict[str, Any], api_port_ref: str) -> list[str]:
    cidr = rule.get("CidrIp", rule.get("CidrIpv6"))
    if cidr is None:
        return []  # from another security group
    if cidr in WORLD:
        return [f"{name}: ingress open to {cidr}"]
    ports = (rule.get("FromPort"), rule.get("ToPort"))
    if ports != ({"Ref": api_port_ref}, {"Ref": api_port_ref}):
        return [f"{name}: CIDR ingress on ports {ports}, not only the API port"]
    return []
