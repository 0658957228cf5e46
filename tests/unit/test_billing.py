"""Billing one request: `bill_terminal` is pure — the same stream gives the same bill, with the
same event id — and refuses what cannot be billed, naming the rule."""

from __future__ import annotations

import pytest

from tests import builders as b
from tollgate_llm.domain.billing import bill_event_id, bill_terminal
from tollgate_llm.domain.errors import DomainError

ENDED = (b.admitted(), b.estimated(), b.routed(), b.completed(), b.refunded())


def test_a_terminal_is_billed_once_from_the_engine_counts_at_its_instant() -> None:
    state = b.folded(ENDED)
    bill = bill_terminal(state, b.price())
    assert bill is not None
    assert (bill.event.prompt_tokens, bill.event.completion_tokens, bill.event.cached_tokens) == (
        812, 300, 512
    )
    assert bill.expected_version == state.version == 5
    assert bill.occurred_at == state.finished_at
    assert bill.event_id == bill_event_id(state.request_id, state.finished_at)  # type: ignore[arg-type]
    assert bill_terminal(b.folded(ENDED), b.price()) == bill  # the same stream, the same bill


def test_a_billed_request_gets_no_second_bill() -> None:
    assert bill_terminal(b.folded((*ENDED, b.billed())), b.price()) is None


@pytest.mark.parametrize(
    ("events", "rule"),
    [
        ((b.admitted(), b.estimated(), b.routed()), "not_terminal"),
        ((b.rejected(),), "not_admitted"),
    ],
)
def test_what_cannot_be_billed_is_refused_by_rule(events: tuple, rule: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(DomainError) as err:
        bill_terminal(b.folded(events), b.price())
    assert err.value.rule == rule


def test_a_price_of_another_model_is_refused() -> None:
    with pytest.raises(DomainError) as err:
        bill_terminal(b.folded(ENDED), b.price(model="llama-3.1-70b"))
    assert err.value.rule == "price_model_mismatch"
