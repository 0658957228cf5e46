"""Goodput (seed 004, invariant 11: "work that misses deadline is waste"): what became of each
request against the service-level objective of its tier.

A request *attains* when it completed within both its tier's TTFT and TPOT targets (DistServe's
definition). Everything else is counted beside it under the outcome that says why, never dropped:
a completion that was too slow, a client that left, a failure, a lease that expired, a refusal
for our capacity or the retry budget, a refusal by the tenant's own quota, an invalid request.

Two ratios come from the counts (`Attainment`):
- `attainment` = attained / served, over the requests we admitted: how well we served them;
- `goodput` = attained / offered, over everything asked of us except invalid requests, so
  refusing work can never improve a tier's figure.

The same function classifies a request on an edge as it ends (the live counters) and in the
replay over the read model (`tollgate ledger goodput`), with the objective in force at the
request's admission, so the two agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Literal, get_args

from tollgate_llm.domain.errors import DomainError

__all__ = [
    "DEFAULT_SLOS",
    "OUTCOMES",
    "Attainment",
    "Outcome",
    "Slo",
    "attainment",
    "outcome",
]

Outcome = Literal[
    "attained",
    "missed_ttft",  # completed, first token later than the target (whatever the TPOT)
    "missed_tpot",  # completed, first token in time, tokens slower than the target
    "cancelled",  # the client left, or was cut off as a slow reader
    "failed",
    "lease_expired",
    "preempted",  # flex work the router stopped to make room for interactive work
    "refused_capacity",  # 503: no replica could take it at its tier
    "shed",  # 503: the retry budget shed it
    "refused_quota",  # 429: the tenant's own limits
    "invalid",  # 400/404: could never have succeeded
]
OUTCOMES: Final[tuple[Outcome, ...]] = get_args(Outcome)
SERVED: Final = frozenset({"attained", "missed_ttft", "missed_tpot", "cancelled", "failed",
                           "lease_expired", "preempted"})
NOT_OFFERED: Final = frozenset({"invalid"})


@dataclass(frozen=True, slots=True)
class Slo:
    """A tier's objective for one request: time to first token and time per output token."""

    ttft_ms: int
    tpot_us: int

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.tpot_us <= 0:
            raise DomainError("bad_slo", "SLO targets must be positive", field="ttft_ms")


# Seed 000's interactive contract (TTFT p95 < 1 s, TPOT p95 < 50 ms), for every tier until an
# operator sets its own.
DEFAULT_SLO: Final = Slo(ttft_ms=1_000, tpot_us=50_000)
DEFAULT_SLOS: Final[dict[str, Slo]] = {
    "free": DEFAULT_SLO,
    "standard": DEFAULT_SLO,
    "enterprise": DEFAULT_SLO,
}

_REFUSALS: Final[dict[str, Outcome]] = {
    "requests": "refused_quota",
    "tokens": "refused_quota",
    "concurrency": "refused_quota",
    "budget": "refused_quota",
    "run_budget": "refused_quota",
    "capacity": "refused_capacity",
    "retry_budget": "shed",
    "invalid": "invalid",
}
_ENDS: Final[dict[str, Outcome]] = {
    "cancelled": "cancelled",
    "failed": "failed",
    "lease_expired": "lease_expired",
    "preempted": "preempted",
}


def outcome(
    status: str,
    slo: Slo,
    *,
    ttft_ms: int | None = None,
    tpot_us: int | None = None,
    reject_reason: str | None = None,
) -> Outcome | None:
    """The outcome of a request in `status` (a RequestState / request_log status); None while
    it is still in flight. A completion with one output token has no TPOT (0): only its TTFT
    is judged."""
    if status == "completed":
        if ttft_ms is None or ttft_ms > slo.ttft_ms:
            return "missed_ttft"
        if tpot_us is not None and tpot_us > slo.tpot_us:
            return "missed_tpot"
        return "attained"
    if status == "rejected":
        found = _REFUSALS.get(reject_reason or "")
        if found is None:
            raise DomainError("bad_reason", f"unknown refusal reason {reject_reason!r}")
        return found
    return _ENDS.get(status)


@dataclass(frozen=True, slots=True)
class Attainment:
    counts: Mapping[str, int]

    @property
    def attained(self) -> int:
        return self.counts.get("attained", 0)

    @property
    def served(self) -> int:
        return sum(n for o, n in self.counts.items() if o in SERVED)

    @property
    def offered(self) -> int:
        return sum(n for o, n in self.counts.items() if o not in NOT_OFFERED)

    @property
    def attainment_ppm(self) -> int | None:
        """attained / served in parts per million (None: nothing served)."""
        return self.attained * 1_000_000 // self.served if self.served else None

    @property
    def goodput_ppm(self) -> int | None:
        """attained / offered in parts per million (None: nothing offered)."""
        return self.attained * 1_000_000 // self.offered if self.offered else None


def attainment(outcomes: Iterable[str]) -> Attainment:
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o] = counts.get(o, 0) + 1
    return Attainment(counts)
