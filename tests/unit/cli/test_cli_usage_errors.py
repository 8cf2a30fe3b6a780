"""Usage and user errors through the installed `orchestrator` console script, run as a user runs
it (issue #19, item 2): a bad option value, an unknown option or command, a missing argument or
file, a broken job file or job spec. Each exits 2, with a short output that holds one error
line and no traceback. The cases run as concurrent processes (a module fixture), then each is
checked on its own."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

MAX_OUTPUT_CHARS = 2500  # a usage message and an error, or an error and its fix
ERROR_LINE = re.compile(r"^(error|Error):", re.MULTILINE)
TIMEOUT_S = 120

#: case -> (arguments, a needle of the error line); JOB_DIR in an argument is the case folder
CASES: dict[str, tuple[tuple[str, ...], str]] = {
    "unknown_command": (("nosuchcommand",), "No such command 'nosuchcommand'"),
    "simulate_unknown_option": (("simulate", "--bogus"), "No such option: --bogus"),
    "simulate_starts_not_a_number": (("simulate", "--starts", "abc"),
                                     "Invalid value for '--starts'"),
    "simulate_starts_without_value": (("simulate", "--starts"),
                                      "Option '--starts' requires an argument"),
    "simulate_extra_argument": (("simulate", "--starts", "1", "stray"),
                                "unexpected extra argument"),
    "simulate_negative_seed": (("simulate", "--seed", "-1"), "--seed"),
    "simulate_unknown_strategy": (("simulate", "--strategy", "bidbrian"), "unknown strategy"),
    "simulate_unknown_reference_type": (("simulate", "--reference-type", "p3.2xlarg"),
                                        "--reference-type"),
    "simulate_missing_config": (("simulate", "--config", "JOB_DIR/missing.yaml"),
                                "cannot read config"),
    "simulate_plot_format": (("simulate", "--plot", "JOB_DIR/plot.txt"), "cannot write plot"),
    "train_missing_argument": (("train",), "Missing argument 'JOB'"),
    "train_missing_file": (("train", "JOB_DIR/x.py"), "does not exist"),
    "train_broken_job": (("train", "JOB_DIR/broken.py"), "SyntaxError"),
    "train_zero_nodes": (("train", "JOB_DIR/broken.py", "--nodes", "0"),
                         "Invalid value for '--nodes'"),
    "submit_missing_argument": (("submit",), "Missing argument 'JOB.yaml'"),
    "submit_missing_file": (("submit", "JOB_DIR/missing.yaml"), "cannot read job file"),
    "submit_invalid_field": (("submit", "JOB_DIR/negative.yaml"), "budget_usd"),
    "submit_infinite_number": (("submit", "JOB_DIR/infinite.yaml"), "time_value_usd_per_hour"),
    "submit_not_a_mapping": (("submit", "JOB_DIR/list.yaml"), "must hold a mapping"),
    "submit_bad_yaml": (("submit", "JOB_DIR/syntax.yaml"), "not valid YAML/JSON"),
    "submit_nested_too_deeply": (("submit", "JOB_DIR/deep.yaml"), "nests lists or mappings"),
    "risk_missing_option": (("risk",), "Missing option '--type'"),
    # issue #33: inputs that once printed a traceback, or passed
    "risk_binary_price_file": (("risk", "--type", "p3.2xlarge", "--zone", "us-east-1b",
                                "--prices", "JOB_DIR/binary_prices"), "is not text"),
    "risk_nan_bid": (("risk", "--type", "p3.2xlarge", "--zone", "us-east-1b",
                      "--bid-delta", "nan"), "--bid-delta: nan is not a number"),
    "risk_infinite_bid": (("risk", "--type", "p3.2xlarge", "--zone", "us-east-1b",
                           "--bid-delta", "inf"), "--bid-delta: inf is not a number"),
    "ledger_binary": (("ledger-check", "JOB_DIR/binary.jsonl"), "is not JSON lines"),
    "ledger_binary_gz": (("ledger-check", "JOB_DIR/binary.jsonl.gz"), "is not JSON lines (gzip)"),
    "ledger_binary_report": (("ledger-check", "JOB_DIR/binary.jsonl", "--report",
                              "JOB_DIR/binary.jsonl"), "cannot read report"),
    "ledger_nan_tolerance": (("ledger-check", "JOB_DIR/binary.jsonl", "--tolerance", "nan"),
                             "--tolerance: nan is not a number"),
    "plan_too_many_workers": (("plan", "--workers", "100000", "--bandwidth", "1e9"),
                              "Invalid value for '--workers'"),
    "simulate_huge_work_rate": (("simulate", "--gpu-work-rates", "V100=1e308", "--starts", "2"),
                                "--gpu-work-rates"),
    "deploy_unknown_region": (("deploy", "--region", "mars-1", "--dry-run", "--vpc",
                               "vpc-0123456789abcdef0", "--controller-subnet",
                               "subnet-0123456789abcdef0", "--worker-subnets",
                               "subnet-0123456789abcdef1", "--api-cidr", "10.0.0.0/8",
                               "--package", "orchestrator"),
                              "'mars-1' is not an AWS region"),
    "teardown_unknown_region": (("deploy", "--teardown", "--region", "mars-1", "--yes"),
                                "'mars-1' is not an AWS region"),
}  # fmt: skip

BINARY = bytes(range(256)) * 8  # not UTF-8, not gzip

FILES = {
    "broken.py": "def model(:\n",
    "negative.yaml": "name: j\nbudget_usd: -1\nwork_gpu_hours: 5\n",
    "infinite.yaml": "name: j\nbudget_usd: 10\nwork_gpu_hours: 5\ntime_value_usd_per_hour: .inf\n",
    "list.yaml": "- name: j\n- budget_usd: 10\n",
    "syntax.yaml": "name: [j\nbudget_usd: 10\n",
    "deep.yaml": "name: j\nbudget_usd: 10\nwork_gpu_hours: 5\napp: " + "[" * 3000 + "]" * 3000,
}


def console_script() -> str:
    """The installed `orchestrator` script (on PATH, or beside this interpreter)."""
    script = shutil.which("orchestrator") or str(Path(sys.executable).parent / "orchestrator")
    if not Path(script).exists():
        pytest.skip("the orchestrator console script is not installed (pip install -e .)")
    return script


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    # no API settings needed: submit's checks come before it talks to the API
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """Every case's process, run three at a time."""
    script = console_script()
    folder = tmp_path_factory.mktemp("cli-usage")
    for name, text in FILES.items():
        (folder / name).write_text(text)
    (folder / "binary_prices").mkdir()
    for name in ("binary_prices/prices.json", "binary.jsonl", "binary.jsonl.gz"):
        (folder / name).write_bytes(BINARY[128:] + BINARY)
    commands = {
        case: [script, *(a.replace("JOB_DIR", str(folder)) for a in args)]
        for case, (args, _) in CASES.items()
    }
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {case: pool.submit(_run, command) for case, command in commands.items()}
        yield {case: future.result() for case, future in futures.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_command_line_exits_2_with_one_error_line_and_no_traceback(
    results: dict[str, subprocess.CompletedProcess[str]], case: str
) -> None:
    proc = results[case]
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, (proc.returncode, output)
    assert "Traceback" not in output, output
    assert len(output) < MAX_OUTPUT_CHARS, output
    assert len(ERROR_LINE.findall(proc.stderr)) == 1, proc.stderr
    needle = CASES[case][1]
    assert needle in " ".join(proc.stderr.split()), (needle, proc.stderr)


def test_python_m_orchestrator_runs_the_same_entry_point() -> None:
    """`python -m orchestrator` is the console script's twin (the other tests use the script)."""
    args = ["simulate", "--bogus"]
    by_script = _run([console_script(), *args])
    by_module = _run([sys.executable, "-m", "orchestrator", *args])
    assert by_module.returncode == by_script.returncode == 2, by_module.stderr
    assert by_module.stderr.replace("python -m orchestrator", "orchestrator") == by_script.stderr


def test_a_command_that_fails_exits_1_through_the_console_script(tmp_path: Path) -> None:
    """`ledger-check` on a ledger whose charge is wrong exits 1 (`typer.Exit(1)`), as a
    script or CI reading the status needs; `main` once returned 0 for it."""
    line = {"strategy": "on-demand", "start_index": 0, "instance_id": "on-demand/0/i0",
            "instance_type": "p3.2xlarge", "zone": "us-east-1b", "market": "on-demand",
            "count": 1.0, "start": "2020-02-16T17:56:04Z", "end": "2020-02-17T13:56:04Z",
            "start_s": 1581875764.0, "end_s": 1581947764.0, "price_usd_per_hour": 3.06,
            "billed_s": 72000.0, "charged_usd": 99.0, "reason": "job-finished"}  # fmt: skip
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text(json.dumps(line) + "\n")
    proc = _run([console_script(), "ledger-check", str(ledger)])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line["charged_usd"] = 61.2  # 20 h at $3.06
    ledger.write_text(json.dumps(line) + "\n")
    assert _run([console_script(), "ledger-check", str(ledger)]).returncode == 0


def test_a_teardown_against_an_aws_that_answers_500_exits_2_with_one_line() -> None:
    """Issue #33: `deploy --teardown` against an endpoint answering HTTP 500 to everything
    (botocore retries, then gives up): one error line and its fix, no traceback."""
    import http.server
    import os
    import threading

    class Failing(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"<Error><Code>InternalError</Code></Error>")

        do_GET = do_POST  # noqa: N815

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # two attempts per call (AWS_MAX_ATTEMPTS), not botocore's nine with their backoff
    env = {
        **os.environ, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y",
        "AWS_MAX_ATTEMPTS": "2",
    }  # fmt: skip
    try:
        proc = subprocess.run(
            [console_script(), "deploy", "--teardown", "--yes", "--region", "us-east-1",
             "--endpoint-url", f"http://127.0.0.1:{server.server_port}"],
            capture_output=True, text=True, timeout=TIMEOUT_S, env=env,
        )  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output and len(ERROR_LINE.findall(proc.stderr)) == 1, output
    assert "DescribeStacks failed" in proc.stderr, output
