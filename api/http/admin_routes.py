"""The admin API (`/v1/admin/...`) and the audit trail (`/v1/audit`): admin keys only. What the
CLI does to tenants, keys, limits, budgets, prices and models, through the same command handler
(api/services/admin_service.py over ControlService), with the calling key as the actor of every
change. Routes parse, call the service off the event loop, render."""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations, and the admin
# dependency they name is this function's local, not a module global.
import asyncio
import functools
from collections.abc import Callable
from decimal import Decimal
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Path, Query, Request
from fastapi.responses import Response

from api.http.admin_schemas import (
    AdminBudget,
    AdminFlexDiscount,
    AdminKey,
    AdminModelProfile,
    AdminPrice,
    AdminProject,
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
    TenantCreate,
    TimeZoneSet,
    WorkspaceCreate,
)
from api.http.schemas import AUTHENTICATED, BearerDep, IntegerText, answers
from api.services.admin_service import AdminService
from api.services.audit_service import AUDIT_LIMIT_DEFAULT, AUDIT_LIMIT_MAX, AuditTrail
from api.services.auth import Caller
from ledger.ids import new_request_id

ADMIN = frozenset({"admin"})
TenantPath = Annotated[str, Path(description="a tenant's id", max_length=63)]
KeyPath = Annotated[str, Path(description="an API key id of the tenant", max_length=64)]
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

    def level(body: Any) -> dict[str, str | None]:
        return {name: getattr(body, name) for name in LEVEL}

    # --- tenants and keys ----------------------------------------------------------------------

    @app.get(
        "/v1/admin/tenants", operation_id="admin_list_tenants", summary="Every tenant and its plan",
        response_model=AdminTenantList, responses=answers(*AUTHENTICATED),
    )  # fmt: skip
    async def list_tenants(request: Request, caller: AdminDep) -> Response:
        return done(request, await asyncio.to_thread(admin.tenants))

    @app.post(
        "/v1/admin/tenants", operation_id="admin_create_tenant",
        summary="Create a tenant (`tollgate tenants create`)",
        response_model=AdminTenant, responses=answers(*AUTHENTICATED, 409),
    )  # fmt: skip
    async def create_tenant(request: Request, caller: AdminDep, body: TenantCreate) -> Response:
        found = await asyncio.to_thread(admin.create_tenant, caller.key_id, body.name, body.plan)
        return done(request, found)

    @app.post(
        "/v1/admin/tenants/{tenant}/plan", operation_id="admin_change_plan",
        summary="Move a tenant to another plan (`tollgate tenants plan`)",
        response_model=AdminTenant, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def change_plan(
        request: Request, caller: AdminDep, tenant: TenantPath, body: PlanChange
    ) -> Response:
        found = await asyncio.to_thread(admin.change_plan, caller.key_id, tenant, body.plan)
        return done(request, found)

    @app.post(
        "/v1/admin/tenants/{tenant}/keys", operation_id="admin_issue_key",
        summary="Issue an API key (`tollgate keys issue`): its secret is in this answer only",
        response_model=IssuedKey, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def issue_key(
        request: Request, caller: AdminDep, tenant: TenantPath,
        body: Annotated[KeyCreate, Body()] = KeyCreate(),  # noqa: B008 - an immutable default
    ) -> Response:  # fmt: skip
        issued = await asyncio.to_thread(
            admin.issue_key, caller.key_id, tenant, body.scope, body.project
        )
        return done(request, issued)

    @app.post(
        "/v1/admin/tenants/{tenant}/keys/{key_id}/revoke", operation_id="admin_revoke_key",
        summary="Revoke an API key (`tollgate keys revoke`): refused within 0.2 s on every edge",
        response_model=AdminKey, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def revoke_key(
        request: Request, caller: AdminDep, tenant: TenantPath, key_id: KeyPath
    ) -> Response:
        found = await asyncio.to_thread(admin.revoke_key, caller.key_id, tenant, key_id)
        return done(request, found)

    @app.post(
        "/v1/admin/tenants/{tenant}/keys/{key_id}/project", operation_id="admin_assign_key",
        summary="Move a key into a project (`tollgate keys assign`)",
        response_model=AdminKey, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def assign_key(
        request: Request, caller: AdminDep, tenant: TenantPath, key_id: KeyPath, body: KeyProject
    ) -> Response:
        found = await asyncio.to_thread(
            admin.assign_key, caller.key_id, tenant, key_id, body.project
        )
        return done(request, found)

    # --- limits, the hierarchy, budgets --------------------------------------------------------

    @app.post(
        "/v1/admin/tenants/{tenant}/limits", operation_id="admin_set_limits",
        summary="Limits of the organization, or of one workspace, project or key "
        "(`tollgate limits set`)",
        response_model=LimitsRecorded, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def set_limits(
        request: Request, caller: AdminDep, tenant: TenantPath, body: LimitsSet
    ) -> Response:
        limits = body.model_dump(exclude={"model", *LEVEL})
        found = await asyncio.to_thread(
            admin.set_limits, caller.key_id, tenant, body.model, level(body), limits
        )
        return done(request, found)

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
        return done(request, await asyncio.to_thread(admin.limits, tenant, model, at))

    @app.post(
        "/v1/admin/tenants/{tenant}/workspaces", operation_id="admin_create_workspace",
        summary="Create a workspace (`tollgate workspaces create`)",
        response_model=AdminWorkspace, responses=answers(*AUTHENTICATED, 404, 409),
    )  # fmt: skip
    async def create_workspace(
        request: Request, caller: AdminDep, tenant: TenantPath, body: WorkspaceCreate
    ) -> Response:
        found = await asyncio.to_thread(admin.create_workspace, caller.key_id, tenant, body.name)
        return done(request, found)

    @app.post(
        "/v1/admin/tenants/{tenant}/projects", operation_id="admin_create_project",
        summary="Create a project in a workspace (`tollgate projects create`)",
        response_model=AdminProject, responses=answers(*AUTHENTICATED, 404, 409),
    )  # fmt: skip
    async def create_project(
        request: Request, caller: AdminDep, tenant: TenantPath, body: ProjectCreate
    ) -> Response:
        found = await asyncio.to_thread(
            admin.create_project, caller.key_id, tenant, body.name, body.workspace
        )
        return done(request, found)

    @app.post(
        "/v1/admin/tenants/{tenant}/budgets", operation_id="admin_set_budget",
        summary="A spend budget per calendar day or month at one level (`tollgate budgets set`)",
        response_model=AdminBudget, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def set_budget(
        request: Request, caller: AdminDep, tenant: TenantPath, body: BudgetSet
    ) -> Response:
        found = await asyncio.to_thread(
            functools.partial(admin.set_budget, currency=body.currency or currency),
            caller.key_id, tenant, body.period, body.usd, level(body),
        )  # fmt: skip
        return done(request, found)

    @app.post(
        "/v1/admin/tenants/{tenant}/time-zone", operation_id="admin_set_time_zone",
        summary="Where the tenant's budget days and months begin (`tollgate budgets timezone`)",
        response_model=AdminTimeZone, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def set_time_zone(
        request: Request, caller: AdminDep, tenant: TenantPath, body: TimeZoneSet
    ) -> Response:
        found = await asyncio.to_thread(admin.set_time_zone, caller.key_id, tenant, body.zone)
        return done(request, found)

    # --- prices and models ---------------------------------------------------------------------

    @app.post(
        "/v1/admin/prices", operation_id="admin_set_price",
        summary="A model's price per million tokens, effective-dated (`tollgate prices set`)",
        response_model=AdminPrice, responses=answers(*AUTHENTICATED),
    )  # fmt: skip
    async def set_price(request: Request, caller: AdminDep, body: PriceSet) -> Response:
        found = await asyncio.to_thread(
            admin.set_price, caller.key_id, body.model, body.prompt, body.completion,
            body.cached, body.effective_at, currency=currency,
        )  # fmt: skip
        return done(request, found)

    @app.post(
        "/v1/admin/prices/flex-discount", operation_id="admin_set_flex_discount",
        summary="The flex class's discount on a model's price (`tollgate prices flex-discount`)",
        response_model=AdminFlexDiscount, responses=answers(*AUTHENTICATED),
    )  # fmt: skip
    async def set_flex_discount(
        request: Request, caller: AdminDep, body: FlexDiscountSet
    ) -> Response:
        found = await asyncio.to_thread(
            admin.set_flex_discount, caller.key_id, body.model, Decimal(str(body.percent)),
            body.effective_at,
        )  # fmt: skip
        return done(request, found)

    @app.post(
        "/v1/admin/models", operation_id="admin_register_model",
        summary="A model's KV profile, effective-dated (`tollgate models register`)",
        response_model=AdminModelProfile, responses=answers(*AUTHENTICATED),
    )  # fmt: skip
    async def register_model(request: Request, caller: AdminDep, body: ModelRegister) -> Response:
        dimensions = body.model_dump(exclude={"model", "effective_at", "mla_rank"})
        dimensions["kv_lora_rank"] = body.mla_rank
        found = await asyncio.to_thread(
            admin.register_model, caller.key_id, body.model, dimensions, body.effective_at
        )
        return done(request, found)

    @app.get(
        # `:path`: a model name may hold a slash (`org/model`), which a client sends as %2F.
        "/v1/admin/models/{model:path}", operation_id="admin_show_model",
        summary="A model's KV profile in force, and its history (`tollgate models show`)",
        response_model=AdminModelProfile, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def show_model(
        request: Request, caller: AdminDep, model: ModelPath, at: AtQuery = None
    ) -> Response:
        return done(request, await asyncio.to_thread(admin.model, model, at))

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
        page = await asyncio.to_thread(
            audit.entries, tenant=tenant, since=since, actor=actor, after=after, limit=limit
        )
        return done(request, page)

    @app.get(
        "/v1/audit/verify", operation_id="verify_audit",
        summary="Check every control stream's hash chain (`tollgate audit verify`): each edited "
        "or deleted event named, and each stream's head",
        response_model=AuditReport, responses=answers(*AUTHENTICATED),
    )  # fmt: skip
    async def verify_audit(request: Request, caller: AdminDep) -> Response:
        return done(request, await asyncio.to_thread(audit.verify))
