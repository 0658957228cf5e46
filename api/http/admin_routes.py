"""The admin API (`/v1/admin/...`) and the audit trail (`/v1/audit`): admin keys only. What the
CLI does to tenants, keys, limits, budgets, prices, models, adapters, residency and retention,
through the same command handler (api/services/admin_service.py over ControlService), with the
calling key as the actor of every change. Routes parse, call the service off the event loop
(`run`), render."""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations, and the admin
# dependency they name is this function's local, not a module global.
import asyncio
import functools
from collections.abc import Callable
from decimal import Decimal
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Path, Query, Request
from fastapi.responses import Response

from tollgate_llm.api.http.admin_schemas import (
    AdapterPriceSet,
    AdapterRegister,
    AdminAdapter,
    AdminAdapterList,
    AdminAdapterPrice,
    AdminBudget,
    AdminDataPolicy,
    AdminFlexDiscount,
    AdminKey,
    AdminModelProfile,
    AdminPrice,
    AdminProject,
    AdminResidency,
    AdminRetention,
    AdminTenant,
    AdminTenantList,
    AdminTimeZone,
    AdminWorkspace,
    AuditPage,
    AuditReport,
    BudgetSet,
    FlexDiscountSet,
    Instant,
    IssuedKey,
    KeyCreate,
    KeyProject,
    LimitsInForce,
    LimitsRecorded,
    LimitsSet,
    ModelRegister,
    PlanChange,
    PriceSet,
    ProjectCreate,
    ResidencyClear,
    ResidencySet,
    RetentionSet,
    TenantCreate,
    TimeZoneSet,
    WorkspaceCreate,
)
from tollgate_llm.api.http.schemas import AUTHENTICATED, BearerDep, IntegerText, answers
from tollgate_llm.api.services.admin_service import AdminService
from tollgate_llm.api.services.audit_service import AUDIT_LIMIT_DEFAULT, AUDIT_LIMIT_MAX, AuditTrail
from tollgate_llm.api.services.auth import Caller
from tollgate_llm.ledger.ids import new_request_id

ADMIN = frozenset({"admin"})
TenantPath = Annotated[str, Path(description="a tenant's id", max_length=63)]
KeyPath = Annotated[str, Path(description="an API key id of the tenant", max_length=64)]
AdapterPath = Annotated[str, Path(description="an adapter of the tenant", max_length=64)]
ModelPath = Annotated[str, Path(description="a model name or version", max_length=193)]
AtQuery = Annotated[Instant | None, Query(description="an RFC 3339 instant (default: now)")]
LEVEL = ("workspace", "project", "key")


