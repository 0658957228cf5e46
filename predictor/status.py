"""What `tollgate predictor status` reports of a model from the log: per tenant, how many of its
recent requests this model predicted, their realised coverage, and how many reserved their cap
instead. Read from `RequestEstimated` (which records the model version) and the engine counts,
so it holds for every edge together, running or not."""

from __future__ import annotations

from typing import Any

from tollgate_llm.ledger.store import EventStore
from tollgate_llm.predictor.dataset import read_requests
from tollgate_llm.predictor.model_file import ModelFile
from tollgate_llm.predictor.runtime import COVERAGE_WINDOW

RECENT_REQUESTS = 50_000


def realised(store: EventStore, mf: ModelFile) -> dict[str, dict[str, Any]]:
    after = max(0, store.last_position() - 10 * RECENT_REQUESTS)
    requests = read_requests(store, since=mf.trained_at, max_requests=RECENT_REQUESTS,
                             after_position=after)  # fmt: skip
    version = mf.version
    hits: dict[str, list[bool]] = {}
    fallbacks: dict[str, int] = {}
    for q in requests:
        tenant = q.shape.tenant_id
        if q.predictor_version == version:
            if q.terminal == "completed":
                hits.setdefault(tenant, []).append(q.completion_tokens <= q.reserved_output_tokens)
        else:
            fallbacks[tenant] = fallbacks.get(tenant, 0) + 1
    out = {}
    for tenant in sorted(set(mf.tenants) | set(hits) | set(fallbacks)):
        recent = hits.get(tenant, [])[-COVERAGE_WINDOW:]
        out[tenant] = {
            "offset": mf.model.tenant_offsets.get(tenant),
            "predicted": len(hits.get(tenant, [])),
            "coverage": round(sum(recent) / len(recent), 4) if recent else None,
            "fallbacks": fallbacks.get(tenant, 0),
        }
    return out
