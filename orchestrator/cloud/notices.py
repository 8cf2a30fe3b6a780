"""Spot interruption and rebalance notices: EC2's two-minute warning that it will reclaim a spot
instance (`interruption`), or that one is at elevated risk (`rebalance`).

An instance reads the warning from its metadata service (`cloud.imds.NoticeWatcher`); the
controller gets the same news as EventBridge events (`POST /v1/notices`). Both become one
`InterruptionNotice`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal, Self, get_args

from pydantic import (
    AwareDatetime,
    BaseModel,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from orchestrator.cloud.errors import MetadataError
from orchestrator.cloud.imds_wire import REBALANCE_PATH, SPOT_ACTION_PATH
from orchestrator.errors import UserError

EVENT_SOURCE = "aws.ec2"
INTERRUPTION_DETAIL_TYPE = "EC2 Spot Instance Interruption Warning"
REBALANCE_DETAIL_TYPE = "EC2 Instance Rebalance Recommendation"

NoticeKind = Literal["interruption", "rebalance"]
SpotAction = Literal["terminate", "stop", "hibernate"]
SPOT_ACTIONS: tuple[str, ...] = get_args(SpotAction)
NOTICE_KINDS: tuple[str, ...] = get_args(NoticeKind)
_DETAIL_TYPE_KINDS: dict[str, NoticeKind] = {
    INTERRUPTION_DETAIL_TYPE: "interruption",
    REBALANCE_DETAIL_TYPE: "rebalance",
}
_NOTICE_PATHS: tuple[tuple[NoticeKind, str], ...] = (
    ("interruption", SPOT_ACTION_PATH),
    ("rebalance", REBALANCE_PATH),
)
_AWARE_DATETIME: TypeAdapter[datetime] = TypeAdapter(AwareDatetime)


class NoticeFormatError(MetadataError):
    """A notice body that is not the JSON IMDS documents (`code` "MalformedNotice")."""


class InvalidEventError(UserError):
    """An EventBridge event that is not an EC2 spot interruption or rebalance event."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(
            message,
            field=field,
            fix=(
                f"route only source {EVENT_SOURCE!r} events with detail-type "
                f"{INTERRUPTION_DETAIL_TYPE!r} or {REBALANCE_DETAIL_TYPE!r} here, unmodified."
            ),
        )


