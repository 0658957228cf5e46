"""The admin API's application service: what the CLI does to tenants, keys, limits, budgets,
prices, models, adapters, residency and retention, for an admin key, which is recorded as the
actor of every change.

It validates nothing of its own beyond the shape the routes' models already checked: each call
goes through the CLI's command handler (`ControlService`: the same decisions, the same events,
the same audit record) and the CLI's parsing rules (`usd_micros`, `level_of`, `profile_shape`).
A `DomainError` becomes a 400 naming the request's field (404 for a tenant or key the path names
that does not exist, 409 for a duplicate or a change that kept racing)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Final, TypeVar

from tollgate_llm.api.services import adapter_service, data_policy_service
from tollgate_llm.api.services.control_service import (
    ControlService,
    level_of,
    profile_shape,
    usd_micros,
)
from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.domain.audit.events import Actor
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.ledger.control import ControlLog
from tollgate_llm.ledger.store import SqlEventStore

T = TypeVar("T")

# The domain's name of a field -> the admin API's (a path parameter or a body field).
PARAMS: Final = {
    "tenant_id": "tenant",
    "prompt_micros_per_mtok": "prompt",
    "completion_micros_per_mtok": "completion",
    "cached_micros_per_mtok": "cached",
    "discount_ppm": "percent",
    "kv_lora_rank": "mla_rank",
    "amount_micros": "amount",
    "time_zone": "zone",
}


def _iso(at: datetime) -> str:
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _usd(micros: int | None) -> str | None:
    return None if micros is None else str(Decimal(micros) / 1_000_000)


# What the admin routes' paths name: an unknown one is a 404; an unknown workspace, project or
# key a body names is that field's 400 (the path's resource exists).
PATH_PARAMS: Final = frozenset({"tenant", "key_id", "adapter"})


def api_error(exc: DomainError, renames: Mapping[str, str] | None = None) -> ApiError:
    """A refused command as the API answers it; `renames`: the domain's field names this
    route calls otherwise."""
    field = exc.field or ""
    param = (renames or {}).get(field) or PARAMS.get(field, exc.field)
    if exc.rule.startswith("unknown_") and param in PATH_PARAMS:
        status = 404
    elif exc.rule.startswith("duplicate_") or exc.rule == "concurrent_change":
        status = 409
    else:
        status = 400
    return ApiError(status, exc.message, param=param, code=exc.rule)


class AdminService:
    """One per API process: its own control log (folded on first use, followed before every
    command) and the lock every command and read on it takes (the view is not thread-safe)."""

    def __init__(self, store: SqlEventStore) -> None:
        self.store = store
        self._lock = threading.RLock()
        self._log: ControlLog | None = None

    @contextmanager
    def _control(
        self, key_id: str | None, renames: Mapping[str, str] | None = None
    ) -> Iterator[ControlService]:
        with self._lock:
            if self._log is None:
                self._log = ControlLog(self.store)
            self._log.follow()
            actor = Actor("key", key_id) if key_id else None
            try:
                yield ControlService(self.store, actor, log=self._log, lock=self._lock)
            except DomainError as exc:
                raise api_error(exc, renames) from None

    def _read(self, fn: Callable[[ControlView], T]) -> T:
        with self._control(None) as service:
            return fn(service.view)

    # --- tenants and keys ----------------------------------------------------------------------

    def tenants(self) -> dict[str, Any]:
        tenants = self._read(lambda view: view.tenants())
        return {"object": "list", "data": [self._tenant(t.tenant_id) for t in tenants]}

    def _tenant(self, tenant_id: str) -> dict[str, Any]:
        def read(view: ControlView) -> dict[str, Any]:
            tenant = view.tenant(tenant_id)
            if tenant is None:
                raise DomainError("unknown_tenant", f"no tenant {tenant_id!r}", field="tenant_id")
            return {"object": "tenant", "id": tenant.tenant_id, "plan": tenant.plan,
                    "registered_at": _iso(tenant.registered_at)}  # fmt: skip

        return self._read(read)

    def create_tenant(self, key_id: str, name: str, plan: str) -> dict[str, Any]:
        with self._control(key_id) as service:
            service.create_tenant(name, plan)
        return self._tenant(name)

    def change_plan(self, key_id: str, tenant: str, plan: str) -> dict[str, Any]:
        with self._control(key_id) as service:
            service.change_plan(tenant, plan)
        return self._tenant(tenant)

    def issue_key(
        self, key_id: str, tenant: str, scope: str, project: str | None
    ) -> dict[str, Any]:
        """A new key, its secret in this answer only (the store keeps its SHA-256)."""
        with self._control(key_id) as service:
            issued, secret = service.issue_key(tenant, scope, project)
        return {"object": "api_key", "id": issued, "tenant": tenant, "scope": scope,
                "project": project, "revoked": False, "secret": secret}  # fmt: skip

    def revoke_key(self, key_id: str, tenant: str, revoked: str) -> dict[str, Any]:
        with self._control(key_id) as service:
            service.revoke_key(tenant, revoked)
            key = service.view.key(revoked)
        assert key is not None
        return {"object": "api_key", "id": key.key_id, "tenant": tenant, "scope": key.scope,
                "project": None, "revoked": key.revoked}  # fmt: skip

    def assign_key(self, key_id: str, tenant: str, assigned: str, project: str) -> dict[str, Any]:
        with self._control(key_id, {"key": "key_id"}) as service:  # the key is the path's
            service.assign_key(tenant, assigned, project)
            key = service.view.key(assigned)
        assert key is not None
        return {"object": "api_key", "id": key.key_id, "tenant": tenant, "scope": key.scope,
                "project": project, "revoked": key.revoked}  # fmt: skip

    # --- limits, the hierarchy, budgets --------------------------------------------------------

    def set_limits(
        self, key_id: str, tenant: str, model: str, level: dict[str, str | None],
        limits: dict[str, int | None], *, per_end_user: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        """`per_end_user`: each end user of the project (level "end_user" of it), bounded by
        rpm and tpm only (the command handler refuses any other, naming it)."""
        with self._control(key_id) as service:
            chosen = level_of(tenant, level.get("workspace"), level.get("project"),
                              level.get("key"), org=False, per_end_user=per_end_user)  # fmt: skip
            service.set_limits_at(tenant, chosen, model, **limits)
        kind, level_id = chosen or ("org", tenant)
        recorded = {name: value for name, value in limits.items() if value is not None}
        return {"object": "limits", "tenant": tenant, "level": kind, "level_id": level_id,
                "model": model, "recorded": recorded}  # fmt: skip

    def limits(self, tenant: str, model: str, at: datetime | None) -> dict[str, Any]:
        with self._control(None) as service:
            shown = service.limits_in_force(tenant, model, at)
        return {"object": "limits_in_force", "tenant": tenant, "model": model,
                "at": _iso(at) if at else None, **shown}  # fmt: skip

    def create_workspace(self, key_id: str, tenant: str, name: str) -> dict[str, Any]:
        with self._control(key_id) as service:
            service.create_workspace(tenant, name)
        return {"object": "workspace", "id": name, "tenant": tenant}

    def create_project(self, key_id: str, tenant: str, name: str, workspace: str) -> dict[str, Any]:
        with self._control(key_id) as service:
            service.create_project(tenant, name, workspace)
        return {"object": "project", "id": name, "tenant": tenant, "workspace": workspace}

    def set_budget(
        self, key_id: str, tenant: str, period: str, given: Mapping[str, str | None],
        level: dict[str, str | None], *, currency: str, per_end_user: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        """`given`: the amount (in `currency`) under the one name it was sent as, `amount` or
        the deprecated `usd`; None removes the level's budget for the period. `per_end_user`:
        each end user's of the project, daily only (the command handler's rule)."""
        if len(given) != 1:
            param = "usd" if len(given) > 1 else "amount"
            raise ApiError(400, "give `amount` (null removes the budget), or the deprecated "
                           "`usd`, not both", param=param, code="invalid_value")  # fmt: skip
        [(field, text)] = given.items()
        with self._control(key_id, {"amount_micros": field}) as service:
            kind, level_id = level_of(tenant, level.get("workspace"), level.get("project"),
                                      level.get("key"), org=True,
                                      per_end_user=per_end_user) or ("org", tenant)  # fmt: skip
            amount = None if text is None else usd_micros(text, field)
            changed = service.set_budget(tenant, kind, level_id, period, amount,
                                         currency=currency)  # fmt: skip
        return {"object": "budget", "tenant": tenant, "level": kind, "level_id": level_id,
                "period": period, "amount_micros": amount, "amount": _usd(amount),
                "usd": _usd(amount), "currency": currency, "changed": changed}  # fmt: skip

    def set_time_zone(self, key_id: str, tenant: str, zone: str) -> dict[str, Any]:
        with self._control(key_id) as service:
            changed = service.set_time_zone(tenant, zone)
        return {"object": "time_zone", "tenant": tenant, "zone": zone, "changed": changed}

    # --- prices and models ---------------------------------------------------------------------

    def set_price(
        self, key_id: str, model: str, prompt: str, completion: str, cached: str,
        effective_at: datetime | None, *, currency: str,
    ) -> dict[str, Any]:  # fmt: skip
        with self._control(key_id) as service:
            given = {"prompt": prompt, "completion": completion, "cached": cached}
            micros = [usd_micros(text, name) for name, text in given.items()]
            at = service.set_price(model, *micros, _aware(effective_at), currency=currency)
        return {"object": "price", "model": model, "currency": currency,
                "prompt_micros_per_mtok": micros[0], "completion_micros_per_mtok": micros[1],
                "cached_micros_per_mtok": micros[2], "effective_at": _iso(at)}  # fmt: skip

    def set_flex_discount(
        self, key_id: str, model: str, percent: Decimal, effective_at: datetime | None
    ) -> dict[str, Any]:
        ppm = percent * 10_000
        if ppm != ppm.to_integral_value():
            raise ApiError(400, "percent has more than four decimals", param="percent",
                           code="invalid_value")  # fmt: skip
        with self._control(key_id) as service:
            at = service.set_flex_discount(model, int(ppm), _aware(effective_at))
        return {"object": "flex_discount", "model": model, "discount_ppm": int(ppm),
                "effective_at": _iso(at)}  # fmt: skip

    def register_model(
        self, key_id: str, model: str, dimensions: dict[str, int | None],
        effective_at: datetime | None,
    ) -> dict[str, Any]:  # fmt: skip
        with self._control(key_id) as service:
            shape = profile_shape(model, None, **dimensions)
            service.register_model(model, shape, _aware(effective_at))
        return self.model(model, None)

    def model(self, model: str, at: datetime | None) -> dict[str, Any]:
        def read(view: ControlView) -> dict[str, Any]:
            profile = view.model_profile(model, _aware(at))
            history = view.model_profiles(model)
            return {
                "object": "model_profile", "model": model, **dataclasses.asdict(profile),
                "kv_bytes_per_token": profile.kv_bytes_per_token,
                "history": [{"effective_at": _iso(when), **dataclasses.asdict(p)}
                            for when, p in history],
            }  # fmt: skip

        return self._read(read)


    # --- adapters, residency, retention --------------------------------------------------------

    def register_adapter(
        self, key_id: str, tenant: str, name: str, base: str, path: str, rank: int | None,
        projects: tuple[str, ...],
    ) -> dict[str, Any]:  # fmt: skip
        """Register (or re-register, with new weights) a tenant's LoRA adapter."""
        with self._control(key_id) as service:
            service.view._tenant_or_error(tenant)  # before reading the path's rank: a 404 first
            adapter = adapter_service.register(service, tenant, name, base, path, rank, projects)
            return {"object": "adapter", **adapter_service.describe(service, adapter)}

    def revoke_adapter(self, key_id: str, tenant: str, name: str) -> dict[str, Any]:
        with self._control(key_id, ADAPTER_PATH) as service:
            service.view._tenant_or_error(tenant)
            changed = adapter_service.revoke(service, tenant, name)
            return {"object": "adapter", **adapter_service.show(service, tenant, name),
                    "changed": changed}  # fmt: skip

    def adapters(self, tenant: str) -> dict[str, Any]:
        with self._control(None) as service:
            found = adapter_service.listing(service, tenant)
        return {"object": "list", "data": [{"object": "adapter", **a} for a in found]}

    def adapter(self, tenant: str, name: str) -> dict[str, Any]:
        with self._control(None, ADAPTER_PATH) as service:
            return {"object": "adapter", **adapter_service.show(service, tenant, name)}

    def price_adapter(
        self, key_id: str, tenant: str, name: str, prompt: str, completion: str, cached: str,
        effective_at: datetime | None, *, currency: str,
    ) -> dict[str, Any]:  # fmt: skip
        with self._control(key_id, ADAPTER_PATH) as service:
            service.view._tenant_or_error(tenant)
            given = {"prompt": prompt, "completion": completion, "cached": cached}
            micros = [usd_micros(text, field) for field, text in given.items()]
            at = adapter_service.set_price(service, tenant, name, *micros, _aware(effective_at),
                                    currency=currency)  # fmt: skip
        return {"object": "adapter_price", "tenant": tenant, "adapter": name,
                "currency": currency, "prompt_micros_per_mtok": micros[0],
                "completion_micros_per_mtok": micros[1], "cached_micros_per_mtok": micros[2],
                "effective_at": _iso(at)}  # fmt: skip

    def set_residency(
        self, key_id: str, tenant: str, regions: list[str], project: str | None
    ) -> dict[str, Any]:
        """Pin the tenant (or one project) to `regions` (each checked by the schema's pattern:
        no comma, so joining them is the CLI's `--regions` text)."""
        with self._control(key_id) as service:
            changed = data_policy_service.set_residency(service, tenant, ",".join(regions), project)
            return self._residency(service, tenant, project, changed)

    def clear_residency(self, key_id: str, tenant: str, project: str | None) -> dict[str, Any]:
        with self._control(key_id) as service:
            changed = data_policy_service.clear_residency(service, tenant, project)
            return self._residency(service, tenant, project, changed)

    @staticmethod
    def _residency(
        service: ControlService, tenant: str, project: str | None, changed: bool
    ) -> dict[str, Any]:
        pinned = service.view.data_policy.pinned(tenant, project)
        return {"object": "residency", "tenant": tenant, "project": project,
                "regions": None if pinned is None else sorted(pinned),
                "changed": changed}  # fmt: skip

    def set_retention(
        self, key_id: str, tenant: str, tier: str, project: str | None
    ) -> dict[str, Any]:
        with self._control(key_id) as service:
            changed = data_policy_service.set_retention(service, tenant, tier, project)
        return {"object": "retention", "tenant": tenant, "project": project, "tier": tier,
                "changed": changed}  # fmt: skip

    def data_policy(self, tenant: str) -> dict[str, Any]:
        with self._control(None) as service:
            return {"object": "data_policy", **data_policy_service.data_policy(service, tenant)}


# The adapter routes name the adapter in their path (`{adapter}`): an unknown one is a 404.
ADAPTER_PATH: Final = {"name": "adapter"}


def _aware(at: datetime | None) -> datetime | None:
    return at.replace(tzinfo=UTC) if at is not None and at.tzinfo is None else at
