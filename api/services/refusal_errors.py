"""Domain decisions as HTTP: status codes, OpenAI error types and codes, and the rate-limit and
Retry-After headers. The rules that produce the decisions live in `domain`; only their rendering
lives here."""

from __future__ import annotations

from typing import Final

from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.domain.admission import RateLimitInfo, Rejected

# 429 is the tenant's quota, 503 our capacity, 400 a request that can never succeed.
STATUS: Final[dict[str, int]] = {
    "requests": 429,
    "tokens": 429,
    "concurrency": 429,
    "budget": 429,
    "run_budget": 429,
    "invalid": 400,
    "retry_budget": 503,
    "capacity": 503,
}
# The OpenAI `type` of a refusal: the quota reasons name the exhausted layer (README).
_TYPES: Final = {"invalid": "invalid_request_error", "retry_budget": "capacity"}
_CODES: Final = {
    "invalid": "invalid_value",
    "retry_budget": "retry_budget_exhausted",
    "budget": "budget_exceeded",
    "run_budget": "run_budget_exceeded",
}


def rate_limit_headers(info: RateLimitInfo) -> dict[str, str]:
    """OpenAI's X-RateLimit-* headers: remaining after the decision, reset until full."""
    return {
        "X-RateLimit-Limit-Requests": str(info.limit_requests),
        "X-RateLimit-Remaining-Requests": str(info.remaining_requests),
        "X-RateLimit-Reset-Requests": duration(info.reset_requests_ms),
        "X-RateLimit-Limit-Tokens": str(info.limit_tokens),
        "X-RateLimit-Remaining-Tokens": str(info.remaining_tokens),
        "X-RateLimit-Reset-Tokens": duration(info.reset_tokens_ms),
    }


def refusal(decision: Rejected, headers: dict[str, str]) -> ApiError:
    """A quota refusal (or an invalid request) as the client sees it. `headers` are the
    response's so far (X-Request-Id, rate limits); Retry-After is added unless retrying cannot
    help."""
    if decision.reason != "invalid":
        headers["Retry-After"] = str(decision.retry_after_s)
    code = _CODES.get(decision.reason, "rate_limit_exceeded")
    param = decision.param
    if decision.reason != "invalid" and (decision.level or "").startswith("end user "):
        # The caller's own customer ran out (domain/governance/end_users.py): a code of its
        # own, so the tenant can tell one customer's limit from its whole project's.
        code = "end_user_budget_exceeded" if decision.reason == "budget" else (
            "end_user_limit_exceeded"
        )
        param = "user"
    return ApiError(
        STATUS[decision.reason],
        decision.detail,
        type=_TYPES.get(decision.reason, decision.reason),
        param=param,
        code=code,
        headers=headers,
    )


def no_capacity(
    model: str, tier: str, detail: str, retry_after_s: int, headers: dict[str, str]
) -> ApiError:
    headers["Retry-After"] = str(retry_after_s)
    return ApiError(
        503,
        f"no capacity for {model} at the {tier} tier ({detail}); retry after the Retry-After "
        "delay",
        type="capacity",
        code="server_overloaded",
        headers=headers,
    )


def region_unavailable(
    model: str, regions: frozenset[str], retry_after_s: int, headers: dict[str, str]
) -> ApiError:
    """A tenant pinned to regions whose regions have no room for `model` (or no replica of
    it): a 503 like any capacity refusal, whose code says the request was kept in its regions
    rather than served elsewhere."""
    headers["Retry-After"] = str(retry_after_s)
    where = ", ".join(sorted(regions)) or "no region"
    return ApiError(
        503,
        f"no capacity for {model} in this tenant's regions ({where}); the request is never "
        "served outside them: retry after the Retry-After delay",
        type="capacity",
        code="region_unavailable",
        headers=headers,
    )


def flex_unavailable(
    model: str, detail: str, retry_after_s: int, headers: dict[str, str]
) -> ApiError:
    """No idle capacity for a flex request: OpenAI's flex answer, a 429 `resource_unavailable`
    that is not billed. (A 429 here, unlike interactive capacity's 503, because it is what the
    flex contract promises and what OpenAI's clients retry on; its `type` is never a quota's.)"""
    headers["Retry-After"] = str(retry_after_s)
    return ApiError(
        429,
        f"no idle capacity for {model} in the flex tier ({detail}); retry later or use the "
        "default tier",
        type="resource_unavailable",
        code="resource_unavailable",
        headers=headers,
    )


PREEMPTED_MESSAGE: Final = (
    "this flex request was preempted for interactive traffic and is not billed; retry later"
)


def preempted(retry_after_s: int, headers: dict[str, str]) -> ApiError:
    """A flex request preempted before anything was sent: a 429 (never billed)."""
    return ApiError(
        429,
        PREEMPTED_MESSAGE,
        type="resource_unavailable",
        code="preempted",
        headers={**headers, "Retry-After": str(retry_after_s)},
    )


def replica_unavailable(retry_after_s: int, headers: dict[str, str]) -> ApiError:
    return ApiError(
        503,
        "the model replica is unavailable; retry later",
        type="capacity",
        code="replica_unavailable",
        headers={**headers, "Retry-After": str(retry_after_s)},
    )


def duration(ms: int) -> str:
    """OpenAI's reset format: "250ms", "1.5s", "6m0s"."""
    if ms < 1000:
        return f"{ms}ms"
    if ms < 60_000:
        return f"{ms / 1000:g}s"
    minutes, rest_ms = divmod(ms, 60_000)
    return f"{minutes}m{rest_ms // 1000}s"
