"""The API's certificate on a controller node (`controller start`): the files the settings
name; else one from Secrets Manager (`api.tls_secret`); else, with `api.tls_self_signed` (the
AWS deployment's default), a self-signed one made for this node's addresses at the first
start, kept in `TLS_DIR` for the next starts, and published to the artifact store
(`tls/api-cert.pem`) so that users can trust it (`ORCHESTRATOR_API__CA_CERT`).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from orchestrator.artifacts import Folder
from orchestrator.errors import UserError
from orchestrator.settings import Settings

log = logging.getLogger(__name__)

TLS_DIR = Path.home() / ".local" / "share" / "orchestrator" / "tls"
CERT_FILE, KEY_FILE = "api-cert.pem", "api-key.pem"
#: Where the self-signed certificate is published: a folder of the artifact store, the file.
PUBLISHED_FOLDER, PUBLISHED_CERT = "tls", "api-cert.pem"
VALID_DAYS = 825  # the longest browsers accept
RENEW_DAYS = 30  # a kept certificate closer than this to its end is made again


def with_api_tls(
    settings: Settings,
    *,
    addresses: Callable[[], list[str]],
    artifacts: Folder | None = None,
    folder: Path = TLS_DIR,
    read_secret: Callable[[str], str] | None = None,
) -> Settings:
    """`settings` with `api.tls_cert`/`tls_key` set from the secret or a self-signed
    certificate (see the module docstring); unchanged when files are given or TLS is off.
    `addresses` gives the node's IPs or names (called only to make a certificate);
    `read_secret` reads a Secrets Manager secret.

    Raises:
        UserError: the secret cannot be read or is not the JSON it must be.
    """
    api = settings.api
    if api.tls_cert is not None or api.tls_key is not None:
        return settings
    if api.tls_secret:
        assert read_secret is not None
        cert, key = _parse_secret(api.tls_secret, read_secret(api.tls_secret))
    elif api.tls_self_signed:
        cert, key = _kept_or_new(folder, addresses)
        if artifacts is not None:
            published = artifacts.sub(PUBLISHED_FOLDER)
            published.write_bytes(PUBLISHED_CERT, cert)
            log.info("API certificate published to %s/%s", published.location, PUBLISHED_CERT)
    else:
        return settings
    cert_path, key_path = _write(folder, cert, key)
    update = {"tls_cert": cert_path, "tls_key": key_path}
    return settings.model_copy(update={"api": api.model_copy(update=update)})


def self_signed(names: list[str], *, now: datetime.datetime | None = None) -> tuple[bytes, bytes]:
    """A certificate (PEM) for `names` (IP addresses or DNS names) signed by its own new
    key, and that key (PEM)."""
    now = now or datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "orchestrator controller API")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName([_san(n) for n in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _kept_or_new(folder: Path, addresses: Callable[[], list[str]]) -> tuple[bytes, bytes]:
    """The certificate kept in `folder` if it still covers this node's names for a while;
    else a new one for them (and 127.0.0.1, localhost)."""
    names = list(dict.fromkeys([*addresses(), "127.0.0.1", "localhost"]))
    cert_path, key_path = folder / CERT_FILE, folder / KEY_FILE
    if cert_path.exists() and key_path.exists():
        cert = cert_path.read_bytes()
        if _covers(cert, names):
            return cert, key_path.read_bytes()
    log.info("making a self-signed API certificate", extra={"names": names})
    return self_signed(names)


def _covers(pem: bytes, names: list[str]) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(pem)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return False
    left = cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
    return all(_san(n) in sans for n in names) and left > datetime.timedelta(days=RENEW_DAYS)


def _parse_secret(secret_id: str, value: str) -> tuple[bytes, bytes]:
    try:
        parsed = json.loads(value)
        cert, key = parsed["certificate"], parsed["private_key"]
        if not (isinstance(cert, str) and isinstance(key, str)):
            raise TypeError("not strings")
        x509.load_pem_x509_certificate(cert.encode())
        serialization.load_pem_private_key(key.encode(), password=None)
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(
            f"the secret {secret_id} does not hold a certificate and its key ({exc})",
            fix='store JSON {"certificate": "<PEM, chain after it>", "private_key": "<PEM, '
            'unencrypted>"} in it',
            field="ORCHESTRATOR_API__TLS_SECRET",
        ) from None
    return cert.encode(), key.encode()


def _write(folder: Path, cert: bytes, key: bytes) -> tuple[Path, Path]:
    """The certificate and key as files in `folder` (this user's only); the key is written
    to a new 0600 file and moved into place, never into an older file's looser mode."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    cert_path, key_path = folder / CERT_FILE, folder / KEY_FILE
    cert_path.write_bytes(cert)
    fd, tmp = tempfile.mkstemp(prefix=".api-key.", dir=folder)  # created 0600
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(key)
        os.replace(tmp, key_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return cert_path, key_path
