"""`/openapi.json`: FastAPI's generated document, with the completions route registered in it.

Every FastAPI route describes itself: typed parameters, `response_model`s and `responses=` from
`api/http/schemas.py`. `POST /v1/chat/completions` is served in front of FastAPI
(api/http/app.py, for CPU), so it is described here by a route the app never serves,
`chat_route()`, whose body schema is `api/services/chat_request.py`'s own field table
(`request_schema()`, the table that checks the body).
`tests/e2e/test_openapi.py` checks the document against what the server answers, and a schema
fuzzer (`tests/e2e/test_api_fuzz.py`) the server against the document.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import FastAPI, Header
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic.json_schema import models_json_schema

from tollgate_llm.api.http.schemas import (
    REQUEST_BODIES,
    REQUEST_ID_HEADER,
    BearerDep,
    ChatCompletion,
    ChatCompletionChunk,
    error_answers,
    request_body,
)
from tollgate_llm.api.services.chat_request import request_schema
from tollgate_llm.domain.runs.state import RUN_ID

JSON = "application/json"
REF = "#/components/schemas/{model}"
EVENT = "ChatCompletionEvent"

# One server-sent event of a streamed completion (OpenAPI 3.1: the media type's schema describes
# each event): a chunk, an error object after a failure mid-stream, then `[DONE]`.
CHAT_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"event": {"type": "string", "const": "message"}},
    "if": {"properties": {"data": {"type": "string", "const": "[DONE]"}}},
    "else": {
        "properties": {
            "data": {
                "type": "string",
                "contentMediaType": JSON,
                "contentSchema": {
                    "anyOf": [
                        {"$ref": REF.format(model="ChatCompletionChunk")},
                        {
                            "type": "object",
                            "required": ["error"],
                            "properties": {
                                "error": {
                                    "type": "object",
                                    "required": ["message"],
                                    "properties": {"message": {"type": "string"}},
                                }
                            },
                        },
                    ]
                },
            }
        }
    },
}


async def create_chat_completion(
    _bearer: BearerDep,
    idempotency_key: Annotated[str | None, Header(
        alias="Idempotency-Key", min_length=1, max_length=255, pattern="^[ -~]+$",
        description="replays the finished request's response for 24 h (same body); 422 for a "
        "different body, 409 while the first is in flight",
    )] = None,
    run_id: Annotated[str | None, Header(
        alias="X-Tollgate-Run-Id", pattern=RUN_ID.pattern,
        description="the agent run the call belongs to (POST /v1/runs, or started by its first "
        "call under the project's run policy); a call past the run's budget is a 429 with code "
        "run_budget_exceeded naming the dimension",
    )] = None,
    end_user: Annotated[str | None, Header(
        alias="X-Tollgate-End-User", max_length=256,
        description="the caller's own customer (replaces the body's `user` and "
        "`safety_identifier`): the project's per-end-user limits and daily budget apply "
        "(429 end_user_limit_exceeded / end_user_budget_exceeded); recorded only as a keyed "
        "hash per tenant",
    )] = None,
) -> None:
    """The signature FastAPI describes `POST /v1/chat/completions` from. Never called: the
    route is `TollgateApp.chat_completions` (`app.idempotency_key_of` and `app.run_id_of` read
    these headers)."""
    raise NotImplementedError("served by api.http.app.TollgateApp")


def chat_route() -> APIRoute:
    ok = {
        "description": "the completion, or with `stream: true` server-sent events: `data: "
        "<ChatCompletionChunk>` frames, then `data: [DONE]`; a failure after the first token is "
        "an error object frame, then `data: [DONE]`",
        "headers": REQUEST_ID_HEADER,
        "content": {"text/event-stream": {"schema": {"$ref": REF.format(model=EVENT)}}},
        "links": {
            "RequestEvents": {
                "operationId": "get_request_events",
                "parameters": {"request_id": "$response.header.X-Request-Id"},
            },
        },
    }
    return APIRoute(
        "/v1/chat/completions",
        create_chat_completion,
        methods=["POST"],
        operation_id="create_chat_completion",
        summary="Create a chat completion (OpenAI-compatible), streamed or not",
        response_model=ChatCompletion,
        responses={200: ok, **error_answers(400, 401, 403, 404, 409, 413, 422, 429, 502, 503)},
        openapi_extra=request_body("ChatCompletionRequest"),
    )


def install(app: FastAPI, models: Callable[[], list[str]]) -> None:
    """Serve the document at /openapi.json. `models` (the models on sale now) gives the model
    field its examples and the request body its example, refreshed on every read."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        on_sale = models()
        document = app.openapi_schema
        model = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]["model"]
        model["examples"] = on_sale
        body = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"][JSON]
        body["example"] = {
            "model": on_sale[0] if on_sale else "llama-3.1-8b",
            "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": 16,
        }
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def build(app: FastAPI) -> dict[str, Any]:
    document = get_openapi(
        title=app.title,
        version=app.version,
        description=app.description,
        routes=[*app.routes, chat_route()],
    )
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    # The bodies read by hand, and what only the chat route's stream names.
    _, defined = models_json_schema(
        [(model, "validation") for model in REQUEST_BODIES]
        + [(ChatCompletionChunk, "serialization")],
        ref_template=REF,
    )
    schemas.update(defined.get("$defs", {}))
    schemas["ChatCompletionRequest"] = request_schema()
    schemas[EVENT] = CHAT_EVENT
    # FastAPI documents a 422 for the validation errors it raises; this app answers them 400 in
    # OpenAI's error body (app.py `_invalid`), which every route documents already.
    for operations in document["paths"].values():
        for operation in operations.values():
            answer = operation["responses"].get("422", {})
            if answer.get("content", {}).get(JSON, {}).get("schema", {}).get("$ref", "").endswith(
                "/HTTPValidationError"
            ):
                del operation["responses"]["422"]
            for parameter in operation.get("parameters", ()):
                _not_null(parameter)
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    return document


def _not_null(parameter: dict[str, Any]) -> None:
    """A parameter is absent or text, never null: FastAPI writes `X | None` as `anyOf` with a
    null, which a client could not send (and a fuzzer would try)."""
    schema = parameter["schema"]
    options = [s for s in schema.get("anyOf", ()) if s != {"type": "null"}]
    if "anyOf" in schema and len(options) < len(schema["anyOf"]):
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        parameter["schema"] = {**options[0], **rest} if len(options) == 1 else {
            **rest, "anyOf": options
        }
