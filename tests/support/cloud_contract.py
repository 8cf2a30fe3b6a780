"""The `Cloud` contract: behaviour every implementation must show, run against `EC2Cloud` on moto
(tests/unit/cloud/test_cloud_contract_ec2.py) and `InMemoryCloud`
(tests/unit/cloud/test_cloud_contract_memory.py), so that a test using the fake can trust it.

A test class mixes `CloudContract` in and provides the fixtures `cloud` (controller "ctl"),
`other_cloud` (controller "ctl-2" of the same account), `zone` (a zone of us-east-1 offering
g4dn.xlarge) and `hooks` (a `CloudHooks`).
"""

from __future__ import annotations

from typing import Any, Protocol

import pytest

from orchestrator.cloud.errors import CapacityError, CloudError
from orchestrator.cloud.instances import (
    TAG_AGILEML_CONTROLLER,
    TAG_CONTROLLER,
    InstanceState,
    LaunchSpec,
)
from orchestrator.cloud.protocol import Cloud

REGION = "us-east-1"
ITYPE = "g4dn.xlarge"


class CloudHooks(Protocol):
    """What a test does to the cloud from outside."""

    def refuse_launches(self, code: str) -> None:
        """Every later RunInstances fails with `code`."""

    def reclaim(self, instance_id: str) -> None:
        """The cloud takes the instance back (a spot interruption)."""


def spec(zone: str, **changes: Any) -> LaunchSpec:
    fields: dict[str, Any] = {
        "job_id": "job-a",
        "allocation_id": "alloc-1",
        "instance_type": ITYPE,
        "zone": zone,
        "count": 2,
        "max_price_usd_per_hour": 0.25,
    }
    return LaunchSpec(**(fields | changes))


class CloudContract:
    """The contract (see the module docstring)."""

    def test_is_a_cloud(self, cloud: Cloud) -> None:
        assert isinstance(cloud, Cloud)

    def test_a_spot_launch_is_tagged_and_reports_its_market_and_bid(
        self, cloud: Cloud, zone: str
    ) -> None:
        launched = cloud.launch(spec(zone, extra_tags={TAG_AGILEML_CONTROLLER: "tcp://x:1"}))
        assert len(launched) == 2
        for inst in launched:
            assert (inst.job_id, inst.allocation_id, inst.controller_id) == ("job-a", "alloc-1",
                                                                            "ctl")  # fmt: skip
            assert inst.lifecycle == "spot" and inst.max_price_usd_per_hour == 0.25
            assert inst.market.zone == zone and inst.instance_type == ITYPE
            assert inst.tags[TAG_AGILEML_CONTROLLER] == "tcp://x:1"
        listed = cloud.describe()
        assert [i.instance_id for i in listed] == sorted(i.instance_id for i in launched)
        assert all(i.state is InstanceState.RUNNING for i in listed)

    def test_an_on_demand_launch_has_no_bid(self, cloud: Cloud, zone: str) -> None:
        [inst] = cloud.launch(spec(zone, count=1, max_price_usd_per_hour=None))
        assert inst.lifecycle == "on-demand" and inst.max_price_usd_per_hour is None

    def test_a_launch_is_idempotent_per_allocation(self, cloud: Cloud, zone: str) -> None:
        first = cloud.launch(spec(zone))
        again = cloud.launch(spec(zone))
        assert {i.instance_id for i in again} == {i.instance_id for i in first}
        assert len(cloud.describe()) == 2

    def test_an_allocation_cannot_move_to_another_market(self, cloud: Cloud, zone: str) -> None:
        cloud.launch(spec(zone))
        with pytest.raises(CloudError) as refused:
            cloud.launch(spec(zone, instance_type="c5.xlarge"))
        assert refused.value.code == "IdempotentParameterMismatch"

    @pytest.mark.parametrize(
        "changes",
        [{"zone": "us-west-2a"}, {"max_price_usd_per_hour": 0.001}],
        ids=["zone-of-another-region", "bid-at-the-floor"],
    )
    def test_launches_ec2_would_refuse_are_refused_before_calling_it(
        self, cloud: Cloud, zone: str, changes: dict[str, Any]
    ) -> None:
        with pytest.raises(CloudError) as refused:
            cloud.launch(spec(**{"zone": zone, **changes}))
        assert refused.value.code == "InvalidParameterValue"
        assert cloud.describe() == []

    def test_our_tags_win_over_extra_tags(self, cloud: Cloud, zone: str) -> None:
        [inst] = cloud.launch(spec(zone, count=1, extra_tags={TAG_CONTROLLER: "somebody"}))
        assert inst.controller_id == "ctl" and inst.tags[TAG_CONTROLLER] == "ctl"

    def test_describe_lists_only_this_controllers_instances_of_the_job_asked(
        self, cloud: Cloud, other_cloud: Cloud, zone: str
    ) -> None:
        mine = cloud.launch(spec(zone))
        other_job = cloud.launch(spec(zone, job_id="job-b", allocation_id="alloc-2", count=1))
        other_cloud.launch(spec(zone, allocation_id="alloc-3"))
        assert {i.instance_id for i in cloud.describe(job_id="job-a")} == {
            i.instance_id for i in mine
        }
        assert len(cloud.describe()) == len(mine) + len(other_job)
        assert len(other_cloud.describe()) == 2

    def test_terminate_is_idempotent_and_terminated_instances_leave_the_listing(
        self, cloud: Cloud, zone: str
    ) -> None:
        first, second = cloud.launch(spec(zone))
        cloud.terminate([first.instance_id])
        cloud.terminate([first.instance_id])  # again: fine
        assert [i.instance_id for i in cloud.describe()] == [second.instance_id]
        gone = {i.instance_id: i for i in cloud.describe(include_terminated=True)}
        assert gone[first.instance_id].state.is_gone

    def test_terminating_an_unknown_id_is_fine(self, cloud: Cloud, zone: str) -> None:
        [inst] = cloud.launch(spec(zone, count=1))
        cloud.terminate(["i-0123456789abcdef0", inst.instance_id])
        assert cloud.describe() == []

    def test_a_capacity_refusal_names_the_market_and_launches_nothing(
        self, cloud: Cloud, zone: str, hooks: CloudHooks
    ) -> None:
        hooks.refuse_launches("InsufficientInstanceCapacity")
        with pytest.raises(CapacityError) as refused:
            cloud.launch(spec(zone))
        assert refused.value.code == "InsufficientInstanceCapacity"
        assert refused.value.market == spec(zone).market
        assert cloud.describe() == []

    def test_an_instance_the_cloud_takes_back_is_gone_from_the_listing(
        self, cloud: Cloud, zone: str, hooks: CloudHooks
    ) -> None:
        first, second = cloud.launch(spec(zone))
        hooks.reclaim(first.instance_id)
        assert [i.instance_id for i in cloud.describe()] == [second.instance_id]
