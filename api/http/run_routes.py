"""The agent-run routes: start a run with a budget, show it, end it."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tollgate_llm.api.http.deps import CustomerDep, RunIdPath, json_response
from tollgate_llm.api.http.schemas import AUTHENTICATED, Run, RunCreate, answers, request_body
from tollgate_llm.api.runtime import Runtime


def add_run_routes(app: FastAPI, runtime: Runtime) -> None:
    """/v1/runs, /v1/runs/{id} and /v1/runs/{id}/end."""

    @app.post(
        "/v1/runs",
        summary="Start an agent run with a budget (limits not given: the project's policy)",
        response_model=Run, responses=answers(
            *AUTHENTICATED, 404, 409, 413, description="the run, started"
        ),
        openapi_extra=request_body(RunCreate, required=False),
    )  # fmt: skip
    async def runs_start(request: Request, caller: CustomerDep) -> Response:
        raw = await request.body()
        run = await asyncio.to_thread(runtime.runs.start, caller, raw)
        return json_response(200, run, {"X-Request-Id": request.state.request_id})

    @app.get(
        "/v1/runs/{run_id}",
        summary="A run's budget, consumption and state (the caller's tenant's runs only)",
        response_model=Run, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def runs_show(request: Request, run_id: RunIdPath, caller: CustomerDep) -> Response:
        run = runtime.runs.show(caller, run_id)
        return json_response(200, run, {"X-Request-Id": request.state.request_id})

    @app.post(
        "/v1/runs/{run_id}/end",
        summary="End a run: its later calls are refused (run_budget_exceeded, ended)",
        response_model=Run, responses=answers(*AUTHENTICATED, 404),
    )  # fmt: skip
    async def runs_end(request: Request, run_id: RunIdPath, caller: CustomerDep) -> Response:
        run = await asyncio.to_thread(runtime.runs.end, caller, run_id)
        return json_response(200, run, {"X-Request-Id": request.state.request_id})
