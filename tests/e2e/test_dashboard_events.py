"""Job-state events written by the API show their state on the dashboard, in a real browser.

The API once wrote `to_state`/`reason` where the dashboard read `state`/`message`, so a
submission and a cancel showed as "state None". Both sides now share the typed event model;
this drives a real API over a real Redis and reads the events table in headless Chromium.
"""

from __future__ import annotations

import secrets

from pydantic import SecretStr
from support.browser import body_data, chromium, have_browser, until

from orchestrator.api.app import create_app
from orchestrator.api.client import ApiClient
from orchestrator.api.serve import BackgroundServer
from orchestrator.settings import ApiSettings, Settings
from orchestrator.store import RedisStore

SPEC = {"name": "resnet", "budget_usd": 40.0, "work_gpu_hours": 20.0}


def test_state_events_from_the_api_show_their_state_in_the_events_table(redis_url: str) -> None:
    token = secrets.token_hex(16)
    store = RedisStore.connect(redis_url, namespace=f"events-{secrets.token_hex(4)}")
    settings = Settings(redis_url=redis_url, api=ApiSettings(token=SecretStr(token)))
    try:
        with BackgroundServer(create_app(store, settings, clock=lambda: 1_580_000_000.0)) as srv:
            client = ApiClient(srv.url, SecretStr(token))
            job_id = client.submit(SPEC)["job_id"]
            client.cancel(job_id)
            texts = [e["text"] for e in client.job_dashboard(job_id)["events"]]
            assert texts == ["state cancelled: cancelled by the user", "state queued: submitted"]
            if not have_browser():
                return
            driver = chromium()
            try:
                driver.get(f"{srv.url}/dashboard?token={token}#job={job_id}")  # sets the cookie
                until(lambda: body_data(driver, "job") == job_id, 20, f"the page to show {job_id}")
                rows = driver.find_elements("css selector", 'table[data-testid="events"] tbody tr')
                shown = [row.text for row in rows]
                assert len(shown) == 2, shown
                assert "state cancelled: cancelled by the user" in shown[0]
                assert "state queued: submitted" in shown[1]
                assert not any("None" in text for text in shown)
            finally:
                driver.quit()
    finally:
        store.close()
