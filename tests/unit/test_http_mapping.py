"""Domain refusals rendered as HTTP: 429 quota, 503 capacity, 400 invalid; OpenAI's rate-limit
headers; Retry-After on everything a retry can fix."""

from __future__ import annotations

from tollgate_llm.api.services import refusal_errors
from tollgate_llm.domain.admission import RateLimitInfo, Rejected
from tollgate_llm.domain.types import CAPACITY_REASONS, QUOTA_REASONS, REJECT_REASONS

INFO = RateLimitInfo(60, 0, 1_000, 10_000, 8_000, 12_000)


def test_every_reason_has_a_status_and_quota_is_never_capacity() -> None:
    assert set(refusal_errors.STATUS) == set(REJECT_REASONS)
    assert {refusal_errors.STATUS[r] for r in QUOTA_REASONS} == {429}
    assert {refusal_errors.STATUS[r] for r in CAPACITY_REASONS} == {503}
    assert refusal_errors.STATUS["invalid"] == 400


def test_rate_limit_headers_use_openai_names_and_reset_format() -> None:
    headers = refusal_errors.rate_limit_headers(INFO)
    assert headers["X-RateLimit-Remaining-Tokens"] == "8000"
    assert headers["X-RateLimit-Reset-Requests"] == "1s"
    assert headers["X-RateLimit-Reset-Tokens"] == "12s"
    assert refusal_errors.duration(250) == "250ms" and refusal_errors.duration(360_000) == "6m0s"


def test_a_quota_refusal_carries_retry_after_and_an_invalid_one_does_not() -> None:
    quota = refusal_errors.refusal(Rejected("tokens", 7, "over", INFO), {"X-Request-Id": "r"})
    assert (quota.status, quota.type, quota.code) == (429, "tokens", "rate_limit_exceeded")
    assert quota.headers["Retry-After"] == "7" and quota.headers["X-Request-Id"] == "r"
    invalid = refusal_errors.refusal(Rejected("invalid", 0, "too long", INFO, "messages"), {})
    assert (invalid.status, invalid.param) == (400, "messages")
    assert "Retry-After" not in invalid.headers
    shed = refusal_errors.refusal(Rejected("retry_budget", 45, "storm", INFO), {})
    assert (shed.status, shed.type, shed.code) == (503, "capacity", "retry_budget_exhausted")
