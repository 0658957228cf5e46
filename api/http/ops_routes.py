"""The operator's routes: the fleet view, liveness, readiness and the Prometheus metrics."""

from __future__ import annotations

import asyncio
import hmac

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tollgate_llm.api.http.deps import AnyKeyDep, json_response, request_source
from tollgate_llm.api.http.schemas import (
    AUTHENTICATED,
    Fleet,
    Health,
    Readiness,
    answers,
    error_answers,
)
from tollgate_llm.api.runtime import Runtime
from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.api.services.refusals import RefusalLimits


def metrics_token(runtime: Runtime, limits: RefusalLimits, request: Request) -> None:
    """With `--metrics-token`, /metrics answers only `Authorization: Bearer <token>` (Prometheus'
    `authorization` setting); a wrong token counts against the client address like a wrong key."""
    token = runtime.settings.metrics_token
    if not token:
        return
    given = request.headers.get("authorization") or ""
    scheme, _, secret = given.partition(" ")

    def attempt() -> None:
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            secret.strip().encode(), token.encode()
        ):
            raise ApiError(
                401, "/metrics needs the metrics token: Authorization: Bearer <token>",
                code="invalid_metrics_token", type="authentication_error",
                headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip

    limits.authenticate(request_source(request), attempt)


def add_ops_routes(app: FastAPI, runtime: Runtime) -> None:
    """/v1/fleet (admin keys), /healthz, /readyz and /metrics."""

    @app.get(
        "/v1/fleet",
        summary="Every replica as the router sees it, and the autoscaling signal (admin keys)",
        response_model=Fleet, responses=answers(*AUTHENTICATED, 503),
    )  # fmt: skip
    async def fleet(request: Request, caller: AnyKeyDep) -> Response:
        if caller.scope != "admin":
            raise ApiError(
                403,
                "the fleet view is for admin keys",
                type="permission_error",
                code="insufficient_scope",
            )
        if runtime.scaling is None:
            raise ApiError(503, "the fleet is starting", type="server_error", code="starting")
        return json_response(
            200, runtime.scaling.view(), {"X-Request-Id": request.state.request_id}
        )

    @app.get(
        "/healthz", summary="Liveness", response_model=Health,
        responses={200: {"description": "alive"}},
    )  # fmt: skip
    async def healthz() -> Response:
        return json_response(200, {"status": "ok"})

    @app.get(
        "/readyz", summary="Readiness: folds healthy, control plane followed, a replica healthy",
        response_model=Readiness, responses={
            200: {"description": "ready"}, 503: {"model": Readiness, "description": "not ready"},
        },
    )  # fmt: skip
    async def readyz() -> Response:
        # Off the event loop: once a second it reads the pipeline's state from the database.
        problems, warnings = await asyncio.to_thread(runtime.readiness)
        status = 503 if problems else 200
        return json_response(
            status,
            {
                "status": "ready" if not problems else "not_ready",
                "problems": problems,
                "warnings": warnings,
            },
        )

    @app.get(
        "/metrics",
        summary="Prometheus metrics (with `--metrics-token`: `Authorization: Bearer <token>`)",
        response_class=Response, responses={
            200: {"description": "Prometheus text format",
                  "content": {"text/plain": {"schema": {"type": "string"}}}},
            **error_answers(401, 429),
        },
    )  # fmt: skip
    async def metrics(request: Request) -> Response:
        metrics_token(runtime, app.state.limits, request)
        runtime.refresh_gauges()
        return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)
