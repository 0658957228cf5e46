"""The billing fold: exactly one bill per ended request, under redelivery, restarts and
requests it cannot price."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from tests import builders as b
from tollgate_llm.domain.billing import BILLING_NAMESPACE_BYTES, bill_event_id
from tollgate_llm.domain.control_plane.events import PriceSet
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.cost import Estimate
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.requests.decide import (
    AdmitRequest,
    BillUsage,
    CancelRequest,
    CompleteRequest,
    RouteRequest,
    decide,
)
from tollgate_llm.domain.requests.evolve import evolve_event
from tollgate_llm.domain.requests.evolve import fold as request_fold
from tollgate_llm.domain.requests.state import RequestState
from tollgate_llm.ledger.checkpoints import Checkpoints
from tollgate_llm.ledger.store import NewEvent, SqlEventStore
from tollgate_llm.streams.billing import BillingFold

PRICED = "llama-3.1-8b-2026-05"
UNPRICED = "llama-3.1-70b-2026-05"
T0 = datetime(2026, 11, 1, tzinfo=UTC)


def _control(store: SqlEventStore) -> ControlView:
    view = ControlView()
    price = NewEvent(
        str(uuid.uuid4()),
        f"prices-{PRICED}",
        "",
        T0 - timedelta(days=1),
        PriceSet(PRICED, 150_000, 600_000, 75_000, T0 - timedelta(days=1)),
    )
    for r in store.append(price.stream_id, 0, [price]):
        view.apply(r)
    return view


def _ended(store: SqlEventStore, model: str = PRICED, at: datetime = T0) -> str:
    rid = "req_" + uuid.uuid4().hex
    events = b.decided(
        AdmitRequest(
            rid, "acme", "key-1", model, "standard", "edge-1", Estimate(100, 50, 1_000, 40_000)
        ),
        RouteRequest("replica-1", 0, request_id=rid),
        CompleteRequest(100, 42, 16, "stop", 30, 20_000, request_id=rid),
        at=at,
    )
    store.append(rid, 0, [NewEvent(str(uuid.uuid4()), rid, "acme", at, e) for e in events])
    return rid


def _bills(store: SqlEventStore, rid: str) -> list[Recorded]:
    return [r for r in store.read_stream(rid) if r.type == "UsageBilled"]


def test_one_bill_per_request_even_when_events_come_again(store: SqlEventStore) -> None:
    control = _control(store)
    rids = [_ended(store) for _ in range(5)]
    fold = BillingFold(store, Checkpoints(store.engine), control)
    records = store.read_all(0, 10_000)
    fold.process(records)
    fold.process(records)  # redelivery: skipped by the checkpoint
    again = BillingFold(store, Checkpoints(store.engine), control)
    again.position = 0  # a crash before the checkpoint moved: everything is folded again
    again.process(store.read_all(0, 10_000))
    for rid in rids:
        bills = _bills(store, rid)
        assert len(bills) == 1
        bill = bills[0].event
        assert (bill.prompt_tokens, bill.completion_tokens, bill.cached_tokens) == (100, 42, 16)
        # (100 - 16) x 0.15 + 16 x 0.075 + 42 x 0.60 micro-units per token, rounded once
        assert bill.amount_micros == (84 * 150_000 + 16 * 75_000 + 42 * 600_000 + 500_000) // 10**6


def test_a_batch_is_billed_from_its_own_records_without_reading_a_stream(
    store: SqlEventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each terminal is appended with its refund after it: a bill decided at the terminal
    record would be one event behind, lose its version race and read the stream to decide
    again (a read per request, which tripled the fold worker's CPU)."""
    control = _control(store)
    rids = [_ended(store) for _ in range(20)]
    fold = BillingFold(store, Checkpoints(store.engine), control)
    records = store.read_all(0, 10_000)
    reads: list[str] = []
    read_stream = store.read_stream
    monkeypatch.setattr(store, "read_stream", lambda rid, *a, **k: reads.append(rid)
                        or read_stream(rid, *a, **k))
    fold.process(records)
    monkeypatch.undo()
    assert reads == []
    assert all(len(_bills(store, rid)) == 1 for rid in rids)


