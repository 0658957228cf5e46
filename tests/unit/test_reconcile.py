"""The account of one request: one terminal, one refund of reserved − used, one bill of the
terminal's counts; what is missing or wrong is a finding that names it."""

from __future__ import annotations

from tests import builders as b
from tollgate_llm.domain.reconcile import account

ENDED = (b.admitted(), b.estimated(), b.routed(), b.completed())
NOW = b.at(3600)


def kinds(*events: object, now: object = NOW, grace_s: float = 60) -> list[str]:
    acc = account(b.RID, b.stream(*events), now, grace_s)  # type: ignore[arg-type]
    return [f.kind for f in acc.findings]


def test_a_complete_account_has_no_findings_and_totals() -> None:
    acc = account(b.RID, b.stream(*ENDED, b.refunded(), b.billed()), NOW, 60)
    assert acc.ok and acc.terminals == acc.refunds == acc.bills == 1
    assert (acc.reserved_tokens, acc.refunded_tokens, acc.used_tokens) == (1800, 688, 1112)
    assert acc.billed_tokens == 812 + 300


def test_each_broken_invariant_is_named() -> None:
    assert kinds(*ENDED, b.billed()) == ["refunds"]
    assert kinds(*ENDED, b.refunded(refunded_tokens=1), b.billed()) == ["refund_mismatch"]
    assert kinds(*ENDED, b.refunded()) == ["bills"]
    assert kinds(*ENDED, b.refunded(), b.billed(completion_tokens=1)) == ["bill_mismatch"]
    assert kinds(*ENDED, b.cancelled(), b.refunded(), b.billed()) == ["terminals"]


def test_an_unended_request_is_in_flight_within_the_grace_then_a_finding() -> None:
    young = account(b.RID, b.stream(b.admitted(), b.estimated()), b.at(30), 60)
    assert young.ok and young.in_flight
    assert kinds(b.admitted(), b.estimated(), now=b.at(61)) == ["no_terminal"]


def test_a_refusal_has_nothing_to_account_for() -> None:
    acc = account(b.RID, b.stream(b.rejected()), NOW, 60)
    assert acc.ok and acc.admitted_at is None and not acc.in_flight
