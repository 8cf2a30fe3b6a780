"""The `orchestrator` command line, run as a real process: outputs, the simulate/ledger-check
contract, and user errors (exit 2, `error:` and `To fix:` on stderr, no traceback)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

import orchestrator
from orchestrator.market.prices import to_epoch_seconds
from orchestrator.market.trace_source import bundled_prices_dir

DEFAULT_STRATEGIES = (
    "on-demand",
    "standard-checkpoint",
    "standard-agileml",
    "cheapest-failover",
    "bidbrain",
    "oracle",
)
SUMMARY_KEYS = (
    "cost_vs_ondemand",
    "runtime_vs_ondemand",
    "free_compute_fraction",
    "evictions_mean",
    "cost_usd_p50",
    "cost_usd_p95",
)
#: Small, fast simulate options for the error cases that get as far as simulating.
FAST = ("--starts", "1", "--workers", "1", "--json")

PRICES_DIR = bundled_prices_dir("us-east-1")
AVAILABILITY_CSV = Path(
    str(resources.files("orchestrator.market") / "data" / "availability" / "p3-node-trace.csv")
)


def run_cli(*args: str | Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def flat(text: str) -> str:
    """Whitespace-normalised text (rich wraps stderr at 80 columns when it is not a terminal)."""
    return " ".join(text.split())


def assert_user_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 2, `error:` and `To fix:` on stderr, no traceback; returns the flattened stderr."""
    stderr = flat(proc.stderr)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "error:" in stderr, proc.stderr
    assert "To fix:" in stderr, proc.stderr
    for needle in needles:
        assert needle in stderr, (needle, proc.stderr)
    return stderr