def add_admin_routes(
    app: FastAPI,
    admin: AdminService,
    audit: AuditTrail,
    key_caller: Callable[[Request, frozenset[str]], Caller],
    render: Callable[[int, Any, dict[str, str]], Response],
    *,
    currency: str,
) -> None:
    """`key_caller(request, scopes)` is the app's authentication (through its limiter),
    `render(status, body, headers)` its JSON response, `currency` the prices' setting."""

    async def admin_key(request: Request, _bearer: BearerDep) -> Caller:
        request.state.request_id = new_request_id()
        return key_caller(request, ADMIN)

    AdminDep = Annotated[Caller, Depends(admin_key)]  # noqa: N806 - a type alias

    def done(request: Request, body: Any) -> Response:
        return render(200, body, {"X-Request-Id": request.state.request_id})

    async def run(request: Request, command: Callable[..., Any], *args: Any, **kw: Any) -> Response:
        """Every admin route's one shape: the command handler's call off the event loop (its
        lock and the store's I/O would block it), its answer rendered."""
        return done(request, await asyncio.to_thread(functools.partial(command, *args, **kw)))

    def level(body: Any) -> dict[str, str | None]:
        return {name: getattr(body, name) for name in LEVEL}

    # --- tenants and keys ----------------------------------------------------------------------

    @app.get(
        "/v1/admin/tenants", operation_id="admin_list_tenants", summary="Every tenant and its plan",
        response_model=AdminTenantList, responses=answers(*AUTHENTICATED),
    )  # fmt: skip
    async def list_tenants(request: Request, caller: AdminDep) -> Response:
        return await run(request, admin.tenants)

    @app.post(
        "/v1/admin/tenants", operation_id="admin_create_tenant",
        summary="Create a tenant (`tollgate tenants create`)",
        response_model=AdminTenant, responses=answers(*AUTHENTICATED, 409),
    )  # fmt: skip
    async def create_tenant(request: Request, caller: AdminDep, body: TenantCreate) -> Response:
        return await run(request, admin.create_tenant, caller.key_id, body.name, body.plan)

    @app.post(
        "/v1/admin/tenants/{tenant}/plan", operation_id="admin_change_plan",
        summary="Move a tenant to another plan (`tollgate tenants plan`)",
        response_model=AdminTenant, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def change_plan(
        request: Request, caller: AdminDep, tenant: TenantPath, body: PlanChange
    ) -> Response:
        return await run(request, admin.change_plan, caller.key_id, tenant, body.plan)

    @app.post(
        "/v1/admin/tenants/{tenant}/keys", operation_id="admin_issue_key",
        summary="Issue an API key (`tollgate keys issue`): its secret is in this answer only",
        response_model=IssuedKey, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def issue_key(
        request: Request, caller: AdminDep, tenant: TenantPath,
        body: Annotated[KeyCreate, Body()] = KeyCreate(),  # noqa: B008 - an immutable default
    ) -> Response:  # fmt: skip
        return await run(request, admin.issue_key, caller.key_id, tenant, body.scope, body.project)

    @app.post(
        "/v1/admin/tenants/{tenant}/keys/{key_id}/revoke", operation_id="admin_revoke_key",
        summary="Revoke an API key (`tollgate keys revoke`): refused within 0.2 s on every edge",
        response_model=AdminKey, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def revoke_key(
        request: Request, caller: AdminDep, tenant: TenantPath, key_id: KeyPath
    ) -> Response:
        return await run(request, admin.revoke_key, caller.key_id, tenant, key_id)

    @app.post(
        "/v1/admin/tenants/{tenant}/keys/{key_id}/project", operation_id="admin_assign_key",
        summary="Move a key into a project (`tollgate keys assign`)",
        response_model=AdminKey, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def assign_key(
        request: Request, caller: AdminDep, tenant: TenantPath, key_id: KeyPath, body: KeyProject
    ) -> Response:
        return await run(request, admin.assign_key, caller.key_id, tenant, key_id, body.project)

    # --- limits, the hierarchy, budgets --------------------------------------------------------

    @app.post(
        "/v1/admin/tenants/{tenant}/limits", operation_id="admin_set_limits",
        summary="Limits of the organization, of one workspace, project or key, or of each end "
        "user of a project (`tollgate limits set [--per-end-user]`)",
        response_model=LimitsRecorded, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def set_limits(
        request: Request, caller: AdminDep, tenant: TenantPath, body: LimitsSet
    ) -> Response:
        limits = body.model_dump(exclude={"model", "per_end_user", *LEVEL})
        return await run(
            request, admin.set_limits, caller.key_id, tenant, body.model, level(body), limits,
            per_end_user=body.per_end_user,
        )  # fmt: skip

    @app.get(
        "/v1/admin/tenants/{tenant}/limits", operation_id="admin_show_limits",
        summary="The limits in force for a tenant and model, now or then (`tollgate limits show`)",
        response_model=LimitsInForce, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def show_limits(
        request: Request, caller: AdminDep, tenant: TenantPath,
        model: Annotated[str, Query(min_length=1, max_length=193, description="a model")],
        at: AtQuery = None,
    ) -> Response:  # fmt: skip
        return await run(request, admin.limits, tenant, model, at)

    @app.post(
        "/v1/admin/tenants/{tenant}/workspaces", operation_id="admin_create_workspace",
        summary="Create a workspace (`tollgate workspaces create`)",
        response_model=AdminWorkspace, responses=answers(*AUTHENTICATED, 404, 409),
    )  # fmt: skip
    async def create_workspace(
        request: Request, caller: AdminDep, tenant: TenantPath, body: WorkspaceCreate
    ) -> Response:
        return await run(request, admin.create_workspace, caller.key_id, tenant, body.name)

    @app.post(
        "/v1/admin/tenants/{tenant}/projects", operation_id="admin_create_project",
        summary="Create a project in a workspace (`tollgate projects create`)",
        response_model=AdminProject, responses=answers(*AUTHENTICATED, 404, 409),
    )  # fmt: skip
    async def create_project(
        request: Request, caller: AdminDep, tenant: TenantPath, body: ProjectCreate
    ) -> Response:
        return await run(
            request, admin.create_project, caller.key_id, tenant, body.name, body.workspace
        )

    @app.post(
        "/v1/admin/tenants/{tenant}/budgets", operation_id="admin_set_budget",
        summary="A spend budget per calendar day or month at one level, or per day for each end "
        "user of a project (`tollgate budgets set`, `tollgate limits set --per-end-user`)",
        response_model=AdminBudget, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def set_budget(
        request: Request, caller: AdminDep, tenant: TenantPath, body: BudgetSet
    ) -> Response:
        return await run(
            request, admin.set_budget, caller.key_id, tenant, body.period, body.amount_given(),
            level(body), currency=body.currency or currency, per_end_user=body.per_end_user,
        )  # fmt: skip

    @app.post(
        "/v1/admin/tenants/{tenant}/time-zone", operation_id="admin_set_time_zone",
        summary="Where the tenant's budget days and months begin (`tollgate budgets timezone`)",
        response_model=AdminTimeZone, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def set_time_zone(
        request: Request, caller: AdminDep, tenant: TenantPath, body: TimeZoneSet
    ) -> Response:
        return await run(request, admin.set_time_zone, caller.key_id, tenant, body.zone)

    # --- prices and models ---------------------------------------------------------------------

    @app.post(
        "/v1/admin/prices", operation_id="admin_set_price",
        summary="A model's price per million tokens, effective-dated (`tollgate prices set`)",
        response_model=AdminPrice, responses=answers(*AUTHENTICATED),
    )  # fmt: skip
    async def set_price(request: Request, caller: AdminDep, body: PriceSet) -> Response:
        return await run(
            request, admin.set_price, caller.key_id, body.model, body.prompt, body.completion,
            body.cached, body.effective_at, currency=currency,
        )  # fmt: skip

    @app.post(
        "/v1/admin/prices/flex-discount", operation_id="admin_set_flex_discount",
        summary="The flex class's discount on a model's price (`tollgate prices flex-discount`)",
        response_model=AdminFlexDiscount, responses=answers(*AUTHENTICATED),
    )  # fmt: skip
    async def set_flex_discount(
        request: Request, caller: AdminDep, body: FlexDiscountSet
    ) -> Response:
        return await run(
            request, admin.set_flex_discount, caller.key_id, body.model,
            Decimal(str(body.percent)), body.effective_at,
        )  # fmt: skip

    @app.post(
        "/v1/admin/models", operation_id="admin_register_model",
        summary="A model's KV profile, effective-dated (`tollgate models register`)",
        response_model=AdminModelProfile, responses=answers(*AUTHENTICATED),
    )  # fmt: skip
    async def register_model(request: Request, caller: AdminDep, body: ModelRegister) -> Response:
        dimensions = body.model_dump(exclude={"model", "effective_at", "mla_rank"})
        dimensions["kv_lora_rank"] = body.mla_rank
        return await run(
            request, admin.register_model, caller.key_id, body.model, dimensions,
            body.effective_at,
        )  # fmt: skip

    @app.get(
        # `:path`: a model name may hold a slash (`org/model`), which a client sends as %2F.
        "/v1/admin/models/{model:path}", operation_id="admin_show_model",
        summary="A model's KV profile in force, and its history (`tollgate models show`)",
        response_model=AdminModelProfile, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def show_model(
        request: Request, caller: AdminDep, model: ModelPath, at: AtQuery = None
    ) -> Response:
        return await run(request, admin.model, model, at)

    # --- adapters, residency, retention --------------------------------------------------------

    @app.post(
        "/v1/admin/tenants/{tenant}/adapters", operation_id="admin_register_adapter",
        summary="Register (or re-register) a tenant's LoRA adapter (`tollgate adapters register`)",
        response_model=AdminAdapter, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def register_adapter(
        request: Request, caller: AdminDep, tenant: TenantPath, body: AdapterRegister
    ) -> Response:
        return await run(
            request, admin.register_adapter, caller.key_id, tenant, body.name, body.base,
            body.path, body.rank, tuple(body.projects),
        )  # fmt: skip

    @app.get(
        "/v1/admin/tenants/{tenant}/adapters", operation_id="admin_list_adapters",
        summary="A tenant's adapters, revoked ones included (`tollgate adapters list`)",
        response_model=AdminAdapterList, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def list_adapters(request: Request, caller: AdminDep, tenant: TenantPath) -> Response:
        return await run(request, admin.adapters, tenant)

    @app.get(
        "/v1/admin/tenants/{tenant}/adapters/{adapter}", operation_id="admin_show_adapter",
        summary="One adapter of a tenant (`tollgate adapters show`)",
        response_model=AdminAdapter, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def show_adapter(
        request: Request, caller: AdminDep, tenant: TenantPath, adapter: AdapterPath
    ) -> Response:
        return await run(request, admin.adapter, tenant, adapter)

    @app.post(
        "/v1/admin/tenants/{tenant}/adapters/{adapter}/revoke", operation_id="admin_revoke_adapter",
        summary="Revoke an adapter (`tollgate adapters revoke`): its name is refused from then",
        response_model=AdminAdapter, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def revoke_adapter(
        request: Request, caller: AdminDep, tenant: TenantPath, adapter: AdapterPath
    ) -> Response:
        return await run(request, admin.revoke_adapter, caller.key_id, tenant, adapter)

    @app.post(
        "/v1/admin/tenants/{tenant}/adapters/{adapter}/price", operation_id="admin_price_adapter",
        summary="An adapter's own price per million tokens, effective-dated "
        "(`tollgate adapters price`)",
        response_model=AdminAdapterPrice, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def price_adapter(
        request: Request, caller: AdminDep, tenant: TenantPath, adapter: AdapterPath,
        body: AdapterPriceSet,
    ) -> Response:  # fmt: skip
        return await run(
            request, admin.price_adapter, caller.key_id, tenant, adapter, body.prompt,
            body.completion, body.cached, body.effective_at, currency=currency,
        )  # fmt: skip

    @app.post(
        "/v1/admin/tenants/{tenant}/residency", operation_id="admin_set_residency",
        summary="Pin a tenant or project to regions (`tollgate residency set`)",
        response_model=AdminResidency, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def set_residency(
        request: Request, caller: AdminDep, tenant: TenantPath, body: ResidencySet
    ) -> Response:
        return await run(
            request, admin.set_residency, caller.key_id, tenant, body.regions, body.project
        )

    @app.post(
        "/v1/admin/tenants/{tenant}/residency/clear", operation_id="admin_clear_residency",
        summary="Unpin a tenant or project (`tollgate residency clear`)",
        response_model=AdminResidency, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def clear_residency(
        request: Request, caller: AdminDep, tenant: TenantPath,
        body: Annotated[ResidencyClear, Body()] = ResidencyClear(),  # noqa: B008 - immutable
    ) -> Response:  # fmt: skip
        return await run(request, admin.clear_residency, caller.key_id, tenant, body.project)

    @app.post(
        "/v1/admin/tenants/{tenant}/retention", operation_id="admin_set_retention",
        summary="A tenant's or project's retention tier (`tollgate retention set`)",
        response_model=AdminRetention, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def set_retention(
        request: Request, caller: AdminDep, tenant: TenantPath, body: RetentionSet
    ) -> Response:
        return await run(
            request, admin.set_retention, caller.key_id, tenant, body.tier, body.project
        )

    @app.get(
        "/v1/admin/tenants/{tenant}/data-policy", operation_id="admin_show_data_policy",
        summary="A tenant's residency and retention, as set and in force for each project "
        "(`tollgate data-policy`)",
        response_model=AdminDataPolicy, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def show_data_policy(request: Request, caller: AdminDep, tenant: TenantPath) -> Response:
        return await run(request, admin.data_policy, tenant)

    # --- the audit trail -----------------------------------------------------------------------

    @app.get(
        "/v1/audit", operation_id="list_audit",
        summary="Control-plane changes, newest first: when, who (the admin key's id or the CLI's "
        "actor), the command, and each value it changed, old -> new",
        response_model=AuditPage, responses=answers(*AUTHENTICATED),
    )  # fmt: skip
    async def list_audit(
        request: Request, caller: AdminDep,
        tenant: Annotated[str | None, Query(
            max_length=63, description="only the changes to this tenant"
        )] = None,
        since: Annotated[Instant | None, Query(
            description="recorded at or after this RFC 3339 instant"
        )] = None,
        actor: Annotated[str | None, Query(
            max_length=200, description="only the changes by this actor (a key id, a name)"
        )] = None,
        limit: Annotated[int, Query(
            ge=1, le=AUDIT_LIMIT_MAX, description=f"default {AUDIT_LIMIT_DEFAULT}"
        ), IntegerText] = AUDIT_LIMIT_DEFAULT,
        after: Annotated[int | None, Query(
            ge=0, description="the `last_id` of the previous page: the page after it, older"
        ), IntegerText] = None,
    ) -> Response:  # fmt: skip
        return await run(
            request, audit.entries, tenant=tenant, since=since, actor=actor, after=after,
            limit=limit,
        )  # fmt: skip

    @app.get(
        "/v1/audit/verify", operation_id="verify_audit",
        summary="Check every control stream's hash chain (`tollgate audit verify`): each edited "
        "or deleted event named, and each stream's head",
        response_model=AuditReport, responses=answers(*AUTHENTICATED),
    )  # fmt: skip
    async def verify_audit(request: Request, caller: AdminDep) -> Response:
        return await run(request, audit.verify)
