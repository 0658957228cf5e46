"""The flex class at the edge, over fakes: admitted only into idle capacity, sent with the lowest
engine priority, echoed, refused with OpenAI's flex 429, and preempted for interactive work —
ending RequestPreempted with the engine's counts, refunded in full, its client told so."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from tests.fakes import FakeIdempotency, Script, sse_events
from tests.unit.test_edge import CALLER, OTHER, Harness, run
from tollgate_llm.api.services.edge import JsonOutcome, StreamOutcome
from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.domain.backoff import FLEX_ENGINE_PRIORITY, engine_priority
from tollgate_llm.domain.requests.events import (
    QuotaRefunded,
    RequestAdmitted,
    RequestPreempted,
    RequestRejected,
)


def rid(n: int) -> str:
    return f"req_{n:032x}"


def test_a_flex_request_runs_at_the_lowest_priority_and_says_which_tier_served_it() -> None:
    async def t(h: Harness) -> None:
        out = await h.chat(service_tier="flex")
        assert isinstance(out, JsonOutcome) and out.status == 200
        assert orjson.loads(out.body)["service_tier"] == "flex"
        body = h.replica.requests[-1][0]
        assert body["priority"] == FLEX_ENGINE_PRIORITY > engine_priority("free")
        assert "service_tier" not in body  # the engine is told by priority, not by our field
        admitted = h.sink.store.read_stream(rid(1))[0].event
        assert isinstance(admitted, RequestAdmitted) and admitted.service_tier == "flex"
        out = await h.chat(service_tier="auto")
        assert isinstance(out, JsonOutcome)
        assert orjson.loads(out.body)["service_tier"] == "default"
        assert h.replica.requests[-1][0]["priority"] == engine_priority("standard")
        flex = {"model": h.replica.model, "tier": "standard", "outcome": "admitted"}
        assert h.value("tollgate_flex_requests_total", flex) == 1.0

    run(t)


def test_every_streamed_chunk_names_the_service_tier() -> None:
    async def t(h: Harness) -> None:
        out = await h.chat(service_tier="flex", stream=True)
        assert isinstance(out, StreamOutcome)
        frames = await sse_events(out.first, out.frames)
        chunks = [orjson.loads(f[6:]) for f in frames[:-1]]
        assert chunks and all(c["service_tier"] == "flex" for c in chunks)

    run(t)


def test_no_idle_capacity_for_flex_is_a_429_resource_unavailable_and_unbilled() -> None:
    async def t(h: Harness) -> None:
        h.fleet.flex_full = True
        with pytest.raises(ApiError) as err:
            await h.chat(service_tier="flex")
        exc = err.value
        assert exc.status == 429 and exc.type == "resource_unavailable"
        assert exc.code == "resource_unavailable"
        assert 5 <= int(exc.headers["Retry-After"]) <= 10
        (rejected,) = [r.event for r in h.sink.store.read_stream(rid(1))]
        assert isinstance(rejected, RequestRejected) and rejected.reason == "capacity"
        assert h.replica.requests == []
        # Interactive work is not affected.
        out = await h.chat()
        assert isinstance(out, JsonOutcome) and out.status == 200

    run(t)


def test_a_preempted_stream_ends_with_an_in_stream_error_and_is_refunded_in_full() -> None:
    async def t(h: Harness) -> None:
        h.other.script = Script(tokens=2)
        out = await h.chat(service_tier="flex", stream=True)
        assert isinstance(out, StreamOutcome)
        flex_id = rid(1)
        h.fleet.preempt_next = (flex_id,)
        interactive = await h.chat()  # the router gave it the flex request's room
        assert isinstance(interactive, JsonOutcome) and interactive.status == 200
        frames = [out.first] + [f async for f in out.frames]
        assert frames[-1] == b"data: [DONE]\n\n"
        error = orjson.loads(frames[-2][6:])["error"]
        assert error["type"] == "resource_unavailable" and error["code"] == "preempted"
        events = [r.event for r in h.sink.store.read_stream(flex_id)]
        preempted, refund = events[-2:]
        assert isinstance(preempted, RequestPreempted) and isinstance(refund, QuotaRefunded)
        assert preempted.preempted_for == rid(2) and preempted.replica_id == "replica-1"
        assert preempted.completion_tokens >= 1  # the engine's count of what it had done
        assert refund.used_tokens == 0 and refund.refunded_tokens > 0
        assert flex_id not in h.edge.in_flight
        labels = {"model": h.replica.model, "tier": "standard", "outcome": "preempted"}
        assert h.value("tollgate_flex_requests_total", labels) == 1.0

    run(t, script=Script(tokens=5_000))


def test_a_flex_request_preempted_before_its_first_token_is_a_429_preempted() -> None:
    async def t(h: Harness) -> None:
        hold = h.replica.script.hold = asyncio.Event()
        h.other.script = Script(tokens=2)
        task = asyncio.ensure_future(h.chat(service_tier="flex"))
        while not h.edge.in_flight:
            await asyncio.sleep(0)
        h.fleet.preempt_next = (rid(1),)
        await h.chat(model=OTHER)
        with pytest.raises(ApiError) as err:
            await task
        assert err.value.status == 429 and err.value.code == "preempted"
        assert err.value.type == "resource_unavailable"
        hold.set()
        types = [type(r.event) for r in h.sink.store.read_stream(rid(1))]
        assert types[-2:] == [RequestPreempted, QuotaRefunded]
        assert types.count(RequestPreempted) == 1

    run(t)


def test_an_interactive_request_is_never_preempted() -> None:
    async def t(h: Harness) -> None:
        out = await h.chat(stream=True)
        assert isinstance(out, StreamOutcome)
        h.edge.preempt((rid(1),), "req_someone_else")
        frames = [out.first] + [f async for f in out.frames]
        assert b"preempted" not in b"".join(frames)
        assert RequestPreempted not in [type(r.event) for r in h.sink.store.read_stream(rid(1))]

    run(t)


class SlowCompletion(FakeIdempotency):
    """Its completion write takes a moment, during which the test cancels the client's task."""

    def __init__(self) -> None:
        super().__init__()
        self.writing = asyncio.Event()

    async def complete(self, *args: Any) -> None:
        self.writing.set()
        await asyncio.sleep(0.01)
        await super().complete(*args)


def test_a_completed_requests_replay_is_kept_when_its_client_leaves_at_that_instant() -> None:
    # A batch item's attempt (or any client) that leaves while the edge records the replay of
    # a completed, billed request: the record must end done, never stay in flight (which would
    # answer every retry 409 for 24 h).
    async def t(h: Harness) -> None:
        slow = h.edge.idempotency = SlowCompletion()
        raw = orjson.dumps({"model": h.replica.model, "max_tokens": 5,
                            "messages": [{"role": "user", "content": "two words"}]})
        task = asyncio.ensure_future(h.edge.chat(
            CALLER, raw, request_id=rid(1), idempotency_key="item-key", retry_count=0,
        ))
        await slow.writing.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        assert slow.records[(CALLER.tenant_id, "item-key")]["status"] == "done"

    run(t)
