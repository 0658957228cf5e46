"""Projection specs: rows from events, keyed by natural keys, rebuildable to identical rows."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

from tests import builders as b
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.projections import (
    LEDGER_ENTRIES,
    PROJECTIONS,
    REQUEST_LOG,
    USAGE_HOURLY,
    ProjectionSpec,
)
from tollgate_llm.domain.requests.events import RefusalsCounted, RequestDowngraded, RequestRouted


def run(spec: ProjectionSpec, records: list[Recorded]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """What the ledger's runner does, in memory: upsert by key, delete on None."""
    table: dict[tuple[Any, ...], dict[str, Any]] = {}
    for recorded in records:
        key = spec.key(recorded)
        if key is None:
            continue
        row = spec.project(table.get(key), recorded)
        if row is None:
            table.pop(key, None)
        else:
            assert tuple(row) == spec.columns, "rows carry every column, in order"
            assert tuple(row[c] for c in spec.key_columns) == key
            table[key] = row
    return table


def test_specs_list_key_columns_first() -> None:
    for spec in PROJECTIONS:
        assert spec.columns[: len(spec.key_columns)] == spec.key_columns


def test_request_log_follows_a_request_to_its_end() -> None:
    rows = run(REQUEST_LOG, b.stream(*b.happy_path()))
    row = rows[(b.RID,)]
    assert row == {
        "request_id": b.RID,
        "tenant_id": b.TENANT,
        "key_id": b.KEY,
        "model": b.MODEL,
        "tier": "standard",
        "status": "completed",
        "admitted_at": b.at(0),
        "finished_at": b.at(4),
        "prompt_tokens": 812,
        "completion_tokens": 300,
        "cached_tokens": 512,
        "ttft_ms": 180,
        "tpot_us": 42_000,
        "finish_reason": "stop",
        "replica_id": "replica-1",
        "reject_reason": None,
        "requested_model": None,
        "service_tier": "default",
        "refusals": None,
        "region": "",  # routed to a replica given no region
        "retention": "standard",
        "adapter": None,
        "end_user": None,
    }


def test_request_log_keeps_the_region_and_the_retention_tier() -> None:
    events = b.happy_path()
    admitted = dataclasses.replace(events[0], retention="zero")
    routed = next(e for e in events if isinstance(e, RequestRouted))
    events = [admitted, *(dataclasses.replace(e, region="eu-west") if e is routed else e
                          for e in events[1:])]  # fmt: skip
    row = run(REQUEST_LOG, b.stream(*events))[(b.RID,)]
    assert (row["region"], row["retention"]) == ("eu-west", "zero")


def test_the_request_log_and_the_ledger_carry_the_adapter() -> None:
    events = list(b.happy_path())
    events[0] = dataclasses.replace(events[0], adapter="support")
    assert run(REQUEST_LOG, b.stream(*events))[(b.RID,)]["adapter"] == "support"
    billed = b.record(b.billed(adapter="support"), position=1)
    assert run(LEDGER_ENTRIES, [billed])[(b.RID,)]["adapter"] == "support"


def test_request_log_keeps_the_model_a_downgraded_request_asked_for() -> None:
    events = b.happy_path()
    downgrade = RequestDowngraded(b.RID, "llama-3.1-70b-2026-05", b.MODEL, "over_ceiling")
    row = run(REQUEST_LOG, b.stream(events[0], downgrade, *events[1:]))[(b.RID,)]
    assert (row["model"], row["requested_model"]) == (b.MODEL, "llama-3.1-70b-2026-05")


def test_request_log_records_rejections() -> None:
    # admitted_at is NOT NULL in the table: a refusal carries the instant it was decided.
    records = b.stream(b.rejected(reason="concurrency"))
    row = run(REQUEST_LOG, records)[(b.RID,)]
    assert (row["status"], row["reject_reason"], row["admitted_at"]) == (
        "rejected",
        "concurrency",
        records[0].occurred_at,
    )
    assert all(row[c] is not None for c in ("tenant_id", "key_id", "model", "tier", "status"))


def test_request_log_has_one_row_for_the_refusals_a_window_counted() -> None:
    """domain/refusals.py: refusals past a key's first ones in a window are one row with their
    count, decided within the window and ended at its end (goodput counts them there)."""
    counted = RefusalsCounted(b.TENANT, b.KEY, b.MODEL, "free", "requests", b.at(0), 60, 385)
    record = b.record(counted, stream_id="rfs_1", position=9)
    assert REQUEST_LOG.opens_row(record)
    row = run(REQUEST_LOG, [record])[("rfs_1",)]
    assert (row["status"], row["reject_reason"], row["refusals"]) == ("rejected", "requests", 385)
    assert (row["admitted_at"], row["finished_at"]) == (b.at(0), b.at(60))
    assert (row["tenant_id"], row["key_id"], row["model"]) == (b.TENANT, b.KEY, b.MODEL)


