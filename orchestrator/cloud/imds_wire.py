"""The IMDSv2 wire, identical on EC2 and on the offline world's `MetadataMock`:

PUT /latest/api/token  (X-aws-ec2-metadata-token-ttl-seconds: 1..21600)  -> 200 token
GET /latest/meta-data/spot/instance-action               -> 404 | {"action", "time"}
GET /latest/meta-data/events/recommendations/rebalance   -> 404 | {"noticeTime"}
GET /latest/meta-data/instance-id                        -> 200 "i-..."
GET /latest/meta-data/local-ipv4                         -> 200 "10.0.1.23"
GET /latest/meta-data/tags/instance/<key>                -> 200 value | 404
    (instance tags: only with InstanceMetadataTags enabled, as infra/ sets it)
Every GET needs X-aws-ec2-metadata-token: <token>; a missing or expired token gets 401.
"""

from __future__ import annotations

from datetime import UTC, datetime

IMDS_BASE_URL = "http://169.254.169.254"
TOKEN_PATH = "/latest/api/token"
SPOT_ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
INSTANCE_ID_PATH = "/latest/meta-data/instance-id"
LOCAL_IPV4_PATH = "/latest/meta-data/local-ipv4"
PUBLIC_IPV4_PATH = "/latest/meta-data/public-ipv4"
INSTANCE_TAG_PATH = "/latest/meta-data/tags/instance/"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
#: IMDSv2 accepts token TTLs of 1 s to 6 h and answers 400 outside that range.
MIN_TOKEN_TTL_SECONDS = 1
MAX_TOKEN_TTL_SECONDS = 21600


def iso_z(when: datetime) -> str:
    """`when` the way IMDS writes times: "2017-09-18T08:22:00Z"."""
    if when.tzinfo is None:
        raise ValueError(f"a notice time must carry a time zone, got naive {when!r}")
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
