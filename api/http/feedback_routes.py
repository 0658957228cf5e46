"""The router's routes (issue 32): the customer's feedback on its own requests, the router's
evidence, and what the router saved against the reference model."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import FastAPI, Query, Request
from fastapi.responses import Response

from tollgate_llm.api.http.deps import (
    PERIOD,
    AnyKeyDep,
    CustomerDep,
    FormatQuery,
    TenantQuery,
    json_response,
    render_rows,
)
from tollgate_llm.api.http.schemas import (
    AUTHENTICATED,
    Feedback,
    FeedbackCreate,
    RoutingSavingsRows,
    answers,
)
from tollgate_llm.api.runtime import Runtime
from tollgate_llm.api.services.routing_savings import SAVINGS_COLUMNS, routing_savings
from tollgate_llm.ledger.ids import utcnow


def add_feedback_routes(app: FastAPI, runtime: Runtime) -> None:
    """POST /v1/feedback and GET /v1/routing/savings."""

    @app.post(
        "/v1/feedback", operation_id="create_feedback",
        summary="Score one of your own served requests (0-1), once it has ended",
        response_model=Feedback, responses=answers(*AUTHENTICATED, 404, 409),
    )  # fmt: skip
    async def feedback(request: Request, body: FeedbackCreate, caller: CustomerDep) -> Response:
        answer = await asyncio.to_thread(
            runtime.feedback.record, caller, body.request_id, body.score, body.label or ""
        )
        return json_response(200, answer, {"X-Request-Id": request.state.request_id})

    @app.get(
        "/v1/routing/savings",
        summary="What the router saved in a month against the reference model, per tenant",
        response_model=RoutingSavingsRows, responses=answers(*AUTHENTICATED, 404, csv=True),
    )  # fmt: skip
    async def routing_savings_rows(
        request: Request, caller: AnyKeyDep, tenant: TenantQuery = None,
        month: Annotated[
            str | None, Query(pattern=PERIOD, description="YYYY-MM, UTC (default: this month)")
        ] = None,
        fmt: FormatQuery = "json",
    ) -> Response:  # fmt: skip
        tenant = runtime.backoffice.billing_tenant(caller.scope, caller.tenant_id, tenant)
        rows = await asyncio.to_thread(
            routing_savings, runtime.store, runtime.control, tenant,
            month or utcnow().strftime("%Y-%m"),
        )  # fmt: skip
        return render_rows(rows, fmt, SAVINGS_COLUMNS, request.state.request_id)
