"""LoRA adapter commands through the control plane's one command handler
(`ControlService.execute`): what `tollgate adapters` runs, and what an admin front end would
call with the same validation and the same events."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from tollgate_llm.api.services.control_service import ControlService
from tollgate_llm.domain.control_plane.adapters import Adapter, RegisterAdapter, RevokeAdapter
from tollgate_llm.domain.control_plane.state import tenant_stream
from tollgate_llm.domain.errors import DomainError


def rank_of(path: str, rank: int | None) -> int:
    """The rank given, else the `r` of the adapter's own `adapter_config.json` (read where the
    command runs: the replicas read the same path on their machines)."""
    if rank is not None:
        return rank
    config = Path(path) / "adapter_config.json"
    try:
        found = orjson.loads(config.read_bytes()).get("r")
    except (OSError, orjson.JSONDecodeError, AttributeError):
        found = None
    if not isinstance(found, int) or isinstance(found, bool):
        raise DomainError(
            "no_rank", f"give --rank: {config} cannot be read here or has no integer `r`",
            field="rank",
        )  # fmt: skip
    return found


def register(
    service: ControlService, tenant: str, name: str, base: str, path: str,
    rank: int | None = None, projects: tuple[str, ...] = (),
) -> Adapter:  # fmt: skip
    """Register (or re-register, with new weights) a tenant's adapter; returns it as now in
    force."""
    command = RegisterAdapter(tenant, name, base, path, rank_of(path, rank), projects)
    service.execute(tenant_stream(tenant), command)
    adapter = service.view.adapters.live(tenant, name)
    assert adapter is not None
    return adapter


def revoke(service: ControlService, tenant: str, name: str) -> bool:
    """False when it was revoked already."""
    return bool(service.execute(tenant_stream(tenant), RevokeAdapter(tenant, name)))


def set_price(
    service: ControlService, tenant: str, name: str, prompt: int, completion: int, cached: int,
    effective_at: datetime | None = None, *, currency: str,
) -> datetime:  # fmt: skip
    """The adapter's own price (without one it is billed at its base model's)."""
    adapter = service.view.adapters.live(tenant, name)
    if service.view.tenant(tenant) is None or adapter is None:
        raise DomainError("unknown_adapter", f"no adapter {name!r} in tenant {tenant!r}",
                          field="name")  # fmt: skip
    return service.set_price(
        adapter.price_key, prompt, completion, cached, effective_at, currency=currency
    )


def describe(service: ControlService, adapter: Adapter) -> dict[str, Any]:
    view = service.view
    now = adapter.revoked_at or adapter.registered_at
    own_price = view.prices.ever_priced(adapter.price_key)
    return {
        "tenant": adapter.tenant_id,
        "name": adapter.name,
        "base": adapter.base_model,
        "path": adapter.path,
        "rank": adapter.rank,
        "projects": sorted(adapter.projects),
        "version": adapter.version,
        "engine_name": adapter.engine_name,
        "registered_at": adapter.registered_at.isoformat(),
        "revoked_at": adapter.revoked_at.isoformat() if adapter.revoked_at else None,
        "priced": "own"
        if own_price
        else "base"
        if view.has_price(adapter.base_model, now)
        else "none",
    }


def listing(service: ControlService, tenant: str) -> list[dict[str, Any]]:
    service.view._tenant_or_error(tenant)
    return [describe(service, a) for a in service.view.adapters.of_tenant(tenant)]


def show(service: ControlService, tenant: str, name: str) -> dict[str, Any]:
    service.view._tenant_or_error(tenant)
    adapter = service.view.adapters.get(tenant, name)
    if adapter is None:
        raise DomainError("unknown_adapter", f"no adapter {name!r} in tenant {tenant!r}",
                          field="name")  # fmt: skip
    return describe(service, adapter)
