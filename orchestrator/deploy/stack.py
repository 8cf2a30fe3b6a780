"""Create, update and tear down the controller stack (boto3 CloudFormation).

Failure semantics: `deploy` creates the stack (or updates it when it exists) and waits,
reporting each new stack event; a stack that ends in a failed or rolled-back state raises a
`UserError` naming the first failed resource and its reason. `teardown` terminates the
controller node, then every instance it launched (its workers are not part of the stack), then
deletes the stack, sweeping for workers once more whatever the deletion did; running it again
after a partial failure finishes the job.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from orchestrator.cloud.ec2 import EC2Cloud
from orchestrator.deploy.template import DeployParams, RenderedStack
from orchestrator.errors import UserError

DONE_OK = {"CREATE_COMPLETE", "UPDATE_COMPLETE", "DELETE_COMPLETE"}
DONE_FAILED = {
    "CREATE_FAILED", "ROLLBACK_COMPLETE", "ROLLBACK_FAILED", "DELETE_FAILED",
    "UPDATE_ROLLBACK_COMPLETE", "UPDATE_ROLLBACK_FAILED",
}  # fmt: skip
POLL_SECONDS = 5.0
TIMEOUT_SECONDS = 45 * 60.0


def secret_name(controller_id: str, kind: str) -> str:
    """`orchestrator/<controller id>/<kind>`: where the controller's tokens live."""
    return f"orchestrator/{controller_id}/{kind}"


@dataclass(frozen=True)
class StackEvent:
    """One line of the stack's progress."""

    at: str
    resource: str
    status: str
    reason: str


