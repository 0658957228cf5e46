"""Control-plane commands (tenants, keys, limits, prices) run against the event store: fold the
control view, decide, append with the stream's expected version, each command closed by its
sealed audit record (domain/audit/). The one command handler of the CLI, of the admin API
(api/services/admin_service.py) and of `tollgate serve` when it seeds the demo."""

from __future__ import annotations

import getpass
import hashlib
import os
import secrets
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import orjson

from tollgate_llm.domain.audit.chain import AuditRow
from tollgate_llm.domain.audit.events import Actor, ChangeAudited
from tollgate_llm.domain.audit.record import Append, audit_record
from tollgate_llm.domain.control_plane.decide import (
    AllowFallback,
    AllowRouting,
    ChangePlan,
    ControlCommand,
    IssueApiKey,
    RegisterModelProfile,
    RegisterTenant,
    RevokeApiKey,
    RevokeFallback,
    RevokeRouting,
    SetFlexDiscount,
    SetLimits,
    SetPrice,
    SetSlo,
    decide_control,
)
from tollgate_llm.domain.control_plane.state import (
    ControlView,
    Tenant,
    model_stream,
    price_stream,
    slo_stream,
    tenant_stream,
)
from tollgate_llm.domain.cost import ModelProfile, profile_from_hf_config
from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.errors import MAX_AMOUNT_MICROS, DomainError
from tollgate_llm.domain.governance.decide import (
    AssignKey,
    CreateProject,
    CreateWorkspace,
    MoveProject,
    SetBudget,
    SetLevelLimits,
    SetRunPolicy,
    SetTimeZone,
)
from tollgate_llm.domain.governance.end_users import END_USER
from tollgate_llm.domain.projections import PROJECTIONS_BY_NAME
from tollgate_llm.domain.runs.state import RunLimits
from tollgate_llm.ledger.audit import stream_rows
from tollgate_llm.ledger.commands import CommandHandler
from tollgate_llm.ledger.control import ControlLog
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.ids import new_event_id
from tollgate_llm.ledger.projections import ProjectionRunner
from tollgate_llm.ledger.schema import upgrade as schema_upgrade
from tollgate_llm.ledger.store import SqlEventStore

# How far ahead a new SLO takes effect by default (see ControlService.set_slo).
SLO_LEAD = timedelta(seconds=5)


def upgrade(url: str) -> str:
    return schema_upgrade(url)


def new_secret() -> str:
    return "tg_" + secrets.token_urlsafe(30)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def usd_micros(text: str, field: str) -> int:
    """A decimal amount of dollars (`25`, `0.50`) as micro-dollars, or a DomainError naming
    `field`: the one rule of the CLI's amounts and the admin API's."""
    try:
        value = Decimal(text)
    except InvalidOperation:
        value = Decimal("NaN")
    if not value.is_finite():
        raise DomainError("bad_amount", f"{text!r} is not a decimal amount", field=field)
    if value < 0:
        raise DomainError("bad_amount", f"{text} is negative", field=field)
    if value > MAX_AMOUNT_MICROS // 1_000_000:  # before any arithmetic: 1e999999999 overflows
        raise DomainError(
            "too_large", f"{text} is over {MAX_AMOUNT_MICROS // 1_000_000:,} dollars",
            field=field,
        )
    micros = value * 1_000_000
    if micros != micros.to_integral_value():
        raise DomainError(
            "bad_amount", f"{text} has more precision than a micro-dollar", field=field
        )
    return int(micros)


def level_of(
    tenant: str, workspace: str | None, project: str | None, key: str | None, *, org: bool,
    per_end_user: bool = False,
) -> tuple[str, str] | None:  # fmt: skip
    """The one level named by a workspace, a project or a key (none: the organization's own when
    `org`, else None). `per_end_user`: each end user of the project, set at level "end_user" of
    the project, which must be named, and alone."""
    given = [(kind, value) for kind, value in
             (("workspace", workspace), ("project", project), ("key", key)) if value]  # fmt: skip
    if per_end_user:
        others = [kind for kind, _ in given if kind != "project"]
        if project is None or others:
            raise DomainError(
                "bad_level", "per-end-user limits and budgets are a project's, with no other "
                "level", field=others[0] if others else "project",
            )  # fmt: skip
        return (END_USER, project)
    if len(given) > 1:
        raise DomainError(
            "bad_level", "give at most one of workspace, project, key", field=given[1][0]
        )
    if given:
        return given[0]
    return ("org", tenant) if org else None


