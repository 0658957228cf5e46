"""`audit_record`: the sealed `ChangeAudited` that closes a command, decided with the facts it
audits, before either is stored (so both go in one append)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime

from tollgate_llm.domain.audit.chain import AUDIT_TYPE, AuditRow, seal
from tollgate_llm.domain.audit.changes import describe
from tollgate_llm.domain.audit.events import Actor, ChangeAudited
from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.registry import from_payload, to_payload


@dataclasses.dataclass(frozen=True, slots=True)
class Append:
    """Where a command's facts will land: its stream, the tenant of its envelope, the version
    the stream is at (the facts take the next ones, the record the one after), their event ids
    (one more than the facts: the record's last) and the instant recorded."""

    stream_id: str
    tenant_id: str
    version: int
    event_ids: tuple[str, ...]
    at: datetime


def audit_record(
    where: Append, stored: Sequence[AuditRow], facts: Sequence[Event], actor: Actor, command: str
) -> ChangeAudited:
    """The record of `facts` (what `command` decided) by `actor`, sealed over `stored` (the
    stream's events as stored, versions 1..where.version) and the facts."""
    if len(where.event_ids) != len(facts) + 1:
        raise DomainError("bad_append", "one event id per fact and one for the record")
    rows = [
        AuditRow(where.stream_id, where.version + 1 + i, where.event_ids[i], where.tenant_id,
                 where.at, fact.EVENT_TYPE, fact.EVENT_VERSION, to_payload(fact))
        for i, fact in enumerate(facts)
    ]  # fmt: skip
    record = ChangeAudited(actor.kind, actor.name, command, describe(_facts(stored), facts))
    row = AuditRow(
        where.stream_id, where.version + len(facts) + 1, where.event_ids[-1], where.tenant_id,
        where.at, AUDIT_TYPE, ChangeAudited.EVENT_VERSION, to_payload(record),
    )  # fmt: skip
    return dataclasses.replace(record, seal=seal([*stored, *rows], row))


def _facts(stored: Sequence[AuditRow]) -> list[Event]:
    """The stream's earlier facts, for their old values; one that no longer decodes (edited in
    the store) is left out here, and `verify` names it."""
    facts = []
    for row in stored:
        try:
            facts.append(from_payload(row.type, row.version, row.payload))
        except (DomainError, TypeError, ValueError, KeyError):
            continue
    return facts
