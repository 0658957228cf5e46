"""Goodput: each request's outcome against its tier's objective in force at admission; the two
ratios; SLOs as effective-dated control-plane facts."""

from __future__ import annotations

import pytest

from tests import builders as b
from tollgate_llm.domain.control_plane.decide import (
    AllowFallback,
    RevokeFallback,
    SetSlo,
    decide_control,
)
from tollgate_llm.domain.control_plane.events import SloSet
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.goodput import DEFAULT_SLO, OUTCOMES, Slo, attainment, outcome

SLO = Slo(ttft_ms=1_000, tpot_us=50_000)


@pytest.mark.parametrize(
    ("status", "kw", "expected"),
    [
        ("completed", {"ttft_ms": 1_000, "tpot_us": 50_000}, "attained"),
        ("completed", {"ttft_ms": 200, "tpot_us": 0}, "attained"),  # one token: no TPOT
        ("completed", {"ttft_ms": 1_001, "tpot_us": 10}, "missed_ttft"),
        ("completed", {"ttft_ms": 1_001, "tpot_us": 90_000}, "missed_ttft"),
        ("completed", {"ttft_ms": 10, "tpot_us": 50_001}, "missed_tpot"),
        ("cancelled", {}, "cancelled"),
        ("failed", {}, "failed"),
        ("lease_expired", {}, "lease_expired"),
        ("rejected", {"reject_reason": "capacity"}, "refused_capacity"),
        ("rejected", {"reject_reason": "retry_budget"}, "shed"),
        ("rejected", {"reject_reason": "tokens"}, "refused_quota"),
        ("rejected", {"reject_reason": "invalid"}, "invalid"),
        ("streaming", {}, None),
    ],
)
def test_each_request_has_one_outcome(status: str, kw: dict, expected: str | None) -> None:  # type: ignore[type-arg]
    assert outcome(status, SLO, **kw) == expected
    assert expected is None or expected in OUTCOMES


def test_attainment_counts_what_was_served_and_goodput_what_was_offered() -> None:
    a = attainment(
        ["attained"] * 6 + ["missed_tpot", "cancelled", "refused_capacity", "shed", "invalid"]
    )
    assert (a.served, a.offered) == (8, 10)
    assert a.attainment_ppm == 750_000 and a.goodput_ppm == 600_000
    assert attainment([]).attainment_ppm is None


def test_slos_are_effective_dated_with_a_default_before_any_is_set() -> None:
    view = ControlView()
    assert view.slo("free", b.at(0)) == DEFAULT_SLO
    view.apply(b.record(SloSet("free", 500, 30_000, b.at(10)), stream_id="slo-free"))
    assert view.slo("free", b.at(9)) == DEFAULT_SLO
    assert view.slo("free", b.at(10)) == Slo(500, 30_000)
    assert view.slo("standard", b.at(10)) == DEFAULT_SLO
    # a back-dated objective takes effect when it was recorded, never before
    view.apply(b.record(SloSet("standard", 200, 10_000, b.at(-100)), seconds=5,
                        stream_id="slo-standard"))
    assert view.slo("standard", b.at(4)) == DEFAULT_SLO
    assert view.slo("standard", b.at(5)) == Slo(200, 10_000)


@pytest.mark.parametrize(
    ("command", "rule"),
    [
        (SetSlo("platinum", 100, 100, b.at(1), b.at(0)), "bad_tier"),
        (SetSlo("free", 0, 100, b.at(1), b.at(0)), "bad_slo"),
        (SetSlo("free", 100, 100, b.at(0), b.at(1)), "slo_backdated"),
    ],
)
def test_an_slo_that_cannot_hold_is_refused(command: SetSlo, rule: str) -> None:
    with pytest.raises(DomainError) as err:
        decide_control(ControlView(), command)
    assert err.value.rule == rule


def test_fallback_consent_is_given_revoked_and_never_to_the_same_model() -> None:
    view = ControlView()
    view.apply(b.record(b.tenant_registered(), stream_id="tenant-acme"))
    (allowed,) = decide_control(view, AllowFallback(b.TENANT, "llama-3.1-8b", "llama-3.1-70b"))
    view.apply(b.record(allowed, version=2, stream_id="tenant-acme"))
    assert view.fallback_book.fallbacks(b.TENANT, "llama-3.1-8b-2026-05") == ("llama-3.1-70b",)
    assert view.fallback_book.fallbacks("other", "llama-3.1-8b-2026-05") == ()
    again = AllowFallback(b.TENANT, "llama-3.1-8b", "llama-3.1-70b")
    assert decide_control(view, again) == ()
    (revoked,) = decide_control(view, RevokeFallback(b.TENANT, "llama-3.1-8b", "llama-3.1-70b"))
    view.apply(b.record(revoked, version=3, stream_id="tenant-acme"))
    assert view.fallback_book.fallbacks(b.TENANT, "llama-3.1-8b") == ()
    with pytest.raises(DomainError) as err:
        decide_control(view, AllowFallback(b.TENANT, "llama-3.1-8b", "llama-3.1-8b-2026-05"))
    assert err.value.rule == "same_model"