def single_json_object(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, stdout
    body = json.loads(lines[0])
    assert isinstance(body, dict)
    return body


def short_price_dir(folder: Path, days: float) -> Path:
    """A price folder holding only the first `days` days of the bundled p3.2xlarge prices."""
    body = json.loads((PRICES_DIR / "p3.2xlarge.json").read_text())
    records = sorted(body["SpotPriceHistory"], key=lambda r: r["Timestamp"])
    first = to_epoch_seconds(records[0]["Timestamp"])
    kept = [r for r in records if to_epoch_seconds(r["Timestamp"]) <= first + days * 86400]
    assert len(kept) > 10
    folder.mkdir()
    (folder / "p3.2xlarge.json").write_text(json.dumps({"SpotPriceHistory": kept}))
    return folder


# -- simulate: output -------------------------------------------------------------------


def test_simulate_json_prints_one_object_with_every_default_strategy_summary():
    proc = run_cli("simulate", "--starts", "3", "--workers", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    report = single_json_object(proc.stdout)
    assert {"starts", "billing", "strategies"} <= report.keys()
    assert report["starts"] == 3
    assert report["billing"] == "per-second"
    assert tuple(report["strategies"]) == DEFAULT_STRATEGIES
    for name, summary in report["strategies"].items():
        for key in SUMMARY_KEYS:
            assert key in summary, (name, key)
            assert isinstance(summary[key], int | float), (name, key)
    strategies = report["strategies"]
    assert strategies["on-demand"]["cost_vs_ondemand"] == 1.0
    assert strategies["oracle"]["cost_vs_ondemand"] <= strategies["bidbrain"]["cost_vs_ondemand"]


def test_simulate_contract_options_write_a_ledger_that_ledger_check_accepts(tmp_path):
    ledger = tmp_path / "l.jsonl"
    proc = run_cli(
        "simulate",
        "--prices", PRICES_DIR,
        "--availability", AVAILABILITY_CSV,
        "--strategy", "on-demand,bidbrain",
        "--job-hours", "2",
        "--nodes", "4",
        "--starts", "2",
        "--seed", "1",
        "--billing", "hourly-refund",
        "--json",
        "--ledger", ledger,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = single_json_object(proc.stdout)
    assert report["billing"] == "hourly-refund"
    assert report["starts"] == 2
    assert set(report["strategies"]) == {"on-demand", "bidbrain"}
    assert report["strategies"]["on-demand"]["cost_vs_ondemand"] == 1.0
    lines = [json.loads(x) for x in ledger.read_text().splitlines() if x.strip()]
    assert lines, "the ledger is empty"
    assert {x["strategy"] for x in lines} == {"on-demand", "bidbrain"}

    report_file = tmp_path / "report.json"
    report_file.write_text(proc.stdout)
    check = run_cli(
        "ledger-check", ledger,
        "--billing", "hourly-refund",
        "--prices", PRICES_DIR,
        "--report", report_file,
    )  # fmt: skip
    assert check.returncode == 0, (check.stdout, check.stderr)
    assert "max relative error" in check.stdout


def test_ledger_check_of_a_missing_ledger_is_a_user_error(tmp_path):
    assert_user_error(run_cli("ledger-check", tmp_path / "nope.jsonl"), "nope.jsonl")


# -- simulate: bad input ----------------------------------------------------------------


def test_malformed_price_json_is_a_user_error_naming_the_file(tmp_path):
    bad = tmp_path / "prices"
    bad.mkdir()
    (bad / "broken.json").write_text('{"SpotPriceHistory": [')
    assert_user_error(run_cli("simulate", "--prices", bad, *FAST), "broken.json", "not valid JSON")


def test_empty_price_file_is_a_user_error(tmp_path):
    folder = tmp_path / "prices"
    folder.mkdir()
    (folder / "empty.json").write_text("")
    assert_user_error(run_cli("simulate", "--prices", folder, *FAST), "empty.json", "empty")


def test_price_dir_without_json_files_is_a_user_error(tmp_path):
    folder = tmp_path / "prices"
    folder.mkdir()
    (folder / "notes.txt").write_text("no prices here")
    assert_user_error(run_cli("simulate", "--prices", folder, *FAST), "no *.json files")


def test_missing_availability_file_is_a_user_error(tmp_path):
    missing = tmp_path / "missing.csv"
    assert_user_error(
        run_cli("simulate", "--availability", missing, *FAST), "missing.csv", "availability"
    )


def test_availability_file_with_a_bad_line_names_the_line(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("0,add,node1\n1000,frobnicate,node1\n2000,remove,node1\n")
    assert_user_error(run_cli("simulate", "--availability", trace, *FAST), "trace.csv:2")


def test_unknown_strategy_suggests_the_close_name():
    stderr = assert_user_error(
        run_cli("simulate", "--strategy", "on-demand,bidbrian", *FAST), "'bidbrian'"
    )
    assert "Did you mean 'bidbrain'" in stderr


def test_empty_strategy_list_is_a_user_error():
    assert_user_error(run_cli("simulate", "--strategy", ",", *FAST), "--strategy")


def test_unknown_billing_lists_the_valid_models():
    assert_user_error(
        run_cli("simulate", "--billing", "hourly", *FAST), "'hourly'", "per-second", "hourly-refund"
    )


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--nodes", "0"),
        ("--starts", "0"),
        ("--job-hours", "-1"),
        ("--budget", "0"),
        ("--budget", "-5"),
        ("--workers", "0"),
        ("--max-scale", "0.5"),
    ],
)
def test_out_of_range_numeric_option_is_a_user_error_naming_the_option(option, value):
    # the option comes after FAST, so it overrides FAST's own --starts/--workers
    assert_user_error(run_cli("simulate", *FAST, option, value), option)


def test_unknown_reference_type_lists_the_catalog_types():
    assert_user_error(
        run_cli("simulate", "--reference-type", "p9.huge", *FAST), "'p9.huge'", "p3.2xlarge"
    )


def test_misspelt_reference_type_suggests_the_close_name():
    stderr = assert_user_error(run_cli("simulate", "--reference-type", "p3.2xlarg", *FAST))
    assert "Did you mean 'p3.2xlarge'" in stderr


def test_reference_type_absent_from_the_prices_is_a_user_error():
    assert_user_error(
        run_cli("simulate", "--reference-type", "g5.xlarge", *FAST), "g5.xlarge", "--reference-type"
    )


def test_job_longer_than_the_price_data_is_a_user_error(tmp_path):
    prices = short_price_dir(tmp_path / "prices", days=10)
    assert_user_error(
        run_cli("simulate", "--prices", prices, "--job-hours", "300", *FAST),
        "too short",
        "--job-hours",
    )


def test_job_longer_than_the_two_week_limit_is_a_user_error():
    assert_user_error(run_cli("simulate", "--job-hours", "400", *FAST), "--job-hours")


def test_unwritable_ledger_path_is_a_user_error(tmp_path):
    ledger = tmp_path / "no" / "such" / "dir" / "l.jsonl"
    assert_user_error(run_cli("simulate", "--ledger", ledger, *FAST), "cannot write")


def test_debug_flag_shows_the_traceback_of_a_user_error():
    proc = run_cli("--debug", "simulate", "--nodes", "0", *FAST)
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr
    assert "UserError" in proc.stderr


# -- risk ---------------------------------------------------------------------------------


def test_risk_json_gives_a_probability_for_each_cause():
    proc = run_cli(
        "risk", "--type", "p3.2xlarge", "--zone", "us-east-1b", "--bid-delta", "0.1", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    body = single_json_object(proc.stdout)
    assert body["instance_type"] == "p3.2xlarge"
    assert body["zone"] == "us-east-1b"
    betas = {cause: body[cause]["beta"] for cause in ("price-crossing", "capacity", "combined")}
    for cause, beta in betas.items():
        assert 0.0 <= beta <= 1.0, (cause, beta)
    # competing risks: the combined hazard is the sum, so β is at least each part's
    assert betas["combined"] >= max(betas["price-crossing"], betas["capacity"]) - 1e-6


def test_risk_for_an_unknown_zone_lists_the_zones_with_prices():
    assert_user_error(
        run_cli("risk", "--type", "p3.2xlarge", "--zone", "us-east-1z", "--json"),
        "us-east-1z",
        "us-east-1b",
    )


def test_risk_with_zero_horizon_is_a_user_error():
    assert_user_error(
        run_cli("risk", "--type", "p3.2xlarge", "--zone", "us-east-1b", "--horizon-hours", "0"),
        "--horizon-hours",
    )


# -- catalog, version -------------------------------------------------------------------


def test_catalog_lists_p3_2xlarge():
    proc = run_cli("catalog")
    assert proc.returncode == 0, proc.stderr
    assert "p3.2xlarge" in proc.stdout
    assert "3.060" in proc.stdout  # its us-east-1 on-demand price


def test_catalog_of_an_unknown_region_lists_the_regions():
    assert_user_error(run_cli("catalog", "--region", "mars-1"), "'mars-1'", "us-east-1")


def test_version_prints_the_package_version():
    proc = run_cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"orchestrator {orchestrator.__version__}"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("simulate", "--bogus"), "No such option: --bogus"),
        (("simulate", "--starts", "abc"), "Invalid value for '--starts'"),
        (("no-such-command",), "No such command"),
    ],
)
def test_a_usage_error_exits_2_with_the_usage_and_no_traceback(args, needle):
    """Whatever click typer runs on (its own copy since typer 0.29), a usage error is a usage
    message and exit code 2, never a traceback."""
    proc = run_cli(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and needle in flat(proc.stderr), proc.stderr
    assert "Usage: " in proc.stderr and "orchestrator" in proc.stderr


def test_installed_console_script_prints_the_version():
    script = shutil.which("orchestrator") or str(Path(sys.executable).parent / "orchestrator")
    if not Path(script).exists():
        pytest.skip("the orchestrator console script is not installed")
    proc = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert orchestrator.__version__ in proc.stdout


def test_config_file_sets_overheads_and_work_rates_and_options_override_it(tmp_path):
    cfg = tmp_path / "sim.yaml"
    cfg.write_text(
        "job_hours: 2\nnodes: 4\nstarts: 3\nstrategies: [on-demand, oracle]\n"
        "app: {add_overhead_s: 600}\ngpu_work_rates: {K80: 0.3}\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "simulate",
            "--config",
            str(cfg),
            "--starts",
            "2",
            "--workers",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["starts"] == 2 and report["job_hours"] == 2.0
    assert set(report["strategies"]) == {"on-demand", "oracle"}
    # with K80 at 0.3 a p2.xlarge at $0.27/h beats a V100 at $0.918/h per unit of work
    assert report["strategies"]["oracle"]["cost_vs_ondemand"] < 0.3


def test_config_file_with_an_unknown_setting_is_a_user_error(tmp_path):
    cfg = tmp_path / "sim.yaml"
    cfg.write_text("app: {sigma: 3}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "simulate", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "app.sigma" in proc.stderr and "Traceback" not in proc.stderr
