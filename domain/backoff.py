"""How long a refused client should wait, and which requests the engine serves first: one policy
for every refusal (quota, capacity, a replica gone, the retry budget) and every tier.

Seed 000 R6: a fixed Retry-After synchronises every client that was refused together into the
next burst, so every wait is a base plus uniform jitter drawn by the caller (domain draws no
random numbers); a wait shorter than the time an exhausted bucket needs to refill only buys the
client another refusal, so the base is never below it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from tollgate_llm.domain.errors import DomainError

# vLLM's `priority` request field: lower is served first. The tier sets it, never the client.
ENGINE_PRIORITY: Final[dict[str, int]] = {"enterprise": 0, "standard": 1, "free": 2}
_LAST: Final = max(ENGINE_PRIORITY.values())
# Flex work is served after every interactive tier, whatever the tenant's tier: under vLLM's
# `--scheduling-policy priority` it waits behind them and is the first the engine itself preempts
# when its KV runs out.
FLEX_ENGINE_PRIORITY: Final = _LAST + 8


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    retry_after_base_s: int = 5
    retry_after_jitter_s: int = 5  # the jitter is an integer uniform in [0, this]
    # The retry budget (R6): over the last `retry_window_s`, when retries are more than
    # `retry_budget_ppm` of every request seen (and at least `retry_budget_min_requests` were
    # seen: below that a ratio means nothing), non-reserved retries are shed.
    retry_window_s: int = 60
    retry_budget_ppm: int = 200_000
    retry_budget_min_requests: int = 20
    retry_shed_min_s: int = 30
    retry_shed_max_s: int = 60

    def retry_after_s(self, jitter: float, refill_s: int = 0) -> int:
        """max(base, seconds until the bucket holds enough) + floor(jitter × (jitter_s + 1))."""
        _check_jitter(jitter)
        base = max(self.retry_after_base_s, refill_s)
        return base + int(jitter * (self.retry_after_jitter_s + 1))

    def shed_after_s(self, jitter: float) -> int:
        """A retry shed by the budget waits long enough for the storm to pass: [30, 60] s."""
        _check_jitter(jitter)
        spread = self.retry_shed_max_s - self.retry_shed_min_s + 1
        return self.retry_shed_min_s + int(jitter * spread)

    def over_budget(self, requests: int, retries: int) -> bool:
        return (
            requests >= self.retry_budget_min_requests
            and retries * 1_000_000 > requests * self.retry_budget_ppm
        )


def engine_priority(tier: str, service_tier: str = "default") -> int:
    """The engine priority of a tier (an unknown tier is served last); flex after all of them."""
    if service_tier == "flex":
        return FLEX_ENGINE_PRIORITY
    return ENGINE_PRIORITY.get(tier, _LAST)


def _check_jitter(jitter: float) -> None:
    if not 0.0 <= jitter < 1.0:
        raise DomainError("bad_jitter", "jitter is a uniform draw in [0, 1)", field="jitter")
