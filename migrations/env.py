"""Alembic environment: runs Tollgate's migrations on SQLite or PostgreSQL.

The URL comes from, in order: config.attributes["url"] (ledger.schema.upgrade), `-x url=...`
on the alembic command line, or the TOLLGATE_DATABASE_URL environment variable.
"""

from __future__ import annotations

import os

from alembic import context

from tollgate_llm.ledger.engine import create_engine_from_url, parse_url
from tollgate_llm.ledger.errors import BadDatabaseUrl
from tollgate_llm.ledger.schema import metadata

config = context.config


def _url() -> str:
    url = (
        config.attributes.get("url")
        or context.get_x_argument(as_dictionary=True).get("url")
        or os.environ.get("TOLLGATE_DATABASE_URL")
    )
    if not url:
        raise BadDatabaseUrl(
            "no database URL: pass -x url=..., set TOLLGATE_DATABASE_URL, or call "
            "ledger.schema.upgrade(url)"
        )
    return str(url)


def run_offline() -> None:
    context.configure(
        url=parse_url(_url()),
        target_metadata=metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    engine = create_engine_from_url(_url())
    try:
        with engine.connect() as connection:
            # SQLite cannot ALTER most things in place; batch mode rebuilds tables instead.
            context.configure(
                connection=connection,
                target_metadata=metadata,
                render_as_batch=connection.dialect.name == "sqlite",
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
