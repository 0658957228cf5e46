"""The edge as an application service over fakes (tests/fakes.py): no HTTP, no database. Each
test drives `Edge.chat` the way the route does and reads back what was recorded in the store,
what the replica was sent and what the client got."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest

from tests import builders as b
from tests.fakes import (
    FakeClock,
    FakeFleet,
    FakeIdempotency,
    FakePredictor,
    FakeReplica,
    FakeSink,
    FixedTokens,
    Script,
    sse_events,
)
from tollgate_llm.api.metrics import Metrics
from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.edge import Edge, JsonOutcome, StreamOutcome
from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.domain.control_plane.events import FallbackAllowed, PriceSet
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.quota import QuotaView
from tollgate_llm.domain.requests.decide import ExpireLease, decide
from tollgate_llm.domain.requests.events import (
    FeedbackRecorded,
    FirstTokenStreamed,
    LeaseExpired,
    LeasesRenewed,
    QuotaRefunded,
    RequestAdmitted,
    RequestCancelled,
    RequestCompleted,
    RequestDowngraded,
    RequestEstimated,
    RequestFailed,
    RequestRejected,
    RequestRouted,
)
from tollgate_llm.ledger.commands import CommandHandler, request_stream

MODEL = b.MODEL
CALLER = Caller(b.KEY, b.TENANT, "customer", "standard", "salt-acme")


OTHER = "llama-3.1-70b-2026-05"


class Harness:
    def __init__(self, *, rpm: int = 600, script: Script | None = None) -> None:
        self.control = ControlView()
        for i, event in enumerate(
            (
                b.tenant_registered(),
                b.key_issued(),
                b.price_set(effective_at=b.at(-60)),
                b.limits_set(rpm=rpm),
                b.price_set(model="llama-3.1-70b", effective_at=b.at(-60)),
            )
        ):
            stream = f"prices-{i}" if isinstance(event, PriceSet) else "tenant-acme"
            self.control.apply(b.record(event, version=i + 1, seconds=-60, stream_id=stream))
        self.clock = FakeClock(b.at(0))
        self.replica = FakeReplica("replica-1", MODEL, script)
        self.other = FakeReplica("replica-2", OTHER, script)
        self.fleet = FakeFleet(self.replica, self.other)
        self.sink = FakeSink()
        self.metrics = Metrics()
        self.metrics.models.known = frozenset(self.fleet.models())  # as the runtime sets them
        self.idempotency = FakeIdempotency()
        self.edge = Edge(
            control=self.control, quota=QuotaView(self.control.limits), fleet=self.fleet,
            events=self.sink, idempotency=self.idempotency, metrics=self.metrics,
            tokens=lambda model: FixedTokens(), edge_id="edge-1", rng=random.Random(7),
            clock=self.clock, commands=CommandHandler(self.sink.store, clock=self.clock),
        )
        self._n = 0

    async def chat(self, **body: Any) -> JsonOutcome | StreamOutcome:
        self._n += 1
        raw = orjson.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "two words"}], **body}
        )
        return await self.edge.chat(
            CALLER, raw, request_id=f"req_{self._n:032x}", idempotency_key=None, retry_count=0
        )

    def types(self, n: int | None = None) -> list[type]:
        rid = f"req_{(n or self._n):032x}"
        return [type(r.event) for r in self.sink.store.read_stream(rid)]

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels or {})


def run(test: Callable[[Harness], Awaitable[None]], **kw: Any) -> Harness:
    h = Harness(**kw)
    asyncio.run(test(h))
    return h


ENDED = [
    RequestAdmitted, RequestEstimated, RequestRouted, FirstTokenStreamed, RequestCompleted,
    QuotaRefunded,
]


def test_a_completed_request_is_recorded_billed_from_the_engine_and_answered() -> None:
    async def t(h: Harness) -> None:
        out = await h.chat(max_tokens=50)
        assert isinstance(out, JsonOutcome) and out.status == 200
        answer = orjson.loads(out.body)
        assert answer["choices"][0]["message"]["content"] == "t1 t2 t3 "
        assert answer["usage"]["completion_tokens"] == 3
        assert h.types() == ENDED
        stream = h.sink.store.read_stream(f"req_{1:032x}")
        done = next(r.event for r in stream if isinstance(r.event, RequestCompleted))
        assert (done.prompt_tokens, done.completion_tokens) == (10, 3)  # the engine's, not ours
        body, rid, salt = h.replica.requests[0]
        # the tier sets the engine priority and the tenant's salt is sent, whatever the client
        assert (body["priority"], body["max_tokens"], salt) == (1, 50, "salt-acme")
        assert rid == f"req_{1:032x}" and h.edge.in_flight == {}
        assert len(h.fleet.released) == 1

    run(t)


def test_a_quota_refusal_is_a_recorded_429_with_retry_after_and_rate_limit_headers() -> None:
    async def t(h: Harness) -> None:
        await h.chat()
        with pytest.raises(ApiError) as err:
            await h.chat()
        assert err.value.status == 429 and err.value.type == "requests"
        assert 5 <= int(err.value.headers["Retry-After"]) <= 70
        assert err.value.headers["X-RateLimit-Remaining-Requests"] == "0"
        assert h.types() == [RequestRejected]
        rejected = h.sink.store.read_stream(f"req_{2:032x}")[0].event
        assert isinstance(rejected, RequestRejected) and rejected.reason == "requests"
        assert h.replica.requests[1:] == []  # the engine never saw it

    run(t, rpm=1)


def test_a_capacity_refusal_is_a_503_that_gives_the_quota_back() -> None:
    async def t(h: Harness) -> None:
        h.fleet.full = True
        with pytest.raises(ApiError) as err:
            await h.chat()
        assert err.value.status == 503 and err.value.type == "capacity"
        assert 5 <= int(err.value.headers["Retry-After"]) <= 10
        assert h.types() == [RequestRejected]
        h.fleet.full = False
        out = await h.chat()  # the one request/min was voided, not spent
        assert isinstance(out, JsonOutcome) and out.status == 200

    run(t, rpm=1)


def test_an_unknown_model_is_a_recorded_404() -> None:
    async def t(h: Harness) -> None:
        with pytest.raises(ApiError) as err:
            await h.chat(model="nope-2026-05")
        assert err.value.status == 404 and err.value.param == "model"
        assert h.types() == [RequestRejected]

    run(t)


def test_a_replica_that_breaks_before_answering_fails_the_request_with_its_counts() -> None:
    async def t(h: Harness) -> None:
        with pytest.raises(ApiError) as err:
            await h.chat()
        assert err.value.status == 503 and err.value.code == "replica_unavailable"
        assert h.types()[-2:] == [RequestFailed, QuotaRefunded]
        assert h.edge.in_flight == {}

    run(t, script=Script(tokens=5, fail_after=0))


def test_an_engine_error_is_recorded_by_its_codes_never_its_message() -> None:
    # vLLM's validation errors quote the input: the message reaches the client who sent it,
    # never the event log (prompts are never stored).
    canary = "CANARY-the-prompt-text"
    body = {"error": {"message": f"bad input: {canary}", "type": "BadRequestError",
                      "param": "messages", "code": 400}}

    async def t(h: Harness) -> None:
        with pytest.raises(ApiError) as err:
            await h.chat()
        assert err.value.status == 400 and canary in err.value.message
        failed = next(r.event for r in h.sink.store.read_stream(f"req_{1:032x}")
                      if isinstance(r.event, RequestFailed))
        assert canary not in failed.error
        assert failed.error == (
            "replica answered 400 (engine error type=BadRequestError code=400 param=messages)"
        )

    run(t, script=Script(http_error=(400, body)))


def test_a_stream_relays_every_chunk_then_done_and_records_the_end() -> None:
    async def t(h: Harness) -> None:
        out = await h.chat(stream=True)
        assert isinstance(out, StreamOutcome)
        frames = await sse_events(out.first, out.frames)
        assert frames[-1] == b"data: [DONE]\n\n" and len(frames) == 4
        assert h.types() == ENDED

    run(t)


def test_chunks_that_arrived_together_reach_the_client_in_fewer_writes() -> None:
    async def t(h: Harness) -> None:
        out = await h.chat(stream=True)
        assert isinstance(out, StreamOutcome)
        # The fake engine delivers its three chunks at once: what is ready is sent in one write
        # (the first still alone: it answers the status), the same events in the same order.
        writes = [out.first] + [f async for f in out.frames]
        events = [e for e in b"".join(writes).split(b"\n\n") if e]
        assert len(writes) < len(events) == 4
        assert [orjson.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:3]] == [
            "t1 ", "t2 ", "t3 "
        ]
        assert events[3] == b"data: [DONE]"

    run(t)


def test_a_client_that_leaves_mid_stream_is_cancelled_with_what_the_engine_sent() -> None:
    async def t(h: Harness) -> None:
        out = await h.chat(stream=True)
        assert isinstance(out, StreamOutcome)
        await out.frames.aclose()  # the client is gone after the first frame
        for _ in range(20):
            await asyncio.sleep(0)
        # ... and the implicit signal of a client that gave up on an answer (domain.feedback).
        assert h.types()[-3:] == [RequestCancelled, QuotaRefunded, FeedbackRecorded]
        cancel = h.sink.store.read_stream(f"req_{1:032x}")[-3].event
        assert isinstance(cancel, RequestCancelled) and cancel.engine_reported
        assert cancel.completion_tokens >= 1

    run(t, script=Script(tokens=50))


def test_a_request_the_sweeper_expired_meanwhile_ends_once() -> None:
    async def t(h: Harness) -> None:
        hold = h.replica.script.hold = asyncio.Event()
        task = asyncio.ensure_future(h.chat())
        while not h.edge.in_flight:
            await asyncio.sleep(0)
        rid = next(iter(h.edge.in_flight))
        # The edge went silent for the lease TTL: the sweeper expired the request.
        CommandHandler(h.sink.store, clock=h.clock).handle(
            rid,
            lambda state: decide(state, ExpireLease(b.at(0))),
            request_stream(h.sink.store, rid),
            tenant_id=b.TENANT,
        )
        hold.set()
        # The client does not get an answer the ledger does not know (done only when durable):
        # the request ended by its lease expiry, billed what was renewed.
        with pytest.raises(ApiError) as refused:
            await task
        assert refused.value.status == 503 and refused.value.code == "not_recorded"
        # The request has one terminal event: the edge's lost the race and was decided again on
        # the stored stream, where the request had already ended.
        types = h.types()
        assert types.count(LeaseExpired) == 1 and RequestCompleted not in types
        assert h.value("tollgate_event_append_conflicts_total") == 1.0

    run(t)


@pytest.mark.parametrize("fault", ["refuse", "lose_answer"])
def test_a_requests_end_the_store_dropped_is_sent_again_and_recorded_once(fault: str) -> None:
    """A dropped database connection under the append that ends a request (before it
    committed, or after, with the answer lost): the same batch goes again, so the request ends
    as it did, billed what the client was shown, not by lease expiry 15 s later."""

    async def t(h: Harness) -> None:
        h.sink.faults = [fault, "refuse"]  # the end's append, then its first retry
        out = await h.chat()
        assert isinstance(out, JsonOutcome) and out.status == 200
        for _ in range(500):  # two retries, 0.1 s apart, then the one that is taken
            ends = [b for b in h.sink.batches
                    if any(type(e.event) is RequestCompleted for e in b.events)]  # fmt: skip
            if ends and h.value("tollgate_event_append_retries_total") == 2.0:
                break
            await asyncio.sleep(0.01)
        types = h.types()
        assert types.count(RequestCompleted) == 1 and LeaseExpired not in types
        assert h.value("tollgate_event_append_retries_total") == 2.0
        assert h.value("tollgate_event_append_failures_total") == 0.0

    run(t)


def test_lease_renewal_is_one_event_with_every_request_in_flight() -> None:
    async def t(h: Harness) -> None:
        hold = h.replica.script.hold = asyncio.Event()
        tasks = [asyncio.ensure_future(h.chat()) for _ in range(3)]
        while len(h.edge.in_flight) < 3:
            await asyncio.sleep(0)
        h.edge.renew_leases()
        renewals = h.sink.store.read_stream("edge-edge-1")
        assert len(renewals) == 1 and isinstance(renewals[0].event, LeasesRenewed)
        assert {p.request_id for p in renewals[0].event.progress} == set(h.edge.in_flight)
        hold.set()
        await asyncio.gather(*tasks)
        h.edge.renew_leases()  # nothing in flight: no event
        assert len(h.sink.store.read_stream("edge-edge-1")) == 1

    run(t)


def test_without_consent_no_other_model_is_served_under_saturation() -> None:
    async def t(h: Harness) -> None:
        h.fleet.full_models = {MODEL}
        with pytest.raises(ApiError) as err:
            await h.chat()
        assert err.value.status == 503 and "X-Tollgate-Downgraded-From" not in err.value.headers
        assert h.types() == [RequestRejected] and h.other.requests == []

    run(t)


def test_with_consent_a_saturated_model_is_served_by_the_other_and_says_so() -> None:
    async def t(h: Harness) -> None:
        consent = FallbackAllowed(b.TENANT, "llama-3.1-8b", OTHER)
        h.control.apply(b.record(consent, version=9, stream_id="tenant-acme"))
        h.fleet.full_models = {MODEL}
        out = await h.chat()
        assert isinstance(out, JsonOutcome) and out.status == 200
        assert out.headers["X-Tollgate-Downgraded-From"] == MODEL
        assert len(h.other.requests) == 1 and h.replica.requests == []
        stream = h.sink.store.read_stream(f"req_{1:032x}")
        admitted = stream[0].event
        assert isinstance(admitted, RequestAdmitted) and admitted.model == OTHER  # billed as it
        downgrade = stream[1].event
        assert isinstance(downgrade, RequestDowngraded)
        assert (downgrade.requested_model, downgrade.served_model) == (MODEL, OTHER)
        assert downgrade.reason == "over_ceiling"
        assert h.value(
            "tollgate_requests_downgraded_total", {"requested": MODEL, "served": OTHER}
        ) == 1.0
        # the requested model's quota was given back: nothing of it is in flight
        assert h.edge.quota.kv_in_flight(b.TENANT, MODEL) == 0

    run(t)


def test_live_goodput_counts_each_outcome_against_the_tier_objective() -> None:
    async def t(h: Harness) -> None:
        await h.chat()  # completes at once on the fake: attained
        with pytest.raises(ApiError):
            await h.chat()  # the one request/min is spent: refused by quota
        labels = {"tenant": b.TENANT, "tier": "standard", "model": MODEL}
        assert h.value("tollgate_requests_attained_total", labels) == 1.0
        refused = {**labels, "outcome": "refused_quota"}
        assert h.value("tollgate_requests_not_attained_total", refused) == 1.0
        h.metrics.refresh_ratios()
        assert h.value("tollgate_slo_attainment_ratio", {"tier": "standard"}) == 1.0
        assert h.value("tollgate_goodput_ratio", {"tier": "standard"}) == 0.5

    run(t, rpm=1)


def test_a_prediction_narrows_the_reservation_never_the_engines_max_tokens() -> None:
    predictor = FakePredictor(tokens=40)

    async def t(h: Harness) -> None:
        h.edge.predictor = predictor
        await h.chat(
            max_tokens=4096,
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        )
        stream = h.sink.store.read_stream(f"req_{1:032x}")
        est = next(r.event for r in stream if isinstance(r.event, RequestEstimated))
        # the standard plan lets 4096 through; 40 is reserved
        assert (est.reserved_output_tokens, est.output_cap_tokens) == (40, 4096)
        assert est.predictor_version == "op-test" and est.message_count == 2
        assert 0 <= est.system_prompt_bucket < 64
        body, _, _ = h.replica.requests[0]
        assert body["max_tokens"] == 4096  # the answer may still be as long as asked
        shape, reserved, produced = predictor.observed[0]
        assert (shape.output_cap_tokens, shape.message_count, reserved, produced) == (
            4096, 2, 40, 3,
        )
        assert h.value("tollgate_output_predicted_total", {"tenant": b.TENANT}) == 1

    run(t)


def test_a_skipped_prediction_reserves_the_cap_and_is_counted_by_reason() -> None:
    predictor = FakePredictor(skip="little_history")

    async def t(h: Harness) -> None:
        h.edge.predictor = predictor
        await h.chat(max_tokens=300)
        est = next(
            r.event for r in h.sink.store.read_stream(f"req_{1:032x}")
            if isinstance(r.event, RequestEstimated)
        )
        assert (est.reserved_output_tokens, est.output_cap_tokens, est.predictor_version) == (
            300, 300, "",
        )
        assert est.system_prompt_bucket == -1  # no system message
        assert predictor.observed[0][1] is None  # no prediction: nothing said of coverage
        labels = {"tenant": b.TENANT, "reason": "little_history"}
        assert h.value("tollgate_output_prediction_fallbacks_total", labels) == 1

    run(t)


def test_the_system_prompt_bucket_is_keyed_by_tenant() -> None:
    from tollgate_llm.api.services.admission import system_prompt_bucket
    from tollgate_llm.api.services.chat_request import parse_chat_request

    prompts = [f"You are assistant number {i}." for i in range(40)]
    raws = [
        orjson.dumps({"model": MODEL, "messages": [{"role": "system", "content": p},
                                                   {"role": "user", "content": "hi"}]})
        for p in prompts
    ]
    other = Caller(b.KEY, "globex", "customer", "standard", "salt-globex")
    mine = [system_prompt_bucket(CALLER, parse_chat_request(r)) for r in raws]
    theirs = [system_prompt_bucket(other, parse_chat_request(r)) for r in raws]
    assert mine == [system_prompt_bucket(CALLER, parse_chat_request(r)) for r in raws]
    assert mine != theirs  # the same prompt, another tenant: another bucket


# --- done only when durable (issue 26, item 3) --------------------------------------------------


class _Held:
    """Holds the commits of the batches that carry an event of `kinds` until `release()`: the
    store is slow to commit them (or the edge dies meanwhile)."""

    def __init__(self, sink: FakeSink, *kinds: type) -> None:
        self.sink, self.kinds = sink, kinds
        self.waiting: list[tuple[Any, asyncio.Future[Any]]] = []
        for name in ("commit", "later"):
            setattr(sink, name, self._wrap(getattr(sink, name)))

    def _wrap(self, append: Callable[[Any], asyncio.Future[Any]]) -> Any:
        def held(batch: Any) -> asyncio.Future[Any]:
            if not any(isinstance(e.event, self.kinds) for e in batch.events):
                return append(batch)
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self.waiting.append((batch, future))
            return future

        return held

    def release(self) -> None:
        for batch, future in self.waiting:
            future.set_result(self.sink.store.append_many([batch])[0])
        self.waiting = []


async def _settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


def test_a_streams_last_chunk_final_usage_and_done_wait_for_its_terminal_events_commit() -> None:
    """A client never holds a complete answer the ledger does not know: the chunk with the
    finish reason, the final usage and [DONE] are sent once RequestCompleted has committed (an
    edge killed before that commit had sent a whole answer, its usage and [DONE], and was
    billed from the lease)."""

    async def t(h: Harness) -> None:
        held = _Held(h.sink, RequestCompleted)
        out = await h.chat(
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
        assert isinstance(out, StreamOutcome)
        frames = [out.first]

        async def read() -> None:
            async for frame in out.frames:
                frames.append(frame)

        reader = asyncio.ensure_future(read())
        await _settle()
        assert held.waiting, "the end is being committed"
        assert not reader.done()
        sent = b"".join(frames)
        assert b"[DONE]" not in sent and b"finish_reason\":\"stop" not in sent
        assert b"completion_tokens\":3" not in sent  # neither the final usage
        held.release()
        await reader
        assert frames[-1] == b"data: [DONE]\n\n"
        last = orjson.loads(frames[-2][6:])
        assert last["choices"][0]["finish_reason"] == "stop"
        assert last["usage"]["completion_tokens"] == 3  # (continuous usage stats asked for)
        done = next(r.event for r in h.sink.store.read_stream(f"req_{1:032x}")
                    if isinstance(r.event, RequestCompleted))  # fmt: skip
        assert (done.prompt_tokens, done.completion_tokens) == (
            last["usage"]["prompt_tokens"], last["usage"]["completion_tokens"]
        )

    run(t)


def test_a_json_body_waits_for_its_terminal_events_commit() -> None:
    async def t(h: Harness) -> None:
        held = _Held(h.sink, RequestCompleted)
        task = asyncio.ensure_future(h.chat())
        await _settle()
        assert held.waiting and not task.done()
        held.release()
        out = await task
        assert isinstance(out, JsonOutcome) and out.status == 200

    run(t)


def test_a_streams_first_token_waits_for_the_engines_prompt_count_to_commit() -> None:
    """The engine's prompt count (with its first chunk) is durable before the client sees a
    token, so an edge killed from then on is billed at least the prompt by the lease expiry."""

    async def t(h: Harness) -> None:
        held = _Held(h.sink, FirstTokenStreamed)
        task = asyncio.ensure_future(h.chat(stream=True))
        await _settle()
        assert held.waiting and not task.done()
        held.release()
        out = await task
        assert isinstance(out, StreamOutcome)
        first = next(r.event for r in h.sink.store.read_stream(f"req_{1:032x}")
                     if isinstance(r.event, FirstTokenStreamed))  # fmt: skip
        assert (first.prompt_tokens, first.cached_tokens) == (10, 4)  # the engine's
        await out.frames.aclose()

    run(t, script=Script(tokens=50, prompt_tokens=10, cached_tokens=4))


def test_an_answer_read_whole_before_a_frame_goes_commits_its_first_token_with_its_end() -> None:
    """An engine that answers at once: its whole answer is read before a frame can go, so the
    first token's event rides with the terminal event (one commit, not two), and no frame, the
    first included, is sent before that commit."""

    async def t(h: Harness) -> None:
        held = _Held(h.sink, FirstTokenStreamed, RequestCompleted)
        task = asyncio.ensure_future(h.chat(stream=True))
        await _settle()
        assert not task.done()  # not even the first frame (the status) before the commit
        [(batch, _)] = held.waiting
        assert [type(e.event) for e in batch.events] == [
            FirstTokenStreamed, RequestCompleted, QuotaRefunded
        ]
        held.release()
        out = await task
        assert isinstance(out, StreamOutcome)
        frames = await sse_events(out.first, out.frames)
        assert frames[-1] == b"data: [DONE]\n\n" and len(frames) == 4
        assert h.types() == ENDED

    run(t, script=Script(together=True))


def test_a_stream_broken_before_its_first_frame_went_sends_it_once_the_failure_commits() -> None:
    async def t(h: Harness) -> None:
        held = _Held(h.sink, FirstTokenStreamed, RequestFailed)
        task = asyncio.ensure_future(h.chat(stream=True))
        await _settle()
        assert not task.done()
        [(batch, _)] = held.waiting
        assert [type(e.event) for e in batch.events][:2] == [FirstTokenStreamed, RequestFailed]
        held.release()
        out = await task
        assert isinstance(out, StreamOutcome)
        frames = await sse_events(out.first, out.frames)
        sent = b"".join(frames)
        assert b'"t1 "' in sent and b'"t2 "' in sent and b"replica_failed" in sent
        assert frames[-1] == b"data: [DONE]\n\n"

    run(t, script=Script(tokens=5, fail_after=2, together=True))


def test_renewals_carry_only_the_streams_that_progressed_and_skip_an_idle_interval() -> None:
    """One LeasesRenewed per interval (0.1 s) with the counts that moved; an interval where
    nothing moved writes nothing; every 0.5 s all leases are renewed (a queued stream keeps its
    lease)."""

    async def t(h: Harness) -> None:
        hold = h.replica.script.hold = asyncio.Event()
        task = asyncio.ensure_future(h.chat())
        while not h.edge.in_flight:
            await asyncio.sleep(0)

        def renewals() -> list[LeasesRenewed]:
            return [r.event for r in h.sink.store.read_stream("edge-edge-1")]  # type: ignore[misc]

        h.edge.renew_leases()  # the first: every lease
        await _settle()
        assert len(renewals()) == 1 and len(renewals()[0].progress) == 1
        h.clock.advance(0.1)
        h.edge.renew_leases()  # nothing moved: nothing written
        await _settle()
        assert len(renewals()) == 1
        h.clock.advance(0.4)
        h.edge.renew_leases()  # the keep-alive: every lease again, moved or not
        await _settle()
        assert len(renewals()) == 2
        hold.set()
        await task

    run(t)
