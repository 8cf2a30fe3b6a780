"""Between `RedisStore` and redis-py: values as JSON, replies as records, errors as the store's.

* Every value Redis holds is JSON (`enc`); a record is a hash with one JSON value per field
  (`encode_fields`), so a script can change single fields atomically.
* A reply that does not decode into its record is a `StoreError` naming the key (`decode_hash`,
  `decode_json`, `decode_event`): the data was corrupted outside the store.
* `redis_errors` turns redis-py's exceptions into `StoreUnavailableError` (not reachable) and
  `StoreError` (a refused command), never retrying.
* `redact_url` keeps passwords out of messages and logs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.exceptions
from pydantic import BaseModel, ValidationError

from orchestrator.store.errors import StoreError, StoreUnavailableError
from orchestrator.store.events import Event, parse_event

M = TypeVar("M", bound=BaseModel)


def enc(value: Any) -> str:
    """`value` as compact JSON.

    Raises:
        ValueError: it holds NaN or an infinity (JSON has neither).
    """
    return json.dumps(value, allow_nan=False, separators=(",", ":"))


def encode_fields(model: BaseModel) -> dict[str, str]:
    """One JSON document per field (so Redis can update single fields atomically)."""
    return {name: enc(value) for name, value in model.model_dump(mode="json").items()}


def flat(mapping: Mapping[str, str]) -> list[str]:
    """`{"a": "1", "b": "2"}` -> `["a", "1", "b", "2"]` (HSET's and the scripts' argument form)."""
    return [item for pair in mapping.items() for item in pair]


def pairs(flat_items: Sequence[str]) -> dict[str, str]:
    """The inverse of `flat` (HGETALL's reply inside a script's reply)."""
    return dict(zip(flat_items[::2], flat_items[1::2], strict=True))


def decode_hash(model: type[M], key: str, raw: Mapping[str, str]) -> M:
    """The record held in the hash `key` (one JSON value per field).

    Raises:
        StoreError: it is not a valid `model`.
    """
    try:
        return model.model_validate({name: json.loads(value) for name, value in raw.items()})
    except (ValueError, ValidationError) as exc:
        raise StoreError(f"corrupt {model.__name__} at {key}: {exc}") from exc


def decode_json(model: type[M], key: str, text: str) -> M:
    """The record in one JSON document read from `key` (a list item or a stream entry).

    Raises:
        StoreError: it is not a valid `model`.
    """
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        raise StoreError(f"corrupt {model.__name__} in {key}: {exc}") from exc


def decode_event(key: str, text: str) -> Event:
    """The event in one entry of the stream `key` (either stored form, see `parse_event`).

    Raises:
        StoreError: it is not an event.
    """
    try:
        return parse_event(text)
    except ValueError as exc:
        raise StoreError(f"corrupt event in {key}: {exc}") from exc


@contextmanager
def redis_errors(url: str) -> Iterator[None]:
    """Turn redis-py's exceptions into the store's (never retrying); `url` names the server.

    Raises:
        StoreUnavailableError: the connection failed or timed out.
        StoreError: Redis refused the command.
    """
    try:
        yield
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        raise StoreUnavailableError(url, str(exc) or type(exc).__name__) from exc
    except redis.exceptions.RedisError as exc:
        raise StoreError(f"Redis at {url} refused a command: {exc}") from exc


def redact_url(url: str) -> str:
    """`url` with any password replaced by `***` (in the netloc or a `password=` query)."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            host = netloc.rsplit("@", 1)[1]
            netloc = f"{parts.username or ''}:***@{host}"
        query = parts.query
        if "password=" in query:
            query_pairs = parse_qsl(query, keep_blank_values=True)
            query = urlencode([(k, "***" if k == "password" else v) for k, v in query_pairs])
        return urlunsplit(parts._replace(netloc=netloc, query=query))
    except ValueError:
        return "<unparseable Redis URL>"


def describe_client(kwargs: Mapping[str, Any]) -> str:
    """A redacted URL for a client built without one (from its connection kwargs)."""
    if "path" in kwargs:
        return f"unix://{kwargs['path']}?db={kwargs.get('db', 0)}"
    host, port, db = kwargs.get("host", "localhost"), kwargs.get("port", 6379), kwargs.get("db", 0)
    return f"redis://{host}:{port}/{db}"
