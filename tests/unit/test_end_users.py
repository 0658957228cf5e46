"""End users (domain/governance/end_users.py): the keyed hash, the per-end-user level of a
project's path (limits and daily budget, each end user on its own), the bound on end users
tracked and its overflow level, and another edge's reservation folded from the log."""

from __future__ import annotations

from typing import Any

import pytest

from tests import builders as b
from tests.unit.test_budgets import KV, LIMITS, MAX_COST, MODEL, PRICE, Org, tree
from tollgate_llm.domain import admission
from tollgate_llm.domain.admission import Admitted, Rejected, ReserveQuota
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.governance.budgets import PathView
from tollgate_llm.domain.governance.decide import SetBudget, SetLevelLimits
from tollgate_llm.domain.governance.end_users import (
    OVERFLOW,
    EndUserRoster,
    end_user_hash,
    on_path,
)
from tollgate_llm.domain.requests.events import BudgetReserved


def ask(org: Org, end_user: str, roster: EndUserRoster | None = None, **kw: Any) -> Any:
    org._rid += 1
    when = b.at(kw.pop("seconds", 0))
    cmd = ReserveQuota(
        request_id=f"r{org._rid}", tenant_id=b.TENANT, key_id=b.KEY, model=MODEL,
        tier="enterprise", edge_id="edge-1", prompt_tokens=100, max_tokens=100,
        kv_bytes_per_token=KV, tpot_us=50_000, now=when, jitter=0.0,
    )  # fmt: skip
    path = org.view.hierarchy.policy(b.TENANT, b.KEY, MODEL, when)
    path = on_path(path, org.view.hierarchy, roster or org.paths.end_users, MODEL, end_user)
    assert path is not None
    return admission.decide_on_path(org.quota, org.paths, cmd, LIMITS, path, PRICE)


def test_the_hash_is_keyed_per_tenant_and_never_the_identifier() -> None:
    one = end_user_hash("salt-of-acme", "alice@example.com")
    assert len(one) == 32 and "alice" not in one
    assert one == end_user_hash("salt-of-acme", "alice@example.com")
    assert one != end_user_hash("salt-of-globex", "alice@example.com")
    assert end_user_hash("salt-of-acme", "") == ""


def test_each_end_user_has_its_own_requests_per_minute() -> None:
    org = tree()
    org.do(SetLevelLimits(b.TENANT, "end_user", "search-bot", "*", rpm=2))
    for _ in range(2):
        assert isinstance(ask(org, "h-alice"), Admitted)
    no = ask(org, "h-alice")
    assert isinstance(no, Rejected) and no.reason == "requests"
    assert no.level == 'end user "h-alice"'
    assert isinstance(ask(org, "h-bob"), Admitted)
    assert isinstance(ask(org, ""), Admitted)  # no end user named: the project's levels only


def test_an_end_users_daily_budget_is_reserved_and_trued_up() -> None:
    org = tree()
    org.do(SetBudget(b.TENANT, "end_user", "search-bot", "day", 2 * MAX_COST + 150))
    first = ask(org, "h-alice")
    assert isinstance(first, Admitted) and first.reserved is not None
    assert first.reserved.end_user == "h-alice"
    assert isinstance(ask(org, "h-alice"), Admitted)
    no = ask(org, "h-alice")
    assert isinstance(no, Rejected) and no.reason == "budget" and no.dimension == "day"
    org.finish(first, completion=10)  # 120 posted instead of 300 reserved: room again
    assert isinstance(ask(org, "h-alice"), Admitted)
    assert isinstance(ask(org, "h-bob"), Admitted)


def test_a_per_end_user_budget_is_daily_and_set_on_a_project() -> None:
    org = tree()
    with pytest.raises(DomainError) as monthly:
        org.do(SetBudget(b.TENANT, "end_user", "search-bot", "month", 100))
    assert monthly.value.field == "period"
    with pytest.raises(DomainError) as unknown:
        org.do(SetLevelLimits(b.TENANT, "end_user", "nope", "*", rpm=1))
    assert unknown.value.field == "project"


def test_an_end_user_is_bounded_by_a_rate_only() -> None:
    org = tree()
    for name in ("max_context", "max_output", "kv_gib_seconds"):
        with pytest.raises(DomainError) as refused:
            org.do(SetLevelLimits(b.TENANT, "end_user", "search-bot", "*", rpm=1, **{name: 5}))
        assert (refused.value.rule, refused.value.field) == ("bad_limit", name)
    org.do(SetLevelLimits(b.TENANT, "end_user", "search-bot", "*", rpm=1, tpm=100))
    # The same fields at the project itself are still its own to set.
    org.do(SetLevelLimits(b.TENANT, "project", "search-bot", "*", max_context=5))


def test_past_the_bound_new_end_users_share_the_overflow_level() -> None:
    org = tree()
    org.do(SetLevelLimits(b.TENANT, "end_user", "search-bot", "*", rpm=2))
    org.paths.end_users.max_per_project = 3
    for name in ("a", "b", "c"):
        assert isinstance(ask(org, name), Admitted)
    assert org.paths.end_users.tracked(b.TENANT, "search-bot", b.at().date().isoformat()) == 3
    # New identities past the bound: one allowance between them all, never a fresh one each.
    first = ask(org, "d")
    assert isinstance(first, Admitted) and first.reserved is not None
    assert first.reserved.end_user == OVERFLOW
    assert isinstance(ask(org, "e"), Admitted)
    no = ask(org, "f")
    assert isinstance(no, Rejected) and no.level == 'end user "overflow"'
    assert isinstance(ask(org, "a"), Admitted)  # a tracked end user keeps its own level


def test_a_new_day_starts_the_roster_afresh_and_forgets_yesterdays_buckets() -> None:
    roster = EndUserRoster(max_per_project=1)
    roster.note("t", "p", "2026-12-01", "a")
    assert roster.slot("t", "p", "2026-12-01", "b") == OVERFLOW
    assert roster.slot("t", "p", "2026-12-02", "b") == "b"
    roster.note("t", "p", "2026-12-02", "b")
    assert roster.rolled and not roster.tracks("t", "p/a") and roster.tracks("t", "p/b")
    roster.note("t", "p", "2026-12-01", "c")  # a late reservation of a day already over
    assert roster.tracked("t", "p", "2026-12-02") == 1


def test_another_edges_end_user_reservation_counts_here() -> None:
    org = tree()
    org.do(SetLevelLimits(b.TENANT, "end_user", "search-bot", "*", rpm=2))
    hierarchy = org.view.hierarchy
    org.paths = PathView(rates_for=hierarchy.level_rates)
    day = b.at().date().isoformat()
    for n in range(2):
        other = BudgetReserved(
            f"other-{n}", b.TENANT, b.KEY, "research", "search-bot", None, MODEL, day, day[:7],
            MAX_COST, 200, 0, "USD", "h-alice",
        )  # fmt: skip
        org.paths.apply(b.record(other, stream_id=f"other-{n}", position=n + 1))
    assert org.paths.end_users.tracked(b.TENANT, "search-bot", day) == 1
    no = ask(org, "h-alice")
    assert isinstance(no, Rejected) and no.reason == "requests"
    assert isinstance(ask(org, "h-bob"), Admitted)
