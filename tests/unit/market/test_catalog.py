"""The packaged EC2 instance catalog and its loader."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest

from orchestrator.errors import UserError
from orchestrator.market.catalog import DEFAULT_GPU_WORK_RATES, Catalog, InstanceType
from orchestrator.market.errors import UnknownInstanceTypeError, UnknownMarketError

REQUIRED_TYPES = (
    "p2.xlarge", "p2.8xlarge", "p2.16xlarge",
    "p3.2xlarge", "p3.8xlarge", "p3.16xlarge",
    "g4dn.xlarge", "g4dn.12xlarge", "g5.xlarge", "g5.12xlarge",
    "c5.xlarge", "c5.2xlarge", "c5.4xlarge", "m5.xlarge", "m5.2xlarge", "m5.4xlarge",
)  # fmt: skip
REQUIRED_REGIONS = (
    "us-east-1", "us-east-2", "us-west-1", "us-west-2",
    "eu-west-1", "eu-west-2", "eu-west-3", "eu-central-1", "eu-north-1",
)  # fmt: skip
CPU_TYPES = ("c5.xlarge", "c5.2xlarge", "c5.4xlarge", "m5.xlarge", "m5.2xlarge", "m5.4xlarge")


@pytest.fixture
def catalog() -> Catalog:
    return Catalog.load()


@pytest.fixture
def packaged_body() -> dict[str, Any]:
    text = (
        Path(__file__).resolve().parents[3] / "orchestrator/market/data/catalog.json"
    ).read_text()
    body: dict[str, Any] = json.loads(text)
    return body


def write_catalog(tmp_path: Path, body: dict[str, Any]) -> Path:
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps(body))
    return path


# --- the packaged data -------------------------------------------------------------------------


def test_every_required_type_lists_every_required_region_with_a_price_or_explicit_null(
    packaged_body: dict[str, Any],
) -> None:
    types = packaged_body["instance_types"]
    for name in REQUIRED_TYPES:
        assert name in types, name
        prices = types[name]["on_demand_usd_per_hour"]
        for region in REQUIRED_REGIONS:
            assert region in prices, f"{name} has no entry for {region}"
            assert prices[region] is None or prices[region] > 0


def test_loaded_catalog_knows_every_required_type_and_region(catalog: Catalog) -> None:
    assert set(REQUIRED_TYPES) <= set(catalog.names())
    assert set(REQUIRED_REGIONS) <= set(catalog.regions())
    assert all(name in catalog for name in REQUIRED_TYPES)
    assert "p9.mega" not in catalog


def test_packaged_file_is_version_1_and_says_prices_may_have_changed(catalog: Catalog) -> None:
    assert catalog.version == 1
    assert "on-demand" in catalog.source and "may have changed" in catalog.source
    assert "Narayanan" in catalog.gpu_work_rates_source
    assert catalog.as_of is not None


def test_p3_2xlarge_costs_3_06_in_us_east_1_and_has_one_v100(catalog: Catalog) -> None:
    p3 = catalog.get("p3.2xlarge")
    assert p3.on_demand_price("us-east-1") == pytest.approx(3.06)
    assert (p3.vcpus, p3.gpu_count, p3.gpu_model, p3.gpu_memory_gib) == (8, 1, "V100", 16.0)
    assert catalog.work_rate("p3.2xlarge") == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("name", "price"),
    [
        ("p3.8xlarge", 12.24), ("p3.16xlarge", 24.48),
        ("p2.xlarge", 0.90), ("p2.8xlarge", 7.20), ("p2.16xlarge", 14.40),
        ("g4dn.xlarge", 0.526), ("g4dn.12xlarge", 3.912),
        ("g5.xlarge", 1.006), ("g5.12xlarge", 5.672),
        ("c5.xlarge", 0.17), ("m5.xlarge", 0.192),
    ],
)  # fmt: skip
def test_us_east_1_list_prices_match_aws(catalog: Catalog, name: str, price: float) -> None:
    assert catalog.get(name).on_demand_price("us-east-1") == pytest.approx(price)


def test_default_gpu_work_rates_are_relative_to_v100() -> None:
    assert dict(DEFAULT_GPU_WORK_RATES) == {"V100": 1.0, "K80": 0.2, "T4": 0.35, "A10G": 0.7}


def test_every_gpu_type_has_a_default_work_rate(catalog: Catalog) -> None:
    for name in catalog.gpu_types():
        assert catalog.work_rate(name) > 0


def test_gpu_types_are_the_p_and_g_families(catalog: Catalog) -> None:
    assert set(catalog.gpu_types()) == set(REQUIRED_TYPES) - set(CPU_TYPES)
    assert not any(catalog.get(name).is_gpu for name in CPU_TYPES)


def test_default_catalog_is_loaded_once() -> None:
    assert Catalog.load() is Catalog.load()


# --- lookups and errors ------------------------------------------------------------------------


def test_unknown_type_suggests_a_close_match(catalog: Catalog) -> None:
    with pytest.raises(UnknownInstanceTypeError) as info:
        catalog.get("p3.2xlarg")
    assert "Did you mean 'p3.2xlarge'" in info.value.message
    assert "g4dn.xlarge" in info.value.fix
    assert isinstance(info.value, UserError)


def test_wrong_case_type_suggests_the_lowercase_name(catalog: Catalog) -> None:
    with pytest.raises(UnknownInstanceTypeError, match=r"Did you mean 'p3\.2xlarge'\?"):
        catalog.get("P3.2XLARGE")


def test_type_not_offered_in_region_raises_with_regions_that_offer_it(catalog: Catalog) -> None:
    p2 = catalog.get("p2.xlarge")
    assert not p2.offered_in("us-west-1")
    assert p2.offered_in("us-east-1")
    with pytest.raises(UnknownMarketError) as info:
        p2.on_demand_price("us-west-1")
    assert "p2.xlarge" in info.value.message and "us-west-1" in info.value.message
    assert "us-east-1" in info.value.fix and "us-west-1" not in info.value.fix


def test_region_missing_from_catalog_raises_unknown_market(catalog: Catalog) -> None:
    with pytest.raises(UnknownMarketError, match="ap-south-9"):
        catalog.get("c5.xlarge").on_demand_price("ap-south-9")


# --- work rates --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CPU_TYPES)
def test_cpu_types_have_work_rate_zero_and_infinite_price_per_work(
    catalog: Catalog, name: str
) -> None:
    assert catalog.work_rate(name) == 0.0
    assert math.isinf(catalog.price_per_work(name, "us-east-1"))


def test_work_rate_is_gpu_count_times_model_rate(catalog: Catalog) -> None:
    assert catalog.work_rate("p2.16xlarge") == pytest.approx(16 * 0.2)
    assert catalog.work_rate("p3.16xlarge") == pytest.approx(8.0)
    assert catalog.work_rate("g4dn.12xlarge") == pytest.approx(4 * 0.35)


def test_custom_work_rates_override_the_defaults(catalog: Catalog) -> None:
    measured = {**DEFAULT_GPU_WORK_RATES, "K80": 0.3}
    assert catalog.work_rate("p2.8xlarge", measured) == pytest.approx(8 * 0.3)
    assert catalog.price_per_work("p2.8xlarge", "us-east-1", measured) == pytest.approx(7.2 / 2.4)
    assert catalog.work_rate("p2.8xlarge") == pytest.approx(8 * 0.2)  # defaults untouched


def test_work_rates_missing_the_gpu_model_raise_naming_gpu_work_rates(catalog: Catalog) -> None:
    with pytest.raises(UserError) as info:
        catalog.work_rate("g5.xlarge", {"V100": 1.0})
    assert info.value.field == "gpu_work_rates"
    assert "A10G" in info.value.message and "A10G" in info.value.fix


def test_non_positive_work_rate_is_rejected(catalog: Catalog) -> None:
    with pytest.raises(UserError, match="positive") as info:
        catalog.work_rate("p3.2xlarge", {"V100": 0.0})
    assert info.value.field == "gpu_work_rates"


def test_price_per_work_divides_price_by_work_rate(catalog: Catalog) -> None:
    assert catalog.price_per_work("p3.8xlarge", "us-east-1") == pytest.approx(12.24 / 4)
    assert catalog.price_per_work("p2.xlarge", "us-east-1") == pytest.approx(0.90 / 0.2)


def test_price_per_work_in_region_without_the_type_raises(catalog: Catalog) -> None:
    with pytest.raises(UnknownMarketError):
        catalog.price_per_work("p3.2xlarge", "eu-north-1")


# --- loading other files -----------------------------------------------------------------------


def test_a_valid_catalog_file_loads_from_a_path(
    tmp_path: Path, packaged_body: dict[str, Any]
) -> None:
    loaded = Catalog.load(write_catalog(tmp_path, packaged_body))
    assert loaded.names() == Catalog.load().names()
    assert loaded.path == str(tmp_path / "catalog.json")


def test_malformed_field_raises_user_error_naming_file_and_field(
    tmp_path: Path, packaged_body: dict[str, Any]
) -> None:
    body = copy.deepcopy(packaged_body)
    body["instance_types"]["p3.2xlarge"]["vcpus"] = "eight"
    path = write_catalog(tmp_path, body)
    with pytest.raises(UserError) as info:
        Catalog.load(path)
    assert info.value.field == 'instance_types["p3.2xlarge"].vcpus'
    assert info.value.path == str(path)
    assert str(path) in info.value.message and "vcpus" in info.value.message


def test_negative_price_raises_naming_the_region(
    tmp_path: Path, packaged_body: dict[str, Any]
) -> None:
    body = copy.deepcopy(packaged_body)
    body["instance_types"]["c5.xlarge"]["on_demand_usd_per_hour"]["eu-west-1"] = -0.1
    with pytest.raises(UserError) as info:
        Catalog.load(write_catalog(tmp_path, body))
    assert info.value.field == 'instance_types["c5.xlarge"].on_demand_usd_per_hour["eu-west-1"]'


def test_missing_region_entry_raises_asking_for_explicit_null(
    tmp_path: Path, packaged_body: dict[str, Any]
) -> None:
    body = copy.deepcopy(packaged_body)
    del body["instance_types"]["p2.xlarge"]["on_demand_usd_per_hour"]["us-west-1"]
    with pytest.raises(UserError, match="null") as info:
        Catalog.load(write_catalog(tmp_path, body))
    assert info.value.field == 'instance_types["p2.xlarge"].on_demand_usd_per_hour["us-west-1"]'


def test_misspelled_field_is_rejected(tmp_path: Path, packaged_body: dict[str, Any]) -> None:
    body = copy.deepcopy(packaged_body)
    body["instance_types"]["m5.xlarge"]["vcpu"] = body["instance_types"]["m5.xlarge"].pop("vcpus")
    with pytest.raises(UserError) as info:
        Catalog.load(write_catalog(tmp_path, body))
    assert info.value.field in (
        'instance_types["m5.xlarge"].vcpus',
        'instance_types["m5.xlarge"].vcpu',
    )


def test_gpu_model_without_gpus_is_rejected(tmp_path: Path, packaged_body: dict[str, Any]) -> None:
    body = copy.deepcopy(packaged_body)
    body["instance_types"]["c5.xlarge"]["gpu_model"] = "V100"
    with pytest.raises(UserError) as info:
        Catalog.load(write_catalog(tmp_path, body))
    assert info.value.field == 'instance_types["c5.xlarge"].gpu_model'


def test_gpu_model_without_work_rate_is_rejected(
    tmp_path: Path, packaged_body: dict[str, Any]
) -> None:
    body = copy.deepcopy(packaged_body)
    del body["gpu_work_rates"]["T4"]
    with pytest.raises(UserError, match="T4") as info:
        Catalog.load(write_catalog(tmp_path, body))
    assert info.value.field == "gpu_work_rates"


def test_unsupported_version_is_rejected(tmp_path: Path, packaged_body: dict[str, Any]) -> None:
    body = {**packaged_body, "version": 2}
    with pytest.raises(UserError, match="version 2") as info:
        Catalog.load(write_catalog(tmp_path, body))
    assert info.value.field == "version"


def test_invalid_json_raises_user_error_with_line(tmp_path: Path) -> None:
    path = tmp_path / "catalog.json"
    path.write_text('{"version": 1,\n  "source": }')
    with pytest.raises(UserError, match="line 2") as info:
        Catalog.load(path)
    assert info.value.path == str(path)


def test_missing_file_raises_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="cannot read catalog file"):
        Catalog.load(tmp_path / "nope.json")


# --- building types directly -------------------------------------------------------------------


def test_instance_type_is_immutable_and_validated() -> None:
    t = InstanceType(
        name="x1.small", vcpus=2, memory_gib=4.0, gpu_count=0, gpu_model=None,
        gpu_memory_gib=None, on_demand_usd_per_hour={"us-east-1": 0.1},
    )  # fmt: skip
    with pytest.raises(ValueError):
        t.vcpus = 4  # type: ignore[misc]
    with pytest.raises(ValueError):
        InstanceType(
            name="x1.gpu", vcpus=2, memory_gib=4.0, gpu_count=2, gpu_model=None,
            gpu_memory_gib=None, on_demand_usd_per_hour={},
        )  # fmt: skip