def test_a_request_admitted_before_the_checkpoint_is_billed_from_its_stream(
    store: SqlEventStore,
) -> None:
    control = _control(store)
    rid = "req_" + uuid.uuid4().hex
    state, first = RequestState(), []
    for command in (
        AdmitRequest(
            rid, "acme", "key-1", PRICED, "standard", "edge-1", Estimate(10, 5, 100, 40_000)
        ),
        RouteRequest("replica-1", 0, request_id=rid),
    ):
        for event in decide(state, command):  # type: ignore[arg-type]
            first.append(NewEvent(str(uuid.uuid4()), rid, "acme", T0, event))
            state = evolve_event(state, event, T0)
    store.append(rid, 0, first)
    fold = BillingFold(store, Checkpoints(store.engine), control)
    fold.process(store.read_all(0, 100))  # sees the admission; then the process "restarts"
    restarted = BillingFold(store, Checkpoints(store.engine), control)
    assert restarted.states == {}
    end = [
        NewEvent(str(uuid.uuid4()), rid, "acme", T0, e)
        for e in decide(state, CancelRequest(10, 3, 0, request_id=rid))
    ]
    store.append(rid, state.version, end)
    restarted.process(store.read_all(restarted.position, 100))
    assert len(_bills(store, rid)) == 1


def test_an_unpriced_request_is_dead_lettered_and_the_others_still_billed(
    store: SqlEventStore,
) -> None:
    control = _control(store)
    unpriced = _ended(store, UNPRICED)
    priced = _ended(store, PRICED)
    fold = BillingFold(store, Checkpoints(store.engine), control)
    fold.process(store.read_all(0, 100))
    assert _bills(store, unpriced) == [] and "no_price" in fold.dead_letters[unpriced]
    assert len(_bills(store, priced)) == 1
    assert fold.lag() == 1  # only its own UsageBilled is behind the checkpoint


def test_bill_ids_are_deterministic_and_sort_by_the_end_of_the_request() -> None:
    """Same request and terminal instant, same id (a redelivered terminal re-appends the same
    bill); a later end sorts later, so bills land at the right edge of the event_id index."""
    rid = "req_" + uuid.uuid4().hex
    first = bill_event_id(rid, T0)
    assert bill_event_id(rid, T0) == first
    assert bill_event_id("req_" + uuid.uuid4().hex, T0) != first
    later = [bill_event_id("req_" + uuid.uuid4().hex, T0 + timedelta(milliseconds=ms))
             for ms in (1, 2, 1000, 3_600_000)]
    assert [first, *later] == sorted([first, *later])
    parsed = uuid.UUID(first)
    assert (parsed.version, parsed.variant) == (8, uuid.RFC_4122)
    assert first[:13].replace("-", "") == f"{int(T0.timestamp() * 1000):012x}"


def test_a_bill_under_the_former_uuid5_id_is_not_billed_again(store: SqlEventStore) -> None:
    """Bills appended before ids were time-ordered carry uuid5(request) ids: a terminal
    redelivered after the change (checkpoint behind the bill) meets the stream's version check
    and the stored bill, not a second bill."""
    control = _control(store)
    rid = _ended(store)
    state = request_fold(store.read_stream(rid))
    price = control.price(state.model, state.admitted_at)  # type: ignore[arg-type]
    old_id = str(uuid.uuid5(uuid.UUID(bytes=BILLING_NAMESPACE_BYTES), f"{rid}/UsageBilled"))
    bill = decide(state, BillUsage(request_id=rid, price=price))
    store.append(rid, state.version, [NewEvent(old_id, rid, "acme", T0, e) for e in bill])
    fold = BillingFold(store, Checkpoints(store.engine), control)
    fold.position = 0
    fold.process(store.read_all(0, 10_000))  # the bill follows the terminal in the records
    again = BillingFold(store, Checkpoints(store.engine), control)
    again.position = 0
    records = store.read_all(0, 10_000)
    again.process([r for r in records if r.type != "UsageBilled"])  # the terminal alone
    assert [r.event_id for r in _bills(store, rid)] == [old_id]
