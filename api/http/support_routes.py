"""The support routes: a tenant's requests, newest first, and one request's event timeline."""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import FastAPI, Path, Query, Request
from fastapi.responses import Response

from tollgate_llm.api.http.deps import AnyKeyDep, FromQuery, ModelQuery, ToQuery, json_response
from tollgate_llm.api.http.schemas import (
    AUTHENTICATED,
    IntegerText,
    RequestList,
    RequestTimeline,
    answers,
)
from tollgate_llm.api.runtime import Runtime
from tollgate_llm.api.services.backoffice import (
    REQUEST_ID,
    REQUESTS_LIMIT_DEFAULT,
    REQUESTS_LIMIT_MAX,
    parse_range,
    timeline_json,
)
from tollgate_llm.domain.projections import REQUEST_LOG_STATUSES
from tollgate_llm.ledger.ids import utcnow


def add_support_routes(app: FastAPI, runtime: Runtime) -> None:
    """/v1/requests and /v1/requests/{id}/events."""

    @app.get(
        "/v1/requests", operation_id="list_requests",
        summary="A tenant's requests, newest first (support keys name the tenant; a customer "
        "its own)",
        response_model=RequestList, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def list_requests(
        request: Request, caller: AnyKeyDep,
        tenant: Annotated[str | None, Query(
            description="the tenant (required for support, admin and finance keys; a customer "
            "key reads its own, and another tenant answers as an unknown one)",
        )] = None,
        start: FromQuery = None, end: ToQuery = None,
        status: Annotated[
            Literal[REQUEST_LOG_STATUSES] | None, Query(description="one request_log status")
        ] = None,
        key_id: Annotated[str | None, Query(description="the key that sent it")] = None,
        model: ModelQuery = None,
        limit: Annotated[int, Query(
            ge=1, le=REQUESTS_LIMIT_MAX, description=f"default {REQUESTS_LIMIT_DEFAULT}"
        ), IntegerText] = REQUESTS_LIMIT_DEFAULT,
        after: Annotated[str | None, Query(
            description="the `last_id` of the previous page: the page after it, older"
        )] = None,
    ) -> Response:  # fmt: skip
        bo = runtime.backoffice
        chosen = bo.requests_tenant(caller.scope, caller.tenant_id, tenant)
        since, until = parse_range(start, end, utcnow())
        page = await asyncio.to_thread(
            bo.requests, chosen, since, until, status=status, key_id=key_id, model=model,
            limit=limit, after=after,
        )  # fmt: skip
        return json_response(200, page, {"X-Request-Id": request.state.request_id})

    @app.get(
        "/v1/requests/{request_id}/events", operation_id="get_request_events",
        summary="A request's event timeline, re-folded (support keys; a customer its own)",
        response_model=RequestTimeline, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def request_events(
        request: Request,
        request_id: Annotated[str, Path(
            pattern=REQUEST_ID.pattern, description="the X-Request-Id of a response"
        )],
        caller: AnyKeyDep,
    ) -> Response:  # fmt: skip
        timeline = await asyncio.to_thread(
            runtime.backoffice.timeline, request_id, caller.scope, caller.tenant_id, utcnow()
        )
        return json_response(
            200, timeline_json(timeline), {"X-Request-Id": request.state.request_id}
        )
