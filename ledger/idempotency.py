"""Idempotency-Key records: the response a client asked to be replayable, kept 24 h.

This is a cache table, not an event projection: it is the one place a completion's content is
kept, and only because the client sent an Idempotency-Key to get exactly this replay. Rows expire
after 24 h and are purged. The primary key (tenant_id, idempotency_key) makes "two requests with
the same key at once" a constraint violation, answered 409, never two generations.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from tollgate_llm.ledger.schema import idempotency_records

RETENTION = timedelta(hours=24)


class IdempotencyConflict(Exception):
    """`kind` is "in_flight" (409) or "different_body" (422)."""

    def __init__(self, kind: str, request_id: str) -> None:
        super().__init__(kind)
        self.kind = kind
        self.request_id = request_id


@dataclass(frozen=True, slots=True)
class StoredResponse:
    request_id: str
    status: int
    body: bytes
    content_type: str
    headers: dict[str, str]


class IdempotencyStore:
    def __init__(self, engine: Engine, *, recent_keys: int = 100_000) -> None:
        self.engine = engine
        # Keys seen in the last 10 minutes, so a retried request can be told from a first
        # attempt even when the first attempt was refused and left no row.
        self._recent: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._recent_max = recent_keys

    def seen_recently(self, tenant_id: str, key: str | None) -> bool:
        if key is None:
            return False
        now = time.monotonic()
        k = (tenant_id, key)
        seen = self._recent.get(k)
        self._recent[k] = now
        self._recent.move_to_end(k)
        while len(self._recent) > self._recent_max:
            self._recent.popitem(last=False)
        return seen is not None and now - seen < 600

    def lookup(self, tenant_id: str, key: str, body_sha256: str) -> StoredResponse | None:
        """None when the key is new (or expired); the stored response when it is a replay."""
        t = idempotency_records
        now = datetime.now(UTC)
        with self.engine.begin() as conn:
            row = (
                conn.execute(
                    sa.select(t).where(t.c.tenant_id == tenant_id, t.c.idempotency_key == key)
                )
                .mappings()
                .first()
            )
            if row is None:
                return None
            if row["expires_at"] <= now:
                conn.execute(
                    t.delete().where(t.c.tenant_id == tenant_id, t.c.idempotency_key == key)
                )
                return None
        if row["body_sha256"] != body_sha256:
            raise IdempotencyConflict("different_body", row["request_id"])
        if row["status"] != "done":
            raise IdempotencyConflict("in_flight", row["request_id"])
        return _stored(row)

    def begin(self, tenant_id: str, key: str, request_id: str, body_sha256: str) -> None:
        now = datetime.now(UTC)
        try:
            with self.engine.begin() as conn:
                conn.execute(
                    idempotency_records.insert().values(
                        tenant_id=tenant_id,
                        idempotency_key=key,
                        request_id=request_id,
                        body_sha256=body_sha256,
                        status="in_flight",
                        response_status=None,
                        response_body=None,
                        content_type=None,
                        created_at=now,
                        expires_at=now + RETENTION,
                    )
                )
        except IntegrityError:
            raise IdempotencyConflict("in_flight", request_id) from None

    def complete(
        self,
        tenant_id: str,
        key: str,
        status: int,
        body: bytes,
        content_type: str,
        headers: dict[str, str],
    ) -> None:
        t = idempotency_records
        stored = orjson.dumps({"body": body.decode("latin-1"), "headers": headers}).decode()
        with self.engine.begin() as conn:
            conn.execute(
                t.update()
                .where(t.c.tenant_id == tenant_id, t.c.idempotency_key == key)
                .values(
                    status="done",
                    response_status=status,
                    response_body=stored,
                    content_type=content_type,
                )
            )

    def abandon(self, tenant_id: str, key: str) -> None:
        """A request that failed or was cancelled leaves nothing to replay: the key is free for
        the client's retry."""
        t = idempotency_records
        with self.engine.begin() as conn:
            conn.execute(
                t.delete().where(
                    t.c.tenant_id == tenant_id,
                    t.c.idempotency_key == key,
                    t.c.status == "in_flight",
                )
            )

    def release_request(self, request_id: str) -> int:
        """The key of a request that ended without its edge (the sweeper expired its lease: the
        edge died mid-generation) is freed like an abandoned one, so the client's retry runs
        instead of answering 409 for the key's 24 h. A completed replay is never touched."""
        t = idempotency_records
        with self.engine.begin() as conn:
            return conn.execute(
                t.delete().where(t.c.request_id == request_id, t.c.status == "in_flight")
            ).rowcount

    def done_with_prefix(self, tenant_id: str, prefix: str) -> dict[str, StoredResponse]:
        """The finished responses of `tenant_id`'s keys that start with `prefix`, by key."""
        t = idempotency_records
        query = sa.select(t).where(
            t.c.tenant_id == tenant_id,
            t.c.idempotency_key.startswith(prefix, autoescape=True),
            t.c.status == "done",
        )
        with self.engine.connect() as conn:
            rows = conn.execute(query).mappings().all()
        return {row["idempotency_key"]: _stored(row) for row in rows}

    def delete_prefixed(self, tenant_id: str, prefix: str) -> int:
        """Every record of `tenant_id` whose key starts with `prefix` (a batch's items, when the
        batch ends: the runner's keys, kept only while the batch runs)."""
        t = idempotency_records
        with self.engine.begin() as conn:
            return conn.execute(
                t.delete().where(
                    t.c.tenant_id == tenant_id,
                    t.c.idempotency_key.startswith(prefix, autoescape=True),
                )
            ).rowcount

    def purge_expired(self) -> int:
        t = idempotency_records
        with self.engine.begin() as conn:
            return conn.execute(t.delete().where(t.c.expires_at <= datetime.now(UTC))).rowcount


def _stored(row: Any) -> StoredResponse:
    stored = orjson.loads(row["response_body"])
    return StoredResponse(
        request_id=row["request_id"],
        status=row["response_status"],
        body=stored["body"].encode("latin-1"),
        content_type=row["content_type"],
        headers=stored["headers"],
    )
