"""The end-of-run summary says what its figures mean: the offered rate, replays, the verdicts."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from tollgate_llm.loadgen.clients import Attempt
from tollgate_llm.loadgen.reconcile import client_side, compare
from tollgate_llm.loadgen.stats import Stats
from tollgate_llm.loadgen.summary import COLUMNS, print_reconciliation, print_summary


def attempt(request_id: str, kind: str, **fields: Any) -> Attempt:
    return Attempt(seq=0, attempt=0, tenant="acme", tier="standard", model="m", cls="chat",
                   stream=True, t_start=0.0, status=200, kind=kind, request_id=request_id,
                   **fields)  # fmt: skip


def completed(request_id: str, **fields: Any) -> Attempt:
    return attempt(request_id, "ok", usage_seen=True, prompt_tokens=10, completion_tokens=5,
                   **fields)  # fmt: skip


ATTEMPTS = [
    completed("r1"),
    completed("r2"),
    completed("r3"),
    completed("r1", replayed=True),  # the same Idempotency-Key again, answered from storage
    completed("r2", replayed=True),
    attempt("r4", "cancelled", chunks=4),  # the client hung up mid-stream
]


def meta(mode: str) -> dict[str, Any]:
    return {
        "profile": "seeds", "mode": mode, "client": "httpx", "stop_reason": "duration",
        "rate": 5.0 if mode == "open" else None, "wall_s": 2.0, "offered_rps": 3.0,
        "generator_cpu": {"user_s": 0.1, "system_s": 0.0, "percent_of_one_core": 5.0,
                          "us_per_request": 100.0},
    }  # fmt: skip


def printed(show: Any, *args: Any) -> str:
    out = io.StringIO()
    show(Console(file=out, width=400, color_system=None), *args)
    return out.getvalue()


def run_stats() -> Stats:
    stats = Stats()
    for a in ATTEMPTS:
        stats.started()
        stats.finished(a)
    return stats


def test_the_offered_rate_is_explained_against_the_target_rate() -> None:
    text = printed(print_summary, run_stats(), meta("open"))
    assert "offered 3.0 req/s" in text
    assert "offered = the HTTP requests the run actually sent" in text
    assert "differs from the target 5 req/s" in text
    for cause in ("arrivals are random", "--max-in-flight", "the drain"):
        assert cause in text
    # A closed loop has no target rate to compare with.
    assert "target" not in printed(print_summary, run_stats(), meta("closed"))


def test_replays_and_the_consistent_verdict_are_explained() -> None:
    ledger = {"requests": 4, "prompt_tokens": 40, "completion_tokens": 19, "cached_tokens": 0,
              "amount_micros": 1}  # fmt: skip
    report = compare(client_side(ATTEMPTS), {"acme": ledger})
    rec = {"available": True, "waited_s": 0.5, "timed_out": False, "tenants": report,
           "note": "difference = ledger delta - client"}  # fmt: skip
    assert report["acme"]["verdict"] == "consistent"
    assert report["acme"]["difference_ledger_minus_client"]["requests"] == 1
    summary = printed(print_summary, run_stats(), meta("open"))
    row = next(line for line in summary.splitlines() if "acme" in line)
    cells = [cell.strip() for cell in row.split("│")[1:-1]]
    assert cells[COLUMNS.index("ok")] == "5"  # three completions and two replays
    text = printed(print_reconciliation, rec)
    assert "the Idempotency-Key replays (2 in this run)" in text
    assert "not a new completion in the ledger" in text
    assert "consistent = a difference the cancelled or failed requests account for" in text
