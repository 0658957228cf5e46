"""Test doubles that subclass or satisfy the port they replace (cosmicpython's fakes):
production code never imports this module. The event store in memory; the edge's ports
(`api/ports.py`) — a fleet of scripted replicas, an event sink over the in-memory store,
idempotency records in a dict — each keeping what it was asked, so a test can read it back."""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import orjson

from tollgate_llm.api.ports import (
    EventSink,
    Fleet,
    Idempotency,
    OutputPredictor,
    Replica,
    TokenEstimator,
)
from tollgate_llm.domain.capacity import AdapterRef, Choice, Refusal, TpotEstimate, UnknownModel
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.prediction import Prediction, RequestShape, Skip
from tollgate_llm.domain.registry import from_payload
from tollgate_llm.domain.residency import REGION_UNAVAILABLE, in_region
from tollgate_llm.engine_adapter.exchange import ChatExchange, IteratorExchange
from tollgate_llm.engine_adapter.vllm_http import ReplicaHTTPError, ReplicaStreamBroken
from tollgate_llm.ledger.errors import StoreUnavailable
from tollgate_llm.ledger.idempotency import IdempotencyConflict, StoredResponse
from tollgate_llm.ledger.store import AppendBatch, AppendResult, EventStore, NewEvent
from tollgate_llm.ledger.store.planning import Stored, finish_appends, plan_appends, prepare_batches


