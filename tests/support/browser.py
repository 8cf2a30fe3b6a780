"""Headless Chromium for the dashboard tests (Debian's chromium and chromedriver, through
selenium). `.ci/run` installs both and sets ORCHESTRATOR_REQUIRE_CHROMIUM=1, so that CI never
skips a browser check."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import pytest

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
REQUIRE_BROWSER = os.environ.get("ORCHESTRATOR_REQUIRE_CHROMIUM") == "1"


def have_browser() -> bool:
    """True when Chromium can run; fails the test when CI requires it and it is missing."""
    if CHROMIUM and CHROMEDRIVER:
        return True
    if REQUIRE_BROWSER:
        pytest.fail("chromium and chromedriver are required here (apt-get install chromium "
                    "chromium-driver)")  # fmt: skip
    return False


def chromium() -> Any:
    """A headless Chromium driver (quit it when done)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--window-size=1366,900", "--disable-dev-shm-usage"):  # fmt: skip
        options.add_argument(argument)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def body_data(driver: Any, key: str) -> str | None:
    """`document.body.dataset[key]`: the page's render state (`state`, `job`, `renderedAt`)."""
    return driver.execute_script(f"return document.body.dataset.{key} || null")


def until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Wait until `check()` holds (exceptions count as not yet), or fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except Exception:  # noqa: BLE001 - an element not rendered yet: look again
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:g} s for {what}")
        time.sleep(0.2)
