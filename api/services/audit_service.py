"""The audit trail as the CLI (`tollgate audit`) and `GET /v1/audit` read it: the records of
control-plane changes, newest first, and the check of every control stream's hash chain."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import sqlalchemy as sa

from tollgate_llm.domain.audit.chain import verify
from tollgate_llm.ledger.audit import AuditEntry, audit_entries, audited_streams

AUDIT_LIMIT_DEFAULT: Final = 100
AUDIT_LIMIT_MAX: Final = 500


def entry_json(entry: AuditEntry) -> dict[str, Any]:
    row = entry.row
    payload = row.payload
    return {
        "id": row.event_id,
        "position": entry.position,
        "stream": row.stream_id,
        "stream_version": row.stream_version,
        "tenant": row.tenant_id or None,
        "at": row.occurred_at.astimezone(UTC).isoformat().replace("+00:00", "Z"),
        "actor": payload.get("actor"),
        "actor_kind": payload.get("actor_kind"),
        "command": payload.get("command"),
        "changes": payload.get("changes", []),
    }


@dataclass(frozen=True, slots=True)
class AuditTrail:
    engine: sa.Engine

    def entries(
        self, *, tenant: str | None = None, since: datetime | None = None,
        actor: str | None = None, after: int | None = None, limit: int = AUDIT_LIMIT_DEFAULT,
    ) -> dict[str, Any]:  # fmt: skip
        """A page of audit records, newest first; `after`: the previous page's `last_id`."""
        if since is not None and since.tzinfo is None:
            since = since.replace(tzinfo=UTC)
        found = audit_entries(
            self.engine, tenant=tenant, since=since, actor=actor, before=after, limit=limit + 1
        )
        page = found[:limit]
        return {
            "object": "list",
            "data": [entry_json(e) for e in page],
            "has_more": len(found) > limit,
            "last_id": page[-1].position if page else None,
        }

    def verify(self) -> dict[str, Any]:
        """Every audited control stream's chain checked: its problems, and each stream's head
        (last sealed version and seal), for a copy kept elsewhere to compare."""
        checks = [verify(stream, rows) for stream, rows in audited_streams(self.engine).items()]
        return {
            "ok": all(c.ok for c in checks),
            "streams": len(checks),
            "events": sum(c.events for c in checks),
            "problems": [{"stream": c.stream_id, "problem": p} for c in checks for p in c.problems],
            "heads": [
                {"stream": c.stream_id, "sealed_through": c.sealed_through, "seal": c.head}
                for c in checks
            ],
        }
