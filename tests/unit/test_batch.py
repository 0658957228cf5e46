"""The batch stream and the batch file format (domain/batches/): what a file may hold, the
states a batch moves through, each item recorded once, and what a batch item's attempt bills."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest

from tests import builders as tb
from tollgate_llm.domain.batches.decide import (
    BatchCommand,
    CancelBatch,
    CreateBatch,
    EndBatch,
    FinalizeBatch,
    RecordItem,
    StartBatch,
    decide,
)
from tollgate_llm.domain.batches.events import BatchCreated, BatchItemFinished
from tollgate_llm.domain.batches.evolve import evolve
from tollgate_llm.domain.batches.files import (
    MAX_FILE_BYTES,
    MAX_LINES,
    output_line,
    parse_input,
    unrun_line,
)
from tollgate_llm.domain.batches.state import ENDPOINT, BatchState, window_seconds
from tollgate_llm.domain.billing import bill_terminal
from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.requests.decide import billed_counts

NOW = tb.at(0)


def line(custom_id: str = "a", **overrides: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "secret prompt"}]},
            **overrides}


def content(*lines: Any) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n"
                    for x in lines)


def refused(raw: bytes) -> DomainError:
    with pytest.raises(DomainError) as err:
        parse_input(raw)
    assert "secret prompt" not in err.value.message
    return err.value


# --- the file -----------------------------------------------------------------------------------


def test_a_file_is_its_lines_in_order_blank_lines_aside() -> None:
    parsed = parse_input(content(line("a"), b"", line("b")))
    assert [(p.line, p.custom_id) for p in parsed] == [(1, "a"), (3, "b")]


@pytest.mark.parametrize(
    ("raw", "rule", "where"),
    [
        (content(line("a"), b"{oops"), "invalid_json", "line 2"),
        (content(b"[1, 2]"), "invalid_json", "line 1"),
        (content(line("a"), line("a")), "duplicate_custom_id", "line 2: custom_id"),
        (content(line("")), "invalid_custom_id", "line 1: custom_id"),
        (content(line("x" * 65)), "invalid_custom_id", "line 1: custom_id"),
        (content(line(method="GET")), "invalid_method", "line 1: method"),
        (content(line(url="/v1/embeddings")), "invalid_url", "line 1: url"),
        (content(line(body=[])), "invalid_body", "line 1: body"),
        (content(line(body={"model": "m", "stream": True})), "stream_unsupported",
         "line 1: body.stream"),
        (content(line(body={"x": "nested:70"})), "too_nested", "line 1"),
        (b"\n\n", "empty_file", None),
    ],
)
def test_a_bad_line_is_refused_naming_it_never_quoting_it(
    raw: bytes, rule: str, where: str | None
) -> None:
    raw = raw.replace(b'"nested:70"', b"[" * 70 + b"1" + b"]" * 70)
    error = refused(raw)
    assert error.rule == rule
    if where is not None:
        assert error.field == where and error.message.startswith(where)


def test_a_file_is_bounded_in_bytes_and_lines() -> None:
    assert refused(b"x" * (MAX_FILE_BYTES + 1)).rule == "file_too_large"
    many = content(*(line(f"i{i}") for i in range(MAX_LINES + 1)))
    if len(many) <= MAX_FILE_BYTES:
        assert refused(many).rule == "too_many_lines"


def test_windows_are_24h_and_only_the_extra_ones_a_server_offers() -> None:
    assert window_seconds("24h") == 86_400
    assert window_seconds("30s") is None
    assert window_seconds("30s", ("30s",)) == 30
    assert window_seconds("5m", ("5m",)) == 300
    assert window_seconds("7d", ("7d",)) is None
    assert window_seconds(24) is None


# --- the stream ---------------------------------------------------------------------------------


def create(total: int = 2) -> CreateBatch:
    return CreateBatch("batch_1", "acme", "key-1", "file-1", ENDPOINT, "24h", 86_400, total,
                         NOW)


class Stream:
    def __init__(self) -> None:
        self.state = BatchState()
        self.events: list[Event] = []

    def do(self, command: BatchCommand, seconds: float = 1) -> tuple[Event, ...]:
        events = decide(self.state, command)
        for event in events:
            self.events.append(event)
            self.state = evolve(self.state, tb.record(
                event, version=self.state.version + 1, seconds=seconds, stream_id="batch-batch_1"))
        return events


def test_a_batch_moves_validating_in_progress_finalizing_completed() -> None:
    s = Stream()
    (created,) = s.do(create())
    assert isinstance(created, BatchCreated)
    assert created.expires_at == NOW + timedelta(hours=24)
    assert s.state.status == "validating"
    s.do(StartBatch())
    assert s.state.status == "in_progress" and s.state.in_progress_at is not None
    s.do(RecordItem("a", "req_1", "completed", 200))
    with pytest.raises(DomainError) as err:
        s.do(FinalizeBatch("completed"))
    assert err.value.rule == "items_left"
    s.do(RecordItem("b", "req_2", "failed", 400))
    assert (s.state.completed, s.state.failed) == (1, 1) and s.state.all_finished
    s.do(FinalizeBatch("completed"))
    assert s.state.status == "finalizing"
    s.do(EndBatch("file-out", "file-err"))
    assert s.state.status == "completed" and s.state.completed_at is not None
    assert (s.state.output_file_id, s.state.error_file_id) == ("file-out", "file-err")


def test_an_item_is_recorded_once_whatever_is_retried() -> None:
    s = Stream()
    s.do(create())
    s.do(StartBatch())
    assert s.do(RecordItem("a", "req_1", "completed", 200))
    assert s.do(RecordItem("a", "req_9", "completed", 200)) == ()
    assert s.state.completed == 1
    # A stream that somehow holds two outcomes for one item is loud.
    twice = BatchItemFinished("batch_1", "a", "req_9", "completed", 200)
    with pytest.raises(DomainError) as err:
        evolve(s.state, tb.record(twice, version=s.state.version + 1))
    assert err.value.rule == "item_twice"


def test_cancel_stops_an_open_batch_and_ends_it_cancelled() -> None:
    s = Stream()
    s.do(create())
    s.do(StartBatch())
    s.do(CancelBatch())
    assert s.state.status == "cancelling" and s.state.cancelling_at is not None
    assert s.do(CancelBatch()) == ()
    s.do(RecordItem("a", "req_1", "completed", 200))  # it finished as the cancel arrived
    s.do(EndBatch("file-out", None))
    assert s.state.status == "cancelled" and s.state.completed == 1
    assert s.do(CancelBatch()) == ()


def test_a_finished_batch_cannot_be_cancelled() -> None:
    s = Stream()
    s.do(create(1))
    s.do(StartBatch())
    s.do(RecordItem("a", "req_1", "completed", 200))
    s.do(FinalizeBatch("completed"))
    s.do(EndBatch("file-out", None))
    with pytest.raises(DomainError) as err:
        s.do(CancelBatch())
    assert err.value.rule == "not_cancellable"


def test_expiry_finalizes_with_what_completed() -> None:
    s = Stream()
    s.do(create(3))
    s.do(StartBatch())
    s.do(RecordItem("a", "req_1", "completed", 200))
    s.do(FinalizeBatch("expired"))
    s.do(EndBatch("file-out", "file-err"))
    assert s.state.status == "expired" and s.state.expired_at is not None
    assert s.do(RecordItem("b", "req_2", "completed", 200)) == ()  # too late: ended


def test_commands_on_an_unknown_batch_are_refused() -> None:
    with pytest.raises(DomainError) as err:
        decide(BatchState(), StartBatch())
    assert err.value.rule == "unknown_batch"


def test_creating_the_same_batch_again_records_nothing() -> None:
    s = Stream()
    s.do(create())
    assert s.do(create()) == ()


def test_the_error_file_names_unrun_items_by_why() -> None:
    assert unrun_line("a", "expired")["error"]["code"] == "batch_expired"
    assert unrun_line("a", "cancelled")["error"]["code"] == "batch_cancelled"
    out = output_line("a", "req_0123", 200, {"x": 1})
    assert out["id"] == "batch_req_0123" and out["response"]["request_id"] == "req_0123"


# --- what an item's attempt bills ---------------------------------------------------------------


FLEX_ITEM = (tb.admitted(service_tier="flex", batch_item="batch_1/a"), tb.estimated(),
             tb.routed())


@pytest.mark.parametrize("end", [tb.cancelled(), tb.failed(), tb.lease_expired()])
def test_a_batch_items_attempt_that_did_not_complete_bills_nothing(end: Event) -> None:
    state = tb.folded((*FLEX_ITEM, end, tb.refunded()))
    bill = bill_terminal(state, tb.price())
    assert bill is not None
    assert (bill.event.prompt_tokens, bill.event.completion_tokens, bill.event.amount_micros) \
        == (0, 0, 0)


def test_a_completed_batch_item_bills_the_engine_counts() -> None:
    state = tb.folded((*FLEX_ITEM, tb.first_token(), tb.completed(), tb.refunded()))
    bill = bill_terminal(state, tb.price())
    assert bill is not None and bill.event.completion_tokens == 300
    assert bill.event.amount_micros > 0


def test_billed_counts_is_the_one_rule() -> None:
    counts = (10, 5, 2)
    assert billed_counts("completed", "", counts) == counts
    assert billed_counts("cancelled", "", counts) == counts
    assert billed_counts("preempted", "", counts) == (0, 0, 0)
    assert billed_counts("cancelled", "batch_1/a", counts) == (0, 0, 0)
    assert billed_counts("completed", "batch_1/a", counts) == counts
