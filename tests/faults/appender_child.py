"""An edge's writes, as the database-crash test runs them: requests appended one after another,
each request id printed (and flushed) only once its append has committed — the acknowledgement.
A failed append (the database went away) is retried with a new request after a pause."""

from __future__ import annotations

import sys
import time
import uuid
from datetime import UTC, datetime

from tests import builders as b
from tollgate_llm.domain.cost import Estimate
from tollgate_llm.domain.requests.decide import AdmitRequest, CompleteRequest, RouteRequest
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.store import NewEvent, SqlEventStore

MODEL = "llama-3.1-8b-2026-05"


def main() -> None:
    store = SqlEventStore(create_engine_from_url(sys.argv[1]))
    while True:
        rid = "req_" + uuid.uuid4().hex
        at = datetime.now(UTC)
        events = b.decided(
            AdmitRequest(
                rid, "acme", "key-1", MODEL, "standard", "edge-1", Estimate(100, 50, 1_000, 40_000)
            ),
            RouteRequest("replica-1", 0, request_id=rid),
            CompleteRequest(100, 42, 0, "stop", 30, 20_000, request_id=rid),
            at=at,
        )
        try:
            store.append(rid, 0, [NewEvent(str(uuid.uuid4()), rid, "acme", at, e) for e in events])
        except Exception:  # noqa: BLE001 - not acknowledged; the database is back soon
            time.sleep(0.2)
            continue
        sys.stdout.write(rid + "\n")
        sys.stdout.flush()
        time.sleep(0.005)


if __name__ == "__main__":
    main()
