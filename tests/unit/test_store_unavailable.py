"""Which errors mean "the store is away" (a 503 with Retry-After, never a 500):
api/services/errors.py's one mapping, used by every route."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tollgate_llm.api.services.errors import ApiError, store_unavailable
from tollgate_llm.ledger.errors import StoreBusy, StoreUnavailable, WrongExpectedVersion


def _dbapi(cls: type[sa.exc.DBAPIError], invalidated: bool = False) -> sa.exc.DBAPIError:
    return cls(
        "SELECT 1",
        None,
        Exception("server closed the connection"),
        connection_invalidated=invalidated,
    )


@pytest.mark.parametrize(
    "error",
    [
        StoreUnavailable("event store unavailable: connection refused"),
        StoreBusy("the write lock is taken"),
        _dbapi(sa.exc.OperationalError),
        _dbapi(sa.exc.InterfaceError),
        _dbapi(sa.exc.DBAPIError, invalidated=True),
        sa.exc.TimeoutError("QueuePool limit of size 10 overflow 10 reached"),
    ],
)
def test_a_store_that_is_away_is_a_503_with_retry_after(error: Exception) -> None:
    answer = store_unavailable(error)
    assert answer is not None
    assert answer.status == 503 and int(answer.headers["Retry-After"]) >= 1
    assert answer.body()["error"]["type"] == "server_error"
    assert answer.body()["error"]["code"] == "store_unavailable"


def test_one_raised_from_a_store_error_is_too() -> None:
    try:
        try:
            raise _dbapi(sa.exc.OperationalError)
        except sa.exc.OperationalError as exc:
            raise RuntimeError("reading the usage failed") from exc
    except RuntimeError as wrapped:
        assert store_unavailable(wrapped) is not None


@pytest.mark.parametrize(
    "error",
    [
        _dbapi(sa.exc.IntegrityError),  # a bug or a race, not an outage
        _dbapi(sa.exc.DBAPIError),
        WrongExpectedVersion("req_1", 2, 3),
        ValueError("no"),
    ],
)
def test_other_errors_are_not_mapped(error: Exception) -> None:
    assert store_unavailable(error) is None


def test_every_503_says_when_to_retry() -> None:
    assert ApiError(503, "the fleet is starting").headers["Retry-After"] == "2"
    assert ApiError(503, "busy", headers={"Retry-After": "7"}).headers["Retry-After"] == "7"
    assert "Retry-After" not in ApiError(400, "bad").headers
