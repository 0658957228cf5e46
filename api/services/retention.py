"""The zero-retention tier at the edge: the header its responses carry, and what an
Idempotency-Key record keeps of them (the status and the request id, never the body).

The tier is the control plane's (`domain.control_plane.data_policy`); admission puts the
header on the response, and the idempotency service (api/services/idempotency_service.py)
reads it there, so the response that says "zero" is exactly the one whose body is not kept.
"""

from __future__ import annotations

from typing import Final

import orjson

from tollgate_llm.domain.control_plane.data_policy import ZERO
from tollgate_llm.ledger.idempotency import StoredResponse

RETENTION_HEADER: Final = "X-Tollgate-Retention"


def retention_headers(tier: str) -> dict[str, str]:
    """What a response of a request under `tier` says of it (nothing for the standard tier)."""
    return {RETENTION_HEADER: ZERO} if tier == ZERO else {}


def is_zero(headers: dict[str, str]) -> bool:
    return headers.get(RETENTION_HEADER) == ZERO


def not_retained(stored: StoredResponse) -> StoredResponse:
    """The replay of a zero-retention request: its status and request id, and a body that says
    the answer was not kept (JSON, whether the first answer was JSON or a stream)."""
    body = orjson.dumps({
        "object": "tollgate.idempotent_replay",
        "request_id": stored.request_id,
        "status": stored.status,
        "retention": ZERO,
        "message": "this request finished; under zero retention its response was not kept, "
        "so it cannot be replayed (the request id finds its record and its bill)",
    })  # fmt: skip
    return StoredResponse(
        stored.request_id,
        stored.status,
        body,
        "application/json",
        {**stored.headers, RETENTION_HEADER: ZERO},
    )
