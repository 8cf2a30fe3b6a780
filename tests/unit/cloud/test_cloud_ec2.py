"""EC2Cloud and Reconciler against moto, with RunInstances errors injected at botocore's seam."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import moto.settings
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError
from moto import mock_aws

from orchestrator.bidbrain.model import AllocationRequest
from orchestrator.cloud import ec2 as ec2_module
from orchestrator.cloud.availability import MarketAvailability, Scope
from orchestrator.cloud.ec2 import EC2Cloud
from orchestrator.cloud.errors import CapacityError, CloudError, ThrottledError
from orchestrator.cloud.instances import (
    TAG_ALLOCATION,
    TAG_CONTROLLER,
    TAG_JOB,
    TAG_MAX_PRICE,
    TAG_TIER,
    CloudInstance,
    InstanceState,
    LaunchSpec,
)
from orchestrator.cloud.reconcile import Reconciler, plan_reconciliation
from orchestrator.errors import OrchestratorError
from orchestrator.market.prices import Market

REGION = "us-east-1"
ITYPE = "g4dn.xlarge"  # in moto's offering data (p2/p3 are not)
CONTROLLER = "ctl-1"
OTHER_CONTROLLER = "ctl-2"


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SECURITY_TOKEN": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": REGION,
        # moto builds ~1000 public AMIs per fresh backend (0.3 s a test); we use a placeholder
        "MOTO_EC2_LOAD_DEFAULT_AMIS": "false",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.fixture(scope="module")
def session() -> boto3.Session:
    """One session for the module: it caches the EC2 service model (a client costs ~10 ms)."""
    return boto3.Session()


@pytest.fixture
def client(aws_env: None, session: boto3.Session) -> Iterator[Any]:
    with mock_aws():
        yield session.client("ec2", region_name=REGION)


@pytest.fixture
def zone(client: Any) -> str:
    """A zone of the region that moto says offers ITYPE."""
    offerings = client.describe_instance_type_offerings(
        LocationType="availability-zone",
        Filters=[{"Name": "instance-type", "Values": [ITYPE]}],
    )["InstanceTypeOfferings"]
    return sorted(o["Location"] for o in offerings)[0]


@pytest.fixture
def cloud(client: Any) -> EC2Cloud:
    return EC2Cloud(REGION, CONTROLLER, client=client)


def spot_spec(zone: str, **changes: Any) -> LaunchSpec:
    fields: dict[str, Any] = {
        "job_id": "job-a",
        "allocation_id": "alloc-1",
        "instance_type": ITYPE,
        "zone": zone,
        "count": 2,
        "max_price_usd_per_hour": 0.25,
    }
    return LaunchSpec(**(fields | changes))


def capture_run_instances(client: Any) -> list[dict[str, Any]]:
    """Record the parameters of every RunInstances call the client makes."""
    calls: list[dict[str, Any]] = []

    def record(params: dict[str, Any], **_: Any) -> None:
        calls.append(dict(params))

    client.meta.events.register("provide-client-params.ec2.RunInstances", record)
    return calls


def fail_run_instances(client: Any, code: str) -> None:
    """Make RunInstances fail with `code`, as if EC2 (after botocore's retries) refused it."""

    def refuse(**_: Any) -> None:
        raise ClientError({"Error": {"Code": code, "Message": f"injected {code}"}}, "RunInstances")

    client.meta.events.register("before-call.ec2.RunInstances", refuse)


def raw_instance(client: Any, instance_id: str) -> dict[str, Any]:
    reservations = client.describe_instances(InstanceIds=[instance_id])["Reservations"]
    instance: dict[str, Any] = reservations[0]["Instances"][0]
    return instance


def all_instance_ids(client: Any) -> set[str]:
    pages = client.get_paginator("describe_instances").paginate()
    return {i["InstanceId"] for p in pages for r in p["Reservations"] for i in r["Instances"]}


def state_of(client: Any, instance_id: str) -> str:
    return str(raw_instance(client, instance_id)["State"]["Name"])


# --- launch -------------------------------------------------------------------------------------


def test_spot_launch_carries_max_price_spot_lifecycle_and_all_tags(
    client: Any, cloud: EC2Cloud, zone: str
) -> None:
    calls = capture_run_instances(client)
    spec = spot_spec(zone)
    instances = cloud.launch(spec)

    assert len(instances) == 2
    (params,) = calls
    assert params["MinCount"] == params["MaxCount"] == 2
    assert params["Placement"] == {"AvailabilityZone": zone}
    assert params["ClientToken"] == spec.client_token(CONTROLLER)
    assert params["InstanceMarketOptions"] == {
        "MarketType": "spot",
        "SpotOptions": {
            "MaxPrice": "0.25",
            "SpotInstanceType": "one-time",
            "InstanceInterruptionBehavior": "terminate",
        },
    }
    expected_tags = {
        TAG_CONTROLLER: CONTROLLER,
        TAG_JOB: "job-a",
        TAG_ALLOCATION: "alloc-1",
        TAG_TIER: "spot",
        TAG_MAX_PRICE: "0.25",
    }
    for instance in instances:
        assert instance.market == Market(ITYPE, zone)
        assert instance.lifecycle == "spot"
        assert instance.max_price_usd_per_hour == 0.25
        assert (instance.job_id, instance.allocation_id, instance.controller_id) == (
            "job-a",
            "alloc-1",
            CONTROLLER,
        )
        assert instance.launched_at.tzinfo is not None
        raw = raw_instance(client, instance.instance_id)
        assert raw["InstanceLifecycle"] == "spot"
        assert {t["Key"]: t["Value"] for t in raw["Tags"]} == expected_tags
    volumes = client.describe_volumes(
        Filters=[{"Name": "tag:orchestrator:job-id", "Values": ["job-a"]}]
    )
    assert volumes["Volumes"], "volumes are tagged too"


def test_on_demand_launch_has_no_market_options(client: Any, cloud: EC2Cloud, zone: str) -> None:
    calls = capture_run_instances(client)
    (instance,) = cloud.launch(spot_spec(zone, count=1, max_price_usd_per_hour=None))

    assert "InstanceMarketOptions" not in calls[0]
    assert instance.lifecycle == "on-demand"
    assert instance.max_price_usd_per_hour is None
    raw = raw_instance(client, instance.instance_id)
    assert "InstanceLifecycle" not in raw
    tags = {t["Key"]: t["Value"] for t in raw["Tags"]}
    assert tags[TAG_TIER] == "reliable" and TAG_MAX_PRICE not in tags


def test_retried_launch_with_the_same_spec_launches_nothing_twice(
    client: Any, cloud: EC2Cloud, zone: str
) -> None:
    calls = capture_run_instances(client)
    spec = spot_spec(zone)
    first = cloud.launch(spec)
    again = cloud.launch(spec)
    # a new EC2Cloud (a restarted controller) retrying the same allocation
    restarted = EC2Cloud(REGION, CONTROLLER, client=client).launch(spec)

    assert len(calls) == 1
    ids = {i.instance_id for i in first}
    assert {i.instance_id for i in again} == {i.instance_id for i in restarted} == ids
    assert all_instance_ids(client) == ids


def test_retried_launch_after_termination_does_not_relaunch(
    client: Any, cloud: EC2Cloud, zone: str
) -> None:
    spec = spot_spec(zone, count=1)
    (first,) = cloud.launch(spec)
    cloud.terminate([first.instance_id])
    (again,) = cloud.launch(spec)
    assert again.instance_id == first.instance_id
    assert again.state is InstanceState.TERMINATED


def test_same_allocation_in_another_market_is_refused(cloud: EC2Cloud, zone: str) -> None:
    cloud.launch(spot_spec(zone, count=1))
    with pytest.raises(CloudError) as info:
        cloud.launch(spot_spec(zone, count=1, instance_type="c5.xlarge"))
    assert info.value.code == "IdempotentParameterMismatch"


def test_same_allocation_id_under_another_controller_launches(
    client: Any, cloud: EC2Cloud, zone: str
) -> None:
    spec = spot_spec(zone, count=1)
    other = EC2Cloud(REGION, OTHER_CONTROLLER, client=client)
    assert cloud.launch(spec)[0].instance_id != other.launch(spec)[0].instance_id
    assert spec.client_token(CONTROLLER) != spec.client_token(OTHER_CONTROLLER)


def test_client_token_is_deterministic_ascii_and_at_most_64_chars(zone: str) -> None:
    spec = spot_spec(zone, allocation_id="a" * 500)
    token = spec.client_token("c" * 500)
    assert token == spot_spec(zone, allocation_id="a" * 500).client_token("c" * 500)
    assert len(token) <= 64 and token.isascii()
    assert token != spot_spec(zone, allocation_id="a" * 499).client_token("c" * 500)


CAPACITY_CASES = [
    # code, cooldown (None: not marked), scope
    ("InsufficientInstanceCapacity", 600.0, Scope.MARKET),
    ("MaxSpotInstanceCountExceeded", 1800.0, Scope.REGION),
    ("SpotMaxPriceTooLow", 300.0, Scope.MARKET),
    ("Unsupported", 86400.0, Scope.MARKET),
    ("InstanceLimitExceeded", None, None),
]


@pytest.mark.parametrize(("code", "cooldown_s", "scope"), CAPACITY_CASES)
def test_capacity_error_carries_code_and_market_and_marks_availability(
    client: Any, cloud: EC2Cloud, zone: str, code: str, cooldown_s: float | None, scope: Scope
) -> None:
    fail_run_instances(client, code)
    spec = spot_spec(zone)
    with pytest.raises(CapacityError) as info:
        cloud.launch(spec)
    error = info.value
    assert (error.code, error.market, error.operation) == (code, spec.market, "RunInstances")
    assert isinstance(error, OrchestratorError)
    assert all_instance_ids(client) == set(), "a launch that raises launched nothing"

    assert error.market is not None
    table = MarketAvailability()
    mark = table.mark(error.market, error.code, 1000.0)
    if cooldown_s is None:
        assert mark is None and table.is_available(spec.market, 1000.0)
        return
    assert mark is not None
    assert (mark.code, mark.since_s, mark.until_s, mark.scope) == (
        code,
        1000.0,
        1000.0 + cooldown_s,
        scope,
    )
    assert not table.is_available(spec.market, 1000.0 + cooldown_s - 1)
    assert table.is_available(spec.market, 1000.0 + cooldown_s)


def test_request_limit_exceeded_raises_throttled_and_marks_nothing(
    client: Any, cloud: EC2Cloud, zone: str
) -> None:
    fail_run_instances(client, "RequestLimitExceeded")
    with pytest.raises(ThrottledError) as info:
        cloud.launch(spot_spec(zone))
    assert not isinstance(info.value, CapacityError)
    assert info.value.code == "RequestLimitExceeded"
    assert MarketAvailability().mark(spot_spec(zone).market, info.value.code, 0.0) is None


def test_other_client_errors_raise_plain_cloud_error(
    client: Any, cloud: EC2Cloud, zone: str
) -> None:
    fail_run_instances(client, "UnauthorizedOperation")
    with pytest.raises(CloudError) as info:
        cloud.launch(spot_spec(zone))
    assert type(info.value) is CloudError
    assert "UnauthorizedOperation" in str(info.value)


def test_connection_failure_raises_cloud_error_named_after_botocore_exception(
    client: Any, cloud: EC2Cloud, zone: str
) -> None:
    def unreachable(**_: Any) -> None:
        raise EndpointConnectionError(endpoint_url="https://ec2.us-east-1.amazonaws.com")

    client.meta.events.register("before-call.ec2.DescribeInstances", unreachable)
    with pytest.raises(CloudError) as info:
        cloud.describe()
    assert (info.value.code, info.value.operation) == (
        "EndpointConnectionError",
        "DescribeInstances",
    )


@pytest.mark.parametrize("price", [0.001, 0.0005, 0.0, -1.0])
def test_spot_max_price_at_or_below_a_tenth_of_a_cent_is_refused_locally(
    client: Any, cloud: EC2Cloud, zone: str, price: float
) -> None:
    calls = capture_run_instances(client)
    with pytest.raises(CloudError) as info:
        cloud.launch(spot_spec(zone, max_price_usd_per_hour=price))
    assert type(info.value) is CloudError and info.value.code == "InvalidParameterValue"
    assert calls == []


def test_zone_outside_the_region_is_refused_locally(client: Any, cloud: EC2Cloud) -> None:
    calls = capture_run_instances(client)
    with pytest.raises(CloudError) as info:
        cloud.launch(spot_spec("us-west-2a"))
    assert info.value.code == "InvalidParameterValue" and calls == []


def test_moto_accepts_p3_unless_instance_type_validation_is_on(
    monkeypatch: pytest.MonkeyPatch, cloud: EC2Cloud, zone: str
) -> None:
    assert cloud.launch(spot_spec(zone, instance_type="p3.2xlarge", allocation_id="p3-ok"))
    monkeypatch.setattr(moto.settings, "EC2_ENABLE_INSTANCE_TYPE_VALIDATION", True)
    with pytest.raises(CloudError) as info:
        cloud.launch(spot_spec(zone, instance_type="p3.2xlarge", allocation_id="p3-refused"))
    assert info.value.code == "InvalidInstanceType.NotFound"
    assert cloud.launch(spot_spec(zone, allocation_id="g4-ok"))


def test_launch_spec_from_allocation_request(zone: str) -> None:
    request = AllocationRequest(instance_type=ITYPE, zone=zone, count=3, max_price_usd_per_hour=0.4)
    spec = LaunchSpec.from_request(request, job_id="j", allocation_id="a", user_data="#!/bin/sh")
    assert (spec.market, spec.count, spec.max_price_usd_per_hour, spec.tier) == (
        request.market,
        3,
        0.4,
        "spot",
    )
    with pytest.raises(ValueError):
        LaunchSpec(job_id="j", allocation_id="a", instance_type=ITYPE, zone=zone, count=0)


# --- describe -----------------------------------------------------------------------------------


def test_describe_filters_by_controller_and_job(client: Any, cloud: EC2Cloud, zone: str) -> None:
    other = EC2Cloud(REGION, OTHER_CONTROLLER, client=client)
    a = cloud.launch(spot_spec(zone, job_id="job-a", allocation_id="1", count=2))
    b = cloud.launch(spot_spec(zone, job_id="job-b", allocation_id="2", count=1))
    theirs = other.launch(spot_spec(zone, job_id="job-a", allocation_id="1", count=1))
    client.run_instances(ImageId="ami-x", MinCount=1, MaxCount=1, InstanceType=ITYPE)

    def ids(instances: list[CloudInstance]) -> set[str]:
        return {i.instance_id for i in instances}

    assert ids(cloud.describe()) == ids(a) | ids(b)
    assert ids(cloud.describe(job_id="job-a")) == ids(a)
    assert ids(cloud.describe(job_id="job-b")) == ids(b)
    assert ids(other.describe()) == ids(theirs)
    assert cloud.describe(job_id="job-z") == []


def test_describe_pages_through_many_reservations(
    monkeypatch: pytest.MonkeyPatch, client: Any, cloud: EC2Cloud, zone: str
) -> None:
    launched = set()
    for n in range(7):  # one reservation each; pages of 5 reservations
        launched |= {
            i.instance_id for i in cloud.launch(spot_spec(zone, allocation_id=f"a{n}", count=1))
        }
    pages: list[int] = []
    client.meta.events.register(
        "after-call.ec2.DescribeInstances",
        lambda parsed, **_: pages.append(len(parsed["Reservations"])),
    )
    original = client.get_paginator

    def small_pages(name: str) -> Any:
        paginator = original(name)
        paginate = paginator.paginate
        paginator.paginate = lambda **kw: paginate(**kw, PaginationConfig={"PageSize": 5})
        return paginator

    monkeypatch.setattr(client, "get_paginator", small_pages)
    assert {i.instance_id for i in cloud.describe()} == launched
    assert len(pages) >= 2


# --- terminate ----------------------------------------------------------------------------------


def test_terminate_is_idempotent_and_skips_unknown_ids(
    client: Any, cloud: EC2Cloud, zone: str
) -> None:
    first, second = cloud.launch(spot_spec(zone))
    cloud.terminate([first.instance_id])
    assert [i.instance_id for i in cloud.describe()] == [second.instance_id]
    every = {i.instance_id: i.state for i in cloud.describe(include_terminated=True)}
    assert every[first.instance_id] is InstanceState.TERMINATED

    unknown = "i-0123456789abcdef0"
    cloud.terminate([first.instance_id, unknown, second.instance_id, second.instance_id])
    cloud.terminate([unknown])
    cloud.terminate([])
    assert cloud.describe() == []
    assert state_of(client, second.instance_id) == "terminated"


def test_terminate_sends_at_most_the_chunk_size_per_call(
    monkeypatch: pytest.MonkeyPatch, client: Any, cloud: EC2Cloud, zone: str
) -> None:
    monkeypatch.setattr(ec2_module, "TERMINATE_CHUNK_SIZE", 2)
    sizes: list[int] = []
    client.meta.events.register(
        "provide-client-params.ec2.TerminateInstances",
        lambda params, **_: sizes.append(len(params["InstanceIds"])),
    )
    instances = cloud.launch(spot_spec(zone, count=5))
    cloud.terminate(i.instance_id for i in instances)
    assert sizes == [2, 2, 1]
    assert cloud.describe() == []


def test_terminate_raises_other_errors(client: Any, cloud: EC2Cloud) -> None:
    def refuse(**_: Any) -> None:
        error = {"Code": "UnauthorizedOperation", "Message": "injected"}
        raise ClientError({"Error": error}, "TerminateInstances")

    client.meta.events.register("before-call.ec2.TerminateInstances", refuse)
    with pytest.raises(CloudError) as info:
        cloud.terminate(["i-0123456789abcdef0"])
    assert (info.value.code, info.value.operation) == (
        "UnauthorizedOperation",
        "TerminateInstances",
    )


# --- reconcile ----------------------------------------------------------------------------------


def test_reconciler_terminates_orphans_adopts_unknowns_reports_gone_and_spares_others(
    client: Any, cloud: EC2Cloud, zone: str
) -> None:
    (kept,) = cloud.launch(spot_spec(zone, job_id="job-a", allocation_id="a1", count=1))
    (unknown,) = cloud.launch(spot_spec(zone, job_id="job-a", allocation_id="a2", count=1))
    (finished,) = cloud.launch(spot_spec(zone, job_id="job-b", allocation_id="b1", count=1))
    (stray,) = cloud.launch(spot_spec(zone, job_id="job-c", allocation_id="c1", count=1))
    (dead,) = cloud.launch(spot_spec(zone, job_id="job-a", allocation_id="a3", count=1))
    cloud.terminate([dead.instance_id])
    (foreign,) = EC2Cloud(REGION, OTHER_CONTROLLER, client=client).launch(
        spot_spec(zone, job_id="job-b", allocation_id="x1", count=1)
    )
    untagged = client.run_instances(ImageId="ami-x", MinCount=1, MaxCount=1, InstanceType=ITYPE)[
        "Instances"
    ][0]["InstanceId"]
    owned = {
        kept.instance_id: "job-a",
        finished.instance_id: "job-b",
        dead.instance_id: "job-a",
        "i-00000000000000000": "job-a",
        foreign.instance_id: "job-a",  # a corrupt store entry must not make us touch it
    }

    plan = Reconciler(cloud).reconcile(owned, {"job-a"})

    assert set(plan.terminate) == {finished.instance_id, stray.instance_id}
    assert [i.instance_id for i in plan.adopt] == [unknown.instance_id]
    assert set(plan.gone) == {dead.instance_id, "i-00000000000000000", foreign.instance_id}
    assert state_of(client, finished.instance_id) == "terminated"
    assert state_of(client, stray.instance_id) == "terminated"
    for instance_id in (kept.instance_id, unknown.instance_id, foreign.instance_id, untagged):
        assert state_of(client, instance_id) in ("pending", "running")

    again = Reconciler(cloud).reconcile(owned | {unknown.instance_id: "job-a"}, {"job-a"})
    assert again.terminate == () and again.adopt == ()


def make_instance(instance_id: str, job_id: str | None, **changes: Any) -> CloudInstance:
    fields: dict[str, Any] = {
        "instance_id": instance_id,
        "instance_type": ITYPE,
        "zone": "us-east-1a",
        "state": InstanceState.RUNNING,
        "lifecycle": "spot",
        "job_id": job_id,
        "allocation_id": "a",
        "controller_id": CONTROLLER,
        "launched_at": "2024-05-01T00:00:00Z",
    }
    return CloudInstance(**(fields | changes))


def test_plan_keeps_owned_instance_of_active_job_whatever_its_tag() -> None:
    cloud = [make_instance("i-1", "job-old")]
    assert plan_reconciliation(cloud, {"i-1": "job-a"}, {"job-a"}).is_noop


def test_plan_never_terminates_or_adopts_instances_already_going() -> None:
    cloud = [
        make_instance("i-1", "job-b", state=InstanceState.SHUTTING_DOWN),
        make_instance("i-2", "job-a", state=InstanceState.TERMINATED),
        make_instance("i-3", "job-a", state=InstanceState.SHUTTING_DOWN),
    ]
    plan = plan_reconciliation(cloud, {"i-3": "job-a"}, {"job-a"})
    assert (plan.terminate, plan.adopt, plan.gone) == ((), (), ("i-3",))


def test_plan_terminates_instance_without_job_tag_and_guards_controller() -> None:
    cloud = [
        make_instance("i-1", None),
        make_instance("i-2", "job-z", controller_id=OTHER_CONTROLLER),
    ]
    plan = plan_reconciliation(cloud, {}, {"job-a"}, controller_id=CONTROLLER)
    assert plan.terminate == ("i-1",)
