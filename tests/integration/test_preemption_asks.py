"""Asks for a flex request's preemption, from many edges at once, on real PostgreSQL: the
request stream's expected version lets one ask in, and none once the request ended, whatever
the interleaving with the serving edge's own appends."""

from __future__ import annotations

import threading
import uuid

import pytest
import sqlalchemy as sa

from tests import builders as b
from tollgate_llm.domain.requests.decide import AskToPreempt, decide
from tollgate_llm.domain.requests.events import TERMINAL_TYPES, PreemptionRequested
from tollgate_llm.domain.requests.evolve import fold
from tollgate_llm.ledger.commands import CommandHandler, request_stream
from tollgate_llm.ledger.store import NewEvent, SqlEventStore

pytestmark = pytest.mark.postgres
EDGES = 8


@pytest.fixture
def store(postgres_engine: sa.Engine) -> SqlEventStore:
    return SqlEventStore(postgres_engine)  # many edges at once: real PostgreSQL


def _flex(store: SqlEventStore) -> str:
    rid = f"req-{uuid.uuid4().hex[:12]}"
    events = (
        b.admitted(request_id=rid, service_tier="flex", edge_id="edge-b"),
        b.estimated(request_id=rid),
        b.routed(request_id=rid),
        b.first_token(request_id=rid),
    )
    store.append(rid, 0, [NewEvent(str(uuid.uuid4()), rid, b.TENANT, b.at(i), e)
                          for i, e in enumerate(events)])  # fmt: skip
    return rid


def _ask(store: SqlEventStore, rid: str, edge: str) -> None:
    command = AskToPreempt(edge, f"req-for-{edge}", "replica-1")
    CommandHandler(store, attempts=EDGES + 2).handle(
        rid, lambda state: decide(state, command), request_stream(store, rid),
        tenant_id=b.TENANT,
    )  # fmt: skip


def _all_at_once(*jobs: object) -> None:
    start = threading.Barrier(len(jobs))
    errors: list[BaseException] = []

    def run(job: object) -> None:
        start.wait()
        try:
            job()  # type: ignore[operator]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_many_edges_asking_at_once_record_one_ask(store: SqlEventStore) -> None:
    rid = _flex(store)
    _all_at_once(*(lambda e=f"edge-{i}": _ask(store, rid, e) for i in range(EDGES)))
    asks = [r.event for r in store.read_stream(rid) if isinstance(r.event, PreemptionRequested)]
    assert len(asks) == 1
    state = fold(store.read_stream(rid))
    assert state.preemption_requested_by == asks[0].requested_by and not state.is_terminal


def test_asks_racing_the_serving_edges_end_leave_one_terminal(store: SqlEventStore) -> None:
    rid = _flex(store)

    def complete() -> None:  # the serving edge, deciding again on a conflict as its recorder does
        CommandHandler(store, attempts=EDGES + 2).handle(
            rid, lambda state: decide(state, b.complete()), request_stream(store, rid),
            tenant_id=b.TENANT,
        )  # fmt: skip

    _all_at_once(complete, *(lambda e=f"edge-{i}": _ask(store, rid, e) for i in range(EDGES)))
    types = [r.type for r in store.read_stream(rid)]
    assert [t for t in types if t in TERMINAL_TYPES] == ["RequestCompleted"]
    assert types.count("PreemptionRequested") <= 1
    if "PreemptionRequested" in types:  # an ask, if any, came before the end, never after it
        assert types.index("PreemptionRequested") < types.index("RequestCompleted")
    before = len(types)
    _ask(store, rid, "edge-late")
    assert len(store.read_stream(rid)) == before
