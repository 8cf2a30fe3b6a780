"""The learned work rates a controller announced show on the job's page, in a real browser:
the API over a real Redis, the event the controller writes (`WorkRatesEvent`), headless
Chromium reading the work-rates table."""

from __future__ import annotations

import secrets

from pydantic import SecretStr
from support.browser import body_data, chromium, have_browser, until

from orchestrator.api.app import create_app
from orchestrator.api.client import ApiClient
from orchestrator.api.serve import BackgroundServer
from orchestrator.settings import ApiSettings, Settings
from orchestrator.store import RedisStore, WorkRatesEvent
from orchestrator.store.events import LearnedRate

SPEC = {"name": "resnet", "budget_usd": 40.0, "work_gpu_hours": 20.0}
T0 = 1_580_000_000.0


def test_learned_rates_show_against_the_catalogs_on_the_jobs_page(redis_url: str) -> None:
    token = secrets.token_hex(16)
    store = RedisStore.connect(redis_url, namespace=f"rates-{secrets.token_hex(4)}")
    settings = Settings(redis_url=redis_url, api=ApiSettings(token=SecretStr(token)))
    try:
        with BackgroundServer(create_app(store, settings, clock=lambda: T0)) as srv:
            client = ApiClient(srv.url, SecretStr(token))
            job_id = client.submit(SPEC)["job_id"]
            assert client.job_dashboard(job_id)["work_rates"] == []
            v100 = LearnedRate(prior=1.0, learned=0.52, low=0.47, high=0.58, observed_hours=16.0)
            store.append_event(WorkRatesEvent(job_id=job_id, at_s=T0, rates={"V100": v100}))
            [row] = client.job_dashboard(job_id)["work_rates"]
            assert row == {"gpu_model": "V100", **v100.model_dump()}
            if not have_browser():
                return
            driver = chromium()
            try:
                driver.get(f"{srv.url}/dashboard?token={token}#job={job_id}")
                until(lambda: body_data(driver, "job") == job_id, 20, f"the page to show {job_id}")
                rows = driver.find_elements("css selector", '[data-testid="work-rates"] tbody tr')
                assert [r.text for r in rows] == ["V100 1.000 0.520 0.470–0.580 16.0"]
                assert driver.find_element("css selector", "#rates-panel").is_displayed()
            finally:
                driver.quit()
    finally:
        store.close()
