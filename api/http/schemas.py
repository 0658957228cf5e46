"""What the routes answer and read, as pydantic models from which FastAPI generates `/openapi.json`.

They describe; they do not serialise. The routes render their own JSON (orjson, straight from the
services' dicts) and return a `Response`, which FastAPI sends as it is, so declaring a model as a
route's `response_model` costs no CPU per request. `tests/e2e/test_openapi.py` checks the real
answers against the schemas, and the fuzz test (`tests/e2e/test_api_fuzz.py`) the server against
the whole document. The chat request is described by `api/services/chat_request.py`'s field
table, which is also what checks it.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from tollgate_llm.domain.feedback import MAX_LABEL_CHARS
from tollgate_llm.domain.runs.state import RUN_ID

INTEGER = re.compile(r"-?[0-9]{1,18}")


def _integer_text(value: Any) -> Any:
    # Only ASCII digits: pydantic's int (like int()) also takes " 7", "+7", "7_000" and "7.0",
    # which the published schema (an integer) does not.
    if isinstance(value, str) and not INTEGER.fullmatch(value):
        raise ValueError("must be an integer")
    return value


# An integer query parameter: `Annotated[int, Query(...), IntegerText]` (in that order: placed
# before the Query, it hides the Query's bounds from the document).
IntegerText = BeforeValidator(_integer_text)

# Declares the bearer scheme on every keyed route of the document; it never refuses
# (`auto_error=False`): the key is checked by `app.key_caller`, through the limiter.
BearerDep = Annotated[
    HTTPAuthorizationCredentials | None, Depends(HTTPBearer(scheme_name="bearer", auto_error=False))
]

Count = Annotated[int, Field(ge=0)]
Epoch = int | None
Object = dict[str, Any]
Usd = Annotated[str, Field(pattern=r"^[0-9]+(\.[0-9]{1,6})?$")]
Limit = Annotated[int, Field(ge=0, le=10**12)] | None
# What every amount of a bill is in: an ISO 4217 code, e.g. USD.
Currency = Annotated[str, Field(pattern=r"^[A-Z]{3}$", examples=["USD"])]
RunId = Annotated[str, Field(pattern=RUN_ID.pattern)]
# OpenAI's metadata, as domain.text.check_metadata checks it (a NUL anywhere is a 400 too).
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=16),
]


class ErrorDetail(BaseModel):
    message: Annotated[str, Field(max_length=1024)]
    type: str
    param: str | None
    code: str | None


class Error(BaseModel):
    """OpenAI's error body, on every route and for every error."""

    error: ErrorDetail


# --- models ------------------------------------------------------------------------------------


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str = Field(description="`tollgate` for a model on sale; a LoRA adapter's tenant")
    parent: str | None = Field(
        None, description="a LoRA adapter's only: the base model version that serves it"
    )


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


# --- chat completions: the answers (the request is api/services/chat_request.py's) ----------------


class PromptTokensDetails(BaseModel):
    cached_tokens: Count | None = None


class Usage(BaseModel):
    prompt_tokens: Count
    completion_tokens: Count
    total_tokens: Count
    prompt_tokens_details: PromptTokensDetails | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] | None = None
    function: FunctionCall


class Logprobs(BaseModel):
    content: list[Object] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Logprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    service_tier: Literal["default", "flex"] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Object
    logprobs: Logprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    service_tier: Literal["default", "flex"] | None = None


# --- billing -----------------------------------------------------------------------------------


class UsageRow(BaseModel):
    tenant: str
    model: str
    period_start: str
    requests: Count
    prompt_tokens: Count
    completion_tokens: Count
    cached_tokens: Count
    amount_micros: int
    currency: Currency
    key_id: str | None = Field(None, description="with group_by=key")
    workspace_id: str | None = Field(None, description="with group_by=workspace")
    project_id: str | None = Field(None, description="with group_by=project")
    run_id: str | None = Field(None, description="with group_by=run")
    region: str | None = Field(
        None, description="with group_by=region: where the requests ran ('' for no region)"
    )
    adapter: str | None = Field(
        None, description="with group_by=adapter: the LoRA adapter (null: the base model)"
    )


class UsageRows(BaseModel):
    data: list[UsageRow]


class Prices(BaseModel):
    prompt_micros_per_mtok: int
    completion_micros_per_mtok: int
    cached_micros_per_mtok: int
    currency: Currency


