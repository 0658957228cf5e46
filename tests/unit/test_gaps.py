"""The continuous reconciliation's fold: a terminal event is pending until its ledger row is
seen; an admission nobody renews or ends is overdue past the TTL and the grace; a restart reads
the log again from before the oldest of either."""

from __future__ import annotations

from tests import builders as b
from tollgate_llm.domain.gaps import GapBook


def _book(*events: object, start: int = 1) -> GapBook:
    book = GapBook()
    for record in b.stream(*events, start=start):  # type: ignore[arg-type]
        book.apply(record)
    return book


def test_a_terminal_event_is_pending_until_its_ledger_row_is_seen() -> None:
    book = _book(b.admitted(), b.completed())
    report = book.report(b.at(60))
    assert report.unbilled_terminals == 1 and report.unbilled_sample == (b.RID,)
    assert report.oldest_unbilled_at == b.at(1)
    book.posted([b.RID])
    assert book.report(b.at(60)).unbilled_terminals == 0
    # The same terminal event delivered again after it was posted is pending again until the
    # next check: the reconciler asks the ledger for every pending id on every step.
    assert book.pending() == []


def test_an_admission_unrenewed_past_the_ttl_and_the_grace_is_overdue() -> None:
    book = _book(b.admitted())
    assert book.report(b.at(24), ttl_s=15, grace_s=10).overdue_leases == 0
    late = book.report(b.at(26), ttl_s=15, grace_s=10)
    assert late.overdue_leases == 1 and late.oldest_overdue_at == b.at(0)
    assert late.overdue_sample == (b.RID,)


def test_a_renewal_moves_the_horizon_and_a_terminal_event_closes_it() -> None:
    book = _book(b.admitted(), b.renewed(b.lease_progress()))  # renewed at 1 s
    assert book.report(b.at(25.5), ttl_s=15, grace_s=10).overdue_leases == 0
    assert book.report(b.at(27), ttl_s=15, grace_s=10).overdue_leases == 1
    ended = _book(b.admitted(), b.lease_expired())
    assert ended.report(b.at(100)).overdue_leases == 0


def test_a_restart_reads_again_from_before_the_oldest_open_lease_or_pending_bill() -> None:
    book = _book(b.admitted(), b.completed(), start=10)  # positions 10, 11
    assert book.resume_position(50) == 10  # the terminal at 11 awaits its row
    book.posted([b.RID])
    assert book.resume_position(50) == 50
    open_lease = _book(b.admitted(), start=7)
    assert open_lease.resume_position(50) == 6
