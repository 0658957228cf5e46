"""What the FastAPI routes share: the key a request sends as its caller (through the one limiter
of failed authentications), the typed dependency aliases, the routes' typed query parameters,
and the JSON / CSV answers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

import orjson
from fastapi import Depends, Path, Query, Request
from fastapi.responses import Response
from pydantic import WithJsonSchema

from tollgate_llm.api.http.schemas import BearerDep
from tollgate_llm.api.runtime import Runtime
from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.backoffice import FORMATS, GROUP_BY, to_csv
from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.api.services.refusals import RefusalLimits
from tollgate_llm.domain.runs.state import RUN_ID
from tollgate_llm.ledger.finance import GOODPUT_GROUPS
from tollgate_llm.ledger.ids import new_request_id

CUSTOMER = frozenset({"customer", "admin"})
ALL_SCOPES = frozenset({"customer", "finance", "support", "admin"})


def authenticate(
    runtime: Runtime, limits: RefusalLimits, source: str | None, attempt: Callable[[], Caller]
) -> Caller:
    """`attempt`'s caller, through the one limiter of failed authentications (counted)."""
    try:
        return limits.authenticate(source, attempt)
    except ApiError as exc:
        if exc.status == 429:
            runtime.metrics.rejected.labels("auth_failures", "none").inc()
        raise


def request_source(request: Request) -> str | None:
    limits: RefusalLimits = request.app.state.limits
    return limits.source(request.scope.get("client"), request.headers.get("x-forwarded-for"))


def key_caller(
    request: Request, scopes: frozenset[str], authorization: str | None = None
) -> Caller:
    """The caller of the API key a request sends (Authorization), through the limiter."""
    state = request.app.state
    header = authorization or request.headers.get("authorization")
    return authenticate(
        state.runtime,
        state.limits,
        request_source(request),
        lambda: state.runtime.edge.authenticate(header, scopes),
    )


async def customer(request: Request, _bearer: BearerDep) -> Caller:
    request.state.request_id = new_request_id()
    return key_caller(request, CUSTOMER)


CustomerDep = Annotated[Caller, Depends(customer)]


async def any_key(request: Request, _bearer: BearerDep) -> Caller:
    request.state.request_id = new_request_id()
    return key_caller(request, ALL_SCOPES)


AnyKeyDep = Annotated[Caller, Depends(any_key)]

# The routes' parameters, typed: FastAPI checks them before the route runs (a bad one is a 400
# naming it, in OpenAI's error body: `_invalid` below) and describes them in /openapi.json. A
# query parameter is absent or text, never null (`openapi.py` drops the null FastAPI writes).

# Empty means "the default", as the web pages' forms send it.
Instant = Annotated[str, WithJsonSchema({
    "anyOf": [{"type": "string", "format": "date-time"}, {"type": "string", "maxLength": 0}]
})]  # fmt: skip
TenantQuery = Annotated[
    str | None, Query(description="a tenant (finance keys; a customer key only its own)")
]
FromQuery = Annotated[Instant | None, Query(
    alias="from",
    description="ISO 8601 instant, e.g. 2026-11-01T00:00:00Z (default: 30 days before `to`); "
    "the range is at most 366 days",
)]  # fmt: skip
ToQuery = Annotated[
    Instant | None, Query(alias="to", description="ISO 8601 instant (default: now)")
]
ModelQuery = Annotated[str | None, Query(description="a model name or version")]
FormatQuery = Annotated[Literal[FORMATS], Query(alias="format", description="default json")]
UsageGroupQuery = Annotated[Literal[GROUP_BY], Query(
    description="default hour; key, workspace, project and run add that column (null: the "
    "organization's own, or outside any run); end_user adds the end user's keyed hash (null: "
    "none named)",
)]  # fmt: skip
GOODPUT_GROUPS_PATTERN = "^({0})(,({0}))*$".format("|".join(GOODPUT_GROUPS))
PERIOD = "^[0-9]{4}-(0[1-9]|1[0-2])$"
# Described, not checked here: an id that is not a run's is a run that does not exist (404).
RunIdPath = Annotated[
    str,
    Path(description="the run's id"),
    WithJsonSchema({"type": "string", "pattern": RUN_ID.pattern}),
]


def json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status, headers, media_type="application/json")


def render_rows(
    rows: list[dict[str, Any]], fmt: str, columns: tuple[str, ...], request_id: str
) -> Response:
    headers = {"X-Request-Id": request_id}
    if fmt == "csv":
        return Response(to_csv(rows, columns), 200, headers, media_type="text/csv")
    return json_response(200, {"data": rows}, headers)
