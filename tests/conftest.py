"""Shared fixtures: an empty SQLite file and an empty PostgreSQL schema per test.

PostgreSQL is never optional: if it is unreachable, tests that ask for it fail, they do not skip.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url

POSTGRES_URL = os.environ.get(
    "TOLLGATE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)

# The soak runs only in the long tier (`./dev reliability`): ten minutes is no fast test.
collect_ignore = [] if os.environ.get("TOLLGATE_RELIABILITY") == "long" else ["reliability"]


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'tollgate.db'}"


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A URL whose connections see only a fresh, uniquely named schema (via search_path), so
    tests can run migrations and write freely; the schema is dropped afterwards."""
    base = make_url(POSTGRES_URL)
    conninfo = base.set(drivername="postgresql").render_as_string(hide_password=False)
    schema = f"t_{os.getpid()}_{uuid.uuid4().hex[:12]}"
    try:
        admin = psycopg.connect(conninfo, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL is required and unreachable at {POSTGRES_URL}: {exc}")
    with admin:
        admin.execute(f'CREATE SCHEMA "{schema}"')
        try:
            yield base.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
                hide_password=False
            )
        finally:
            # A test that left a connection open in a transaction would make DROP wait forever.
            admin.execute("SET lock_timeout = '10s'")
            try:
                admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
            except psycopg.errors.LockNotAvailable:
                holders = _drop_held_schema(admin, schema)
                pytest.fail(f"connections left holding locks in {schema}: {holders}")


def _drop_held_schema(admin: psycopg.Connection[Any], schema: str) -> list[tuple[Any, ...]]:
    """Who held the schema (for the failure message), ended so the schema can still go."""
    holders = admin.execute(
        "SELECT DISTINCT a.pid, a.client_port, a.application_name, a.state, left(a.query, 80) "
        "FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE n.nspname = %s AND l.pid <> pg_backend_pid()",
        (schema,),
    ).fetchall()
    for pid, *_ in holders:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    admin.execute(f'DROP SCHEMA "{schema}" CASCADE')
    return holders


# --- the real vLLM engine (tests/vllm/engine.py) ---------------------------------------------


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One `vllm serve` on the tiny model for the whole session (a start costs 20-50 s of two
    cores). Tests that restart or crash it leave it running again when they end."""
    from tests.vllm.engine import VllmServer, engine_python, tiny_model

    python = engine_python()
    server = VllmServer(python, tiny_model(python), tmp_path_factory.mktemp("vllm") / "vllm.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_lora_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A second `vllm serve` on the tiny model, with LoRA on (tests/vllm/engine.py LORA_ARGS):
    the adapters' tier. Its own engine, so the session's keeps the configuration every other
    test measured (LoRA turns vLLM's compilation off and adds its kernels to every step)."""
    from tests.vllm.engine import LORA_ARGS, LORA_ENV, VllmServer, engine_python, tiny_model

    python = engine_python()
    server = VllmServer(
        python, tiny_model(python), tmp_path_factory.mktemp("vllm-lora") / "vllm.log",
        extra_args=LORA_ARGS, extra_env=LORA_ENV,
    )  # fmt: skip
    server.start()
    try:
        yield server
    finally:
        server.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Every test on the real engine carries the `vllm` marker (`-m "not vllm"` for a quick local
    # run; CI runs them all and a skipped one fails it).
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "vllm_server" in names or "vllm_lora_server" in names:
            item.add_marker(pytest.mark.vllm)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from tests.vllm.engine import TIMINGS

    if not TIMINGS.starts_s:
        return
    env = "built" if TIMINGS.env_built else "cached"
    starts = ", ".join(f"{s:.0f} s" for s in TIMINGS.starts_s)
    terminalreporter.write_line(
        f"vLLM tier: engine venv {env} ({TIMINGS.env_s:.0f} s), tiny model "
        f"{f'built in {TIMINGS.model_s:.0f} s' if TIMINGS.model_s else 'cached'}, "
        f"server starts {starts}"
    )


# --- the Kafka-protocol broker (streams/dev_broker.py, DESIGN.md §7) --------------------------


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One development broker for the session, on a free port. A test that restarts it (to
    lose every topic) leaves it running; each test makes its own topics."""
    from tollgate_llm.streams.dev_broker import DevBroker

    broker = DevBroker(log_path=tmp_path_factory.mktemp("kafka") / "tansu.log")
    try:
        broker.start()
    except RuntimeError as exc:
        pytest.fail(f"the Kafka-protocol broker is required and did not start: {exc}")
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def kafka_topic(kafka_broker: Any) -> str:
    """A fresh topic name (created by whoever publishes first, with the relay's partitions)."""
    return f"t{uuid.uuid4().hex[:12]}.events"