def rebuild_projections(
    database_url: str, name: str | None
) -> list[tuple[str, str, int]]:
    url = database_url
    upgrade(url)
    engine = create_engine_from_url(url)
    try:
        store = SqlEventStore(engine)
        if name is not None and name not in PROJECTIONS_BY_NAME:
            raise DomainError(
                "unknown_projection",
                f"unknown projection {name!r}; known: {', '.join(sorted(PROJECTIONS_BY_NAME))}",
            )
        out = []
        for spec in [PROJECTIONS_BY_NAME[name]] if name else PROJECTIONS_BY_NAME.values():
            runner = ProjectionRunner(engine, store, spec)
            rows = runner.rebuild()
            out.append((spec.name, runner.table_digest(), rows))
        return out
    finally:
        engine.dispose()


@contextmanager
def open_backoffice(database_url: str) -> Iterator[Any]:
    """A Backoffice over the database, with the control view folded (the CLI acts as an
    operator: it has every scope)."""
    from tollgate_llm.api.services.backoffice import Backoffice

    url = database_url
    upgrade(url)
    engine = create_engine_from_url(url)
    try:
        store = SqlEventStore(engine)
        yield Backoffice(engine, store, ControlLog(store).view)
    finally:
        engine.dispose()


def operator(name: str | None, *, required: bool) -> Actor:
    """The CLI's actor: `name` (--actor, TOLLGATE_ACTOR), else the OS user at this host, unless
    the setting `require_actor` says a name must be given."""
    if name:
        return Actor("operator", name)
    if required:
        raise DomainError(
            "no_actor", "this deployment requires an actor for control-plane changes: give "
            "--actor NAME (or TOLLGATE_ACTOR)", field="actor",
        )  # fmt: skip
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for this uid (a container)
        user = f"uid{os.getuid()}"
    return Actor("operator", f"{user}@{socket.gethostname()}"[:200])


# Tollgate itself, when `tollgate serve` seeds the demo tenants, keys and prices.
SYSTEM = Actor("system", "tollgate serve")


