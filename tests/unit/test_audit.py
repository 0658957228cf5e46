"""The audit trail's pure parts: what a command changed (old -> new) and the hash chain that seals
a control stream (domain/audit/). Given a stream's rows, when one is edited or deleted, then
`verify` names it."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest

from tollgate_llm.domain.audit.chain import GENESIS, AuditRow, head, verify
from tollgate_llm.domain.audit.changes import describe
from tollgate_llm.domain.audit.events import Actor, AuditedChange, ChangeAudited
from tollgate_llm.domain.audit.record import Append, audit_record
from tollgate_llm.domain.control_plane.events import (
    ApiKeyIssued,
    ApiKeyRevoked,
    LimitsSet,
    PlanChanged,
    TenantRegistered,
)
from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.governance.events import BudgetSet
from tollgate_llm.domain.registry import from_payload, to_payload

T0 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
ALICE = Actor("operator", "alice")
STREAM = "tenant-acme"


def rows_of(*commands: tuple[Event, ...], actor: Actor = ALICE) -> list[AuditRow]:
    """A stream as ControlService writes it: each command's facts, then its sealed record."""
    rows: list[AuditRow] = []
    for n, facts in enumerate(commands):
        at = T0 + timedelta(seconds=n)
        ids = tuple(f"e{len(rows) + i}" for i in range(len(facts) + 1))
        record = audit_record(Append(STREAM, "acme", len(rows), ids, at), rows, facts, actor, "Cmd")
        for i, event in enumerate((*facts, record)):
            rows.append(AuditRow(STREAM, len(rows) + 1, ids[i], "acme", at, event.EVENT_TYPE,
                                 event.EVENT_VERSION, to_payload(event)))  # fmt: skip
    return rows


def history() -> list[AuditRow]:
    return rows_of(
        (TenantRegistered("acme", "acme", "standard", "salt"),),
        (LimitsSet("acme", "*", rpm=100),),
        (LimitsSet("acme", "*", rpm=50, tpm=9),),
        (PlanChanged("acme", "enterprise"),),
    )


def edited(rows: list[AuditRow], version: int, **payload: object) -> list[AuditRow]:
    return [dataclasses.replace(r, payload={**r.payload, **payload})
            if r.stream_version == version else r for r in rows]  # fmt: skip


# --- old -> new ----------------------------------------------------------------------------------


def test_a_limit_shows_the_value_it_replaced_and_leaves_unset_fields_out() -> None:
    before = [TenantRegistered("acme", "acme", "standard", "s"), LimitsSet("acme", "*", rpm=100)]
    assert describe(before, [LimitsSet("acme", "*", rpm=50, tpm=9)]) == (
        AuditedChange("limits model=*", "rpm", "100", "50"),
        AuditedChange("limits model=*", "tpm", None, "9"),
    )


def test_a_key_shows_its_scope_then_its_revocation_and_never_its_hash() -> None:
    issued = ApiKeyIssued("acme", "key_1", "a" * 64, "admin")
    assert describe([], [issued]) == (
        AuditedChange("key key_1", "scope", None, "admin"),
        AuditedChange("key key_1", "revoked", None, "false"),
    )
    assert describe([issued], [ApiKeyRevoked("acme", "key_1")]) == (
        AuditedChange("key key_1", "revoked", "false", "true"),
    )


def test_a_cleared_budget_is_a_change_to_none() -> None:
    set_ = BudgetSet("acme", "org", "acme", "month", 25_000_000)
    assert describe([set_], [BudgetSet("acme", "org", "acme", "month", None)]) == (
        AuditedChange("budget org acme month", "amount_micros", "25000000", None),
    )


def test_a_fact_without_a_rule_is_described_by_its_fields() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class ResidencyLater(Event):
        EVENT_TYPE = "ResidencyLater"
        tenant_id: str
        regions: tuple[str, ...]

    assert describe([], [ResidencyLater("acme", ("eu-west",))]) == (
        AuditedChange("ResidencyLater", "regions", None, '["eu-west"]'),
    )


def test_a_repeat_that_changes_nothing_still_says_what_it_set() -> None:
    again = LimitsSet("acme", "*", rpm=100)
    assert describe([again], [again]) == (AuditedChange("limits model=*", "rpm", "100", "100"),)


