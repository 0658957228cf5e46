"""`--log-format json` (api/logs.py): every record one line of JSON with its time, level,
logger and message, the request's ids when the call passed them, and the traceback when there
is one."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from tollgate_llm.api.logs import QUIET_LOGGERS, JsonFormatter, setup_logging


@pytest.fixture
def logged() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("tollgate.test-logs")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield logger, out
    finally:
        logger.removeHandler(handler)
        logger.propagate = True


def lines(out: io.StringIO) -> list[dict[str, str]]:
    text = out.getvalue()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_every_record_is_one_json_object_with_its_fields(
    logged: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = logged
    before = datetime.now(UTC)
    logger.info("replica %s serving", "sim-a-0")
    logger.warning('two\nlines and a "quote"')
    logger.debug("%d items", 3)
    after = datetime.now(UTC)

    first, second, third = lines(out)
    assert first == {
        "time": first["time"],
        "level": "INFO",
        "logger": "tollgate.test-logs",
        "message": "replica sim-a-0 serving",
    }
    at = datetime.fromisoformat(first["time"])
    assert at.utcoffset() == timedelta(0)
    assert before - timedelta(milliseconds=1) <= at <= after
    assert (second["level"], second["message"]) == ("WARNING", 'two\nlines and a "quote"')
    assert (third["level"], third["message"]) == ("DEBUG", "3 items")


def test_the_ids_a_call_passes_are_carried_and_absent_ones_left_out(
    logged: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = logged
    logger.info("aborted", extra={"request_id": "req-1", "tenant_id": "acme"})
    logger.info("only the request", extra={"request_id": "req-2", "tenant_id": None})
    logger.info("none")

    with_both, with_one, without = lines(out)
    assert (with_both["request_id"], with_both["tenant_id"]) == ("req-1", "acme")
    assert with_one["request_id"] == "req-2" and "tenant_id" not in with_one
    assert not {"request_id", "tenant_id", "trace_id", "exc"} & without.keys()


def test_an_exception_is_in_the_same_line(logged: tuple[logging.Logger, io.StringIO]) -> None:
    logger, out = logged
    try:
        raise ConnectionResetError("the peer went away")
    except ConnectionResetError:
        logger.exception("sending failed", extra={"request_id": "req-3"})

    (line,) = lines(out)
    assert (line["level"], line["message"], line["request_id"]) == (
        "ERROR",
        "sending failed",
        "req-3",
    )
    assert line["exc"].startswith("Traceback (most recent call last):")
    assert line["exc"].endswith("ConnectionResetError: the peer went away")


def test_setup_keeps_http_client_request_lines_out_and_refuses_unknown_formats() -> None:
    levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    try:
        setup_logging("plain")
        for name in QUIET_LOGGERS:
            assert not logging.getLogger(name).isEnabledFor(logging.INFO), name
            assert logging.getLogger(name).isEnabledFor(logging.WARNING), name
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    with pytest.raises(ValueError, match="xml"):
        setup_logging("xml")
