"""Money with its currency: a price is set in the deployment's currency, its bills carry it, a
price or bill recorded before currencies were recorded reads as USD, and totals are never taken
across two currencies."""

from __future__ import annotations

import pytest

from tests import builders as b
from tollgate_llm.domain.billing import bill_terminal
from tollgate_llm.domain.control_plane.decide import SetPrice, decide_control
from tollgate_llm.domain.control_plane.events import PriceSet
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.registry import from_payload, to_payload
from tollgate_llm.domain.requests.events import UsageBilled
from tollgate_llm.ledger.finance import currency_totals

ENDED = (b.admitted(), b.estimated(), b.routed(), b.completed(), b.refunded())


def _view(*events: PriceSet) -> ControlView:
    view = ControlView()
    for n, event in enumerate(events, start=1):
        view.apply(b.record(event, version=n, stream_id="prices-llama-3.1-8b"))
    return view


def test_a_price_recorded_before_currencies_reads_as_usd() -> None:
    # Given a PriceSet payload as it was written before the field existed
    payload = to_payload(b.price_set())
    del payload["currency"]
    # When it is read back
    event = from_payload("PriceSet", PriceSet.EVENT_VERSION, payload)
    # Then it is a USD price, at the version it always had
    assert isinstance(event, PriceSet) and event.currency == "USD"
    assert PriceSet.EVENT_VERSION == 1


def test_a_bill_recorded_before_currencies_reads_as_usd() -> None:
    payload = to_payload(b.billed())
    del payload["currency"]
    event = from_payload("UsageBilled", UsageBilled.EVENT_VERSION, payload)
    assert isinstance(event, UsageBilled) and event.currency == "USD"
    assert UsageBilled.EVENT_VERSION == 1


def test_a_price_is_set_in_the_currency_the_command_names() -> None:
    command = SetPrice("llama-3.1-8b", 1, 2, 0, effective_at=b.at(10), now=b.at(5),
                       currency="EUR")  # fmt: skip
    (event,) = decide_control(ControlView(), command)
    assert isinstance(event, PriceSet) and event.currency == "EUR"


@pytest.mark.parametrize("code", ["usd", "EURO", "", "E1R", "€"])
def test_a_currency_that_is_not_an_iso_4217_code_is_refused(code: str) -> None:
    command = SetPrice("llama-3.1-8b", 1, 2, 0, effective_at=b.at(10), now=b.at(5),
                       currency=code)  # fmt: skip
    with pytest.raises(DomainError) as err:
        decide_control(ControlView(), command)
    assert (err.value.rule, err.value.field) == ("bad_currency", "currency")


def test_a_bill_keeps_the_currency_of_the_price_in_force_at_admission() -> None:
    # Given a USD price in force from 0 s and a EUR price recorded later, from 100 s
    view = _view(
        b.price_set(effective_at=b.at(0)),
        b.price_set(effective_at=b.at(100), currency="EUR"),
    )
    # When a request admitted at 0 s is billed after the change
    state = b.folded(ENDED)
    bill = bill_terminal(state, view.price(state.model, state.admitted_at))  # type: ignore[arg-type]
    # Then its bill is in USD, and a request admitted after the change is priced in EUR
    assert bill is not None and bill.event.currency == "USD"
    assert view.price(b.MODEL, b.at(150)).currency == "EUR"


def test_the_flex_price_keeps_its_currency() -> None:
    view = _view(b.price_set(currency="EUR"))
    assert view.price(b.MODEL, b.at(1), "flex").currency == "EUR"


def test_totals_are_split_per_currency_never_summed_across() -> None:
    rows = [
        {"currency": "USD", "requests": 2, "amount_micros": 1_500_000},
        {"currency": "EUR", "requests": 1, "amount_micros": 250_000},
        {"currency": "USD", "requests": 1, "amount_micros": 500_000},
    ]
    assert currency_totals(rows) == [
        {"currency": "EUR", "requests": 1, "amount_micros": 250_000, "amount": "0.250000"},
        {"currency": "USD", "requests": 3, "amount_micros": 2_000_000, "amount": "2.000000"},
    ]
    assert currency_totals([]) == []