class InterruptionNotice(BaseModel, frozen=True, extra="forbid"):
    """EC2's warning that an instance will be reclaimed (`interruption`) or is at elevated risk
    of it (`rebalance`).

    `notice_time` is the instant the notice names, in UTC: for an IMDS interruption, when the
    action will happen (`time`); for an IMDS rebalance, when it was issued (`noticeTime`); for an
    EventBridge event, when the event was emitted (`time`, about two minutes before the action).
    `received_at_s` is the receiver's wall clock (epoch seconds) when the notice arrived.
    `action` is set for interruptions and None for rebalance recommendations.
    """

    instance_id: str = Field(min_length=1)
    kind: NoticeKind
    action: SpotAction | None
    notice_time: AwareDatetime
    received_at_s: float

    @field_validator("notice_time")
    @classmethod
    def _to_utc(cls, value: datetime) -> datetime:
        return value.astimezone(UTC)

    @model_validator(mode="after")
    def _action_matches_kind(self) -> Self:
        if self.kind == "interruption" and self.action is None:
            raise ValueError("an interruption notice needs an action (terminate/stop/hibernate)")
        if self.kind == "rebalance" and self.action is not None:
            raise ValueError(f"a rebalance notice has no action, got {self.action!r}")
        return self

    @property
    def dedupe_key(self) -> tuple[NoticeKind, datetime]:
        """Two notices with the same key are the same notice served twice."""
        return (self.kind, self.notice_time)

    @classmethod
    def from_imds(
        cls, instance_id: str, path_kind: NoticeKind, body: str | bytes, received_at_s: float
    ) -> InterruptionNotice:
        """Parse the 200 body of the instance-action (`interruption`) or rebalance path.

        Raises:
            NoticeFormatError: the body is not JSON of the documented shape (the service, not
                the caller, is at fault; the watcher logs it and retries at the next poll).
            ValueError: `path_kind` is not "interruption" or "rebalance".
        """
        if path_kind not in NOTICE_KINDS:
            raise ValueError(f"path_kind must be one of {NOTICE_KINDS}, got {path_kind!r}")
        path = SPOT_ACTION_PATH if path_kind == "interruption" else REBALANCE_PATH
        text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise _format_error(path, f"not JSON ({exc}): {text[:200]!r}") from exc
        if not isinstance(data, dict):
            raise _format_error(path, f"expected a JSON object, got {text[:200]!r}")
        if path_kind == "interruption":
            action, when = data.get("action"), data.get("time")
        else:
            action, when = None, data.get("noticeTime")
        try:
            return cls(
                instance_id=instance_id,
                kind=path_kind,
                action=action,
                notice_time=when,
                received_at_s=received_at_s,
            )
        except ValidationError as exc:
            raise _format_error(path, f"{_first_error(exc)} in {text[:200]!r}") from exc

    @classmethod
    def from_eventbridge(cls, event: Mapping[str, Any], received_at_s: float) -> InterruptionNotice:
        """Parse an "EC2 Spot Instance Interruption Warning" or "EC2 Instance Rebalance
        Recommendation" EventBridge event.

        Raises:
            InvalidEventError (a `UserError`): the event is of another source or detail-type, or
                misses a field; `field` names it ("source", "detail-type", "detail",
                "detail.instance-id", "detail.instance-action", "time").
        """
        if not isinstance(event, Mapping):
            raise InvalidEventError(
                f"an EventBridge event must be a JSON object, got {type(event).__name__}",
                field="event",
            )
        source = event.get("source")
        if source != EVENT_SOURCE:
            raise InvalidEventError(
                f"event field 'source' is {source!r}, expected {EVENT_SOURCE!r}", field="source"
            )
        detail_type = event.get("detail-type")
        kind = _DETAIL_TYPE_KINDS.get(detail_type) if isinstance(detail_type, str) else None
        if kind is None:
            raise InvalidEventError(
                f"event field 'detail-type' is {detail_type!r}, expected one of "
                f"{sorted(_DETAIL_TYPE_KINDS)}",
                field="detail-type",
            )
        detail = event.get("detail")
        if not isinstance(detail, Mapping):
            raise InvalidEventError(
                f"event field 'detail' is missing or not an object: {detail!r}", field="detail"
            )
        instance_id = detail.get("instance-id")
        if not isinstance(instance_id, str) or not instance_id:
            raise InvalidEventError(
                f"event field 'detail.instance-id' is missing or empty: {instance_id!r}",
                field="detail.instance-id",
            )
        action: SpotAction | None = None
        if kind == "interruption":
            raw_action = detail.get("instance-action")
            if raw_action not in SPOT_ACTIONS:
                raise InvalidEventError(
                    f"event field 'detail.instance-action' is {raw_action!r}, expected one of "
                    f"{list(SPOT_ACTIONS)}",
                    field="detail.instance-action",
                )
            action = raw_action
        try:
            when = _AWARE_DATETIME.validate_python(event.get("time"))
        except ValidationError as exc:
            raise InvalidEventError(
                f"event field 'time' is not an ISO 8601 time with a zone: {event.get('time')!r}",
                field="time",
            ) from exc
        return cls(
            instance_id=instance_id,
            kind=kind,
            action=action,
            notice_time=when,
            received_at_s=received_at_s,
        )


def _format_error(path: str, reason: str) -> NoticeFormatError:
    return NoticeFormatError(
        f"malformed notice at {path}: {reason}", code="MalformedNotice", operation=f"GET {path}"
    )


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(part) for part in err["loc"]) or "notice"
    return f"{where}: {err['msg']}"
