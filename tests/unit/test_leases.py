"""Leases: admissions open them, renewals move them on (largest progress, latest instant), a
terminal event closes them; what is unrenewed for the TTL is expired."""

from __future__ import annotations

import pytest

from tests import builders as b
from tollgate_llm.domain import leases
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.leases import LEASE_KEEPALIVE_S, LEASE_RENEW_S, LEASE_TTL_S, LeaseBook


def book(*records: object) -> LeaseBook:
    lb = LeaseBook()
    for r in records:
        lb.apply(r)  # type: ignore[arg-type]
    return lb


def admitted(rid: str, seconds: float = 0) -> object:
    return b.record(b.admitted(request_id=rid), version=1, seconds=seconds, stream_id=rid)


def test_the_ttl_is_three_keepalives_and_a_renewal_bounds_the_loss_to_a_tenth_of_a_second() -> None:
    assert LEASE_TTL_S >= 3 * LEASE_KEEPALIVE_S
    assert LEASE_RENEW_S <= 0.1 <= LEASE_KEEPALIVE_S


def test_unrenewed_leases_expire_after_the_ttl() -> None:
    renewal = b.renewed(b.lease_progress(request_id="a", completion_tokens=33), edge_id="edge-2")
    lb = book(
        admitted("a"), admitted("b"), b.record(renewal, seconds=10, stream_id="edge-edge-2")
    )
    assert lb.expired(b.at(14.999)) == []
    assert [lease.request_id for lease in lb.expired(b.at(15))] == ["b"]
    assert [lease.request_id for lease in lb.expired(b.at(25))] == ["b", "a"]
    a = lb.get("a")
    assert a is not None and a.edge_id == "edge-2" and a.renewed_at == b.at(10)
    assert a.progress is not None and a.progress.completion_tokens == 33


def test_an_older_renewal_delivered_late_changes_nothing() -> None:
    late = b.renewed(b.lease_progress(request_id="a", completion_tokens=5))
    new = b.renewed(b.lease_progress(request_id="a", completion_tokens=50))
    lb = book(admitted("a"), b.record(new, seconds=10), b.record(late, seconds=5))
    lease = lb.get("a")
    assert lease is not None and lease.renewed_at == b.at(10)
    assert lease.progress is not None and lease.progress.completion_tokens == 50


def test_a_terminal_event_closes_the_lease_and_a_repeated_admission_does_not_reopen_it() -> None:
    lb = book(admitted("a"))
    lb.apply(b.record(b.completed(request_id="a"), version=5, seconds=2, stream_id="a"))
    assert "a" not in lb and len(lb) == 0 and lb.expired(b.at(100)) == []
    lb2 = book(admitted("a"), admitted("a", seconds=30))
    lease = lb2.get("a")
    assert lease is not None and lease.renewed_at == b.at(0)


def test_a_renewal_is_one_event_for_every_request_and_none_for_no_request() -> None:
    progress = [b.lease_progress(request_id=f"r{i}") for i in range(3)]
    event = leases.renewal("edge-1", progress)
    assert event is not None and len(event.progress) == 3 and event.edge_id == "edge-1"
    assert leases.renewal("edge-1", []) is None
    assert leases.edge_stream("edge-1") == "edge-edge-1"
    with pytest.raises(DomainError):
        leases.renewal("edge-1", [b.lease_progress(completion_tokens=-1)])


def test_a_renewal_after_the_first_carries_only_the_requests_whose_counts_moved() -> None:
    progress = [b.lease_progress(request_id=f"r{i}", completion_tokens=i) for i in range(3)]
    previous = {"r0": (812, 0, 0), "r1": (812, 0, 0)}  # r1 moved since, r2 is new
    event = leases.renewal("edge-1", progress, previous)
    assert event is not None and [p.request_id for p in event.progress] == ["r1", "r2"]
    unchanged = {p.request_id: leases.counts(p) for p in progress}
    assert leases.renewal("edge-1", progress, unchanged) is None  # an idle interval: nothing


def test_a_successor_resumes_just_before_the_oldest_open_leases_admission() -> None:
    def at(rid: str, position: int) -> object:
        return b.record(b.admitted(request_id=rid), stream_id=rid, position=position)

    lb = book(at("a", 10), at("b", 12), at("c", 15))
    assert lb.resume_position(20) == 9
    lb.apply(b.record(b.completed(request_id="a"), version=5, stream_id="a", position=16))
    assert lb.resume_position(20) == 11  # b is now the oldest open lease
    for rid in ("b", "c"):
        lb.forget(rid)
    assert lb.resume_position(20) == 20  # none open: where the book was folded to
