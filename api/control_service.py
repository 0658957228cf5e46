"""Control-plane commands (tenants, keys, limits, prices) run against the event store: fold the
control view, decide, append with the stream's expected version. Used by the CLI and by
`tollgate serve` when it seeds the demo."""

from __future__ import annotations

import hashlib
import secrets
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields
from datetime import UTC, datetime
from typing import Any

from api.config import default_database_url
from domain import control as c
from domain.errors import DomainError
from domain.events import Event
from domain.projections import LEDGER_ENTRIES, REQUEST_LOG, USAGE_HOURLY
from ledger.engine import create_engine_from_url
from ledger.projections import ProjectionRunner
from ledger.schema import upgrade as schema_upgrade
from ledger.store import NewEvent, SqlEventStore, WrongExpectedVersion

PROJECTIONS = {spec.name: spec for spec in (REQUEST_LOG, USAGE_HOURLY, LEDGER_ENTRIES)}


def upgrade(url: str) -> str:
    return schema_upgrade(url)


def new_secret() -> str:
    return "tg_" + secrets.token_urlsafe(30)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def rebuild_projections(
    database_url: str | None, name: str | None
) -> list[tuple[str, str, int]]:
    url = database_url or default_database_url()
    upgrade(url)
    engine = create_engine_from_url(url)
    try:
        store = SqlEventStore(engine)
        if name is not None and name not in PROJECTIONS:
            raise DomainError(
                "unknown_projection",
                f"unknown projection {name!r}; known: {', '.join(sorted(PROJECTIONS))}",
            )
        out = []
        for spec in [PROJECTIONS[name]] if name else PROJECTIONS.values():
            runner = ProjectionRunner(engine, store, spec)
            rows = runner.rebuild()
            out.append((spec.name, runner.table_digest(), rows))
        return out
    finally:
        engine.dispose()


@contextmanager
def open_backoffice(database_url: str | None) -> Iterator[Any]:
    """A Backoffice over the database, with the control view folded (the CLI acts as an
    operator: it has every scope)."""
    from api.backoffice import Backoffice

    url = database_url or default_database_url()
    upgrade(url)
    engine = create_engine_from_url(url)
    try:
        store = SqlEventStore(engine)
        view = c.ControlView()
        for record in store.read_streams_with_prefix(c.CONTROL_PREFIXES):
            view.apply(record)
        yield Backoffice(engine, store, view)
    finally:
        engine.dispose()


class ControlService:
    def __init__(self, store: SqlEventStore) -> None:
        self.store = store
        self.view = c.ControlView()
        for record in store.read_streams_with_prefix(c.CONTROL_PREFIXES):
            self.view.apply(record)

    @classmethod
    @contextmanager
    def open(cls, database_url: str | None) -> Iterator[ControlService]:
        url = database_url or default_database_url()
        upgrade(url)
        engine = create_engine_from_url(url)
        try:
            yield cls(SqlEventStore(engine))
        finally:
            engine.dispose()

    def execute(self, stream_id: str, command: Any, now: datetime | None = None) -> list[Event]:
        """One command, one append: all of its events or none."""
        events = c.decide_control(self.view, command)
        if not events:
            return []
        at = now or datetime.now(UTC)
        tenant_id = getattr(command, "tenant_id", None) or getattr(command, "name", "") or ""
        new = [NewEvent(str(uuid.uuid4()), stream_id, tenant_id, at, e) for e in events]
        expected = self.store.stream_version(stream_id)
        try:
            recorded = self.store.append(stream_id, expected, new)
        except WrongExpectedVersion:
            raise DomainError(
                "concurrent_change",
                f"{stream_id} changed while this command ran; run it again",
            ) from None
        for record in recorded:
            self.view.apply(record)
        return list(events)

    def create_tenant(self, name: str, plan: str) -> None:
        command = c.RegisterTenant(name=name, plan=plan, cache_salt=secrets.token_hex(16))
        self.execute(c.tenant_stream(name), command)

    def change_plan(self, tenant: str, plan: str) -> None:
        self.execute(c.tenant_stream(tenant), c.ChangePlan(tenant_id=tenant, plan=plan))

    def list_tenants(self) -> list[c.Tenant]:
        return self.view.tenants()

    def issue_key(self, tenant: str, scope: str) -> tuple[str, str]:
        secret = new_secret()
        key_id = "key_" + secrets.token_hex(8)
        command = c.IssueApiKey(
            tenant_id=tenant, key_id=key_id, key_hash=hash_secret(secret), scope=scope
        )
        self.execute(c.tenant_stream(tenant), command)
        return key_id, secret

    def revoke_key(self, tenant: str, key_id: str) -> None:
        self.execute(c.tenant_stream(tenant), c.RevokeApiKey(tenant_id=tenant, key_id=key_id))

    def set_limits(self, tenant: str, model: str, **limits: int | None) -> None:
        self.execute(c.tenant_stream(tenant), c.SetLimits(tenant_id=tenant, model=model, **limits))

    def limits_in_force(self, tenant: str, model: str, at: datetime | None) -> dict[str, Any]:
        limits = self.view.limits(tenant, model, at)
        return {
            "plan": self.view.plan(tenant, at),
            **{f.name: getattr(limits, f.name) for f in fields(limits)},
        }

    def set_price(
        self, model: str, prompt: int, completion: int, cached: int,
        effective_at: datetime | None = None,
    ) -> datetime:
        now = datetime.now(UTC)
        effective_at = effective_at or now
        command = c.SetPrice(
            model=model, prompt_micros_per_mtok=prompt, completion_micros_per_mtok=completion,
            cached_micros_per_mtok=cached, effective_at=effective_at, now=now,
        )
        self.execute(c.price_stream(model), command, now)
        return effective_at