class ControlService:
    """`actor`: who the changes are recorded as made by (None: a reader, whose changes are
    refused). `log` and `lock`: a control log kept by a long-lived process (the admin API) and
    the lock every command on it takes; by default its own, folded now."""

    def __init__(
        self, store: SqlEventStore, actor: Actor | None = None, *, log: ControlLog | None = None,
        lock: threading.Lock | None = None,
    ) -> None:  # fmt: skip
        self.store = store
        self.actor = actor
        self.log = log or ControlLog(store)
        self.view = self.log.view
        self.commands = CommandHandler(store)
        self.lock = lock or threading.Lock()

    @classmethod
    @contextmanager
    def open(cls, database_url: str, actor: Actor | None = None) -> Iterator[ControlService]:
        url = database_url
        upgrade(url)
        engine = create_engine_from_url(url)
        try:
            yield cls(SqlEventStore(engine), actor)
        finally:
            engine.dispose()

    def execute(
        self, stream_id: str, command: ControlCommand, now: datetime | None = None
    ) -> list[Event]:
        """One command, one append: its facts and their sealed audit record, or nothing; decided
        on the control plane as folded and appended at the version folded (a concurrent change
        makes it decide again). Answers the facts (none when the command changed nothing)."""
        actor = self.actor
        if actor is None:
            raise DomainError("no_actor", "a control-plane change needs an actor", field="actor")
        tenant_id = getattr(command, "tenant_id", None) or getattr(command, "name", "") or ""
        at = now or datetime.now(UTC)
        ids: dict[int, str] = {}

        def event_id(i: int) -> str:  # the same on a retry: the record seals these ids
            return ids.setdefault(i, new_event_id())

        def load() -> tuple[tuple[ControlView, int, list[AuditRow]], int]:
            view, version = self.log.loader(stream_id)()
            return (view, version, stream_rows(self.store.engine, stream_id, version)), version

        def decide(state: tuple[ControlView, int, list[AuditRow]]) -> tuple[Event, ...]:
            view, version, stored = state
            facts = decide_control(view, command)
            if not facts:
                return ()
            ids_ = tuple(event_id(i) for i in range(len(facts) + 1))
            where = Append(stream_id, tenant_id, version, ids_, at)
            return (*facts, audit_record(where, stored, facts, actor, type(command).__name__))

        with self.lock:
            handled = self.commands.handle(
                stream_id, decide, load, tenant_id=tenant_id, at=at, event_id=event_id
            )
            for record in handled.records:
                self.view.apply(record)
        return [e for e in handled.events if not isinstance(e, ChangeAudited)]

    def create_tenant(self, name: str, plan: str) -> None:
        command = RegisterTenant(name=name, plan=plan, cache_salt=secrets.token_hex(16))
        self.execute(tenant_stream(name), command)

    def change_plan(self, tenant: str, plan: str) -> None:
        self.execute(tenant_stream(tenant), ChangePlan(tenant_id=tenant, plan=plan))

    def list_tenants(self) -> list[Tenant]:
        return self.view.tenants()

    def issue_key(
        self, tenant: str, scope: str, project: str | None = None
    ) -> tuple[str, str]:
        secret = new_secret()
        key_id = "key_" + secrets.token_hex(8)
        command = IssueApiKey(
            tenant_id=tenant, key_id=key_id, key_hash=hash_secret(secret), scope=scope,
            project_id=project,
        )
        self.execute(tenant_stream(tenant), command)
        return key_id, secret

    def revoke_key(self, tenant: str, key_id: str) -> None:
        self.execute(tenant_stream(tenant), RevokeApiKey(tenant_id=tenant, key_id=key_id))

    def set_limits(self, tenant: str, model: str, **limits: int | None) -> None:
        self.execute(tenant_stream(tenant), SetLimits(tenant_id=tenant, model=model, **limits))

    def set_limits_at(
        self, tenant: str, level: tuple[str, str] | None, model: str, **limits: int | None
    ) -> None:
        """Limits of the organization (`level` None) or of one workspace, project or key."""
        if level is None:
            self.set_limits(tenant, model, **limits)
            return
        if limits.pop("reserved_kv_gib_seconds", None) is not None:
            raise DomainError(
                "bad_level", "reserved_kv_gib_seconds is an organization's limit",
                field="reserved_kv_gib_seconds",
            )  # fmt: skip
        self.set_level_limits(tenant, *level, model, **limits)

    def limits_in_force(self, tenant: str, model: str, at: datetime | None) -> dict[str, Any]:
        limits = self.view.limits(tenant, model, at)
        return {
            "plan": self.view.plan(tenant, at),
            **{f.name: getattr(limits, f.name) for f in fields(limits)},
        }

    def set_price(
        self, model: str, prompt: int, completion: int, cached: int,
        effective_at: datetime | None = None, *, currency: str,
    ) -> datetime:
        """A price for `model` from `effective_at` (default now), in `currency` (the setting)."""
        now = datetime.now(UTC)
        effective_at = effective_at or now
        command = SetPrice(
            model=model, prompt_micros_per_mtok=prompt, completion_micros_per_mtok=completion,
            cached_micros_per_mtok=cached, effective_at=effective_at, now=now, currency=currency,
        )
        self.execute(price_stream(model), command, now)
        return effective_at

    def set_flex_discount(
        self, model: str, discount_ppm: int, effective_at: datetime | None = None
    ) -> datetime:
        """The flex class's discount on `model`'s price, from `effective_at` (default now)."""
        now = datetime.now(UTC)
        effective_at = effective_at or now
        command = SetFlexDiscount(
            model=model, discount_ppm=discount_ppm, effective_at=effective_at, now=now
        )
        self.execute(price_stream(model), command, now)
        return effective_at

    def register_model(
        self, model: str, shape: dict[str, Any], effective_at: datetime | None = None
    ) -> tuple[ModelProfile, datetime]:
        """Record a model profile (`shape`: the RegisterModelProfile fields, from
        `profile_shape`); returns the profile now in force for it and when it takes effect."""
        now = datetime.now(UTC)
        command = RegisterModelProfile(model=model, effective_at=effective_at, now=now, **shape)
        self.execute(model_stream(model), command, now)
        return self.view.model_profile(model, effective_at or now), effective_at or now


    def set_slo(
        self, tier: str, ttft_ms: int, tpot_us: int, effective_at: datetime | None = None
    ) -> datetime:
        """A tier's objective from `effective_at` on. The default is a few seconds ahead, so
        that every edge's control-plane follower (200 ms) has it before it takes effect and
        the edges' live counters judge each request by the same objective as the replay."""
        now = datetime.now(UTC)
        effective_at = effective_at or now + SLO_LEAD
        command = SetSlo(tier, ttft_ms, tpot_us, effective_at, now)
        self.execute(slo_stream(tier), command, now)
        return effective_at

    # --- the hierarchy, budgets and runs ------------------------------------------------------

    def create_workspace(self, tenant: str, name: str) -> None:
        self.execute(tenant_stream(tenant), CreateWorkspace(tenant, name))

    def create_project(self, tenant: str, name: str, workspace: str) -> None:
        self.execute(tenant_stream(tenant), CreateProject(tenant, name, workspace))

    def move_project(self, tenant: str, project: str, workspace: str) -> bool:
        command = MoveProject(tenant, project, workspace)
        return bool(self.execute(tenant_stream(tenant), command))

    def assign_key(self, tenant: str, key_id: str, project: str) -> bool:
        return bool(self.execute(tenant_stream(tenant), AssignKey(tenant, key_id, project)))

    def set_level_limits(
        self, tenant: str, level: str, level_id: str, model: str, **limits: int | None
    ) -> None:
        command = SetLevelLimits(tenant, level, level_id, model, **limits)
        self.execute(tenant_stream(tenant), command)

    def set_budget(
        self, tenant: str, level: str, level_id: str, period: str, amount_micros: int | None,
        *, currency: str,
    ) -> bool:  # fmt: skip
        """A budget of `amount_micros` micro-units of `currency` (ISO 4217; the CLI gives the
        deployment's setting unless told), or None to remove it."""
        command = SetBudget(tenant, level, level_id, period, amount_micros, currency)
        return bool(self.execute(tenant_stream(tenant), command))

    def set_time_zone(self, tenant: str, zone: str) -> bool:
        return bool(self.execute(tenant_stream(tenant), SetTimeZone(tenant, zone)))

    def set_run_policy(self, tenant: str, project: str, limits: RunLimits) -> None:
        self.execute(tenant_stream(tenant), SetRunPolicy(tenant, project, limits))

    def allow_fallback(self, tenant: str, from_model: str, to_model: str) -> bool:
        command = AllowFallback(tenant, from_model, to_model)
        return bool(self.execute(tenant_stream(tenant), command))

    def revoke_fallback(self, tenant: str, from_model: str, to_model: str) -> bool:
        command = RevokeFallback(tenant, from_model, to_model)
        return bool(self.execute(tenant_stream(tenant), command))

    def allow_routing(self, command: AllowRouting) -> bool:
        return bool(self.execute(tenant_stream(command.tenant_id), command))

    def revoke_routing(self, tenant: str, project: str = "") -> bool:
        return bool(self.execute(tenant_stream(tenant), RevokeRouting(tenant, project)))


