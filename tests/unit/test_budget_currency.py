"""Budgets and runs in a currency (issue 29 item 6): a budget is an amount in one ISO 4217
currency and counts only the spend priced in it; a run is billed in one currency (its cost
limit's, else its first call's); a budget or cost limit in a currency no price is in is refused;
every refusal names the currency of its amounts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests import builders as b
from tests.unit.test_budgets import KV, LIMITS, MAX_COST, MODEL, PRICE, Org, admitted, tree
from tollgate_llm.domain import admission
from tollgate_llm.domain.admission import Admitted, Rejected, ReserveQuota
from tollgate_llm.domain.control_plane.decide import SetPrice
from tollgate_llm.domain.cost import Price
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.governance.budgets import PathView
from tollgate_llm.domain.governance.decide import SetBudget, SetRunPolicy, StartRun
from tollgate_llm.domain.governance.events import BudgetSet
from tollgate_llm.domain.requests.events import BudgetReserved
from tollgate_llm.domain.runs.events import RunStarted
from tollgate_llm.domain.runs.state import Run, RunLimits

EUR_PRICE = replace(PRICE, currency="EUR")


def ask(
    org: Org, price: Price, *, run: Run | None = None, seconds: float = 0
) -> Admitted | Rejected:
    """`Org.ask` at another price (its currency among them)."""
    org._rid += 1
    when = b.at(seconds)
    cmd = ReserveQuota(
        request_id=f"r{org._rid}", tenant_id=b.TENANT, key_id=b.KEY, model=MODEL,
        tier="enterprise", edge_id="edge-1", prompt_tokens=100, max_tokens=100,
        kv_bytes_per_token=KV, tpot_us=50_000, now=when, jitter=0.0,
    )  # fmt: skip
    path = org.view.hierarchy.policy(b.TENANT, b.KEY, MODEL, when, run)
    assert path is not None
    return admission.decide_on_path(org.quota, org.paths, cmd, LIMITS, path, price)


def refused(decision: Admitted | Rejected) -> Rejected:
    assert isinstance(decision, Rejected), decision
    return decision


# --- budgets ------------------------------------------------------------------------------------


def test_a_budget_records_its_currency_and_defaults_to_usd() -> None:
    org = tree()
    (event,) = org.do(SetBudget(b.TENANT, "project", "search-bot", "day", 1_000, "EUR"))
    assert event == BudgetSet(b.TENANT, "project", "search-bot", "day", 1_000, "EUR")
    (event,) = org.do(SetBudget(b.TENANT, "org", b.TENANT, "month", 5_000))
    assert isinstance(event, BudgetSet) and event.currency == "USD"
    found = org.view.hierarchy.level_budgets(b.TENANT, "project", "search-bot")
    assert (found["day"].amount_micros, found["day"].currency) == (1_000, "EUR")


def test_the_same_amount_in_another_currency_is_a_new_budget() -> None:
    org = tree()
    org.do(SetBudget(b.TENANT, "project", "search-bot", "day", 1_000, "USD"))
    assert org.do(SetBudget(b.TENANT, "project", "search-bot", "day", 1_000, "USD")) == ()
    (event,) = org.do(SetBudget(b.TENANT, "project", "search-bot", "day", 1_000, "EUR"))
    assert isinstance(event, BudgetSet) and event.currency == "EUR"


@pytest.mark.parametrize("code", ["usd", "EURO", "", "€"])
def test_a_budget_in_no_iso_currency_is_refused_naming_the_field(code: str) -> None:
    org = tree()
    with pytest.raises(DomainError) as err:
        org.do(SetBudget(b.TENANT, "project", "search-bot", "day", 1_000, code))
    assert (err.value.rule, err.value.field) == ("bad_currency", "currency")


def test_a_budget_in_a_currency_no_price_is_in_is_refused_once_prices_exist() -> None:
    org = tree()
    org.do(SetBudget(b.TENANT, "project", "search-bot", "day", 1_000, "JPY"))  # no price yet
    org.do(SetPrice(MODEL, 1_000_000, 2_000_000, 500_000, b.at(), b.at(), "EUR"))
    with pytest.raises(DomainError) as err:
        org.do(SetBudget(b.TENANT, "project", "search-bot", "month", 1_000, "USD"))
    assert (err.value.rule, err.value.field) == ("unpriced_currency", "currency")
    assert "EUR" in err.value.message and "USD" in err.value.message
    org.do(SetBudget(b.TENANT, "project", "search-bot", "month", 1_000, "EUR"))
    org.do(SetBudget(b.TENANT, "project", "search-bot", "day", None, "USD"))  # a removal: any


def test_a_budget_counts_only_the_spend_priced_in_its_currency() -> None:
    org = tree()
    org.do(SetBudget(b.TENANT, "project", "search-bot", "day", MAX_COST, "EUR"))
    # Priced in USD: the EUR budget does not count it, however many.
    for _ in range(3):
        admitted(ask(org, PRICE))
    day = b.at().date().isoformat()
    assert org.paths.spend(b.TENANT, "project", "search-bot", day, "EUR") == (0, 0)
    assert org.paths.spend(b.TENANT, "project", "search-bot", day, "USD") == (3 * MAX_COST, 0)
    # Priced in EUR: the first fills it, the second is refused, in EUR.
    first = admitted(ask(org, EUR_PRICE))
    assert first.reserved is not None and first.reserved.currency == "EUR"
    no = refused(ask(org, EUR_PRICE))
    assert (no.reason, no.level, no.dimension) == ("budget", 'project "search-bot"', "day")
    assert "0.0003 EUR" in no.detail and "USD" not in no.detail
    assert org.paths.spend(b.TENANT, "project", "search-bot", day, "EUR") == (MAX_COST, 0)


def test_a_request_above_a_whole_budget_says_both_amounts_in_its_currency() -> None:
    org = tree()
    org.do(SetBudget(b.TENANT, "key", b.KEY, "month", MAX_COST - 1, "EUR"))
    no = refused(ask(org, EUR_PRICE))
    assert (no.reason, no.param) == ("invalid", "max_tokens")
    assert "up to 0.0003 EUR" in no.detail and "(0.000299 EUR)" in no.detail


def test_a_view_folding_the_log_counts_a_reservation_in_its_currency() -> None:
    view = PathView()
    event = BudgetReserved(
        "r1", b.TENANT, b.KEY, None, None, None, MODEL, "2026-01-05", "2026-01", 250, 200, 1,
        "EUR",
    )  # fmt: skip
    view.apply(b.record(event, stream_id="r1"))
    assert view.spend(b.TENANT, "org", b.TENANT, "2026-01", "EUR") == (250, 0)
    assert view.spend(b.TENANT, "org", b.TENANT, "2026-01", "USD") == (0, 0)


# --- runs ---------------------------------------------------------------------------------------


def test_a_run_is_billed_in_its_first_calls_currency() -> None:
    org = tree()
    org.do(StartRun(b.TENANT, "run-1", "search-bot", RunLimits(max_calls=10)))
    run = org.view.hierarchy.run(b.TENANT, "run-1")
    assert run is not None
    admitted(ask(org, EUR_PRICE, run=run))
    no = refused(ask(org, PRICE, run=run))
    assert (no.reason, no.dimension, no.retry_after_s) == ("run_budget", "currency", 0)
    assert "billed in EUR" in no.detail and "priced in USD" in no.detail
    usage = org.paths.runs.usage(b.TENANT, "run-1")
    assert (usage.calls, usage.currency, usage.reserved_micros) == (1, "EUR", MAX_COST)


def test_a_run_with_a_cost_limit_is_billed_in_the_limits_currency() -> None:
    org = tree()
    limits = RunLimits(max_cost_micros=2 * MAX_COST, currency="EUR")
    (event,) = org.do(StartRun(b.TENANT, "run-1", "search-bot", limits))
    assert isinstance(event, RunStarted) and event.currency == "EUR"
    run = org.view.hierarchy.run(b.TENANT, "run-1")
    assert run is not None and run.limits == limits
    assert refused(ask(org, PRICE, run=run)).dimension == "currency"
    admitted(ask(org, EUR_PRICE, run=run))
    admitted(ask(org, EUR_PRICE, run=run))
    no = refused(ask(org, EUR_PRICE, run=run))
    assert no.dimension == "cost"
    assert "0.0006 EUR of its 0.0006 EUR" in no.detail and "0.0003 EUR" in no.detail


def test_a_run_takes_its_projects_cost_limit_with_that_limits_currency() -> None:
    org = tree()
    policy = RunLimits(max_calls=5, max_cost_micros=9, currency="EUR")
    org.do(SetRunPolicy(b.TENANT, "search-bot", policy))
    # The run gives only its calls: the cost limit, and its currency, are the policy's.
    (event,) = org.do(StartRun(b.TENANT, "r", "search-bot", RunLimits(max_calls=2)))
    assert isinstance(event, RunStarted) and (event.max_cost_micros, event.currency) == (9, "EUR")
    # A cost limit of its own brings its own currency.
    own = RunLimits(max_cost_micros=7, currency="GBP")
    (event,) = org.do(StartRun(b.TENANT, "s", "search-bot", own))
    assert isinstance(event, RunStarted) and (event.max_cost_micros, event.currency) == (7, "GBP")


def test_a_run_cost_limit_in_a_currency_no_price_is_in_is_refused() -> None:
    org = tree()
    org.do(SetPrice(MODEL, 1_000_000, 2_000_000, 500_000, b.at(), b.at(), "USD"))
    with pytest.raises(DomainError) as err:
        org.do(StartRun(b.TENANT, "r", None, RunLimits(max_cost_micros=5, currency="EUR")))
    assert (err.value.rule, err.value.field) == ("unpriced_currency", "currency")
    # Without a cost limit the currency bounds nothing: allowed.
    org.do(StartRun(b.TENANT, "r", None, RunLimits(max_calls=5, currency="EUR")))
