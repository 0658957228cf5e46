"""How every long-running Tollgate process logs, to stderr: `plain` (a line of text, the default)
or `json` (one object a line, for a log pipeline: `time` in ISO 8601 UTC, `level`, `logger`,
`message`, the `request_id`, `tenant_id` and `trace_id` a log call passes in its `extra`, and
`exc`, the traceback, when there is one). A process's stdout (`tollgate serve`'s banner) is
not the log.

httpx's and httpcore's own lines (one INFO line per HTTP request the batch runner sends) and
alembic's are kept to warnings and above."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import orjson

LOG_FORMATS = ("plain", "json")
PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# Carried by a log call's `extra=`, written when present.
CONTEXT_FIELDS = ("request_id", "tenant_id", "trace_id")
QUIET_LOGGERS = ("alembic", "httpx", "httpcore")


class JsonFormatter(logging.Formatter):
    """A record as one JSON object on one line (a message or a traceback with newlines in it
    stays one line: JSON escapes them)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, str] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value:
                line[name] = str(value)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(line).decode()


def setup_logging(log_format: str = "plain") -> None:
    """INFO and above of every logger to stderr in `log_format`. Like `logging.basicConfig`, it
    leaves a process whose logging is already set up (a test harness) as it is."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r}: one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(PLAIN_FORMAT)
    )
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    if log_format == "json":
        logging.captureWarnings(True)  # a Python warning too is a line of JSON, not raw text
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
