"""Log formatting for the processes the project starts (instance agents, AgileML nodes)."""

from __future__ import annotations

import logging
import sys


class FieldsFormatter(logging.Formatter):
    """The standard format plus the record's structured fields (`extra=`) as key=value."""

    _STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = {k: v for k, v in vars(record).items() if k not in self._STANDARD}
        return text + "".join(f" {k}={v}" for k, v in fields.items())


def log_to_stderr(name: str, level: int | str = logging.INFO) -> None:
    """Send this process's logs to stderr as `<time> <level> <name> <message> key=value...`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(FieldsFormatter(f"%(asctime)s %(levelname)s {name} %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