class LedgerEntry(Prices):
    request_id: str
    tenant: str
    key_id: str
    model: str
    prompt_tokens: Count
    completion_tokens: Count
    cached_tokens: Count
    amount_micros: int
    terminal_reason: str
    admitted_at: str
    finished_at: str
    billed_at: str
    workspace_id: str | None = None
    project_id: str | None = None
    run_id: str | None = None
    adapter: str | None = Field(None, description="the tenant's LoRA adapter that served it")


class LedgerEntries(BaseModel):
    data: list[LedgerEntry]


class InvoiceLine(Prices):
    model: str
    adapter: str | None = Field(None, description="the LoRA adapter (null: the base model)")
    requests: Count
    uncached_prompt_tokens: int
    cached_tokens: Count
    completion_tokens: Count
    amount_micros: int


class CurrencyTotal(BaseModel):
    currency: Currency
    requests: Count
    amount_micros: int
    amount: str


class Invoice(BaseModel):
    tenant: str
    period: str
    period_start: str
    period_end: str
    currency_unit: Literal["micro"]
    lines: list[InvoiceLine]
    totals: list[CurrencyTotal] = Field(
        description="one per currency the month was billed in; amounts in two currencies are "
        "never summed"
    )
    requests: Count
    currency: Currency | None = Field(
        description="the month's one currency (null: none billed, or more than one: see totals)"
    )
    amount_micros: int | None = Field(description="null when the month has several currencies")
    amount: str | None = Field(description="null when the month has several currencies")


class Mismatch(BaseModel):
    request_id: str
    problem: str


