"""`controller.tls`: where the API's certificate comes from on a controller node."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography import x509
from pydantic import SecretStr

from orchestrator.artifacts import LocalFolder
from orchestrator.controller.tls import self_signed, with_api_tls
from orchestrator.errors import UserError
from orchestrator.settings import ApiSettings, Settings


def settings(**api: object) -> Settings:
    return Settings(api=ApiSettings(token=SecretStr("t"), **api))


def sans(pem: bytes) -> list[str]:
    cert = x509.load_pem_x509_certificate(pem)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(n.value) for n in names]


def test_no_tls_asked_leaves_the_settings_alone(tmp_path: Path) -> None:
    plain = settings()
    assert with_api_tls(plain, addresses=list, folder=tmp_path) is plain
    given = settings(tls_cert=tmp_path / "c.pem", tls_key=tmp_path / "k.pem", tls_self_signed=True)
    assert with_api_tls(given, addresses=list, folder=tmp_path) is given


def test_self_signed_is_made_once_published_and_made_again_for_a_new_address(
    tmp_path: Path,
) -> None:
    artifacts = LocalFolder(tmp_path / "artifacts")
    folder = tmp_path / "tls"
    ask = settings(tls_self_signed=True)
    got = with_api_tls(ask, addresses=lambda: ["10.0.0.5"], artifacts=artifacts, folder=folder)
    assert got.api.tls_cert == folder / "api-cert.pem" and got.api.require_tls() is not None
    first = got.api.tls_cert.read_bytes()
    assert sans(first) == ["10.0.0.5", "127.0.0.1", "localhost"]
    assert (folder / "api-key.pem").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "artifacts" / "tls" / "api-cert.pem").read_bytes() == first
    # restarted on the same node: the same certificate, which clients already trust
    with_api_tls(ask, addresses=lambda: ["10.0.0.5"], artifacts=artifacts, folder=folder)
    assert (folder / "api-cert.pem").read_bytes() == first
    # a new public address: a new certificate that names it, published again
    with_api_tls(ask, addresses=lambda: ["10.0.0.5", "3.1.2.3"], artifacts=artifacts,
                 folder=folder)  # fmt: skip
    second = (folder / "api-cert.pem").read_bytes()
    assert second != first and "3.1.2.3" in sans(second)
    assert (tmp_path / "artifacts" / "tls" / "api-cert.pem").read_bytes() == second


def test_a_certificate_from_secrets_manager_is_written_for_the_server(tmp_path: Path) -> None:
    cert, key = self_signed(["api.example.com"])
    value = json.dumps({"certificate": cert.decode(), "private_key": key.decode()})
    asked: list[str] = []

    def read(secret_id: str) -> str:
        asked.append(secret_id)
        return value

    got = with_api_tls(settings(tls_secret="arn:tls", tls_self_signed=True), addresses=list,
                       folder=tmp_path, read_secret=read)  # fmt: skip
    assert asked == ["arn:tls"]
    assert got.api.tls_cert is not None and got.api.tls_cert.read_bytes() == cert
    assert got.api.tls_key is not None and got.api.tls_key.read_bytes() == key


@pytest.mark.parametrize(
    "value", ["not json", "[]", '{"certificate": "x"}', '{"certificate": 1, "private_key": 2}',
              '{"certificate": "-----BEGIN CERTIFICATE-----", "private_key": "k"}'],
)  # fmt: skip
def test_a_secret_that_is_not_a_certificate_and_key_is_refused_by_name(
    tmp_path: Path, value: str
) -> None:
    with pytest.raises(UserError) as refused:
        with_api_tls(settings(tls_secret="arn:tls"), addresses=list, folder=tmp_path,
                     read_secret=lambda _: value)  # fmt: skip
    assert refused.value.field == "ORCHESTRATOR_API__TLS_SECRET"
    assert "arn:tls" in refused.value.message
    assert not (tmp_path / "api-key.pem").exists()