class StackDeployer:
    """The controller stack `name` in one region, through `cloudformation` (a boto3 client)."""

    def __init__(
        self,
        cloudformation: Any,
        name: str,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = POLL_SECONDS,
        timeout_s: float = TIMEOUT_SECONDS,
    ) -> None:
        self.cfn = cloudformation
        self.name = name
        self._sleep = sleep
        self._clock = clock
        self._poll_s = poll_s
        self._timeout_s = timeout_s

    @staticmethod
    def ensure_secrets(secretsmanager: Any, controller_id: str) -> tuple[str, str]:
        """The ARNs of the API token and the worker token secrets of `controller_id`,
        created with random values when absent (`orchestrator/<id>/api-token`, `.../worker-token`).

        Raises:
            UserError: Secrets Manager refused (credentials, permissions, a secret of that
                name pending deletion).
        """
        arns = []
        for kind in ("api-token", "worker-token"):
            name = secret_name(controller_id, kind)
            try:
                try:
                    arns.append(secretsmanager.describe_secret(SecretId=name)["ARN"])
                except ClientError as exc:
                    if exc.response.get("Error", {}).get("Code") != "ResourceNotFoundException":
                        raise
                    created = secretsmanager.create_secret(
                        Name=name,
                        SecretString=secrets.token_hex(32),
                        Description=f"orchestrator {controller_id}: {kind}",
                        Tags=[{"Key": "orchestrator:controller-id", "Value": controller_id}],
                    )
                    arns.append(created["ARN"])
            except (ClientError, BotoCoreError) as exc:
                raise _aws_error(exc, f"Secrets Manager ({name})") from None
        return arns[0], arns[1]

    @staticmethod
    def delete_secrets(secretsmanager: Any, controller_id: str) -> None:
        """Delete both token secrets now (a later deploy creates new ones)."""
        for kind in ("api-token", "worker-token"):
            try:
                secretsmanager.delete_secret(
                    SecretId=secret_name(controller_id, kind), ForceDeleteWithoutRecovery=True
                )
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") != "ResourceNotFoundException":
                    raise _aws_error(exc, "DeleteSecret") from None

    def status(self) -> str | None:
        """The stack's status, None when there is no such stack."""
        try:
            stacks = self.cfn.describe_stacks(StackName=self.name)["Stacks"]
        except ClientError as exc:
            if "does not exist" in str(exc):
                return None
            raise _aws_error(exc, "DescribeStacks") from None
        return str(stacks[0]["StackStatus"]) if stacks else None

    def deploy(
        self,
        rendered: RenderedStack,
        params: DeployParams,
        on_event: Callable[[StackEvent], None] = lambda e: None,
    ) -> dict[str, str]:
        """Create or update the stack and wait for it; returns its outputs.

        Raises:
            UserError: CloudFormation refused the template or the stack failed (with the
                first failed resource and its reason).
        """
        request = {
            "StackName": self.name,
            "TemplateBody": rendered.body,
            "Parameters": params.cloudformation(),
            "Capabilities": ["CAPABILITY_IAM"],
            # not the controller-id tag: CloudFormation copies stack tags onto the controller
            # instance, which the controller must never count among its workers
            "Tags": [{"Key": "orchestrator:deployment", "Value": params.controller_id}],
        }
        existing = self.status()
        seen = {e["EventId"] for e in self._events()} if existing else set()
        try:
            if existing is None:
                self.cfn.create_stack(**request, OnFailure="ROLLBACK")
            else:
                self.cfn.update_stack(**request)
        except ClientError as exc:
            if "No updates are to be performed" in str(exc):
                return self.outputs()
            raise _aws_error(exc, "CreateStack" if existing is None else "UpdateStack") from None
        self._wait(seen, on_event)
        return self.outputs()

    def outputs(self) -> dict[str, str]:
        """The stack's outputs (key -> value)."""
        stack = self.cfn.describe_stacks(StackName=self.name)["Stacks"][0]
        return {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}

    def teardown(
        self,
        ec2: EC2Cloud,
        on_event: Callable[[StackEvent], None] = lambda e: None,
    ) -> list[str]:
        """Terminate the controller node first (so that it launches nothing more), then its
        workers, then delete the stack and wait; a last sweep for workers runs even when the
        deletion fails.

        Returns:
            The ids of the worker instances terminated.
        """
        status = self.status()
        controller = self.outputs().get("ControllerInstanceId") if status is not None else None
        if controller:
            try:
                ec2.client.terminate_instances(InstanceIds=[controller])
                ec2.client.get_waiter("instance_terminated").wait(
                    InstanceIds=[controller], WaiterConfig={"Delay": max(1, int(self._poll_s))}
                )
            except (ClientError, BotoCoreError) as exc:
                raise _aws_error(exc, "TerminateInstances (the controller node)") from None
        terminated = self._terminate_workers(ec2)
        try:
            if status is not None:
                seen = {e["EventId"] for e in self._events()}
                try:
                    self.cfn.delete_stack(StackName=self.name)
                except ClientError as exc:
                    raise _aws_error(exc, "DeleteStack") from None
                self._wait(seen, on_event, deleting=True)
        finally:
            terminated += self._terminate_workers(ec2)
        return terminated

    @staticmethod
    def _terminate_workers(ec2: EC2Cloud) -> list[str]:
        instances = [i.instance_id for i in ec2.describe() if not i.state.is_gone]
        if instances:
            ec2.terminate(instances)
        return instances

    def _events(self) -> list[dict[str, Any]]:
        try:
            events = self.cfn.describe_stack_events(StackName=self.name)["StackEvents"]
        except ClientError:
            return []
        return list(reversed(events))  # oldest first

    def _wait(
        self, seen: set[str], on_event: Callable[[StackEvent], None], deleting: bool = False
    ) -> None:
        deadline = self._clock() + self._timeout_s
        failures: list[StackEvent] = []
        while True:
            for raw in self._events():
                if raw["EventId"] in seen:
                    continue
                seen.add(raw["EventId"])
                event = StackEvent(
                    at=str(raw.get("Timestamp", "")),
                    resource=str(raw.get("LogicalResourceId", "")),
                    status=str(raw.get("ResourceStatus", "")),
                    reason=str(raw.get("ResourceStatusReason", "") or ""),
                )
                if event.status.endswith("_FAILED"):
                    failures.append(event)
                on_event(event)
            status = self.status()
            if status is None and deleting:
                return
            if status in DONE_OK:
                return
            if status in DONE_FAILED:
                first = failures[0] if failures else None
                why = f": {first.resource} {first.status}: {first.reason}" if first else ""
                raise UserError(
                    f"stack {self.name} ended {status}{why}",
                    fix="read the events above (or `aws cloudformation describe-stack-events "
                    f"--stack-name {self.name}`), fix the cause, delete a rolled-back stack "
                    "with `orchestrator deploy --teardown`, and deploy again",
                )
            if self._clock() > deadline:
                raise UserError(
                    f"stack {self.name} is still {status} after {self._timeout_s / 60:g} min",
                    fix="watch it in the CloudFormation console; nothing was cancelled",
                )
            self._sleep(self._poll_s)


def _aws_error(exc: ClientError | BotoCoreError, operation: str) -> UserError:
    message = str(exc)
    fix = "check your AWS credentials and region (aws sts get-caller-identity)"
    if "Capabilit" in message:
        fix = "the stack creates IAM roles: CAPABILITY_IAM is required"
    return UserError(f"CloudFormation {operation} failed: {message}", fix=fix)