class Reconciliation(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    from_: str = Field(alias="from")
    to: str
    totals: dict[str, int]
    mismatches: list[Mismatch]
    ok: bool


class GoodputRow(BaseModel):
    tenant: str | None = Field(None, description="with group_by=tenant")
    tier: str | None = Field(None, description="with group_by=tier")
    model: str | None = Field(None, description="with group_by=model")
    hour: str | None = Field(
        None, description="with group_by=hour: the hour the requests ended"
    )
    attained: Count
    missed_ttft: Count
    missed_tpot: Count
    cancelled: Count
    failed: Count
    lease_expired: Count
    refused_capacity: Count
    shed: Count
    refused_quota: Count
    invalid: Count
    served: Count
    offered: Count
    attainment_ppm: Count | None = Field(description="attained / served, parts per million")
    goodput_ppm: Count | None = Field(description="attained / offered, parts per million")


class GoodputRows(BaseModel):
    data: list[GoodputRow]


class RoutingSavingsRow(BaseModel):
    tenant: str
    month: str = Field(description="YYYY-MM (UTC), the bills' month")
    currency: str
    routed_requests: Count = Field(description="requests the router served, billed")
    routed_away: Count = Field(description="... by a cheaper model than the reference")
    billed_micros: Count
    reference_micros: Count = Field(
        description="what the reference model would have billed for the same engine counts"
    )
    saving_micros: int
    mean_score_routed_away: float | None = Field(description="the customers' mean score")
    mean_score_reference: float | None


class RoutingSavingsRows(BaseModel):
    data: list[RoutingSavingsRow]


# --- operations --------------------------------------------------------------------------------


class ModelScaling(BaseModel):
    replicas: Count
    starting: Count
    desired_replicas: Count | None
    terms: Object | None = Field(description="what produced the signal")


class ReplicaView(BaseModel):
    replica_id: str
    model: str
    healthy: bool
    draining: bool
    reserved_only: bool | None = None
    kv_occupancy: float
    effective_occupancy: float | None = None
    kv_capacity_tokens: Count | None = None
    running: Count | None = None
    waiting: Count | None = None
    last_error: str | None = None


class Fleet(BaseModel):
    policy: Object = Field(description="the autoscaling policy in force")
    models: dict[str, ModelScaling]
    replicas: list[ReplicaView]


class TimelineEvent(BaseModel):
    position: int
    stream_version: int
    occurred_at: str
    type: str
    state_after: str | None = None
    quota_effect: Object | None = None
    payload: Object
    note: str | None = None


class RequestTimeline(BaseModel):
    request_id: str
    status: str
    tenant: str | None = None
    key_id: str | None = None
    model: str | None = None
    adapter: str | None = Field(None, description="the tenant's LoRA adapter that served it")
    tier: str | None = None
    trace_id: str | None = None
    downgraded_from: str | None = None
    routing: Object | None = Field(None, description="RequestModelRouted: the router's choice")
    feedback: Object | None = Field(None, description="the customer's score and label")
    plan_at_admission: str | None = None
    limits_at_admission: Object | None = None
    budget_reserved_micros: int | None = Field(
        None, description="the maximum cost reserved at the levels of its path, when governed"
    )
    budget_reserved_currency: Currency | None = Field(
        None, description="the ISO 4217 code of budget_reserved_micros (its price's)"
    )
    replica_id: str | None = None
    replica_occupancy_at_routing: float | None = None
    region: str | None = None
    retention: str | None = None
    ttft_ms: int | None = None
    tpot_us: int | None = None
    quota: Object
    tokens: Object
    billing: Object | None = None
    rejection: Object | None = None
    lease_renewals: Count | None = None
    events: list[TimelineEvent]
    anomalies: list[Object]


class RequestTokens(BaseModel):
    """The request's tokens, once it ended (null before, and for a refusal)."""

    prompt_tokens: Count | None = None
    completion_tokens: Count | None = None
    cached_tokens: Count | None = None


class RequestSummary(BaseModel):
    """One row of the request log: no prompt or completion content (the log holds none)."""

    request_id: str
    status: str
    model: str
    tier: str
    key_id: str
    admitted_at: str
    finished_at: str | None = None
    tokens: RequestTokens
    reject_reason: str | None = None
    replica: str | None = None
    region: str | None = None
    retention: str | None = None
    adapter: str | None = None
    refusals: Count | None = Field(
        None, description="a row of counted refusals stands for this many (null: one request)"
    )


class RequestList(BaseModel):
    object: Literal["list"]
    tenant: str
    data: list[RequestSummary]
    has_more: bool
    last_id: str | None = Field(None, description="pass as `after` for the next page")


class Readiness(BaseModel):
    status: Literal["ready", "not_ready"]
    problems: list[str]
    warnings: list[str]


class Health(BaseModel):
    status: Literal["ok"]


# --- feedback ----------------------------------------------------------------------------------


FeedbackLabel = Annotated[
    str, Field(min_length=1, max_length=MAX_LABEL_CHARS, description="a word or two of your own")
]


class FeedbackCreate(BaseModel):
    """A customer's score of one of its own served requests, once it has ended (one per request;
    the router learns from them: `tollgate routing allow`)."""

    model_config = ConfigDict(extra="forbid")

    request_id: Annotated[
        str, Field(pattern=r"^req_[0-9a-f]{32}$", description="the X-Request-Id of the response")
    ]
    score: Annotated[float, Field(ge=0, le=1, description="0: useless, 1: all that was needed")]
    label: FeedbackLabel | None = None


class Feedback(BaseModel):
    object: Literal["feedback"]
    request_id: str
    score: float
    label: str | None
    recorded: bool = Field(
        description="false: the same feedback had been recorded before; it stands as it was"
    )


# --- runs --------------------------------------------------------------------------------------


class RunCreate(BaseModel):
    """What `POST /v1/runs` reads (parsed by `api/services/runs_service.py`; limits not given: the
    project's run policy)."""

    model_config = ConfigDict(extra="forbid")

    id: RunId | None = Field(None, description="default: a new run_ id")
    project: str | None = Field(None, description="default: the calling key's project")
    max_calls: Limit = None
    max_tool_calls: Limit = None
    max_wall_seconds: Annotated[int, Field(ge=0, le=10**9)] | None = None  # 10**12 ms
    max_cost: Usd | Annotated[float, Field(ge=0)] | None = Field(
        None, description="the run's cost limit, in `currency`"
    )
    currency: Currency | None = Field(
        None, description="ISO 4217 of max_cost (default: the deployment's currency)"
    )
    max_cost_usd: Usd | Annotated[float, Field(ge=0)] | None = Field(
        None, description="the same as max_cost with currency USD"
    )
    max_in_flight: Limit = None


class RunLimits(BaseModel):
    max_calls: Limit
    max_tool_calls: Limit
    max_wall_seconds: float | None
    max_cost: Usd | None
    currency: Currency
    max_cost_usd: Usd | None = Field(description="max_cost when the currency is USD, else null")
    max_in_flight: Limit


class RunUsage(BaseModel):
    calls: int
    in_flight: int
    tool_calls: int
    currency: Currency = Field(description="the run's currency: every call is billed in it")
    cost: Usd
    reserved: Usd
    cost_usd: Usd | None = Field(description="cost when the currency is USD, else null")
    reserved_usd: Usd | None = Field(description="reserved when the currency is USD, else null")


class Run(BaseModel):
    id: str
    object: Literal["run"]
    project: str | None
    status: Literal["active", "exhausted", "ended"]
    started_at: datetime
    ended_at: datetime | None
    implicit: bool
    limits: RunLimits
    usage: RunUsage
    exhausted: (
        Literal["calls", "tool_calls", "wall_clock", "cost", "in_flight", "ended", "currency"]
        | None
    )


# --- files and batches -------------------------------------------------------------------------


class File(BaseModel):
    id: str
    object: Literal["file"]
    bytes: Count
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: str | None = None
    expires_at: Epoch = None
    status_details: str | None = None


class FileUpload(BaseModel):
    """What `POST /v1/files` reads (multipart, parsed by `api/services/batch_service.py`)."""

    file: bytes = Field(json_schema_extra={"format": "binary"})
    purpose: Literal["batch"]


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class RequestCounts(BaseModel):
    total: Count
    completed: Count
    failed: Count


class Batch(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: str
    errors: Object | None = None
    input_file_id: str
    completion_window: str
    status: Literal[
        "validating", "in_progress", "finalizing", "completed", "expired", "cancelling",
        "cancelled", "failed",
    ]  # fmt: skip
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: Epoch = None
    expires_at: Epoch = None
    finalizing_at: Epoch = None
    completed_at: Epoch = None
    failed_at: Epoch = None
    expired_at: Epoch = None
    cancelling_at: Epoch = None
    cancelled_at: Epoch = None
    request_counts: RequestCounts
    metadata: Object | None = None


class BatchList(BaseModel):
    object: Literal["list"]
    data: list[Batch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


class BatchCreateRequest(BaseModel):
    """What `POST /v1/batches` reads (parsed by `api/services/batch_service.py`)."""

    input_file_id: str
    endpoint: Literal["/v1/chat/completions"]
    completion_window: str = Field(
        description="24h (and any window the server was started with, e.g. 30s)"
    )
    metadata: Metadata | None = None


# Request bodies the routes read by hand (their own limits and messages), described here.
REQUEST_BODIES: tuple[type[BaseModel], ...] = (RunCreate, FileUpload, BatchCreateRequest)


# --- answers -----------------------------------------------------------------------------------

REQUEST_ID_HEADER = {
    "X-Request-Id": {
        "description": "the request's id: the join key for support and finance",
        "schema": {"type": "string"},
        "required": True,
    }
}
RETRY_AFTER_HEADER = {
    "Retry-After": {"description": "seconds", "schema": {"type": "string"}, "required": True}
}
ERROR_DESCRIPTIONS = {
    400: "invalid request: `param` names the field",
    401: "missing, unknown or revoked API key",
    403: "the key's scope may not call this (or read that tenant)",
    404: "not found (another tenant's data answers exactly like unknown data)",
    409: "a request with this Idempotency-Key is still in flight",
    413: "request body over the size limit",
    422: "Idempotency-Key reused with a different body",
    429: "a limit: the tenant's quota (type requests, tokens, concurrency; the message names "
    "the level of the hierarchy that refused), a spend budget (code budget_exceeded), a run's "
    "budget (code run_budget_exceeded), too many refused requests from this key, or too many "
    "failed authentications from this address",
    502: "the model replica failed before the first token",
    503: "no capacity (ours, not the tenant's quota)",
}
# Every route that takes a key can answer these.
AUTHENTICATED = (400, 401, 403, 429)


def error_answers(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """Each status as OpenAI's error body with its X-Request-Id, 429 and 503 with Retry-After."""
    responses: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        headers = dict(REQUEST_ID_HEADER)
        if status in (429, 503):
            headers.update(RETRY_AFTER_HEADER)
        responses[status] = {
            "model": Error, "description": ERROR_DESCRIPTIONS[status], "headers": headers,
        }  # fmt: skip
    return responses


def answers(
    *errors: int, csv: bool = False, description: str = "OK", media_type: str | None = None
) -> dict[int | str, dict[str, Any]]:
    """A route's `responses=`: the 200 with its X-Request-Id, its body the route's
    `response_model` (or text of `media_type`), and a CSV rendering with `?format=csv`; then
    `error_answers(*errors)`."""
    success: dict[str, Any] = {"description": description, "headers": REQUEST_ID_HEADER}
    text = {"schema": {"type": "string"}}
    if media_type:
        success["content"] = {media_type: text}
    if csv:
        success["content"] = {"text/csv": text}
    return {200: success, **error_answers(*errors)}


def request_body(model: type[BaseModel] | str, *, required: bool = True,
                 media_type: str = "application/json") -> dict[str, Any]:
    """`openapi_extra` for a route that reads its body by hand (its own limits and messages):
    the body described by `model` (one of REQUEST_BODIES, or the chat request: the document's
    components hold them, api/http/openapi.py)."""
    name = model if isinstance(model, str) else model.__name__
    schema = {"$ref": f"#/components/schemas/{name}"}
    return {"requestBody": {"required": required, "content": {media_type: {"schema": schema}}}}
