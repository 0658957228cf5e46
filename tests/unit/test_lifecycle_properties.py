"""Hypothesis invariants of the request stream: whatever commands arrive in whatever order, a
stream never holds two terminal events, a refund is reserved − used and never negative, folding
is deterministic, and a redelivered event changes nothing."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests import builders as b
from tollgate_llm.domain.envelope import Event, Recorded
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.requests.decide import Command, decide
from tollgate_llm.domain.requests.events import TERMINAL_EVENTS, QuotaRefunded, UsageBilled
from tollgate_llm.domain.requests.evolve import evolve, fold
from tollgate_llm.domain.requests.state import RequestState

counts = st.tuples(st.integers(0, 3000), st.integers(0, 3000)).flatmap(
    lambda pc: st.tuples(st.just(pc[0]), st.just(pc[1]), st.integers(0, pc[0]))
)

commands = st.one_of(
    st.builds(
        lambda p, o: b.admit(estimate=b.estimate(prompt_tokens=p, reserved_output_tokens=o)),
        st.integers(0, 4000),
        st.integers(0, 4000),
    ),
    st.just(b.reject()),
    st.just(b.route()),
    st.just(b.record_first_token()),
    counts.map(
        lambda c: b.complete(prompt_tokens=c[0], completion_tokens=c[1], cached_tokens=c[2])
    ),
    counts.map(lambda c: b.cancel(prompt_tokens=c[0], completion_tokens=c[1], cached_tokens=c[2])),
    counts.map(lambda c: b.fail(prompt_tokens=c[0], completion_tokens=c[1], cached_tokens=c[2])),
    counts.map(lambda c: b.expire(prompt_tokens=c[0], completion_tokens=c[1], cached_tokens=c[2])),
    st.just(b.bill()),
    # a command that is malformed on purpose
    st.just(b.complete(completion_tokens=-5)),
)


def run(sequence: list[Command]) -> tuple[RequestState, list[Recorded]]:
    state = RequestState()
    records: list[Recorded] = []
    for i, command in enumerate(sequence):
        try:
            events = decide(state, command)
        except DomainError:
            continue
        for event in events:
            recorded = b.record(event, version=state.version + 1, seconds=i)
            records.append(recorded)
            state = evolve(state, recorded)
    return state, records


@settings(max_examples=300, deadline=None)
@given(st.lists(commands, max_size=14))
def test_any_command_sequence_keeps_the_stream_invariants(sequence: list[Command]) -> None:
    state, records = run(sequence)
    events: list[Event] = [r.event for r in records]
    terminals = [e for e in events if isinstance(e, TERMINAL_EVENTS)]
    refunds = [e for e in events if isinstance(e, QuotaRefunded)]
    bills = [e for e in events if isinstance(e, UsageBilled)]
    assert len(terminals) <= 1
    assert len(refunds) == len(terminals)  # every ending refunds, exactly once
    assert len(bills) <= len(terminals)
    for refund in refunds:
        assert refund.refunded_tokens >= 0
        assert refund.refunded_tokens == max(0, state.reserved_tokens - refund.used_tokens)
        assert refund.refunded_kv_byte_seconds == state.kv_byte_seconds
    for bill in bills:
        assert bill.amount_micros >= 0
        assert (bill.prompt_tokens, bill.completion_tokens) == (
            state.prompt_tokens,
            state.completion_tokens,
        )
    # rebuild == incremental, and folding is deterministic
    assert fold(records) == state
    assert fold(records) == fold(list(records))


@settings(max_examples=200, deadline=None)
@given(st.lists(commands, max_size=12), st.data())
def test_applying_any_event_twice_is_applying_it_once(
    sequence: list[Command], data: st.DataObject
) -> None:
    state, records = run(sequence)
    if not records:
        return
    # Redeliver random earlier events right after their first delivery (at-least-once).
    redelivered: list[Recorded] = []
    for recorded in records:
        redelivered.append(recorded)
        if data.draw(st.booleans()):
            redelivered.append(recorded)
        if data.draw(st.booleans()):
            redelivered.append(records[data.draw(st.integers(0, records.index(recorded)))])
    assert fold(redelivered) == state
