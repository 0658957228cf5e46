"""The control plane: decide_control's refusals, and the view's history (limits and prices as of
a past instant)."""

from __future__ import annotations

import pytest

from tests import builders as b
from tollgate_llm.domain.control_plane.decide import (
    ChangePlan,
    ControlCommand,
    IssueApiKey,
    RegisterTenant,
    RevokeApiKey,
    SetLimits,
    SetPrice,
    decide_control,
)
from tollgate_llm.domain.control_plane.events import LimitsSet, PlanChanged, TenantRegistered
from tollgate_llm.domain.control_plane.state import LIMIT_FIELDS, PLAN_LIMITS, ControlView
from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.errors import MAX_QUANTITY, DomainError


def view_of(*timed: tuple[float, Event]) -> ControlView:
    view = ControlView()
    for i, (seconds, event) in enumerate(timed, start=1):
        view.apply(b.record(event, version=i, seconds=seconds, position=i))
    return view


def refused(view: ControlView, command: ControlCommand) -> DomainError:
    with pytest.raises(DomainError) as err:
        decide_control(view, command)
    return err.value


ACME = (0.0, b.tenant_registered())


# --- decide_control -----------------------------------------------------------------------------


def test_register_tenant() -> None:
    events = decide_control(ControlView(), RegisterTenant("acme", "standard", "salt"))
    assert events == (TenantRegistered("acme", "acme", "standard", "salt"),)


@pytest.mark.parametrize("name", ["", "Acme", "-acme", "a" * 64, "acme corp", "acme_1"])
def test_bad_tenant_names_are_refused(name: str) -> None:
    err = refused(ControlView(), RegisterTenant(name, "free", "salt"))
    assert (err.rule, err.field) == ("bad_name", "name")


def test_tenant_name_limits() -> None:
    for name in ("a", "0", "a" * 63, "acme-2"):
        assert decide_control(ControlView(), RegisterTenant(name, "free", "s"))


def test_duplicate_tenant_is_refused() -> None:
    assert refused(view_of(ACME), RegisterTenant("acme", "free", "s")).rule == "duplicate_tenant"


def test_bad_plan_is_refused() -> None:
    assert refused(ControlView(), RegisterTenant("x", "gold", "s")).rule == "bad_plan"
    assert refused(view_of(ACME), ChangePlan("acme", "gold")).rule == "bad_plan"


def test_unknown_tenant_is_refused() -> None:
    for command in (
        ChangePlan("nope", "free"),
        SetLimits("nope", "*", rpm=1),
        IssueApiKey("nope", "k", b.KEY_HASH),
    ):
        assert refused(view_of(ACME), command).rule == "unknown_tenant"


def test_change_plan_to_the_same_plan_records_nothing() -> None:
    view = view_of(ACME)
    assert decide_control(view, ChangePlan("acme", "standard")) == ()
    assert decide_control(view, ChangePlan("acme", "free")) == (PlanChanged("acme", "free"),)


def test_negative_limits_name_the_field() -> None:
    err = refused(view_of(ACME), SetLimits("acme", "*", rpm=10, max_output=-1))
    assert (err.rule, err.field) == ("negative_limit", "max_output")


def test_limits_and_prices_past_the_quantity_bound_name_the_field() -> None:
    err = refused(view_of(ACME), SetLimits("acme", "*", rpm=MAX_QUANTITY + 1))
    assert (err.rule, err.field) == ("too_large", "rpm")
    assert decide_control(view_of(ACME), SetLimits("acme", "*", rpm=MAX_QUANTITY))
    price = SetPrice("m", 1, MAX_QUANTITY + 1, 0, effective_at=b.at(10), now=b.at(5))
    err = refused(view_of(ACME), price)
    assert (err.rule, err.field) == ("too_large", "completion_micros_per_mtok")


def test_set_limits_records_only_what_it_sets() -> None:
    events = decide_control(view_of(ACME), SetLimits("acme", "llama-3.1-8b", tpm=5))
    assert events == (LimitsSet("acme", "llama-3.1-8b", tpm=5),)
    assert refused(view_of(ACME), SetLimits("acme", "*")).rule == "empty_limits"


