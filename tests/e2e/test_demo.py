"""The README's main command, end to end: `orchestrator demo`, watched on its dashboard in a
real headless Chromium (Debian's chromium and chromedriver, through selenium), then shared as
a report (`orchestrator report`)."""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.browser import body_data, chromium, have_browser, until

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts"
LIVE_LAG_S = 5.0  # the dashboard shows a change within this long of the API
LIVE_ITERATIONS = 900  # about 27 s of training on a quiet 2-core machine
LIVE_SPEED = 100  # market time at 100x real time: a busy machine's slower run stays in budget
LINGER_S = 120  # the dashboard stays up for the checks after the end; then Ctrl-C stops it


@pytest.mark.slow
@pytest.mark.ci
def test_the_offline_demo_finishes_within_budget_and_its_dashboard_follows_it_live(tmp_path):
    """A longer run than the default (LIVE_ITERATIONS, at LIVE_SPEED), so that the page is
    watched while the job runs and recovers from its eviction (one by a quarter of the work,
    the trace's or injected) even on a fast machine; the browser starts first."""
    summary_path = tmp_path / "summary.json"
    driver = chromium() if have_browser() else None
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "demo", "--json-summary", str(summary_path),
         "--port", "0", "--linger", str(LINGER_S), "--iterations", str(LIVE_ITERATIONS),
         "--speed", str(LIVE_SPEED)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    lines = _lines_of(proc)
    output: list[str] = []
    try:
        url = _dashboard_url(lines, output, timeout_s=60)
        if driver is not None:
            _watch_in_chromium(driver, url, tmp_path)
        _stop_lingering(proc, lines, output, timeout_s=400)
        proc.wait(timeout=60)
    finally:
        if driver is not None:
            driver.quit()
        if proc.poll() is None:
            proc.kill()
        output += _drain(lines)
    text = "".join(output)
    assert proc.returncode == 0, text[-4000:]
    summary = json.loads(summary_path.read_text())
    assert summary["job_state"] == "succeeded"
    assert summary["spent_usd"] <= summary["budget_usd"]
    assert summary["evictions"] >= 1
    assert summary["orphans_after"] == 0
    assert summary["work_done_fraction"] == 1.0
    assert summary["wall_seconds"] < 400
    assert summary["training_iterations"] == LIVE_ITERATIONS
    # the agents trained a real model with AgileML through the evictions
    assert summary["training_iterations"] > 0
    assert summary["final_loss"] < summary["loss_at_start"]
    # the job handed its weights back: a CNN that reads digits it never trained on
    assert summary["weights_source"] == "the model at the end"
    assert summary["held_out_accuracy"] >= 0.8
    assert "Returned weights" in text
    assert any(event.startswith("evicted") for event in summary["training_events"])
    assert "Summary: job succeeded" in text
    assert "Stopped serving the dashboard." in text
    if driver is None:
        pytest.skip("the demo passed; chromium/chromedriver missing, so the dashboard was not "
                    "checked in a browser")  # fmt: skip


@pytest.mark.slow
def test_the_offline_demo_trains_a_pipeline_job_whose_stages_the_dashboard_shows(tmp_path):
    """`orchestrator demo --pipeline`: the same job as a two-stage pipeline on the spot
    instances, through the eviction (a lost stage is rebuilt on the next instance, or the job
    re-plans), within budget, no orphans; the dashboard lists the stages and their instances."""
    summary_path = tmp_path / "summary.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "demo", "--pipeline", "--json-summary",
         str(summary_path), "--port", "0", "--linger", str(LINGER_S)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    lines = _lines_of(proc)
    output: list[str] = []
    stages_seen: list[list[dict[str, Any]]] = []
    try:
        url = _dashboard_url(lines, output, timeout_s=60)
        api = url  # the dashboard link carries the read-only token
        deadline = time.monotonic() + 280
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                page = _job(api)
            except (httpx.HTTPError, ValueError):
                break  # the demo stopped serving
            if page.get("pipeline") and page["pipeline"] not in stages_seen:
                stages_seen.append(page["pipeline"])
            if page.get("job", {}).get("state") == "succeeded":
                if have_browser():
                    _see_stages_in_chromium(url, page["pipeline"])
                break
            time.sleep(1)
        _stop_lingering(proc, lines, output, timeout_s=60)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        output += _drain(lines)
    text = "".join(output)
    assert proc.returncode == 0, text[-4000:]
    summary = json.loads(summary_path.read_text())
    assert summary["parallelism"] == "pipeline"
    assert summary["job_state"] == "succeeded"
    assert summary["spent_usd"] <= summary["budget_usd"]
    assert summary["evictions"] >= 1 and summary["orphans_after"] == 0
    assert summary["training_iterations"] > 0
    assert summary["held_out_accuracy"] >= 0.8
    events = summary["training_events"]
    assert events[0].startswith("profiled ")
    assert events[1].startswith("backups on i-") and events[1].endswith("(reliable)")
    assert events[2].startswith("planned [[0, ")
    assert any(e.startswith(("replaced stage", "re-planned")) for e in events), events
    # planned on the 2 instances; a re-plan runs on those held then (after a second loss
    # without a replacement: 1 stage), and on 2 again once another registers. Every list the
    # page showed: contiguous stages over all the layers, each on an instance
    assert any(len(stages) == 2 for stages in stages_seen), stages_seen
    assert len({stages[-1]["last_layer"] for stages in stages_seen}) == 1, stages_seen
    for stages in stages_seen:
        assert stages[0]["first_layer"] == 0 and all(st["nodes"] for st in stages), stages
        pairs = zip(stages, stages[1:], strict=False)
        assert all(a["last_layer"] + 1 == b["first_layer"] for a, b in pairs), stages
    assert "pipeline iterations" in text


