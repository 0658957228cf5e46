"""The event store: the port every writer and reader uses (`port`: `EventStore`, whose docstring
is the contract, and the values that cross it), the append planning every implementation
shares (`planning`), and the SQL adapter (`sql`: SQLite and PostgreSQL, with SQLite's driver
paths in `sqlite`). The in-memory fake for unit tests lives in tests/fakes.py."""

from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.errors import (
    BadDatabaseUrl,
    EventIdConflict,
    StoreBusy,
    StoreError,
    StoreUnavailable,
    WrongExpectedVersion,
)
from tollgate_llm.ledger.store.planning import check_batch
from tollgate_llm.ledger.store.port import AppendBatch, AppendResult, EventStore, NewEvent
from tollgate_llm.ledger.store.sql import SqlEventStore
from tollgate_llm.ledger.store.sqlite import sqlite_instant, sqlite_utc

__all__ = [
    "AppendBatch",
    "AppendResult",
    "BadDatabaseUrl",
    "EventIdConflict",
    "EventStore",
    "NewEvent",
    "SqlEventStore",
    "StoreBusy",
    "StoreError",
    "StoreUnavailable",
    "WrongExpectedVersion",
    "check_batch",
    "create_engine_from_url",
    "sqlite_instant",
    "sqlite_utc",
]