def test_issue_key_checks_hash_scope_and_duplicates() -> None:
    view = view_of(ACME, (1.0, b.key_issued()))
    assert refused(view, IssueApiKey("acme", "k2", "XYZ")).rule == "bad_key_hash"
    assert refused(view, IssueApiKey("acme", "k2", "b" * 64, "root")).rule == "bad_scope"
    assert refused(view, IssueApiKey("acme", "k2", b.KEY_HASH)).rule == "duplicate_key_hash"
    assert refused(view, IssueApiKey("acme", b.KEY, "b" * 64)).rule == "duplicate_key"
    assert decide_control(view, IssueApiKey("acme", b.KEY, b.KEY_HASH)) == ()  # a repeat


def test_revoke_key() -> None:
    view = view_of(ACME, (1.0, b.key_issued()))
    assert decide_control(view, RevokeApiKey("acme", b.KEY)) == (b.key_revoked(),)
    assert refused(view, RevokeApiKey("other", b.KEY)).rule == "unknown_key"
    view.apply(b.record(b.key_revoked(), version=3, seconds=2))
    assert decide_control(view, RevokeApiKey("acme", b.KEY)) == ()


def test_set_price_cannot_be_backdated_or_negative() -> None:
    ok = SetPrice("llama-3.1-8b", 1, 2, 0, effective_at=b.at(10), now=b.at(5))
    assert decide_control(ControlView(), ok)
    late = SetPrice("llama-3.1-8b", 1, 2, 0, effective_at=b.at(0), now=b.at(5))
    assert refused(ControlView(), late).rule == "price_backdated"
    neg = SetPrice("llama-3.1-8b", 1, -2, 0, effective_at=b.at(10), now=b.at(5))
    assert refused(ControlView(), neg).field == "completion_micros_per_mtok"


# --- the view -----------------------------------------------------------------------------------


def test_keys_by_hash_and_revocation() -> None:
    view = view_of(ACME, (1.0, b.key_issued()))
    key = view.key_by_hash(b.KEY_HASH)
    assert key is not None and key.tenant_id == "acme" and not key.revoked
    view.apply(b.record(b.key_revoked(), version=3, seconds=2))
    assert view.key_by_hash(b.KEY_HASH) is None  # a revoked key answers like an unknown one
    revoked = view.key(b.KEY)
    assert revoked is not None and revoked.revoked and revoked.revoked_at == b.at(2)
    assert view.key_by_hash("f" * 64) is None


def test_cache_salt_is_per_tenant() -> None:
    view = view_of(ACME, (0.0, b.tenant_registered(tenant_id="bolt", name="bolt", cache_salt="x")))
    assert view.cache_salt("acme") == "salt-acme" and view.cache_salt("bolt") == "x"


def test_limits_resolve_plan_then_star_then_base_then_version() -> None:
    view = view_of(
        ACME,
        (1.0, b.limits_set(model="*", rpm=100, tpm=1000)),
        (2.0, b.limits_set(model="llama-3.1-8b", rpm=50)),
        (3.0, b.limits_set(model="llama-3.1-8b-2026-05", max_output=77)),
    )
    std = PLAN_LIMITS["standard"]
    pinned = view.limits("acme", "llama-3.1-8b-2026-05")
    assert (pinned.rpm, pinned.tpm, pinned.max_output) == (50, 1000, 77)
    assert pinned.max_context == std.max_context
    base = view.limits("acme", "llama-3.1-8b")
    assert (base.rpm, base.tpm, base.max_output) == (50, 1000, std.max_output)
    other = view.limits("acme", "llama-3.1-70b")
    assert (other.rpm, other.tpm) == (100, 1000)


def test_limits_as_of_a_past_instant() -> None:
    view = view_of(
        ACME,
        (10.0, b.limits_set(rpm=100)),
        (20.0, b.plan_changed(plan="enterprise")),
        (30.0, b.limits_set(rpm=7)),
        (40.0, b.limits_set(tpm=9)),  # leaves rpm=7 in force
    )
    std, ent = PLAN_LIMITS["standard"], PLAN_LIMITS["enterprise"]
    assert view.limits("acme", b.MODEL, b.at(5)) == std
    assert view.limits("acme", b.MODEL, b.at(15)).rpm == 100
    assert view.limits("acme", b.MODEL, b.at(25)).max_context == ent.max_context
    assert view.limits("acme", b.MODEL, b.at(35)).rpm == 7
    now = view.limits("acme", b.MODEL)
    assert (now.rpm, now.tpm, now.max_context) == (7, 9, ent.max_context)
    assert view.plan("acme", b.at(15)) == "standard" and view.plan("acme") == "enterprise"
    with pytest.raises(DomainError):
        view.limits("acme", b.MODEL, b.at(-1))  # before the tenant existed


