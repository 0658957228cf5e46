"""Data residency in routing: a request pinned to regions is placed only among replicas in them.

Pure. The router (`engine_adapter.fleet.Fleet.choose`) drops the replicas `in_region` refuses
before every placement question (p2c, the enterprise scan, flex preemption, other edges' flex
work), so no step after it can see, let alone choose, a replica elsewhere: a fallback to another
model, a preemption or a retry asks the router again, confined again. With no room in the
regions the answer is a refusal, never a replica outside them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, TypeVar

from tollgate_llm.domain.capacity import ReplicaLoad

__all__ = ["REGION_UNAVAILABLE", "confine", "in_region", "refusal_detail"]

# The detail of a pinned request's capacity refusal, and the error code its client gets (503).
REGION_UNAVAILABLE: Final = "region_unavailable"

L = TypeVar("L", bound=ReplicaLoad)


def in_region(region: str, allowed: frozenset[str] | None) -> bool:
    """Whether a replica in `region` may serve a request allowed `allowed` (None: anywhere).
    A replica given no region ("") serves no pinned request: where it runs is not known."""
    return allowed is None or (region != "" and region in allowed)


def confine(loads: Iterable[L], allowed: frozenset[str] | None) -> list[L]:
    """The replicas a request allowed `allowed` may be placed on, in their order."""
    return [load for load in loads if in_region(load.region, allowed)]


def refusal_detail(detail: str, allowed: frozenset[str] | None) -> str:
    """What a capacity refusal records: a pinned request's says it stayed in its regions (and
    why they had no room), an unpinned one's is the router's own detail."""
    if allowed is None:
        return detail
    regions = ",".join(sorted(allowed)) or "none"
    return f"{REGION_UNAVAILABLE} ({regions}): {detail}"
