"""The batch runner shares its slots between tenants (issue 27, item 2): one tenant's batch
whose items the edge keeps refusing neither takes the slots nor pauses another tenant's batch,
and an item whose request cannot be sent (an integer no JSON encoder here can write, a newline
or non-ASCII in its custom_id) ends alone instead of stalling its batch. The edge is an
in-memory HTTP transport that answers per tenant; the runner is driven pass by pass, so the
figures do not depend on timing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import orjson
import pytest
import sqlalchemy as sa

from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.batch_service import BatchService
from tollgate_llm.domain.batches.files import parse_input
from tollgate_llm.ledger.batches import BatchStore, StoredFile
from tollgate_llm.ledger.commands import CommandHandler, batch_stream_loader
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.ids import utcnow
from tollgate_llm.ledger.schema import upgrade
from tollgate_llm.ledger.store import SqlEventStore
from tollgate_llm.streams.batch_runner import BatchRunner

MODEL = "llama-3.1-8b-2026-05"


@pytest.fixture
def engine(sqlite_url: str) -> Iterator[sa.Engine]:
    upgrade(sqlite_url)
    engine = create_engine_from_url(sqlite_url)
    yield engine
    engine.dispose()


def _line(custom_id: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body},
    }  # fmt: skip


def _batch(
    service: BatchService, files: BatchStore, tenant: str, lines: list[dict[str, Any]]
) -> str:
    caller = Caller(f"key-{tenant}", tenant, "customer", "standard", "salt")
    content = b"\n".join(json.dumps(line).encode() for line in lines) + b"\n"
    now = utcnow()
    file_id = f"file-{tenant}-{len(lines)}"
    files.put_file(
        StoredFile(file_id, tenant, "batch", "in.jsonl", len(content), now, now), content
    )
    files.set_expiry(file_id, now.replace(year=now.year + 1))
    created = service.create(
        caller, orjson.dumps({"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                              "completion_window": "24h"}),
    )  # fmt: skip
    return str(created["id"])


class Edge:
    """Refuses every item of `refused_tenant` (429, as a tenant over its quota is), answers the
    others 200; counts what it was sent, per key."""

    def __init__(self, refused_key: str) -> None:
        self.refused_key = refused_key
        self.sent: dict[str, int] = {}
        self.headers: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        key = request.headers["x-tollgate-on-behalf-of"]
        self.sent[key] = self.sent.get(key, 0) + 1
        self.headers.append(request.headers["x-tollgate-batch-item"])
        if key == self.refused_key:
            return httpx.Response(429, json={"error": {"message": "over quota"}})
        rid = f"req_{self.sent[key]}"
        return httpx.Response(200, json={"id": rid, "choices": []}, headers={"x-request-id": rid})


def _passes(runner: BatchRunner, edge: Edge, n: int) -> None:
    async def run() -> None:
        transport = httpx.MockTransport(edge)
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
            for _ in range(n):
                await runner.tick(client)
                running = [t for ts in runner._inflight.values() for t in ts.values()]
                await asyncio.gather(*running, return_exceptions=True)

    asyncio.run(run())


def test_a_tenant_whose_items_keep_failing_neither_takes_nor_pauses_anothers_slots(
    engine: sa.Engine,
) -> None:
    store = SqlEventStore(engine)
    files = BatchStore(engine)
    service = BatchService(files, store, CommandHandler(store))
    # The refused tenant's batch is the older one and has more items than there are slots.
    stuck = _batch(service, files, "tenant-a", [_line(f"a-{i}") for i in range(20)])
    quick = _batch(service, files, "tenant-b", [_line("b-1"), _line("b-2")])
    edge = Edge(refused_key="key-tenant-a")
    runner = BatchRunner(engine, store, edge_url="http://edge", token="t", concurrency=4)

    _passes(runner, edge, 3)

    state, _ = batch_stream_loader(store, quick)()
    assert state.status == "completed", state.status
    assert edge.sent["key-tenant-b"] == 2
    # Tenant a was sent at most half the slots of the first pass, then backed off alone.
    assert 1 <= edge.sent["key-tenant-a"] <= 2
    stuck_state, _ = batch_stream_loader(store, stuck)()
    assert stuck_state.status == "in_progress" and not stuck_state.finished


def test_an_item_that_cannot_be_sent_ends_alone(engine: sa.Engine) -> None:
    """Uploads refuse such a line now (domain/batches/); a batch stored before that rule, or any
    body the encoder refuses, still ends its one item rather than stalling the batch."""
    store = SqlEventStore(engine)
    files = BatchStore(engine)
    service = BatchService(files, store, CommandHandler(store))
    batch_id = _batch(service, files, "tenant-c", [_line("fine-1"), _line("big"), _line("fine-2")])
    edge = Edge(refused_key="nobody")
    runner = BatchRunner(engine, store, edge_url="http://edge", token="t", concurrency=8)
    # As an older version parsed it: an integer beyond 64 bits, which JSON allows.
    lines = parse_input(files.content("tenant-c", _input_file(store, batch_id), utcnow()) or b"")
    runner._inputs[batch_id] = [
        replace(x, body={**x.body, "seed": 2**70}) if x.custom_id == "big" else x for x in lines
    ]

    _passes(runner, edge, 3)

    state, _ = batch_stream_loader(store, batch_id)()
    assert state.status == "completed"
    assert edge.sent["key-tenant-c"] == 2  # the unsendable item was never sent
    # The error file names the item and why; the output file holds the two that ran.
    error = files.content("tenant-c", str(state.error_file_id), utcnow())
    assert error is not None
    (entry,) = [json.loads(x) for x in bytes(error).splitlines()]
    assert entry["custom_id"] == "big"
    assert entry["response"]["body"]["error"]["code"] == "unsendable_request"


def test_a_custom_id_is_percent_encoded_in_the_header(engine: sa.Engine) -> None:
    store = SqlEventStore(engine)
    files = BatchStore(engine)
    service = BatchService(files, store, CommandHandler(store))
    batch_id = _batch(service, files, "tenant-d", [_line("a b/c%d")])
    edge = Edge(refused_key="nobody")
    runner = BatchRunner(engine, store, edge_url="http://edge", token="t")

    _passes(runner, edge, 3)

    state, _ = batch_stream_loader(store, batch_id)()
    assert state.status == "completed"
    assert edge.headers == [f"{batch_id}/a%20b%2Fc%25d"]


def _input_file(store: SqlEventStore, batch_id: str) -> str:
    state, _ = batch_stream_loader(store, batch_id)()
    return state.input_file_id