def test_the_record_reads_back_as_it_was_written() -> None:
    record = [r for r in history() if r.type == "ChangeAudited"][-1]
    event = from_payload(record.type, record.version, record.payload)
    assert isinstance(event, ChangeAudited)
    assert event.changes == (AuditedChange("tenant", "plan", "standard", "enterprise"),)
    assert to_payload(event) == record.payload


BAD_ACTORS = [("nobody", "x"), ("key", ""), ("key", " x"), ("operator", "a\x00b"),
              ("operator", "x" * 201)]  # fmt: skip


@pytest.mark.parametrize("kind, name", BAD_ACTORS)
def test_an_actor_is_a_known_kind_and_a_storable_bounded_name(kind: str, name: str) -> None:
    with pytest.raises(DomainError) as refused:
        Actor(kind, name)
    assert refused.value.field == "actor"


# --- the chain -----------------------------------------------------------------------------------


def test_a_stream_as_written_verifies_and_its_head_is_its_last_seal() -> None:
    rows = history()
    check = verify(STREAM, rows)
    assert check.ok and check.sealed_through == 8 and check.events == 8
    assert check.head == rows[-1].payload["seal"] == head(rows) != GENESIS


def test_an_edited_fact_breaks_the_next_seal_only() -> None:
    check = verify(STREAM, edited(history(), 5, rpm=5000))
    assert check.problems == (
        "version 6: the audit record's seal does not match: an event in versions 5-6 was "
        "edited or deleted",
    )


@pytest.mark.parametrize("field, value", [("actor", "mallory"), ("command", "Other"),
                                          ("changes", []), ("seal", "0" * 64)])  # fmt: skip
def test_an_edited_record_breaks_its_own_seal(field: str, value: object) -> None:
    check = verify(STREAM, edited(history(), 8, **{field: value}))
    assert [p.split(":")[0] for p in check.problems] == ["version 8"]


def test_an_edited_envelope_is_found_too() -> None:
    rows = history()
    later = [dataclasses.replace(r, occurred_at=r.occurred_at + timedelta(hours=1))
             if r.stream_version == 3 else r for r in rows]  # fmt: skip
    assert not verify(STREAM, later).ok
    other = [dataclasses.replace(r, tenant_id="evil") if r.stream_version == 3 else r
             for r in rows]  # fmt: skip
    assert not verify(STREAM, other).ok


def test_a_deleted_fact_is_a_gap_and_a_broken_seal() -> None:
    rows = [r for r in history() if r.stream_version != 3]
    assert verify(STREAM, rows).problems == (
        "version 3 missing: an event was deleted",
        "version 4: the audit record's seal does not match: an event in versions 3-4 was "
        "edited or deleted",
    )


def test_a_deleted_last_record_leaves_its_facts_unsealed() -> None:
    rows = history()[:-1]
    assert verify(STREAM, rows).problems == (
        "versions 7-7 are sealed by no audit record (written around the trail, before it "
        "began, or its record was deleted)",
    )


def test_a_whole_last_command_deleted_is_seen_only_against_a_kept_head() -> None:
    # The chain's stated limit: cut back to an earlier seal, the stream verifies; its head moved.
    rows = history()
    kept = verify(STREAM, rows).head
    cut = verify(STREAM, rows[:-2])
    assert cut.ok and cut.head != kept


def test_a_record_seals_the_events_before_the_trail_began() -> None:
    legacy = [AuditRow(STREAM, 1, "e0", "acme", T0, "TenantRegistered", 1,
                       to_payload(TenantRegistered("acme", "acme", "free", "s")))]  # fmt: skip
    assert not verify(STREAM, legacy).ok
    facts = (PlanChanged("acme", "standard"),)
    record = audit_record(Append(STREAM, "acme", 1, ("e1", "e2"), T0), legacy, facts, ALICE, "C")
    assert record.changes == (AuditedChange("tenant", "plan", "free", "standard"),)
    rows = [
        *legacy,
        AuditRow(STREAM, 2, "e1", "acme", T0, "PlanChanged", 1, to_payload(facts[0])),
        AuditRow(STREAM, 3, "e2", "acme", T0, "ChangeAudited", 1, to_payload(record)),
    ]
    assert verify(STREAM, rows).ok
    assert not verify(STREAM, edited(rows, 1, plan="enterprise")).ok


def test_the_record_needs_one_id_more_than_its_facts() -> None:
    with pytest.raises(DomainError):
        audit_record(Append(STREAM, "acme", 0, ("e0",), T0), [], (PlanChanged("a", "free"),),
                     ALICE, "C")  # fmt: skip
