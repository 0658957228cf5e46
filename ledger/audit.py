"""The audit trail read from the events table as stored: raw rows (envelope and payload text, not
decoded or upcast) for the hash chain (domain/audit/chain.py), and the audit records for a
listing. Read-only; the records are written with the changes they audit (ControlService)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import orjson
import sqlalchemy as sa

from tollgate_llm.domain.audit.chain import AUDIT_TYPE, AUDITED_PREFIXES, AuditRow
from tollgate_llm.domain.control_plane.state import tenant_stream
from tollgate_llm.ledger.schema import events

__all__ = ["AuditEntry", "audit_entries", "audited_streams", "stream_rows"]

_c = events.c
_ROW = (_c.position, _c.stream_id, _c.stream_version, _c.event_id, _c.tenant_id, _c.occurred_at,
        _c.type, _c.version, _c.payload)  # fmt: skip
# Rows read per query of a listing that filters by actor after reading.
_PAGE = 500


@dataclass(frozen=True, slots=True)
class AuditEntry:
    position: int
    row: AuditRow


def _payload(text: str) -> dict[str, object]:
    # A payload edited into something that is not a JSON object still hashes (as itself), so
    # the chain reports it rather than this read failing.
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return {"": text}
    return value if isinstance(value, dict) else {"": value}


def _entry(r: sa.Row[tuple[object, ...]]) -> AuditEntry:
    return AuditEntry(r.position, AuditRow(
        r.stream_id, r.stream_version, r.event_id, r.tenant_id, r.occurred_at, r.type, r.version,
        _payload(r.payload),
    ))  # fmt: skip


def stream_rows(engine: sa.Engine, stream_id: str, upto: int) -> list[AuditRow]:
    """Versions 1..upto of one stream, as stored."""
    query = (sa.select(*_ROW).where(_c.stream_id == stream_id, _c.stream_version <= upto)
             .order_by(_c.stream_version))  # fmt: skip
    with engine.connect() as conn:
        return [_entry(r).row for r in conn.execute(query)]


def audited_streams(engine: sa.Engine, prefixes: Sequence[str] = AUDITED_PREFIXES
                    ) -> dict[str, list[AuditRow]]:  # fmt: skip
    """Every event of every audited control stream, per stream in version order."""
    where = sa.or_(*(_c.stream_id.startswith(p, autoescape=True) for p in prefixes))
    out: dict[str, list[AuditRow]] = {}
    with engine.connect() as conn:
        for r in conn.execute(sa.select(*_ROW).where(where)
                              .order_by(_c.stream_id, _c.stream_version)):  # fmt: skip
            out.setdefault(r.stream_id, []).append(_entry(r).row)
    return out


def audit_entries(
    engine: sa.Engine, *, tenant: str | None, since: datetime | None, actor: str | None,
    before: int | None, limit: int,
) -> list[AuditEntry]:  # fmt: skip
    """Audit records, newest first: of `tenant`'s stream (its tenant-<id> changes) or of all,
    recorded at or after `since`, by `actor` (a key id, or the CLI's name), below position
    `before`; at most `limit`."""
    found: list[AuditEntry] = []
    cursor = before
    with engine.connect() as conn:
        while len(found) < limit:
            query = sa.select(*_ROW).where(_c.type == AUDIT_TYPE)
            if tenant is not None:
                query = query.where(_c.tenant_id == tenant, _c.stream_id == tenant_stream(tenant))
            if since is not None:
                query = query.where(_c.occurred_at >= since)
            if cursor is not None:
                query = query.where(_c.position < cursor)
            page = [_entry(r) for r in conn.execute(
                query.order_by(_c.position.desc()).limit(_PAGE if actor else limit)
            )]  # fmt: skip
            found.extend(e for e in page if actor is None or e.row.payload.get("actor") == actor)
            if len(page) < (_PAGE if actor else limit) or not page:
                break
            cursor = page[-1].position
    return found[:limit]
