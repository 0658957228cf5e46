"""The Batch API's stored content: files, the batch registry and finished items' responses.

Cache tables, not event projections (the batch is its event stream): they are where a batch's
prompts and completions are kept, each row with an expiry after which `purge_expired` deletes
it. Every read names the tenant, so one tenant can never read, list or delete another's file.
Inserts that may be repeated after a crash (a result, an output file with its derived id) keep
the first row: the second writer's content is the same or is discarded.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from tollgate_llm.ledger.schema import batch_files, batch_results, batches


@dataclass(frozen=True, slots=True)
class StoredFile:
    file_id: str
    tenant_id: str
    purpose: str
    filename: str
    bytes: int
    created_at: datetime
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class ItemResult:
    custom_id: str
    request_id: str
    status_code: int
    body: bytes


_META = (
    batch_files.c.file_id, batch_files.c.tenant_id, batch_files.c.purpose,
    batch_files.c.filename, batch_files.c.bytes, batch_files.c.created_at,
    batch_files.c.expires_at,
)


class BatchStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    # --- files ----------------------------------------------------------------------------------

    def put_file(self, stored: StoredFile, content: bytes, *, read_once: bool = False) -> bool:
        """Store a file; False (and nothing changed) when its id exists already. `read_once`:
        deleted by the first read of its content (`content(..., consume=True)`)."""
        try:
            with self.engine.begin() as conn:
                conn.execute(batch_files.insert().values(
                    file_id=stored.file_id, tenant_id=stored.tenant_id, purpose=stored.purpose,
                    filename=stored.filename, bytes=stored.bytes, created_at=stored.created_at,
                    expires_at=stored.expires_at, content=content, read_once=read_once,
                ))
        except IntegrityError:
            return False
        return True

    def file(self, tenant_id: str, file_id: str, now: datetime) -> StoredFile | None:
        """The file's metadata, if it is this tenant's and has not expired."""
        t = batch_files
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(*_META).where(
                    t.c.file_id == file_id, t.c.tenant_id == tenant_id, t.c.expires_at > now
                )
            ).first()
        return StoredFile(*row) if row is not None else None

    def content(
        self, tenant_id: str, file_id: str, now: datetime, *, consume: bool = False
    ) -> bytes | None:
        """The file's content, if it is this tenant's and has not expired. `consume` (the
        customer's download): a read-once file is deleted in the same transaction, so it is
        handed out once, and two downloads at once cannot both get it."""
        t = batch_files
        mine = (t.c.file_id == file_id, t.c.tenant_id == tenant_id, t.c.expires_at > now)
        with self.engine.begin() as conn:
            row = conn.execute(sa.select(t.c.content, t.c.read_once).where(*mine)).first()
            if row is None:
                return None
            if consume and row.read_once:
                taken = conn.execute(t.delete().where(*mine, t.c.read_once.is_(True))).rowcount
                if not taken:  # another read consumed it first
                    return None
            return bytes(row.content)

    def delete_file(self, tenant_id: str, file_id: str) -> bool:
        t = batch_files
        with self.engine.begin() as conn:
            deleted = conn.execute(
                t.delete().where(t.c.file_id == file_id, t.c.tenant_id == tenant_id)
            ).rowcount
        return bool(deleted)

    def set_expiry(self, file_id: str, expires_at: datetime) -> None:
        t = batch_files
        with self.engine.begin() as conn:
            conn.execute(t.update().where(t.c.file_id == file_id).values(expires_at=expires_at))

    def purge_expired(self, now: datetime) -> int:
        """Delete every file past its expiry; how many."""
        t = batch_files
        with self.engine.begin() as conn:
            return int(conn.execute(t.delete().where(t.c.expires_at <= now)).rowcount or 0)

    # --- the registry ---------------------------------------------------------------------------

    def register(self, batch_id: str, tenant_id: str, now: datetime) -> None:
        with self.engine.begin() as conn:
            conn.execute(batches.insert().values(
                batch_id=batch_id, tenant_id=tenant_id, created_at=now, ended_at=None
            ))

    def batch_ids(self, tenant_id: str, after: str | None, limit: int) -> list[str]:
        """A tenant's batches, newest first, after the cursor `after` (a batch id)."""
        t = batches
        query = sa.select(t.c.batch_id).where(t.c.tenant_id == tenant_id)
        with self.engine.connect() as conn:
            if after is not None:
                at = conn.execute(
                    sa.select(t.c.created_at).where(
                        t.c.batch_id == after, t.c.tenant_id == tenant_id
                    )
                ).scalar()
                if at is None:
                    return []
                query = query.where(
                    sa.or_(t.c.created_at < at, sa.and_(t.c.created_at == at, t.c.batch_id < after))
                )
            rows = conn.execute(
                query.order_by(t.c.created_at.desc(), t.c.batch_id.desc()).limit(limit)
            ).scalars()
            return list(rows)

    def open_batches(self) -> list[str]:
        t = batches
        with self.engine.connect() as conn:
            return list(
                conn.execute(
                    sa.select(t.c.batch_id).where(t.c.ended_at.is_(None)).order_by(t.c.created_at)
                ).scalars()
            )

    def mark_ended(self, batch_id: str, now: datetime) -> None:
        t = batches
        with self.engine.begin() as conn:
            conn.execute(t.update().where(t.c.batch_id == batch_id).values(ended_at=now))

    # --- results --------------------------------------------------------------------------------

    def put_result(self, batch_id: str, result: ItemResult, now: datetime) -> ItemResult:
        """Keep an item's response; the one already kept wins (and is returned)."""
        try:
            with self.engine.begin() as conn:
                conn.execute(batch_results.insert().values(
                    batch_id=batch_id, custom_id=result.custom_id, request_id=result.request_id,
                    status_code=result.status_code, body=result.body, created_at=now,
                ))
            return result
        except IntegrityError:
            return self.results(batch_id)[result.custom_id]

    def results(self, batch_id: str) -> dict[str, ItemResult]:
        t = batch_results
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(t.c.custom_id, t.c.request_id, t.c.status_code, t.c.body)
                .where(t.c.batch_id == batch_id)
            ).all()
        return {r[0]: ItemResult(r[0], r[1], r[2], bytes(r[3])) for r in rows}

    def result_outcomes(self, batch_id: str) -> dict[str, ItemResult]:
        """The kept results without their bodies (`body` empty): what a runner's pass needs."""
        t = batch_results
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(t.c.custom_id, t.c.request_id, t.c.status_code)
                .where(t.c.batch_id == batch_id)
            ).all()
        return {r[0]: ItemResult(r[0], r[1], r[2], b"") for r in rows}

    def delete_results(self, batch_id: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(batch_results.delete().where(batch_results.c.batch_id == batch_id))
