"""loadgen's request-by-request reconciliation: what it calls a billing error and what not."""

from __future__ import annotations

from typing import Any

from tollgate_llm.loadgen.clients import Attempt
from tollgate_llm.loadgen.reconcile import by_request


def attempt(request_id: str, status: int, kind: str, **fields: Any) -> Attempt:
    return Attempt(seq=0, attempt=0, tenant="t", tier="standard", model="m", cls="chat",
                   stream=False, t_start=0.0, status=status, kind=kind, request_id=request_id,
                   **fields)  # fmt: skip


def row(**fields: int) -> dict[str, int]:
    return {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0, "amount_micros": 0,
            **fields}  # fmt: skip


def test_a_refusal_with_a_zero_ledger_row_is_admitted_then_failed_not_a_billing_error() -> None:
    attempts = [
        attempt("ok", 200, "ok", usage_seen=True, prompt_tokens=10, completion_tokens=5),
        attempt("failed-early", 503, "503"),  # admitted, the replica failed before answering
        attempt("charged", 502, "5xx"),  # admitted, answered with an error, and charged
        attempt("never-admitted", 429, "429"),
    ]
    entries = {"t": {
        "ok": row(prompt_tokens=10, completion_tokens=5, amount_micros=20),
        "failed-early": row(),
        "charged": row(prompt_tokens=10, amount_micros=10),
    }}  # fmt: skip
    report = by_request(attempts, entries)["t"]
    assert report["completed_exact"] == 1
    assert report["refused_after_admission"] == 1
    assert report["refused_but_billed"] == ["charged"]
    assert not report["exact"]
    del entries["t"]["charged"]
    assert by_request(attempts, entries)["t"]["exact"]
