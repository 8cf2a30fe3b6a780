"""The one way the orchestrator makes boto3 clients, and the retry policy of every AWS call.

Retries: botocore's "adaptive" mode, `max_attempts=8` (botocore counts them as retries: up to
9 attempts per call). Adaptive is exponential backoff with jitter plus a client-side rate limit
that tightens once AWS throttles: the controller shares its account's EC2 API rate with
everything else in the account, and a call that still fails is retried by the next controller
tick (two minutes later), not by a loop of ours. Callers add no retry loop of their own.
"""

from __future__ import annotations

from typing import Any

import boto3
from botocore.config import Config

RETRY_MODE = "adaptive"
RETRY_MAX_ATTEMPTS = 8
RETRY_CONFIG = Config(retries={"mode": RETRY_MODE, "max_attempts": RETRY_MAX_ATTEMPTS})


def aws_client(
    service: str,
    region: str,
    *,
    endpoint_url: str | None = None,
    session: boto3.Session | None = None,
    config: Config | None = None,
) -> Any:
    """A boto3 client of `service` in `region` with `RETRY_CONFIG` (`config` merged over it,
    e.g. the offline world's fail-fast timeouts); `endpoint_url` points it elsewhere than AWS
    (a moto server offline)."""
    merged = RETRY_CONFIG if config is None else RETRY_CONFIG.merge(config)
    return (session or boto3.Session()).client(
        service, region_name=region, endpoint_url=endpoint_url, config=merged
    )