class InMemoryEventStore(EventStore):
    """The EventStore contract in a list and two dicts, for tests that need no database. It
    plans appends with the same code as the SQL store (ledger.store.planning), and payloads
    take the same JSON round trip as in the database, so an event that cannot be stored fails
    here too. tests/contracts/test_event_store.py runs it beside SQLite and PostgreSQL."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._log: list[Stored] = []
        self._by_id: dict[str, Stored] = {}
        self._streams: dict[str, list[Stored]] = {}

    def append(
        self, stream_id: str, expected_version: int | None, events: Sequence[NewEvent]
    ) -> list[Recorded]:
        return self.append_many([AppendBatch(stream_id, expected_version, events)])[0].unwrap()

    def append_many(self, batches: Sequence[AppendBatch]) -> list[AppendResult]:
        prepared = prepare_batches(batches)
        with self._lock:
            versions = {b.stream_id: len(self._streams.get(b.stream_id, ())) for b in batches}
            plan = plan_appends(batches, prepared, versions, self._lookup, check_ids=True)
            for s in plan.to_write:
                s.event = from_payload(s.row.type, s.row.version, orjson.loads(s.row.payload))
            results = finish_appends(plan, batches, len(self._log) + 1)
            for s in plan.to_write:
                self._log.append(s)
                self._by_id[s.row.event_id] = s
                self._streams.setdefault(s.row.stream_id, []).append(s)
            return results

    def _lookup(self, event_ids: list[str]) -> dict[str, Stored]:
        return {i: self._by_id[i] for i in event_ids if i in self._by_id}

    def read_stream(self, stream_id: str, tenant_id: str | None = None) -> list[Recorded]:
        with self._lock:
            return [s.recorded() for s in self._streams.get(stream_id, ())
                    if tenant_id is None or s.recorded().tenant_id == tenant_id]  # fmt: skip

    def read_all(
        self, after_position: int = 0, limit: int = 1000, stream_prefixes: Sequence[str] = (),
        event_types: Sequence[str] = (), known: Mapping[int, Recorded] | None = None,
    ) -> list[Recorded]:  # fmt: skip
        prefixes, types = tuple(stream_prefixes), frozenset(event_types)
        with self._lock:
            tail = self._log[max(after_position, 0) :]
            if prefixes:
                tail = [s for s in tail if s.row.stream_id.startswith(prefixes)]
            if types:
                tail = [s for s in tail if s.row.type in types]
            return [s.recorded() for s in tail[:limit]]

    def read_tail(
        self, after_position: int, limit: int, event_types: Sequence[str],
        excluding_id_suffix: str = "",
    ) -> tuple[list[Recorded], int]:  # fmt: skip
        types = frozenset(event_types)
        with self._lock:
            head = len(self._log)
            tail = [
                s for s in self._log[max(after_position, 0) :]
                if (not types or s.row.type in types)
                and not (excluding_id_suffix and s.row.event_id.endswith(excluding_id_suffix))
            ][:limit]  # fmt: skip
        out = [s.recorded() for s in tail]
        return out, (out[-1].position if len(out) >= limit else max(head, after_position))

    def read_streams_with_prefix(self, prefix: str | Sequence[str]) -> list[Recorded]:
        prefixes = (prefix,) if isinstance(prefix, str) else tuple(prefix)
        with self._lock:
            return [s.recorded() for s in self._log if s.row.stream_id.startswith(prefixes)]

    def read_streams(self, stream_ids: Sequence[str]) -> dict[str, list[Recorded]]:
        with self._lock:
            return {
                i: [s.recorded() for s in self._streams[i]]
                for i in dict.fromkeys(stream_ids)
                if i in self._streams
            }

    def read_stream_window(
        self, stream_id: str, after_position: int, before_position: int
    ) -> list[Recorded]:
        with self._lock:
            return [
                s.recorded()
                for s in self._streams.get(stream_id, ())
                if after_position < s.position < before_position
            ]

    def streams_with(
        self, event_type: str, occurred_from: datetime, occurred_to: datetime,
        tenant_id: str | None = None,
    ) -> list[str]:  # fmt: skip
        with self._lock:
            found = (
                s.row.stream_id
                for s in self._log
                if s.row.type == event_type and occurred_from <= s.row.occurred_at < occurred_to
                and (tenant_id is None or s.row.tenant_id == tenant_id)
            )
            return list(dict.fromkeys(found))

    def last_position(self) -> int:
        with self._lock:
            return len(self._log)

    def stream_version(self, stream_id: str) -> int:
        with self._lock:
            return len(self._streams.get(stream_id, ()))


class FakeClock:
    def __init__(self, start: datetime) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@dataclass
class Script:
    """What a fake replica answers: `tokens` content chunks with cumulative usage on each (as
    the adapter always asks vLLM for), then a finish; `fail_after` breaks the stream after that
    many; `hold` pauses before the first chunk until it is set; `together` sends them all
    before the gateway reads any (an engine that answers at once: one read holds the answer)."""

    tokens: int = 3
    prompt_tokens: int = 10
    cached_tokens: int = 0
    fail_after: int | None = None
    hold: asyncio.Event | None = None
    http_error: tuple[int, dict[str, Any]] | None = None  # the replica refuses: (status, body)
    together: bool = False


class FakeReplica:
    """A `Replica` (structurally: the port's `replica_id` is a read-only property, which a
    subclass could not assign; `tests/unit/port_checks.py` holds it to the port)."""

    def __init__(self, replica_id: str, model: str, script: Script | None = None) -> None:
        self.replica_id = replica_id
        self.model = model
        self.script = script or Script()
        self.requests: list[tuple[dict[str, Any], str, str]] = []  # (body, request_id, salt)
        self.traceparents: list[str | None] = []  # the W3C traceparent each was sent with

    async def open_chat(
        self, body: dict[str, Any], *, request_id: str, cache_salt: str,
        traceparent: str | None = None,
    ) -> ChatExchange:  # fmt: skip
        self.requests.append((body, request_id, cache_salt))
        self.traceparents.append(traceparent)
        return IteratorExchange(self._chunks(request_id))

    async def _chunks(self, request_id: str) -> AsyncIterator[dict[str, Any]]:
        s = self.script
        if s.hold is not None:
            await s.hold.wait()
        if s.http_error is not None:
            raise ReplicaHTTPError(*s.http_error)
        for i in range(1, s.tokens + 1):
            if s.fail_after is not None and i > s.fail_after:
                raise ReplicaStreamBroken(self._usage(i - 1), "replica died")
            yield {
                "id": f"chatcmpl-{request_id}",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": self.model,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": f"t{i} "},
                        "finish_reason": "stop" if i == s.tokens else None,
                    }
                ],
                "usage": self._usage(i),
            }
            if not s.together:
                await asyncio.sleep(0)

    def _usage(self, completion: int) -> dict[str, Any]:
        s = self.script
        return {
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": s.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
        }


class FakeFleet(Fleet):
    def __init__(self, *replicas: FakeReplica, occupancy_ppm: int = 100_000) -> None:
        self.replicas = {r.model: r for r in replicas}
        self.regions: dict[str, str] = {}  # replica id -> its region, where a test sets one
        self.occupancy_ppm = occupancy_ppm
        self.full = False  # every model refuses for capacity
        self.full_models: set[str] = set()  # these models do
        self.flex_full = False  # no idle capacity for flex work
        self.preempt_next: tuple[str, ...] = ()  # the next Choice preempts these requests
        self.preempt_remote_next: tuple[str, ...] = ()  # ... of which another edge serves these
        self.released: list[Choice[Replica]] = []
        self.contexts: dict[str, int] = {}  # a model's max_model_len, where a test sets one
        self.adapters: list[AdapterRef | None] = []  # the adapter each choice was asked for
        self._ids = itertools.count(1)

    @property
    def serves(self) -> Mapping[str, object]:
        return self.replicas

    def models(self) -> list[str]:
        return list(self.replicas)

    def choose(
        self, model: str, tier: str, est_kv_tokens: int, rng: random.Random, *,
        service_tier: str = "default", request_id: str = "",
        regions: frozenset[str] | None = None, adapter: AdapterRef | None = None,
    ) -> Choice[Replica] | Refusal | UnknownModel:
        self.adapters.append(adapter)
        replica = self.replicas.get(model)
        if replica is None:
            return UnknownModel(model)
        region = self.regions.get(replica.replica_id, "")
        if not in_region(region, regions):
            return Refusal(model, REGION_UNAVAILABLE, 0)
        if self.full or model in self.full_models:
            return Refusal(model, "over_ceiling", 850_000, 990_000)
        if service_tier == "flex" and self.flex_full:
            return Refusal(model, "over_ceiling", 500_000, 600_000)
        preempt, self.preempt_next = self.preempt_next, ()
        remote, self.preempt_remote_next = self.preempt_remote_next, ()
        return Choice(
            replica, self.occupancy_ppm, est_kv_tokens, next(self._ids), preempt, remote, region
        )

    def release(self, choice: Choice[Replica]) -> None:
        self.released.append(choice)

    def tpot_p95(self, model: str) -> TpotEstimate | None:
        return None

    def context_tokens(self, model: str) -> int | None:
        return self.contexts.get(model)


class FakeSink(EventSink):
    """Commits each batch at once to an in-memory store (the real contract: expected versions,
    idempotent event ids), answering through a future as the loop's group commit does."""

    def __init__(self, store: InMemoryEventStore | None = None) -> None:
        self.store = store or InMemoryEventStore()
        self.batches: list[AppendBatch] = []
        # The next appends to a stream that has events already (a request's end, not its
        # admission) that fail as a dropped database connection does: before the append
        # ("refuse") or after it committed, its answer lost ("lose_answer").
        self.faults: list[str] = []

    def commit(self, batch: AppendBatch) -> asyncio.Future[AppendResult]:
        return self.later(batch)

    def later(self, batch: AppendBatch) -> asyncio.Future[AppendResult]:
        if self.faults and batch.expected_version:
            fault = self.faults.pop(0)
            if fault == "lose_answer":
                self.store.append_many([batch])
            future: asyncio.Future[AppendResult] = asyncio.get_running_loop().create_future()
            future.set_exception(StoreUnavailable(f"event store unavailable ({fault})"))
            return future
        return self._append(batch)

    def _append(self, batch: AppendBatch) -> asyncio.Future[AppendResult]:
        self.batches.append(batch)
        future: asyncio.Future[AppendResult] = asyncio.get_running_loop().create_future()
        future.set_result(self.store.append_many([batch])[0])
        return future


