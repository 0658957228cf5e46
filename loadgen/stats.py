"""Counters for the live view and the per-tenant / per-tier summary of a run."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from tollgate_llm.loadgen.clients import Attempt

KINDS = ("ok", "cancelled", "429", "503", "4xx", "5xx", "error")


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass
class Group:
    requests: int = 0
    kinds: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    chunks_cancelled: int = 0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)

    def add(self, a: Attempt) -> None:
        self.requests += 1
        self.kinds[a.kind] += 1
        if a.kind != "ok" and a.reason:
            self.reasons[f"{a.status or a.kind} {a.reason}"] += 1
        if a.usage_seen and not a.replayed:
            self.prompt_tokens += a.prompt_tokens
            self.completion_tokens += a.completion_tokens
            self.cached_tokens += a.cached_tokens
        if a.kind == "cancelled":
            self.chunks_cancelled += a.chunks
        if a.kind in ("ok", "cancelled"):
            if a.ttft is not None:
                self.ttft.append(a.ttft)
            if a.tpot is not None:
                self.tpot.append(a.tpot)
        if a.kind == "ok":
            self.latency.append(a.latency)

    def to_json(self) -> dict[str, Any]:
        def ms(values: list[float], q: float) -> float | None:
            p = percentile(values, q)
            return None if p is None else round(p * 1000, 3)

        return {
            "requests": self.requests,
            "status": {k: self.kinds.get(k, 0) for k in KINDS},
            "refusals": dict(self.reasons.most_common()),
            "tokens_seen": {"prompt": self.prompt_tokens, "completion": self.completion_tokens,
                            "cached": self.cached_tokens,
                            "completion_chunks_of_cancelled": self.chunks_cancelled},
            "ttft_ms": {"p50": ms(self.ttft, 50), "p99": ms(self.ttft, 99), "n": len(self.ttft)},
            "tpot_ms": {"p50": ms(self.tpot, 50), "p99": ms(self.tpot, 99), "n": len(self.tpot)},
            "latency_ms": {"p50": ms(self.latency, 50), "p99": ms(self.latency, 99)},
        }


class Stats:
    """Everything the live view and the summary need, updated as attempts finish."""

    def __init__(self) -> None:
        self.sent = 0
        self.in_flight = 0
        self.dropped = 0  # open-loop arrivals not sent: the generator's in-flight cap was hit
        self.total = Group()
        self.by_tenant: dict[tuple[str, str], Group] = defaultdict(Group)
        self.by_tier: dict[str, Group] = defaultdict(Group)
        self.by_class: dict[str, Group] = defaultdict(Group)
        self.attempts: list[Attempt] = []

    def started(self) -> None:
        self.sent += 1
        self.in_flight += 1

    def finished(self, a: Attempt) -> None:
        self.in_flight -= 1
        self.attempts.append(a)
        self.total.add(a)
        self.by_tenant[(a.tenant, a.tier)].add(a)
        self.by_tier[a.tier].add(a)
        self.by_class[a.cls].add(a)

    def live_numbers(self) -> dict[str, Any]:
        k = self.total.kinds
        recent_ttft = self.total.ttft[-2000:]
        recent_tpot = self.total.tpot[-2000:]
        return {
            "sent": self.sent, "in_flight": self.in_flight, "done": self.total.requests,
            "2xx": k["ok"] + k["cancelled"], "cancelled": k["cancelled"], "429": k["429"],
            "503": k["503"], "4xx": k["4xx"], "errors": k["5xx"] + k["error"],
            "ttft_p50": percentile(recent_ttft, 50), "ttft_p99": percentile(recent_ttft, 99),
            "tpot_p50": percentile(recent_tpot, 50), "tpot_p99": percentile(recent_tpot, 99),
            "dropped": self.dropped,
        }