def profile_shape(
    model: str, hf_config: str | None, **flags: int | None
) -> dict[str, Any]:
    """The RegisterModelProfile fields from a config.json (a file or its directory) and/or flags;
    a flag overrides the file. `kv_lora_rank` makes it MLA. Missing dimensions are a one-line
    error naming them."""
    shape: dict[str, Any] = {}
    if hf_config is not None:
        path = Path(hf_config)
        path = path / "config.json" if path.is_dir() else path
        try:
            config = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError) as exc:
            raise DomainError("bad_hf_config", f"cannot read {path}: {exc}") from None
        profile = profile_from_hf_config(model, config)
        shape = {
            name: getattr(profile, name)
            for name in ("layers", "kv_heads", "head_dim", "dtype_bytes", "kv_lora_rank",
                         "rope_dim", "attention")
        }  # fmt: skip
        if isinstance(config.get("max_position_embeddings"), int):
            shape["max_model_len"] = profile.max_model_len
    shape.update({name: value for name, value in flags.items() if value is not None})
    if flags.get("kv_lora_rank"):
        shape["attention"] = "mla"
    mla = shape.get("attention") == "mla"
    needed = ("layers", "dtype_bytes") + (("kv_lora_rank",) if mla else ("kv_heads", "head_dim"))
    missing = [name for name in needed if not shape.get(name)]
    if missing:
        flags_missing = ", ".join("--" + n.replace("_", "-").replace("kv-lora-rank", "mla-rank")
                                  for n in missing)  # fmt: skip
        raise DomainError(
            "incomplete_profile",
            f"model profile for {model} lacks {flags_missing} (or give --hf-config)",
        )
    return shape
