"""The finance routes: usage, ledger entries, invoices, goodput and the reconciliation report."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import FastAPI, Path, Query, Request
from fastapi.responses import Response

from tollgate_llm.api.http.deps import (
    GOODPUT_GROUPS_PATTERN,
    PERIOD,
    AnyKeyDep,
    FormatQuery,
    FromQuery,
    ModelQuery,
    TenantQuery,
    ToQuery,
    UsageGroupQuery,
    json_response,
    render_rows,
)
from tollgate_llm.api.http.schemas import (
    AUTHENTICATED,
    GoodputRows,
    IntegerText,
    Invoice,
    LedgerEntries,
    Reconciliation,
    UsageRows,
    answers,
)
from tollgate_llm.api.runtime import Runtime
from tollgate_llm.api.services.backoffice import (
    ENTRY_COLUMNS,
    GROUP_COLUMNS,
    INVOICE_COLUMNS,
    MAX_ENTRIES,
    USAGE_COLUMNS,
    groups,
    parse_range,
)
from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.ledger.finance import GOODPUT_COLUMNS, GOODPUT_GROUPS
from tollgate_llm.ledger.ids import utcnow


def add_billing_routes(app: FastAPI, runtime: Runtime) -> None:
    """/v1/billing/*: read through the back office, off the event loop."""

    @app.get(
        "/v1/billing/usage", summary="Usage by hour, day, model or key",
        response_model=UsageRows, responses=answers(*AUTHENTICATED, 404, csv=True),
    )  # fmt: skip
    async def billing_usage(
        request: Request, caller: AnyKeyDep, tenant: TenantQuery = None,
        start: FromQuery = None, end: ToQuery = None, model: ModelQuery = None,
        group_by: UsageGroupQuery = "hour", fmt: FormatQuery = "json",
    ) -> Response:  # fmt: skip
        bo = runtime.backoffice
        tenant = bo.billing_tenant(caller.scope, caller.tenant_id, tenant)
        since, until = parse_range(start, end, utcnow())
        rows = await asyncio.to_thread(bo.usage, tenant, since, until, model, group_by)
        extra = GROUP_COLUMNS.get(group_by)
        columns = USAGE_COLUMNS + ((extra,) if extra else ())
        return render_rows(rows, fmt, columns, request.state.request_id)

    @app.get(
        "/v1/billing/ledger", summary="Billing ledger entries, oldest first",
        response_model=LedgerEntries, responses=answers(*AUTHENTICATED, 404, csv=True),
    )  # fmt: skip
    async def billing_ledger(
        request: Request, caller: AnyKeyDep, tenant: TenantQuery = None,
        start: FromQuery = None, end: ToQuery = None, model: ModelQuery = None,
        fmt: FormatQuery = "json",
        limit: Annotated[
            int, Query(ge=1, le=MAX_ENTRIES, description="default 1000"), IntegerText
        ] = 1000,
        after: Annotated[
            str | None, Query(description="the last request_id of the previous page")
        ] = None,
    ) -> Response:  # fmt: skip
        bo = runtime.backoffice
        tenant = bo.billing_tenant(caller.scope, caller.tenant_id, tenant)
        since, until = parse_range(start, end, utcnow())
        rows = await asyncio.to_thread(bo.entries, tenant, since, until, model, limit, after)
        return render_rows(rows, fmt, ENTRY_COLUMNS, request.state.request_id)

    @app.get(
        "/v1/billing/invoices/{tenant}", summary="A tenant's invoice for a calendar month",
        response_model=Invoice, responses=answers(*AUTHENTICATED, 404, csv=True),
    )  # fmt: skip
    async def billing_invoice(
        request: Request, tenant: Annotated[str, Path(description="the tenant")],
        caller: AnyKeyDep, fmt: FormatQuery = "json",
        period: Annotated[
            str | None, Query(pattern=PERIOD, description="YYYY-MM (default: this month)")
        ] = None,
    ) -> Response:  # fmt: skip
        bo = runtime.backoffice
        bo.billing_tenant(caller.scope, caller.tenant_id, tenant)
        invoice = await asyncio.to_thread(bo.invoice, tenant, period, utcnow())
        if fmt == "csv":
            return render_rows(invoice["lines"], fmt, INVOICE_COLUMNS, request.state.request_id)
        return json_response(200, invoice, {"X-Request-Id": request.state.request_id})

    @app.get(
        "/v1/billing/goodput",
        summary="Requests that ended in the range, by outcome against their tier's SLO",
        response_model=GoodputRows, responses=answers(*AUTHENTICATED, 404, csv=True),
    )  # fmt: skip
    async def billing_goodput(
        request: Request, caller: AnyKeyDep, tenant: TenantQuery = None,
        start: FromQuery = None, end: ToQuery = None,
        group_by: Annotated[str | None, Query(
            pattern=GOODPUT_GROUPS_PATTERN,
            description=f"comma-separated subset of {', '.join(GOODPUT_GROUPS)} (default tier)",
        )] = None,
        fmt: FormatQuery = "json",
    ) -> Response:  # fmt: skip
        bo = runtime.backoffice
        tenant = bo.billing_tenant(caller.scope, caller.tenant_id, tenant)
        since, until = parse_range(start, end, utcnow())
        chosen = groups(group_by, GOODPUT_GROUPS, ("tier",), "group_by")
        rows = await asyncio.to_thread(bo.goodput, tenant, since, until, chosen)
        return render_rows(rows, fmt, chosen + GOODPUT_COLUMNS, request.state.request_id)

    @app.get(
        "/v1/billing/reconciliation",
        summary="Admitted vs ended vs refunded vs billed, with every mismatch (finance keys)",
        response_model=Reconciliation, responses=answers(*AUTHENTICATED),
    )  # fmt: skip
    async def billing_reconciliation(
        request: Request, caller: AnyKeyDep, start: FromQuery = None, end: ToQuery = None
    ) -> Response:
        bo = runtime.backoffice
        if bo.billing_tenant(caller.scope, caller.tenant_id, None) is not None:
            raise ApiError(
                403,
                "the reconciliation report is for finance keys",
                type="permission_error",
                code="insufficient_scope",
            )
        since, until = parse_range(start, end, utcnow())
        report = await asyncio.to_thread(bo.reconciliation, since, until)
        return json_response(200, report, {"X-Request-Id": request.state.request_id})