def test_current_limits_cache_follows_new_events() -> None:
    view = view_of(ACME)
    assert view.limits("acme", b.MODEL).rpm == PLAN_LIMITS["standard"].rpm
    view.apply(b.record(b.limits_set(rpm=3), version=2, seconds=1))
    assert view.limits("acme", b.MODEL).rpm == 3


def test_price_is_effective_dated_and_never_retroactive() -> None:
    view = view_of(
        (0.0, b.price_set(prompt_micros_per_mtok=100, effective_at=b.at(0))),
        (5.0, b.price_set(prompt_micros_per_mtok=200, effective_at=b.at(100))),
        # recorded at 50 s but claims to be effective from 10 s: in force only from 50 s
        (50.0, b.price_set(prompt_micros_per_mtok=300, effective_at=b.at(10))),
    )

    def at(seconds: float, model: str = "llama-3.1-8b") -> int:
        return view.price(model, b.at(seconds)).prompt_micros_per_mtok

    assert at(0) == 100 and at(20) == 100 and at(49) == 100
    assert at(50) == 300 and at(99) == 300 and at(100) == 200
    assert at(150, "llama-3.1-8b-2026-05") == 200  # a version falls back to its base price
    with pytest.raises(DomainError) as err:
        view.price("llama-3.1-8b", b.at(-1))
    assert err.value.rule == "no_price"


def test_a_version_price_overrides_its_base() -> None:
    view = view_of(
        (0.0, b.price_set(prompt_micros_per_mtok=100)),
        (0.0, b.price_set(model=b.MODEL, prompt_micros_per_mtok=150)),
    )
    assert view.price(b.MODEL, b.at(1)).prompt_micros_per_mtok == 150
    assert view.price("llama-3.1-8b-2026-06", b.at(1)).prompt_micros_per_mtok == 100


def test_redelivered_control_event_is_ignored() -> None:
    view = ControlView()
    first = b.record(b.tenant_registered(), seconds=0)
    view.apply(first)
    view.apply(b.record(b.plan_changed(plan="free"), version=2, seconds=1))
    view.apply(first)
    assert view.plan("acme") == "free"


def test_plan_defaults_are_ordered() -> None:
    free, std, ent = (PLAN_LIMITS[p] for p in ("free", "standard", "enterprise"))
    for name in LIMIT_FIELDS[:5]:
        assert getattr(free, name) < getattr(std, name) < getattr(ent, name), name
    assert ent.reserved_kv_gib_seconds > 0 == std.reserved_kv_gib_seconds


def test_the_events_the_view_passes_over_are_exactly_those_it_has_no_case_for() -> None:
    # apply() returns before its matches (its own and its _fold_* steps') for any type outside
    # CONTROL_EVENTS: a case added without adding its type there would never run.
    import ast
    import inspect
    import textwrap

    from tollgate_llm.domain.control_plane.adapters import ADAPTER_EVENTS
    from tollgate_llm.domain.control_plane.consents import FallbackBook, RoutingBook
    from tollgate_llm.domain.control_plane.data_policy import DATA_POLICY_EVENTS
    from tollgate_llm.domain.control_plane.prices import PriceBook
    from tollgate_llm.domain.control_plane.state import CONTROL_EVENTS, ControlView
    from tollgate_llm.domain.governance.state import HIERARCHY_EVENTS

    # The view's own cases and those of the books it hands the consents and prices to.
    trees = [
        ast.parse(textwrap.dedent(inspect.getsource(cls)))
        for cls in (ControlView, FallbackBook, RoutingBook, PriceBook)
    ]
    cased = {
        case.pattern.cls.id
        for tree in trees
        for node in ast.walk(tree) if isinstance(node, ast.Match)
        for case in node.cases if isinstance(case.pattern, ast.MatchClass)
    }
    assert cased, "the view folds by a match on the event's class"
    assert {cls.__name__ for cls in CONTROL_EVENTS} == cased | {
        cls.__name__ for cls in (*HIERARCHY_EVENTS, *DATA_POLICY_EVENTS, *ADAPTER_EVENTS)
    }
