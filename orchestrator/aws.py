"""The one way the orchestrator makes boto3 clients, and the retry policy of every AWS call.

Retries: botocore's "adaptive" mode, `max_attempts=8` (botocore counts them as retries: up to
9 attempts per call). Adaptive is exponential backoff with jitter plus a client-side rate limit
that tightens once AWS throttles: the controller shares its account's EC2 API rate with
everything else in the account, and a call that still fails is retried by the next controller
tick (two minutes later), not by a loop of ours. Callers add no retry loop of their own.
AWS's own `AWS_MAX_ATTEMPTS` (attempts in all, 1 to 20) replaces the 8 retries where it is set:
an interactive command against an endpoint that only errors then gives up sooner.
"""

from __future__ import annotations

import os
from typing import Any

import boto3
from botocore.config import Config

RETRY_MODE = "adaptive"
RETRY_MAX_ATTEMPTS = 8
#: The most attempts `AWS_MAX_ATTEMPTS` may ask for.
MAX_ATTEMPTS_ENV_CAP = 20


def retry_config() -> Config:
    """The retry policy (module docstring), `AWS_MAX_ATTEMPTS` honoured when it is a whole
    number of attempts from 1 to `MAX_ATTEMPTS_ENV_CAP` (ignored otherwise)."""
    retries = RETRY_MAX_ATTEMPTS
    text = os.environ.get("AWS_MAX_ATTEMPTS", "").strip()
    if text.isdecimal() and text.isascii() and 1 <= int(text) <= MAX_ATTEMPTS_ENV_CAP:
        retries = int(text) - 1  # botocore's max_attempts here counts retries
    return Config(retries={"mode": RETRY_MODE, "max_attempts": retries})


def aws_client(
    service: str,
    region: str,
    *,
    endpoint_url: str | None = None,
    session: boto3.Session | None = None,
    config: Config | None = None,
) -> Any:
    """A boto3 client of `service` in `region` with `retry_config()` (`config` merged over it,
    e.g. the offline world's fail-fast timeouts); `endpoint_url` points it elsewhere than AWS
    (a moto server offline)."""
    retries = retry_config()
    merged = retries if config is None else retries.merge(config)
    return (session or boto3.Session()).client(
        service, region_name=region, endpoint_url=endpoint_url, config=merged
    )
