"""Deploying on AWS: the CloudFormation template of the controller node and the workers'
launch template (`infra/`), rendered with the user's parameters, checked, and deployed.

    template   find and render infra/controller.yaml (boot scripts inlined), parse it
    checks     least-privilege and network checks on a parsed template, and cfn-lint
    stack      create/update/wait/tear down the stack with boto3
"""

from orchestrator.deploy.checks import lint_problems, policy_problems
from orchestrator.deploy.stack import StackDeployer
from orchestrator.deploy.template import DeployParams, RenderedStack, load_template, render

__all__ = [
    "DeployParams",
    "RenderedStack",
    "StackDeployer",
    "lint_problems",
    "load_template",
    "policy_problems",
    "render",
]
