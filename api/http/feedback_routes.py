"""The customer's feedback on its own requests (issue 32): the router's evidence."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import Response

from api.http.deps import CustomerDep, json_response
from api.http.schemas import AUTHENTICATED, Feedback, FeedbackCreate, answers
from api.runtime import Runtime


def add_feedback_routes(app: FastAPI, runtime: Runtime) -> None:
    """POST /v1/feedback."""

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
