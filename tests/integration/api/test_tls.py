"""HTTPS on the API: a real uvicorn server with a self-signed certificate, reached by
`ApiClient` and by the installed CLI in a subprocess trusting it through
ORCHESTRATOR_API__CA_CERT; a client that does not trust it is told how to."""

from __future__ import annotations

import os
import secrets
import shutil
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from orchestrator.api.app import create_app
from orchestrator.api.client import ApiClient
from orchestrator.api.serve import BackgroundServer
from orchestrator.controller.tls import self_signed as make_self_signed
from orchestrator.errors import UserError
from orchestrator.settings import ApiSettings, Settings
from orchestrator.store import RedisStore

TOKEN, READ_TOKEN = secrets.token_hex(16), secrets.token_hex(16)
SPEC = {"name": "tls-job", "budget_usd": 10.0, "work_gpu_hours": 1.0}


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by its own key, as `controller start` makes one."""
    cert, key = make_self_signed(["127.0.0.1"])
    cert_path, key_path = folder / "api-cert.pem", folder / "api-key.pem"
    cert_path.write_bytes(cert)
    key_path.write_bytes(key)
    return cert_path, key_path


@pytest.fixture
def https(redis_url: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An HTTPS API server; yields its URL and its certificate."""
    cert, key = self_signed(tmp_path)
    api = ApiSettings(token=SecretStr(TOKEN), read_token=SecretStr(READ_TOKEN),
                      tls_cert=cert, tls_key=key)  # fmt: skip
    settings = Settings(redis_url=redis_url, api=api)
    store = RedisStore.connect(redis_url, namespace=f"tls-{secrets.token_hex(4)}")
    try:
        with BackgroundServer(create_app(store, settings), tls=settings.api.require_tls()) as srv:
            assert srv.url.startswith("https://")
            yield srv.url, cert
    finally:
        store.close()


def test_a_client_trusting_the_certificate_submits_and_reads_over_https(https) -> None:
    url, cert = https
    with ApiClient(url, TOKEN, ca_cert=cert) as client:
        job_id = client.submit(SPEC)["job_id"]
    with ApiClient(url, READ_TOKEN, ca_cert=cert) as reader:
        assert [j["job_id"] for j in reader.list_jobs()] == [job_id]
    # the dashboard's cookie is sent over HTTPS only
    trusting = ssl.create_default_context(cafile=cert)
    opened = httpx.get(f"{url}/dashboard", params={"token": READ_TOKEN}, verify=trusting,
                       follow_redirects=False)  # fmt: skip
    assert opened.status_code == 303 and "secure" in opened.headers["set-cookie"].lower()


def test_a_client_that_does_not_trust_the_certificate_is_told_how_to(https) -> None:
    url, _ = https
    with ApiClient(url, TOKEN) as client, pytest.raises(UserError) as refused:
        client.list_jobs()
    assert "certificate" in refused.value.message
    assert refused.value.field == "ORCHESTRATOR_API__CA_CERT"
    # plain HTTP to the HTTPS port is no answer either (no data in clear)
    with ApiClient(url.replace("https://", "http://"), TOKEN) as plain, pytest.raises(UserError):
        plain.list_jobs()


def test_the_cli_reads_over_https_with_the_read_only_token(https, tmp_path: Path) -> None:
    url, cert = https
    with ApiClient(url, TOKEN, ca_cert=cert) as client:
        job_id = client.submit(SPEC)["job_id"]
    exe = shutil.which("orchestrator")
    command = [exe] if exe else [sys.executable, "-m", "orchestrator"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
    env |= {"ORCHESTRATOR_API__URL": url, "ORCHESTRATOR_API__READ_TOKEN": READ_TOKEN,
            "ORCHESTRATOR_API__CA_CERT": str(cert)}  # fmt: skip
    listed = subprocess.run([*command, "jobs"], env=env, capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert job_id in listed.stdout
    # the read-only token cannot cancel: one clear line, no traceback
    cancel = subprocess.run([*command, "cancel", job_id], env=env, capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert cancel.returncode != 0
    assert "read-only" in cancel.stderr + cancel.stdout
    assert "Traceback" not in cancel.stderr
    untrusted = subprocess.run([*command, "jobs"], env={**env, "ORCHESTRATOR_API__CA_CERT": ""},
                               capture_output=True, text=True, timeout=60)  # fmt: skip
    assert untrusted.returncode != 0 and "ORCHESTRATOR_API__CA_CERT" in untrusted.stderr


def test_https_settings_are_checked_before_a_server_starts(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    assert ApiSettings(tls_cert=cert, tls_key=key).require_tls() == (cert, key)
    assert ApiSettings().require_tls() is None
    with pytest.raises(UserError) as half:
        ApiSettings(tls_cert=cert).require_tls()
    assert half.value.field == "ORCHESTRATOR_API__TLS_KEY"
    with pytest.raises(UserError) as missing:
        ApiSettings(tls_cert=cert, tls_key=tmp_path / "nope.pem").require_tls()
    assert missing.value.field == "ORCHESTRATOR_API__TLS_KEY"