def test_request_log_cancel_and_expiry() -> None:
    cancelled = run(REQUEST_LOG, b.stream(b.admitted(), b.routed(), b.cancelled()))[(b.RID,)]
    assert (cancelled["status"], cancelled["finish_reason"]) == ("cancelled", "client_disconnected")
    expired = run(REQUEST_LOG, b.stream(b.admitted(), b.lease_expired()))[(b.RID,)]
    assert (expired["status"], expired["completion_tokens"]) == ("lease_expired", 40)


def test_usage_hourly_sums_ledger_entries_by_tenant_model_and_hour() -> None:
    late = datetime(2026, 5, 4, 12, 59, 59, 999_999, tzinfo=UTC)
    records = [
        b.record(b.billed(request_id="a", finished_at=b.at(10)), position=1),
        b.record(b.billed(request_id="b", finished_at=late, amount_micros=10), position=2),
        b.record(b.billed(request_id="c", finished_at=b.at(3600)), position=3),
        b.record(b.billed(request_id="d", tenant_id="bolt"), position=4),
        b.record(b.completed(), position=5),  # not a bill: ignored
    ]
    rows = run(USAGE_HOURLY, records)
    noon = (b.TENANT, b.MODEL, datetime(2026, 5, 4, 12, tzinfo=UTC), "USD")
    assert rows[noon] == {
        "tenant_id": b.TENANT,
        "model": b.MODEL,
        "hour": datetime(2026, 5, 4, 12, tzinfo=UTC),
        "currency": "USD",
        "requests": 2,
        "prompt_tokens": 1624,
        "completion_tokens": 600,
        "cached_tokens": 1024,
        "amount_micros": 276,
    }
    assert rows[(b.TENANT, b.MODEL, datetime(2026, 5, 4, 13, tzinfo=UTC), "USD")]["requests"] == 1
    assert len(rows) == 3


def test_an_hour_billed_in_two_currencies_keeps_a_row_per_currency() -> None:
    # Given the currency setting changed within an hour: one bill priced in USD, one in EUR
    records = [
        b.record(b.billed(request_id="a", amount_micros=100), position=1),
        b.record(b.billed(request_id="b", amount_micros=7, currency="EUR"), position=2),
    ]
    # When usage_hourly folds them
    rows = run(USAGE_HOURLY, records)
    # Then each currency has its own row, and no amount is a sum of two currencies
    hour = datetime(2026, 5, 4, 12, tzinfo=UTC)
    assert rows[(b.TENANT, b.MODEL, hour, "USD")]["amount_micros"] == 100
    assert rows[(b.TENANT, b.MODEL, hour, "EUR")]["amount_micros"] == 7
    assert rows[(b.TENANT, b.MODEL, hour, "EUR")]["currency"] == "EUR"
    assert len(rows) == 2


def test_ledger_entry_carries_its_bills_currency() -> None:
    usd = run(LEDGER_ENTRIES, [b.record(b.billed(), position=1)])[(b.RID,)]
    eur = run(LEDGER_ENTRIES, [b.record(b.billed(currency="EUR"), position=1)])[(b.RID,)]
    assert (usd["currency"], eur["currency"]) == ("USD", "EUR")


def test_ledger_entry_is_posted_once_with_its_position() -> None:
    bill = b.record(b.billed(), seconds=30, position=42)
    rows = run(LEDGER_ENTRIES, [bill, b.record(b.billed(amount_micros=999), position=43)])
    row = rows[(b.RID,)]
    assert row["amount_micros"] == 266 and row["position"] == 42
    assert row["billed_at"] == b.at(30) and row["terminal"] == "completed"
    assert row["admitted_at"].tzinfo is not None


def test_rebuild_from_zero_gives_identical_rows() -> None:
    records = [
        *b.stream(*b.happy_path()),
        *[
            b.record(e, version=i + 1, position=100 + i)
            for i, e in enumerate(
                [
                    b.admitted(request_id="z"),
                    b.estimated(request_id="z"),
                    b.rejected(request_id="q"),
                ]
            )
        ],
    ]
    for spec in PROJECTIONS:
        assert run(spec, records) == run(spec, list(records))


def test_rows_hold_only_primitives() -> None:
    for spec in PROJECTIONS:
        for row in run(spec, b.stream(*b.happy_path())).values():
            for value in row.values():
                assert value is None or isinstance(value, int | str | datetime)
                if isinstance(value, datetime):
                    assert value.tzinfo is not None


def test_only_a_requests_first_event_opens_its_log_row() -> None:
    admitted, routed = b.stream(b.admitted(), b.routed())
    assert REQUEST_LOG.opens_row(admitted) and not REQUEST_LOG.opens_row(routed)
    # A first event whose request is not its stream's does not vouch for that request's row.
    elsewhere = b.record(b.admitted(request_id="req-other"), version=1, stream_id="req-mine")
    assert not REQUEST_LOG.opens_row(elsewhere)
    assert not any(spec.opens_row(admitted) for spec in PROJECTIONS if spec is not REQUEST_LOG)
