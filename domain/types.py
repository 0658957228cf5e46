"""The closed vocabularies of the model, as `Literal` types (checked by mypy) and their values
(checked at run time by `decide`): tiers, request statuses, refusal and cancel reasons, scopes."""

from __future__ import annotations

from typing import Final, Literal, get_args

Tier = Literal["free", "standard", "enterprise"]
# The service class a request asked for (OpenAI's `service_tier`; "auto" is parsed as "default"):
# `default` is interactive, `flex` harvests idle capacity, is preemptible and priced lower.
ServiceTier = Literal["default", "flex"]
# The reserved class (R2): its floor holds even on a stale view and it is never shed by the
# retry budget.
RESERVED_TIER: Final = "enterprise"

RejectReason = Literal[
    "requests", "tokens", "concurrency", "budget", "run_budget", "capacity", "retry_budget",
    "invalid",
]
# 429: the tenant's quota, which the tenant can fix; 503: our capacity, which it cannot; 400: a
# request that can never succeed. Never mixed (DESIGN §4, invariant 7).
QUOTA_REASONS: Final = frozenset({"requests", "tokens", "concurrency", "budget", "run_budget"})
CAPACITY_REASONS: Final = frozenset({"capacity", "retry_budget"})

TerminalStatus = Literal["completed", "cancelled", "failed", "lease_expired", "preempted"]
Status = Literal["new", "admitted", "routed", "streaming", "rejected"] | TerminalStatus
# slow_reader: the client read nothing for the configured time with its stream's buffer full.
CancelReason = Literal["client_disconnected", "timeout", "slow_reader"]
Scope = Literal["customer", "finance", "support", "admin"]

TIERS: Final[tuple[Tier, ...]] = get_args(Tier)
SERVICE_TIERS: Final[tuple[ServiceTier, ...]] = get_args(ServiceTier)
REJECT_REASONS: Final[tuple[RejectReason, ...]] = get_args(RejectReason)
TERMINAL_STATUSES: Final[frozenset[str]] = frozenset(get_args(TerminalStatus))
CANCEL_REASONS: Final[tuple[CancelReason, ...]] = get_args(CancelReason)
SCOPES: Final[tuple[Scope, ...]] = get_args(Scope)