@dataclass
class FakeIdempotency(Idempotency):
    records: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)

    def seen_recently(self, tenant_id: str, key: str | None) -> bool:
        return key is not None and (tenant_id, key) in self.records

    async def lookup(self, tenant_id: str, key: str, body_sha256: str) -> StoredResponse | None:
        record = self.records.get((tenant_id, key))
        if record is None:
            return None
        if record["body_sha256"] != body_sha256:
            raise IdempotencyConflict("different_body", record["request_id"])
        if record["status"] != "done":
            raise IdempotencyConflict("in_flight", record["request_id"])
        return StoredResponse(record["request_id"], *record["response"])

    async def begin(self, tenant_id: str, key: str, request_id: str, body_sha256: str) -> None:
        if (tenant_id, key) in self.records:
            raise IdempotencyConflict("in_flight", request_id)
        self.records[(tenant_id, key)] = {
            "request_id": request_id, "body_sha256": body_sha256, "status": "in_flight",
        }

    async def complete(
        self, tenant_id: str, key: str, status: int, body: bytes, content_type: str,
        headers: dict[str, str],
    ) -> None:
        record = self.records[(tenant_id, key)]
        record["status"] = "done"
        record["response"] = (status, body, content_type, headers)

    async def abandon(self, tenant_id: str, key: str) -> None:
        record = self.records.get((tenant_id, key))
        if record is not None and record["status"] == "in_flight":
            del self.records[(tenant_id, key)]


class FixedTokens(TokenEstimator):
    """A token estimator that counts one token per word of every message's text."""

    def prompt_tokens(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> int:
        return sum(len(str(m.get("content", "")).split()) for m in messages)


class FakePredictor(OutputPredictor):
    """An output predictor that answers `tokens` (or `skip`) and keeps what it was told."""

    def __init__(self, tokens: int = 40, *, skip: Skip | None = None) -> None:
        self.tokens = tokens
        self.skip = skip
        self.asked: list[RequestShape] = []
        self.observed: list[tuple[RequestShape, int | None, int]] = []

    def predict(self, shape: RequestShape) -> Prediction | Skip:
        self.asked.append(shape)
        return self.skip if self.skip is not None else Prediction(self.tokens, "op-test")

    def observe(
        self, shape: RequestShape, reserved_output_tokens: int | None, output_tokens: int
    ) -> None:
        self.observed.append((shape, reserved_output_tokens, output_tokens))


async def sse_events(first: bytes, frames: AsyncIterator[bytes]) -> list[bytes]:
    """A streamed answer's SSE events, whatever writes carried them (the relay sends the frames
    that are ready together, in one write)."""
    data = first + b"".join([f async for f in frames])
    return [event + b"\n\n" for event in data.split(b"\n\n") if event]
