"""Idempotency-Key at the edge: the store's blocking calls moved off the event loop, and its
answers turned into what the client sees (replay, 409 in flight, 422 different body)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.api.services.retention import is_zero, not_retained
from tollgate_llm.ledger.idempotency import IdempotencyConflict, IdempotencyStore, StoredResponse


class AsyncIdempotency:
    def __init__(self, store: IdempotencyStore) -> None:
        self.store = store

    def seen_recently(self, tenant_id: str, key: str | None) -> bool:
        return self.store.seen_recently(tenant_id, key)

    async def lookup(self, tenant_id: str, key: str, body_sha256: str) -> StoredResponse | None:
        try:
            stored = await asyncio.to_thread(self.store.lookup, tenant_id, key, body_sha256)
        except IdempotencyConflict as exc:
            raise _conflict(exc, key) from None
        if stored is not None and is_zero(stored.headers):
            return not_retained(stored)
        return stored

    async def begin(self, tenant_id: str, key: str, request_id: str, body_sha256: str) -> None:
        try:
            await asyncio.to_thread(self.store.begin, tenant_id, key, request_id, body_sha256)
        except IdempotencyConflict as exc:
            raise _conflict(exc, key) from None

    async def complete(
        self, tenant_id: str, key: str, status: int, body: bytes, content_type: str,
        headers: dict[str, str],
    ) -> None:
        """Keep the finished response for a replay; a zero-retention one's (its headers say
        `X-Tollgate-Retention: zero`) without its body: a retry gets its status and request id."""
        if is_zero(headers):
            body = b""
        await asyncio.to_thread(
            self.store.complete, tenant_id, key, status, body, content_type, headers
        )

    async def abandon(self, tenant_id: str, key: str) -> None:
        await asyncio.to_thread(self.store.abandon, tenant_id, key)

    async def purge_expired(self) -> int:
        return await asyncio.to_thread(self.store.purge_expired)


def _conflict(exc: IdempotencyConflict, key: str) -> ApiError:
    if exc.kind == "different_body":
        return ApiError(
            422,
            f"Idempotency-Key {key!r} was already used with a different request body "
            f"(request {exc.request_id})",
            param="Idempotency-Key", code="idempotency_key_reused",
        )
    return ApiError(
        409,
        f"a request with Idempotency-Key {key!r} is still in flight (request {exc.request_id})",
        param="Idempotency-Key", code="idempotency_key_in_flight",
    )


async def replay_frames(body: bytes) -> AsyncIterator[bytes]:
    yield body
