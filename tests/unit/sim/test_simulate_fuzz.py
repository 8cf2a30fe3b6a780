"""Fuzzing `orchestrator simulate` (issue #19, item 2), seeded:

* its settings, in volume: config files (mutated valid configs, wrong types, unknown and
  misspelt settings, huge, negative, NaN and infinite numbers, unicode, truncated and corrupted
  YAML, tops that are not mappings) with typed option values over them, through
  `simulation_config`, what the command validates before it simulates. Each is a config the
  simulator can start from (its job and start times) or a UserError naming the option or
  setting; nothing else.
* the command itself, a few hundred times in process through `orchestrator.cli.main` (the
  console script's entry point) on fuzzed option strings, files and folders: exit 0 or 2
  (a usage error, or a user error), never a traceback, a hang or another exit code."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import random
import sys
import time
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.fuzz import CaseTimeout, Tally, time_limit

import orchestrator.cli.console
import orchestrator.sim.runner as runner
from orchestrator.cli.simulate import simulation_config
from orchestrator.errors import UserError
from orchestrator.market.trace_source import bundled_prices_dir
from orchestrator.sim.runner import SimConfig, job_for, load_world, start_times

SEED = 19
CONFIG_CASES = 3000
CLI_RUNS = 200
CONFIG_LIMIT_S = 5.0
RUN_LIMIT_S = 30.0
MAX_MESSAGE_CHARS = 4000

PRICES = bundled_prices_dir("us-east-1")
AVAILABILITY = Path(
    str(resources.files("orchestrator.market") / "data" / "availability" / "p3-node-trace.csv")
)
STRATEGIES = [
    "on-demand", "standard-checkpoint", "standard-agileml", "cheapest-failover", "bidbrain",
    "oracle",
]  # fmt: skip

VALID_CONFIGS: list[dict[str, Any]] = [
    {},
    {"job_hours": 2, "nodes": 4, "starts": 3, "seed": 7, "billing": "hourly-refund"},
    {
        "prices": [str(PRICES)],
        "availability": str(AVAILABILITY),
        "strategies": ["on-demand", "bidbrain", "oracle"],
        "job_hours": 20,
        "nodes": 16,
        "reference_type": "p3.2xlarge",
        "max_scale": 1.5,
        "starts": 10,
        "seed": 1,
        "billing": "per-second",
        "budget_usd": 500,
        "reliable_type": "m5.xlarge",
        "reliable_count": 1,
        "time_value_usd_per_hour": 2.5,
        "gpu_work_rates": {"K80": 0.3},
        "app": {"phi": 1.0, "add_overhead_s": 240, "eviction_overhead_s": 30},
        "runtime": {"boot_s": 180, "checkpoint_s": 60, "restart_s": 120, "notice_s": 120,
                    "capacity_cooldown_s": 600, "max_runtime_factor": 10},
        "bidbrain": {"decision_interval_s": 120, "renew_period_s": 3600, "renew_lead_s": 120,
                     "bid_deltas_usd": [0.0001, 0.01, 0.4], "counts": [1, 2, 4],
                     "min_improvement": 0.002, "max_adds_per_decision": 32},
        "workers": 1,
    },
]  # fmt: skip
SECTIONS = {
    "app": ["phi", "add_overhead_s", "eviction_overhead_s"],
    "runtime": ["boot_s", "checkpoint_s", "restart_s", "notice_s", "capacity_cooldown_s",
                "max_runtime_factor"],
    "bidbrain": ["decision_interval_s", "renew_period_s", "renew_lead_s", "bid_deltas_usd",
                 "counts", "min_improvement", "max_adds_per_decision", "budget_reserve_s"],
    "gpu_work_rates": ["V100", "K80", "T4", "M60"],
}  # fmt: skip
FIELDS = list(VALID_CONFIGS[2])
NUMBERS: list[Any] = [
    0, 1, -1, 3, 16, 64, 65, 4096, 4097, 100_000, 100_001, 2**63, 10**30, 10**400, -(10**400),
    0.0, -0.0, 5e-324, 1e-9, 0.5, 1.5, 16.0, 16.5, 336.0, 337.0, 1e300, -1e308,
    math.nan, math.inf, -math.inf, True, False, "1", "2.5", "nan", "inf", "1e400", "abc", "",
]  # fmt: skip
STRINGS: list[Any] = [
    "", " ", "x", "x" * 3000, "名前", "🚀", "résumé", "\u202e", "a\x00b", "per-second",
    "hourly-refund", "hourly", "p3.2xlarge", "p3.8xlarge", "g4dn.xlarge", "m5.xlarge",
    "p3.2xlarg", "on-demand", "bidbrian", "/nonexistent/prices", str(PRICES), str(AVAILABILITY),
    "~", ".", "..",
]  # fmt: skip
OTHERS: list[Any] = [
    None, [], {}, [1, 2], ["on-demand", None], {"a": 1}, {1: 2}, [[[]]], [str(PRICES)],
    ["bidbrain"], STRATEGIES * 3, {"V100": 0.5}, {"V100": -1}, {"": 1},
]  # fmt: skip
DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml's: the writing is not tested
PUNCTUATION = list(":-[]{}\"',#&*!|>%@`?\t\n ") + ["\\", "\ufeff", "é"]


def _value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if roll < 0.45:
        return rng.choice(NUMBERS)
    if roll < 0.7:
        return rng.choice(STRINGS)
    if roll < 0.85 or depth > 1:
        return rng.choice(OTHERS)
    if roll < 0.93:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {_key(rng): _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _key(rng: random.Random) -> Any:
    roll = rng.random()
    if roll < 0.6:
        return rng.choice(FIELDS + SECTIONS["runtime"] + SECTIONS["bidbrain"])
    if roll < 0.85:
        name = rng.choice(FIELDS)
        return rng.choice([name.replace("_", "-"), name.upper(), name[:-1], name + "s"])
    return rng.choice([1, 0, True, None, 2.5, "", "名前", "x" * 200])


def _config_doc(rng: random.Random, kind: str) -> Any:
    doc = copy.deepcopy(rng.choice(VALID_CONFIGS))
    if kind == "valid":
        return doc
    if kind == "mutate_field":
        for _ in range(rng.randint(1, 3)):
            doc[rng.choice(FIELDS)] = _value(rng)
        return doc
    if kind == "mutate_section":
        for _ in range(rng.randint(1, 3)):
            section = rng.choice(list(SECTIONS))
            if not isinstance(doc.get(section), dict):
                doc[section] = {}
            doc[section][rng.choice(SECTIONS[section])] = _value(rng)
        return doc
    if kind == "extra_field":
        target = doc
        section = rng.choice([None, None, "app", "runtime", "bidbrain"])
        if section:
            target = doc.setdefault(section, {})
        target[_key(rng)] = _value(rng)
        return doc
    if kind == "drop_field":
        for key in rng.sample(list(doc), min(len(doc), rng.randint(1, 4))):
            del doc[key]
        return doc
    if kind == "random_doc":
        return {_key(rng): _value(rng) for _ in range(rng.randint(0, 6))}
    if kind == "non_mapping_top":
        return rng.choice([[doc], list(doc), "starts: 1", 3, 2.5, True, [], "null"])
    raise AssertionError(kind)


def _config_text(rng: random.Random) -> tuple[str, str]:
    """(kind, a config file's text): UTF-8, nested a few levels at most."""
    kind = rng.choice(
        ["valid", "mutate_field", "mutate_field", "mutate_section", "mutate_section",
         "extra_field", "drop_field", "random_doc", "non_mapping_top", "truncate", "noise"]
    )  # fmt: skip
    doc = _config_doc(rng, "valid" if kind in ("truncate", "noise") else kind)
    if rng.random() < 0.3:
        text = json.dumps(doc, default=str)
    else:
        text = yaml.dump(doc, Dumper=DUMPER, sort_keys=False, allow_unicode=True)
    if kind == "truncate":
        text = text[: rng.randrange(max(1, len(text)))]
    elif kind == "noise":
        chars = list(text)
        for _ in range(rng.randint(1, 6)):
            i = rng.randrange(len(chars) + 1)
            if rng.random() < 0.5:
                chars.insert(i, rng.choice(PUNCTUATION))
            elif i < len(chars):
                chars[i] = rng.choice(PUNCTUATION)
        text = "".join(chars)
    return kind, text


def _given(rng: random.Random) -> dict[str, Any]:
    """Option values as typer hands them over (None: the option was not given)."""
    pools: dict[str, list[Any]] = {
        "prices": [(PRICES,), (Path("/nonexistent"),), (PRICES, PRICES)],
        "availability": [AVAILABILITY, Path("/nonexistent.csv")],
        "strategies": [(), ("bidbrain",), tuple(STRATEGIES), ("bidbrian",), ("",), ("名前",)],
        "job_hours": [1.0, 20.0, 0.0, -1.0, 1e-300, 336.0, 337.0, math.nan, math.inf, 1e308],
        "nodes": [1, 16, 0, -1, 4096, 4097, 10**30],
        "starts": [1, 1000, 0, -5, 100_000, 100_001, 10**30],
        "seed": [0, 1, -1, 2**64, 10**40],
        "billing": ["per-second", "hourly-refund", "", "hourly", "PER-SECOND"],
        "reference_type": ["p3.2xlarge", "p3.8xlarge", "m5.xlarge", "", "p3.2xlarg", "名前"],
        "budget_usd": [100.0, 0.0, -1.0, 1e-300, math.nan, math.inf, -math.inf],
        "max_scale": [1.0, 2.0, 0.5, 16.0, 16.5, math.nan, math.inf],
        "workers": [1, 2, 0, 64, 65, -1],
    }
    given: dict[str, Any] = dict.fromkeys(pools)
    for name in rng.sample(list(pools), rng.randint(0, 4)):
        given[name] = rng.choice(pools[name])
    return given


@cache
def _default_world() -> Any:
    return load_world(SimConfig.model_validate({"prices": (PRICES,)}))


def _unclear(exc: UserError, config_file: Path | None) -> str | None:
    message = exc.message
    if not message.strip():
        return "empty message"
    if len(message) > MAX_MESSAGE_CHARS:
        return f"{len(message)} characters"
    if "Traceback" in message:
        return "a traceback"
    if exc.field and not _names(message, exc.field):
        return f"does not name {exc.field}"
    return None


def _names(message: str, field: str) -> bool:
    """Whether `message` names `field` or `--option` (as such, or in words: "strategy")."""
    words = field.lstrip("-").replace("_", " ").replace("-", " ").lower()
    return field in message or words in message.lower()


def _unusable(config: SimConfig) -> str | None:
    """What is wrong with an accepted config, if anything: it must be strict JSON (finite
    numbers) and give a job and start times on the bundled prices (or a UserError)."""
    try:
        json.dumps(config.model_dump(mode="json"), allow_nan=False)
    except ValueError as exc:
        return f"not strict JSON: {exc}"
    world = _default_world()
    job_for(config, world)
    start_times(config, world)
    return None


def test_simulate_settings_are_accepted_or_refused_by_name(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    tally = Tally("simulate settings fuzz")
    path = tmp_path / "sim.yaml"
    started = time.monotonic()
    for _ in range(CONFIG_CASES):
        config_file: Path | None = None
        text = None
        if rng.random() < 0.85:
            kind, text = _config_text(rng)
            path.write_text(text, encoding="utf-8")
            config_file = path
        else:
            kind = "options_only"
        given = _given(rng)
        case = (text, given)
        tally.judge(
            kind,
            case,
            lambda config_file=config_file, given=given: _unusable(
                simulation_config(config_file, given)
            ),
            lambda exc, config_file=config_file: _unclear(exc, config_file),
            CONFIG_LIMIT_S,
        )
    print(f"\nsimulate settings fuzz took {time.monotonic() - started:.1f} s")
    tally.check(min_cases=CONFIG_CASES)
    assert tally.outcomes["accepted"] > CONFIG_CASES // 20, tally.summary()


# -- the command, in process ----------------------------------------------------------------


def _files(folder: Path) -> dict[str, Path]:
    """Files and folders the option values name: good, missing, malformed, unwritable."""
    empty_dir = folder / "empty"
    empty_dir.mkdir()
    bad_prices = folder / "bad-prices"
    bad_prices.mkdir()
    (bad_prices / "p3.2xlarge.json").write_text('{"SpotPriceHistory": [{"Timestamp": 3}]')
    empty_prices = folder / "empty-prices"
    empty_prices.mkdir()
    (empty_prices / "p3.2xlarge.json").write_text("")
    not_json = folder / "not.json"
    not_json.write_text("name: yaml")
    bad_csv = folder / "bad.csv"
    bad_csv.write_text("ms,add,node1\n12,evict,node2\n")
    empty_csv = folder / "empty.csv"
    empty_csv.write_text("")
    return {
        "empty_dir": empty_dir,
        "bad_prices": bad_prices,
        "empty_prices": empty_prices,
        "not_json": not_json,
        "bad_csv": bad_csv,
        "empty_csv": empty_csv,
        "missing": folder / "missing",
        "missing_dir_file": folder / "missing" / "file",
    }


def _argv(rng: random.Random, files: dict[str, Path], folder: Path, run: int) -> list[str]:
    """`simulate` with fuzzed options; one start of a short job on one process unless the
    starts, the job's length or the workers are what is fuzzed (valid values stay small)."""
    pools: dict[str, tuple[list[str], list[str]]] = {  # option: (valid values, others)
        "--starts": (["1", "2", "3", " 2"], ["0", "-1", "abc", "1.5", "", "１", "100001", "1e3",
                                             "0x10", "9" * 30]),
        "--job-hours": (["0.5", "2", "24", "1e-6", "0.001"],
                        ["0", "-1", "nan", "inf", "-inf", "337", "abc", "1e309", "", "2h"]),
        "--nodes": (["1", "4", "16"], ["0", "-3", "4097", "abc", "1.5", "9" * 30]),
        "--seed": (["0", "1", "18446744073709551616", "9" * 40], ["-1", "abc", ""]),
        "--billing": (["per-second", "hourly-refund"], ["hourly", "", "PER-SECOND", "名前"]),
        "--reference-type": (["p3.2xlarge", "p3.8xlarge"],
                             ["g4dn.xlarge", "m5.xlarge", "p3.2xlarg", "", "x" * 300]),
        "--budget": (["100", "1e-300", "1e6"], ["0", "-5", "nan", "inf", "abc", "1e400"]),
        "--max-scale": (["1", "2", "1.5"], ["0.5", "16.5", "17", "nan", "inf", "abc"]),
        "--workers": (["1"], ["0", "65", "-1", "abc"]),
        "--strategy": (["on-demand", "bidbrain,oracle", "on-demand,,oracle", "oracle,oracle",
                        " bidbrain ", ",".join(STRATEGIES)],
                       ["", ",,,", "bidbrian", "ON-DEMAND", "名前"]),
        "--prices": ([str(PRICES)],
                     [str(files["missing"]), str(files["not_json"]), str(files["empty_dir"]),
                      str(files["bad_prices"]), str(files["empty_prices"]), "/dev/null", ""]),
        "--availability": ([str(AVAILABILITY)],
                           [str(files["missing"]), str(files["bad_csv"]),
                            str(files["empty_csv"]), str(files["empty_dir"])]),
        "--ledger": ([str(folder / f"ledger-{run}.jsonl"), str(folder / f"ledger-{run}.jsonl.gz")],
                     [str(files["missing_dir_file"]), str(files["empty_dir"]), "/dev/full"]),
        "--plot": ([str(folder / f"plot-{run}.png")],
                   [str(folder / f"plot-{run}.txt"), str(files["missing_dir_file"]),
                    str(files["empty_dir"])]),
        "--config": (["CONFIG"], [str(files["missing"]), str(files["empty_dir"]),
                                  str(files["empty_csv"])]),
    }  # fmt: skip
    argv = ["simulate", "--json"]
    chosen = rng.sample(list(pools), rng.randint(1, 4))
    for option in chosen:
        valid, others = pools[option]
        if option == "--plot" and rng.random() < 0.8:
            valid = others  # a PNG takes a second to draw
        value = rng.choice(valid if rng.random() < 0.6 else others)
        if value == "CONFIG":
            _, text = _config_text(rng)
            value = str(folder / f"config-{run}.yaml")
            Path(value).write_text(text, encoding="utf-8")
        argv += [option, value]
    for option, small in (("--starts", "1"), ("--job-hours", "2"), ("--workers", "1")):
        if option not in chosen:
            argv += [option, small]
    roll = rng.random()
    if roll < 0.05:
        argv.insert(rng.randrange(1, len(argv) + 1), rng.choice(["--bogus", "stray", "-x"]))
    elif roll < 0.08:
        argv.append(rng.choice(["--starts", "--prices", "--strategy"]))  # a missing value
    elif roll < 0.09:
        argv.append("--help")
    return argv


def _run(argv: list[str]) -> tuple[int, str, str]:
    """`orchestrator ARGV` in this process, as the console script runs it."""
    out, err = io.StringIO(), io.StringIO()
    old_argv = sys.argv
    sys.argv = ["orchestrator", *argv]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                orchestrator.cli.console.main()
                code: Any = 0
            except SystemExit as exc:
                code = exc.code
    finally:
        sys.argv = old_argv
    if code is None:
        code = 0
    return (code if isinstance(code, int) else 1), out.getvalue(), err.getvalue()


# numpy's percentile of a strategy whose every start did no work (inf per unit of work: NaN)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_simulate_command_exits_0_or_2_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(orchestrator.cli.console, "exit_on_signals", lambda: None)  # pytest's own
    real_load_world = runner.load_world

    def load_world_once(config: SimConfig, catalog: Any = None) -> Any:
        """The bundled world is read once (the fuzzed files are read every time)."""
        bundled = config.prices == (PRICES,) and config.availability in (None, AVAILABILITY)
        if bundled and config.reference_type == "p3.2xlarge" and not config.gpu_work_rates:
            return _default_world()
        return real_load_world(config, catalog)

    monkeypatch.setattr(runner, "load_world", load_world_once)
    rng = random.Random(SEED)
    tally = Tally("simulate command fuzz")
    files = _files(tmp_path)
    started = time.monotonic()
    for run in range(CLI_RUNS):
        argv = _argv(rng, files, tmp_path, run)
        kind = "help" if "--help" in argv else "run"
        try:
            with time_limit(RUN_LIMIT_S):
                code, out, err = _run(argv)
        except (Exception, CaseTimeout) as exc:  # noqa: BLE001 - main() let it through
            tally.crashed(kind, argv, f"{type(exc).__name__}: {str(exc)[:300]}")
            continue
        if "Traceback" in out + err:
            tally.crashed(kind, argv, f"a traceback (exit {code}): {err[-800:]}")
        elif code == 2:
            if "error:" not in err.lower():
                tally.crashed(kind, argv, f"exit 2 without an error line: {err[-300:]!r}")
            else:
                tally.rejected(kind)
        elif code != 0:
            tally.crashed(kind, argv, f"exit {code}: {err[-500:]}")
        elif kind == "help":
            tally.accepted(kind)
        else:
            lines = [line for line in out.splitlines() if line.strip()]
            if len(lines) != 1 or not isinstance(json.loads(lines[0]), dict):
                tally.crashed(kind, argv, f"--json printed {out[:300]!r}")
                continue
            try:
                json.loads(lines[0], parse_constant=_refuse)  # strict JSON: no NaN or Infinity
            except ValueError as exc:
                tally.crashed(kind, argv, str(exc))
                continue
            tally.accepted(kind)
    print(f"\nsimulate command fuzz took {time.monotonic() - started:.1f} s")
    tally.check(min_cases=CLI_RUNS)
    assert tally.outcomes["accepted"] > CLI_RUNS // 10, tally.summary()


def _refuse(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


# -- config files that cannot be read as text or are nested too deeply ----------------------


def test_a_config_file_that_is_not_utf8_is_a_user_error(tmp_path: Path) -> None:
    config = tmp_path / "sim.yaml"
    config.write_bytes(b"starts: \xff\xfe\n")
    with pytest.raises(UserError, match="not UTF-8") as refused:
        simulation_config(config, {})
    assert refused.value.field == "--config"


def test_a_config_file_nested_too_deeply_is_a_user_error(tmp_path: Path) -> None:
    config = tmp_path / "sim.yaml"
    config.write_text("app: " + "[" * 2000 + "]" * 2000 + "\n")
    with pytest.raises(UserError, match="nested too deeply") as refused:
        simulation_config(config, {})
    assert refused.value.field == "--config"