def _see_stages_in_chromium(url: str, stages: list[dict[str, Any]]) -> None:
    driver = chromium()
    try:
        driver.get(url)
        until(lambda: body_data(driver, "job") == "job-demo", 30, "the dashboard to show the job")
        rows = '[data-testid="pipeline"] tbody tr'
        until(lambda: len(driver.find_elements("css selector", rows)) == len(stages), 10,
              "the pipeline table to list the stages")  # fmt: skip
        panel = driver.find_element("css selector", "#pipeline-panel")
        assert panel.is_displayed()
        cells = driver.find_elements("css selector", rows + " td:last-child")
        assert [c.text for c in cells] == [", ".join(st["nodes"]) for st in stages]
    finally:
        driver.quit()


def test_demo_refuses_a_non_positive_budget():
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "demo", "--budget", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--budget" in proc.stderr and "Traceback" not in proc.stderr


# --- the browser side


def _watch_in_chromium(driver: Any, url: str, tmp_path: Path) -> None:
    """While the demo runs: the page follows the API's spend and evictions within LIVE_LAG_S.
    Once the job has ended: every number and chart matches the API; a screenshot is saved; the
    report of the job renders the same."""
    api = url  # the dashboard link carries the read-only token
    driver.get(url)
    until(lambda: body_data(driver, "state") == "ready"
          and body_data(driver, "job") == "job-demo",
          30, "the dashboard to show job-demo")  # fmt: skip
    _assert_follows_live(driver, api)
    until(lambda: _job(api)["job"]["state"] not in ("queued", "running"), 360, "the job to end")
    # the evaluation of the model at the end comes in the ended job's last report, just after
    until(lambda: _end_evaluated(_job(api)), 60, "the end's evaluation to be reported")
    final = _job(api)
    assert final["job"]["state"] == "succeeded", final["job"]
    until(lambda: float(body_data(driver, "renderedAt") or 0) >= final["now_s"], 10,
           "the page to render the ended job")  # fmt: skip
    final = _job(api)  # the clock moves on; the numbers of an ended job do not
    _assert_page_matches(driver, final, _fleet(api))
    ARTIFACTS.mkdir(exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / "dashboard-demo.png"))
    report = tmp_path / "report.html"
    cli = subprocess.run(
        [sys.executable, "-m", "orchestrator", "report", "job-demo", "--api", _base(api),
         "--token", _read_token(api), "--out", str(report)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stdout + cli.stderr
    html = report.read_text()
    assert 'src="static/' not in html and 'href="static/' not in html  # self-contained
    driver.get(report.as_uri())
    until(lambda: body_data(driver, "state") == "ready", 10, "the report to render")
    _assert_page_matches(driver, _job(api), _fleet(api))
    driver.save_screenshot(str(ARTIFACTS / "report-demo.png"))


def _end_evaluated(data: dict[str, Any]) -> bool:
    """Whether the newest report's evaluation, if any, is of the model after its iteration."""
    last = data["training"][-1] if data["training"] else None
    evaluation = last and last["evaluation"]
    return not evaluation or evaluation["iteration"] == last["iteration"]


def _assert_follows_live(driver: Any, api: str) -> None:
    """Each time the API shows more spend or a new eviction, the page shows it too within
    LIVE_LAG_S (until the job ends or both were seen after an eviction)."""
    seen_eviction = False
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not seen_eviction:
        data = _job(api)
        job = data["job"]
        if job["state"] not in ("queued", "running"):
            break
        at = time.monotonic()
        until(lambda job=job: _value(driver, "spent") >= job["spent_usd"] - 1e-9, LIVE_LAG_S,
               f"the page to show spend ${job['spent_usd']:.4f}")  # fmt: skip
        if job["evictions"] >= 1:
            until(lambda job=job: _value(driver, "evictions") >= job["evictions"], LIVE_LAG_S,
                   f"the page to show {job['evictions']} evictions")  # fmt: skip
            marks = len(driver.find_elements("css selector", '[data-testid="eviction-mark"]'))
            assert marks >= job["evictions"]
            seen_eviction = True
        assert time.monotonic() - at <= LIVE_LAG_S + 1
        time.sleep(0.5)
    assert seen_eviction, "the demo ended before the page showed an eviction"


def _assert_page_matches(driver: Any, data: dict[str, Any], fleet: dict[str, Any]) -> None:
    job = data["job"]

    def count(selector: str) -> int:
        return len(driver.find_elements("css selector", selector))

    assert driver.find_element("css selector", '[data-testid="job-id"]').text == "job-demo"
    # the held-out accuracy during training (`eval_every`), one point per evaluation
    evaluated = {r["evaluation"]["iteration"] for r in data["training"] if r["evaluation"]}
    assert evaluated and job["evaluation"] is not None, data["training"][-3:]
    assert count("circle.evaluation") == len(evaluated)
    for testid, value in [
        ("spent", job["spent_usd"]),
        ("budget", job["budget_usd"]),
        ("projected", job["projected_cost_usd"]),
        ("cost-per-work", job["cost_per_work_usd"]),
        ("evictions", job["evictions"]),
        ("nodes-reliable", job["nodes_alive"]["reliable"]),
        ("nodes-transient", job["nodes_alive"]["transient"]),
        ("iterations", job["iterations"]),
        ("loss", job["loss"]),
    ]:
        if value is None:
            assert _raw(driver, testid) == "", testid
        else:
            assert _value(driver, testid) == pytest.approx(value, rel=1e-9), testid
    evictions = [m for m in data["marks"] if m["kind"] == "eviction"]
    failures = [m for m in data["marks"] if m["kind"] == "launch_failed"]
    assert count('[data-testid="eviction-mark"]') == len(evictions) >= 1
    assert count('[data-testid="failure-mark"]') == len(failures)
    assert count('rect[data-testid="node-bar"]') == len(data["nodes"]) >= 2
    assert count('rect[data-testid="node-bar"][data-tier="reliable"]') == sum(
        n["tier"] == "reliable" for n in data["nodes"]
    )
    assert count('path[data-series="price"]') == len(data["prices"]) >= 1
    assert count('path[data-series="price"][data-held="true"]') == sum(
        p["held"] for p in data["prices"]
    )
    for series in ("spent", "budget", "cost-per-work", "loss"):
        assert count(f'path[data-series="{series}"]') == 1, series
    assert count('table[data-testid="fleet"] tr[data-job]') == len(fleet["jobs"])
    assert count('table[data-testid="events"] tbody tr') == len(data["events"])


def _raw(driver: Any, testid: str) -> str:
    element = driver.find_element("css selector", f'[data-testid="{testid}"]')
    return element.get_attribute("data-value") or ""


def _value(driver: Any, testid: str) -> float:
    raw = _raw(driver, testid)
    return float(raw) if raw else float("nan")


def _base(link: str) -> str:
    """The API's URL, from the dashboard's link."""
    return link.split("/dashboard")[0]


def _read_token(link: str) -> str:
    """The read-only token in the dashboard's link."""
    return link.split("?token=")[1]


def _get(link: str, path: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {_read_token(link)}"}
    return httpx.get(f"{_base(link)}{path}", headers=headers, timeout=10).json()


def _job(link: str) -> dict[str, Any]:
    return _get(link, "/v1/jobs/job-demo/dashboard")


def _fleet(link: str) -> dict[str, Any]:
    return _get(link, "/v1/dashboard")


# --- the demo's output


def _lines_of(proc: subprocess.Popen[str]) -> queue.Queue[str | None]:
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _read_until(
    lines: queue.Queue[str | None],
    output: list[str],
    timeout_s: float,
    what: str,
    want: Callable[[str], str | None],
) -> str | None:
    """The demo's lines into `output` until `want(line)` gives a value (returned), or None
    once the output has ended; AssertionError naming `what` past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            lines.put(None)  # for `_drain`
            return None
        output.append(line)
        if (found := want(line)) is not None:
            return found
    raise AssertionError(f"no {what} in {timeout_s:g} s:\n" + "".join(output)[-3000:])


def _dashboard_url(lines: queue.Queue[str | None], output: list[str], timeout_s: float) -> str:
    def url(line: str) -> str | None:
        match = re.search(r"Dashboard: (http://\S+/dashboard\?token=\w+)", line)
        return match.group(1) if match else None

    found = _read_until(lines, output, timeout_s, "dashboard URL", url)
    assert found is not None, "the demo ended without a dashboard URL:\n" + "".join(output)[-3000:]
    return found


def _stop_lingering(
    proc: subprocess.Popen[str], lines: queue.Queue[str | None], output: list[str], timeout_s: float
) -> None:
    """Once the demo serves its dashboard on after the end (`--linger`), Ctrl-C (SIGINT) stops
    it, as a user would (the summary follows); if the demo ended first, nothing to stop."""

    def serving(line: str) -> str | None:
        return line if "Serving the dashboard" in line else None

    if _read_until(lines, output, timeout_s, "linger", serving) is not None:
        proc.send_signal(signal.SIGINT)


def _drain(lines: queue.Queue[str | None]) -> list[str]:
    rest = []
    while True:
        try:
            line = lines.get(timeout=5)
        except queue.Empty:
            return rest
        if line is None:
            return rest
        rest.append(line)
