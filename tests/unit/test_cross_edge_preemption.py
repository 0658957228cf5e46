"""Preemption across edges: an edge that needs the KV of flex work another edge serves asks for
it on the flex request's stream (`AskToPreempt` → `PreemptionRequested`), and the serving edge,
following the log, preempts it as its own router would. The ask is idempotent, changes nothing
once the request ended, and never makes a second terminal."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import orjson

from tests import builders as b
from tests.builders import given
from tests.fakes import InMemoryEventStore, Script
from tests.unit.test_edge import MODEL, Harness, run
from tollgate_llm.api.services.edge import JsonOutcome, StreamOutcome
from tollgate_llm.domain.capacity import Choice, Refusal
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.remote_flex import RemoteFlex, routes, routes_to_read
from tollgate_llm.domain.requests.decide import AskToPreempt, PreemptRequest, decide
from tollgate_llm.domain.requests.events import (
    TERMINAL_TYPES,
    PreemptionRequested,
    QuotaRefunded,
    RequestCompleted,
    RequestPreempted,
)
from tollgate_llm.engine_adapter.fleet import Fleet
from tollgate_llm.engine_adapter.vllm_http import ReplicaMetrics, VLLMReplica
from tollgate_llm.ledger.commands import CommandHandler, request_stream
from tollgate_llm.ledger.store import NewEvent

FLEX_ROUTED = (b.admitted(service_tier="flex", edge_id="edge-b"), b.estimated(), b.routed())
ASKED = PreemptionRequested(b.RID, "edge-a", "req-interactive", "replica-1")


def ask(**kw: object) -> AskToPreempt:
    return replace(AskToPreempt("edge-a", "req-interactive", "replica-1"), **kw)  # type: ignore[arg-type]


# --- the rule: AskToPreempt on the request stream -------------------------------------------


def test_an_ask_for_a_flex_request_is_recorded_on_its_stream() -> None:
    state = given(*FLEX_ROUTED).when(ask()).then(ASKED)
    assert state.preemption_requested_by == "edge-a"
    assert state.preemption_requested_for == "req-interactive"
    assert state.status == "routed" and not state.is_terminal  # its own edge ends it


def test_a_second_ask_records_nothing_the_first_stands() -> None:
    given(*FLEX_ROUTED, ASKED).when(ask(requested_by="edge-c", preempted_for="req-x")).then()


def test_an_ask_for_a_request_that_ended_changes_nothing() -> None:
    ended = (*FLEX_ROUTED, b.first_token(), b.completed(), b.refunded())
    given(*ended).when(ask()).then()
    preempted = RequestPreempted(b.RID, 812, 40, 0, "replica-1", "req-other")
    given(*FLEX_ROUTED, preempted, b.refunded()).when(ask()).then()


def test_only_flex_work_may_be_asked_for_and_only_where_it_runs() -> None:
    given(b.admitted(), b.estimated(), b.routed()).when(ask()).then_refused("not_preemptible")
    given(*FLEX_ROUTED).when(ask(replica_id="replica-9")).then_refused("not_on_replica")
    given().when(ask()).then_refused("not_admitted")
    given(*FLEX_ROUTED).when(ask(requested_by="")).then_refused("missing_field")


def test_an_asked_request_ends_once_preempted_refunded_in_full() -> None:
    state = given(*FLEX_ROUTED, ASKED).when(
        PreemptRequest(812, 40, 0, "replica-1", "req-interactive")
    ).then(
        RequestPreempted(b.RID, 812, 40, 0, "replica-1", "req-interactive"),
        QuotaRefunded(b.RID, refunded_tokens=1800, refunded_kv_byte_seconds=10 * 2**30,
                      used_tokens=0),
    )  # fmt: skip
    assert state.status == "preempted"
    done = (*FLEX_ROUTED, ASKED, RequestPreempted(b.RID, 812, 40, 0, "replica-1", "i"))
    given(*done).when(b.complete()).then_refused("second_terminal")


def test_an_asked_request_that_finished_first_completes_and_is_billed_as_usual() -> None:
    # Its edge's completion lost the version race to the ask, and is decided again on the
    # stored stream: the ask does not stop a request that is done.
    state = given(*FLEX_ROUTED, b.first_token(), ASKED).when(b.complete()).then(
        b.completed(), b.refunded(refunded_tokens=688, used_tokens=1112),
    )
    assert state.status == "completed"


# --- idempotent through the command handler, at the version folded ---------------------------


def _stored(store: InMemoryEventStore, *events: object) -> None:
    new = [NewEvent(f"e{i}", b.RID, b.TENANT, b.at(i), e) for i, e in enumerate(events)]  # type: ignore[arg-type]
    store.append(b.RID, 0, new)


def _ask_from(store: InMemoryEventStore, edge: str) -> int:
    handled = CommandHandler(store).handle(
        b.RID, lambda state: decide(state, ask(requested_by=edge)),
        request_stream(store, b.RID), tenant_id=b.TENANT,
    )  # fmt: skip
    return len(handled.events)


def test_two_edges_asking_for_the_same_request_record_one_ask() -> None:
    store = InMemoryEventStore()
    _stored(store, *FLEX_ROUTED)
    assert _ask_from(store, "edge-a") == 1
    assert _ask_from(store, "edge-c") == 0
    asks = [r.event for r in store.read_stream(b.RID) if isinstance(r.event, PreemptionRequested)]
    assert [a.requested_by for a in asks] == ["edge-a"]


def test_an_ask_that_arrives_after_the_end_appends_nothing() -> None:
    store = InMemoryEventStore()
    _stored(store, *FLEX_ROUTED, b.first_token(), b.completed(), b.refunded())
    before = len(store.read_stream(b.RID))
    assert _ask_from(store, "edge-a") == 0
    assert len(store.read_stream(b.RID)) == before


# --- RemoteFlex: the flex work other edges serve, from the log -------------------------------


def _records(rid: str, edge: str, tier: str = "flex", replica: str = "replica-1",
             tokens: int = 600) -> list[Recorded]:  # fmt: skip
    events = (
        b.admitted(request_id=rid, edge_id=edge, service_tier=tier),
        b.estimated(request_id=rid, reserved_tokens=tokens),
        b.routed(request_id=rid, replica_id=replica),
    )
    return [b.record(e, version=i + 1, stream_id=rid, position=i + 1)
            for i, e in enumerate(events)]  # fmt: skip


def test_remote_flex_lists_other_edges_flex_work_by_replica_oldest_first() -> None:
    view = RemoteFlex("edge-a")
    for rid, edge, tier in [("f1", "edge-b", "flex"), ("own", "edge-a", "flex"),
                            ("i1", "edge-b", "default"), ("f2", "edge-c", "flex")]:  # fmt: skip
        for record in _records(rid, edge, tier):
            view.apply(record)
    assert view.preemptible("replica-1") == (("f1", 600), ("f2", 600))
    assert view.preemptible("replica-2") == () and view.tenant_of("f1") == b.TENANT
    assert view.ask("f1") and not view.ask("f1") and not view.ask("own")
    assert view.preemptible("replica-1") == (("f2", 600),)
    assert view.asked_tokens("replica-1") == 600  # being freed by its edge
    # Another edge's ask takes f2 out too; the ends give the KV back to the scrape.
    view.apply(b.record(replace(ASKED, request_id="f2"), version=4, stream_id="f2"))
    assert view.preemptible("replica-1") == () and view.asked_tokens("replica-1") == 1200
    for rid in ("f1", "f2"):
        view.apply(b.record(RequestPreempted(rid, 1, 1, 0, "replica-1", "x"), version=5,
                            stream_id=rid))  # fmt: skip
    assert view.asked_tokens("replica-1") == 0 and view.tenant_of("f1") is None


def test_a_follower_tails_no_route_and_reads_only_other_edges_flex_routes() -> None:
    view = RemoteFlex("edge-a")
    assert "RequestRouted" not in view.folded_types()
    assert {"RequestAdmitted", "PreemptionRequested", "RequestPreempted"} <= view.folded_types()
    batch = [*_records("f1", "edge-b")[:2], *_records("own", "edge-a")[:2],
             *_records("i1", "edge-b", "default")[:2]]  # fmt: skip
    assert routes_to_read(batch, "edge-a") == ["f1"]
    assert [r.stream_id for r in routes([_records("f1", "edge-b")])] == ["f1"]


# --- the router: other edges' flex work is preemptible, after its own ------------------------


def _full_fleet(occupancy: float = 0.9) -> Fleet:
    fleet = Fleet(None)  # type: ignore[arg-type]  # never scrapes here: scrapes are fed
    fleet.add(VLLMReplica("replica-1", "http://127.0.0.1:9", MODEL))
    state = fleet.state("replica-1")
    metrics = ReplicaMetrics(kv_cache_usage=occupancy, num_gpu_blocks=64, block_size=16)
    now = time.monotonic()
    fleet.apply_scrape(state, metrics, scrape_started_at=now, now=now)
    return fleet


def test_the_router_preempts_another_edges_flex_work_when_nothing_else_makes_room() -> None:
    import random

    rng = random.Random(3)
    fleet = _full_fleet()
    assert isinstance(fleet.choose(MODEL, "free", 10, rng), Refusal)  # as before
    view = RemoteFlex("edge-a")
    for record in _records("f1", "edge-b", tokens=700):  # 700 of 1,024 tokens: 0.68
        view.apply(record)
    fleet.others_flex = view
    choice = fleet.choose(MODEL, "free", 10, rng, request_id="req-i")
    assert isinstance(choice, Choice)
    assert choice.preempt == ("f1",) and choice.preempt_remote == ("f1",)
    assert choice.occupancy_ppm < 600_000
    view.ask("f1")  # what the edge does with the choice: its KV is counted as being freed
    again = fleet.choose(MODEL, "free", 10, rng, request_id="req-j")
    assert isinstance(again, Choice) and again.preempt == ()  # no second victim for it


def test_the_router_aborts_its_own_flex_work_before_asking_another_edge() -> None:
    import random

    rng = random.Random(3)
    fleet = _full_fleet(0.4)
    own = fleet.choose(MODEL, "free", 700, rng, service_tier="flex", request_id="mine")
    assert isinstance(own, Choice)
    # The engine shows it, and another edge's as much: 0.95, full for free (0.60). Aborting
    # this router's own request alone makes room.
    now = time.monotonic()
    fleet.apply_scrape(fleet.state("replica-1"), ReplicaMetrics(
        kv_cache_usage=0.95, num_gpu_blocks=64, block_size=16), scrape_started_at=now, now=now)
    view = RemoteFlex("edge-a")
    for record in _records("theirs", "edge-b", tokens=700):
        view.apply(record)
    fleet.others_flex = view
    choice = fleet.choose(MODEL, "free", 10, rng, request_id="req-i")
    assert isinstance(choice, Choice)
    assert choice.preempt == ("mine",) and choice.preempt_remote == ()


# --- the edges: one asks, the one serving it preempts ----------------------------------------


def rid(n: int) -> str:
    return f"req_{n:032x}"


def test_the_edge_serving_an_asked_for_stream_preempts_it_within_the_observe_call() -> None:
    """The bound on the serving side: the abort starts in the same call that folds the ask (no
    wait, no poll of its own); the client gets the preempted error then [DONE]."""

    async def t(h: Harness) -> None:
        out = await h.chat(service_tier="flex", stream=True)
        assert isinstance(out, StreamOutcome)
        flex_id = rid(1)
        store = h.sink.store
        handled = CommandHandler(store).handle(
            flex_id, lambda s: decide(s, ask(requested_by="edge-2", request_id=flex_id)),
            request_stream(store, flex_id), tenant_id="acme",
        )  # fmt: skip
        h.edge.observe(handled.records)
        assert h.edge.in_flight[flex_id].preempted_for == "req-interactive"
        frames = [out.first] + [f async for f in out.frames]
        assert frames[-1] == b"data: [DONE]\n\n"
        error = orjson.loads(frames[-2][6:])["error"]
        assert error["type"] == "resource_unavailable" and error["code"] == "preempted"
        for _ in range(5):
            await asyncio.sleep(0)
        types = [type(r.event).__name__ for r in store.read_stream(flex_id)]
        # The first token was staged on top of the version the ask took: that append lost the
        # race and was decided again on the stored stream, after the ask.
        assert types[-2:] == ["RequestPreempted", "QuotaRefunded"]
        assert types.index("PreemptionRequested") < types.index("RequestPreempted")
        assert sum(t in TERMINAL_TYPES for t in types) == 1
        assert flex_id not in h.edge.in_flight
        # Read again (a follower that restarts, or a second ask): nothing more happens.
        h.edge.observe(handled.records)
        assert len(store.read_stream(flex_id)) == len(types)

    run(t, script=Script(tokens=5_000))


def test_an_ask_for_a_request_this_edge_no_longer_serves_changes_nothing_here() -> None:
    async def t(h: Harness) -> None:
        out = await h.chat(service_tier="flex")
        assert isinstance(out, JsonOutcome) and out.status == 200
        record = b.record(replace(ASKED, request_id=rid(1)), version=9, stream_id=rid(1))
        h.edge.observe([record])
        types = h.types(1)
        assert RequestCompleted in types and RequestPreempted not in types

    run(t)


def test_the_edge_needing_the_room_admits_at_once_and_asks_on_the_flex_stream() -> None:
    async def t(h: Harness) -> None:
        store = h.sink.store
        theirs = "req_theirs"
        events = (
            b.admitted(request_id=theirs, edge_id="edge-2", service_tier="flex", model=MODEL),
            b.estimated(request_id=theirs),
            b.routed(request_id=theirs, replica_id="replica-1"),
        )
        stored = store.append(theirs, 0, [
            NewEvent(f"t{i}", theirs, "acme", b.at(0), e) for i, e in enumerate(events)
        ])  # fmt: skip
        h.edge.observe(stored)
        h.edge.observe(routes([stored]))
        h.fleet.preempt_next = h.fleet.preempt_remote_next = (theirs,)
        out = await h.chat()  # answered without waiting for the other edge
        assert isinstance(out, JsonOutcome) and out.status == 200
        for _ in range(50):
            if any(isinstance(r.event, PreemptionRequested) for r in store.read_stream(theirs)):
                break
            await asyncio.sleep(0.01)
        (asked,) = [r.event for r in store.read_stream(theirs)
                    if isinstance(r.event, PreemptionRequested)]  # fmt: skip
        assert asked == PreemptionRequested(theirs, "edge-1", rid(1), "replica-1")
        assert h.edge.others_flex.asked_tokens("replica-1") > 0

    run(t)


def test_support_sees_the_ask_in_the_replay_of_the_flex_request() -> None:
    from tollgate_llm.domain.replay import replay

    preempted = RequestPreempted(b.RID, 812, 40, 0, "replica-1", "req-interactive")
    records = b.stream(*FLEX_ROUTED, ASKED, preempted, b.refunded(refunded_tokens=1800,
                                                                  used_tokens=0))  # fmt: skip
    timeline = replay(b.RID, records, None, b.at(60))
    (step,) = [s for s in timeline.steps if s.type == "PreemptionRequested"]
    assert "edge-a" in step.note and "req-interactive" in step.note
    assert step.status_after == "routed"
    assert timeline.state.status == "preempted"
    assert [a.kind for a in timeline.anomalies] == ["not_billed"]  # no bill in this stream yet
