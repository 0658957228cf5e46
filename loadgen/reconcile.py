"""Reconciliation: the tokens the clients saw against the finance ledger.

The ledger is read with the finance key from
`GET /v1/billing/usage?tenant=&from=&to=&group_by=model`
(`{"data": [{"tenant", "model", "period_start", "requests", "prompt_tokens",
"completion_tokens", "cached_tokens", "amount_micros"}]}`). Ledger rows are bucketed by period, so
other traffic earlier in the same period would be counted too: a snapshot is taken before the run
and the comparison uses the difference (run's ledger delta), which assumes nobody else sends for
the same tenants during the run.

- Completed requests (the client read the final usage): the ledger delta must equal what the
  clients saw, to the token. Replays of a stored response (Idempotent-Replayed) are not billed
  again and are not counted on the client side either.
- Cancelled requests (the client dropped mid-stream, or was interrupted): the client never saw the
  final usage. The ledger bills what the engine generated before the abort, which is at least what
  the client saw; they are reported separately with their X-Request-Id so finance can reconcile
  them one by one.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from tollgate_llm.loadgen.clients import Attempt

FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "amount_micros")
CHARGED = ("prompt_tokens", "completion_tokens", "cached_tokens", "amount_micros")


class Unavailable(Exception):
    """The billing endpoint is missing (404), refuses the key, or cannot be reached."""


def iso(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def window(start: datetime, horizon_s: float) -> tuple[str, str]:
    """[start of start's hour, end of the hour after start + horizon): every period the run can
    touch, fixed before the run so the baseline and the final snapshot ask the same question."""
    frm = start.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    to = (start + timedelta(seconds=horizon_s + 3600)).astimezone(UTC).replace(
        minute=0, second=0, microsecond=0)
    return iso(frm), iso(to)


async def fetch_usage(http: httpx.AsyncClient, finance_key: str, tenant: str, frm: str,
                      to: str) -> dict[str, dict[str, int]]:
    try:
        r = await http.get(
            "/v1/billing/usage",
            params={"tenant": tenant, "from": frm, "to": to, "group_by": "model"},
            headers={"Authorization": f"Bearer {finance_key}"},
        )
    except httpx.HTTPError as exc:
        raise Unavailable(f"billing endpoint unreachable: {type(exc).__name__}") from None
    if r.status_code == 404 and b"tenant" not in r.content.lower():
        raise Unavailable("GET /v1/billing/usage answered 404: the endpoint does not exist on "
                          "this server")
    if r.status_code in (401, 403):
        raise Unavailable(f"GET /v1/billing/usage refused the finance key ({r.status_code})")
    if r.status_code == 404:  # an unknown tenant: nothing billed
        return {}
    if r.status_code != 200:
        raise Unavailable(f"GET /v1/billing/usage answered {r.status_code}: {r.text[:200]}")
    try:
        rows = r.json()["data"]
    except (ValueError, KeyError, TypeError):
        raise Unavailable("GET /v1/billing/usage: unexpected body (no `data` list)") from None
    out: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(FIELDS, 0))
    for row in rows:
        if row.get("tenant", tenant) != tenant:
            continue
        bucket = out[str(row.get("model", "?"))]
        for f in FIELDS:
            bucket[f] += int(row.get(f) or 0)
    return dict(out)


async def fetch_entries(http: httpx.AsyncClient, finance_key: str, tenant: str, frm: str,
                        to: str, page: int = 10_000) -> dict[str, dict[str, Any]] | None:
    """Per-request ledger entries (`GET /v1/billing/ledger`, paged by `after`), keyed by request
    id; None when this server has no such endpoint (the usage comparison still runs)."""
    out: dict[str, dict[str, Any]] = {}
    after: str | None = None
    for _ in range(100):  # at most 1M entries per tenant: bounded
        params = {"tenant": tenant, "from": frm, "to": to, "limit": str(page)}
        if after:
            params["after"] = after
        try:
            r = await http.get("/v1/billing/ledger", params=params,
                               headers={"Authorization": f"Bearer {finance_key}"})
            rows = r.json()["data"] if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None
        if rows is None:
            return None
        for row in rows:
            if row.get("request_id"):
                out[row["request_id"]] = row
        if len(rows) < page:
            break
        after = rows[-1].get("request_id")
    return out


async def snapshot(http: httpx.AsyncClient, finance_key: str, tenants: list[str], frm: str,
                   to: str) -> dict[str, dict[str, dict[str, int]]]:
    results = await asyncio.gather(*(fetch_usage(http, finance_key, t, frm, to) for t in tenants))
    return dict(zip(tenants, results, strict=True))


def _sum(models: dict[str, dict[str, int]]) -> dict[str, int]:
    total = dict.fromkeys(FIELDS, 0)
    for bucket in models.values():
        for f in FIELDS:
            total[f] += bucket.get(f, 0)
    return total


def delta(after: dict[str, dict[str, dict[str, int]]],
          before: dict[str, dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    out = {}
    for tenant, models in after.items():
        a, b = _sum(models), _sum(before.get(tenant, {}))
        out[tenant] = {f: a[f] - b[f] for f in FIELDS}
    return out


def client_side(attempts: list[Attempt]) -> dict[str, dict[str, Any]]:
    """Per tenant: what the clients saw of completed requests, and the cancelled ones."""
    out: dict[str, dict[str, Any]] = {}
    for a in attempts:
        t = out.setdefault(a.tenant, {
            "completed": dict.fromkeys(("requests", "prompt_tokens", "completion_tokens",
                                        "cached_tokens"), 0),
            "replayed": 0,
            "cancelled": {"requests": 0, "completion_chunks_seen": 0, "request_ids": []},
            "cancelled_before_response": 0,
            "failed_after_admission": {"requests": 0, "request_ids": []},
        })
        if a.kind == "ok" and a.replayed:
            t["replayed"] += 1
        elif a.kind == "ok" and a.usage_seen:
            c = t["completed"]
            c["requests"] += 1
            c["prompt_tokens"] += a.prompt_tokens
            c["completion_tokens"] += a.completion_tokens
            c["cached_tokens"] += a.cached_tokens
        elif a.kind == "cancelled" and a.status == 200:
            t["cancelled"]["requests"] += 1
            t["cancelled"]["completion_chunks_seen"] += a.chunks
            t["cancelled"]["request_ids"].append(a.request_id)
        elif a.kind == "cancelled":
            t["cancelled_before_response"] += 1
        elif a.status == 200 or a.kind == "ok":  # broke mid-stream, or ok without usage
            t["failed_after_admission"]["requests"] += 1
            t["failed_after_admission"]["request_ids"].append(a.request_id)
    return out


def compare(seen: dict[str, dict[str, Any]],
            ledger_delta: dict[str, dict[str, int]]) -> dict[str, dict[str, Any]]:
    report = {}
    for tenant, s in seen.items():
        led = ledger_delta.get(tenant, dict.fromkeys(FIELDS, 0))
        comp = s["completed"]
        residual = {f: led[f] - comp[f] for f in
                    ("requests", "prompt_tokens", "completion_tokens", "cached_tokens")}
        uncertain = (s["cancelled"]["requests"] + s["cancelled_before_response"]
                     + s["failed_after_admission"]["requests"])
        if uncertain == 0:
            verdict = "exact" if not any(residual.values()) else "MISMATCH"
        else:
            # the residual is what the ledger billed for the cancelled/failed requests
            ok = (0 <= residual["requests"] <= uncertain
                  and residual["completion_tokens"] >= 0 and residual["prompt_tokens"] >= 0)
            verdict = "consistent" if ok else "MISMATCH"
        report[tenant] = {
            "client_completed": comp,
            "ledger_delta": led,
            "difference_ledger_minus_client": residual,
            "cancelled": s["cancelled"],
            "cancelled_before_response": s["cancelled_before_response"],
            "failed_after_admission": s["failed_after_admission"],
            "replayed_not_billed": s["replayed"],
            "verdict": verdict,
        }
    return report


def by_request(attempts: list[Attempt],
               entries: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per tenant, request by request (X-Request-Id): completed requests must be billed exactly
    what the client saw, refused ones not at all; cancelled ones are billed at least what the
    client saw (one content chunk is one token on the simulator)."""
    out: dict[str, dict[str, Any]] = {}
    for a in attempts:
        ledger = entries.get(a.tenant)
        if ledger is None:
            continue
        t = out.setdefault(a.tenant, {
            "completed_checked": 0, "completed_exact": 0, "completed_mismatch": [],
            "completed_missing": [], "refused_but_billed": [], "refused_after_admission": 0,
            "cancelled": {"requests": 0, "billed": 0, "billed_prompt_tokens": 0,
                          "billed_completion_tokens": 0, "client_saw_chunks": 0,
                          "not_billed": []},
        })
        entry = ledger.get(a.request_id or "")
        if a.kind == "ok" and a.usage_seen and not a.replayed:
            t["completed_checked"] += 1
            if entry is None:
                t["completed_missing"].append(a.request_id)
            elif (entry.get("prompt_tokens"), entry.get("completion_tokens"),
                  entry.get("cached_tokens")) == (a.prompt_tokens, a.completion_tokens,
                                                  a.cached_tokens):
                t["completed_exact"] += 1
            else:
                t["completed_mismatch"].append({
                    "request_id": a.request_id,
                    "client": [a.prompt_tokens, a.completion_tokens, a.cached_tokens],
                    "ledger": [entry.get("prompt_tokens"), entry.get("completion_tokens"),
                               entry.get("cached_tokens")]})
        elif a.status and a.status != 200 and entry is not None and not a.replayed:
            # Admitted, then answered with an error (the replica failed before answering, a
            # flex request preempted): its ledger row must charge nothing.
            if any(int(entry.get(f) or 0) for f in CHARGED):
                t["refused_but_billed"].append(a.request_id)
            else:
                t["refused_after_admission"] += 1
        elif a.kind == "cancelled" and a.status == 200:
            c = t["cancelled"]
            c["requests"] += 1
            c["client_saw_chunks"] += a.chunks
            if entry is None:
                c["not_billed"].append(a.request_id)
            else:
                c["billed"] += 1
                c["billed_prompt_tokens"] += int(entry.get("prompt_tokens") or 0)
                c["billed_completion_tokens"] += int(entry.get("completion_tokens") or 0)
    for t in out.values():
        t["exact"] = not (t["completed_mismatch"] or t["completed_missing"]
                          or t["refused_but_billed"])
        c = t["cancelled"]
        # what the engine generated before the abort is at least what reached the client
        c["billed_at_least_seen"] = not c["not_billed"] and \
            c["billed_completion_tokens"] >= c["client_saw_chunks"]
    return out


def settled(report: dict[str, dict[str, Any]]) -> bool:
    return all(r["verdict"] == "exact" for r in report.values())


async def reconcile(
    base_url: str, finance_key: str, tenants: list[str], frm: str, to: str,
    baseline: dict[str, Any], attempts: list[Attempt], timeout_s: float,
    billing_lag: Callable[[], Any] | None = None, aborted: Callable[[], bool] = lambda: False,
) -> dict[str, Any]:
    """Poll the ledger (bounded) until it has caught up with the run, then compare."""
    seen = client_side(attempts)
    started = time.monotonic()
    polls, stable = 0, 0
    last: Any = None
    report: dict[str, Any] = {}
    per_request: dict[str, Any] | None = None
    async with httpx.AsyncClient(base_url=base_url, timeout=10.0) as http:
        while True:
            after = await snapshot(http, finance_key, tenants, frm, to)
            polls += 1
            report = compare(seen, delta(after, baseline))
            stable = stable + 1 if after == last else 0
            last = after
            lag = await billing_lag() if billing_lag else None
            caught_up = lag in (None, 0)
            waited = time.monotonic() - started
            if settled(report) and caught_up:
                break
            if caught_up and stable >= 3 and waited >= 1.0:
                break  # nothing moves any more: what is left is a real difference
            if waited >= timeout_s or aborted():
                break
            await asyncio.sleep(0.5)
        entries = {}
        for tenant in tenants:
            got = await fetch_entries(http, finance_key, tenant, frm, to)
            if got is None:
                entries = {}
                break
            entries[tenant] = got
        if entries:
            per_request = by_request(attempts, entries)
    waited = round(time.monotonic() - started, 2)
    aggregate_ok = all(r["verdict"] in ("exact", "consistent") for r in report.values())
    if per_request is not None:
        for tenant, r in report.items():
            pr = per_request.get(tenant)
            r["by_request"] = pr
            if pr is not None and not pr["exact"]:
                r["verdict"] = "MISMATCH"
        zero = all(pr["exact"] for pr in per_request.values()) and aggregate_ok
        cancelled_ok: bool | None = all(pr["cancelled"]["billed_at_least_seen"]
                                        for pr in per_request.values())
    else:
        zero = aggregate_ok
        cancelled_ok = None
    return {
        "available": True, "from": frm, "to": to, "polls": polls, "waited_s": waited,
        "timed_out": waited >= timeout_s,
        "per_request": per_request is not None,
        "tenants": report,
        "zero_difference_for_completed": zero,
        "cancelled_billed_at_least_seen": cancelled_ok,
        "note": ("difference = ledger delta over the run (GET /v1/billing/usage) - tokens the "
                 "clients saw in the final usage of completed requests: zero where nothing was "
                 "cancelled. Cancelled requests are billed for what the engine generated before "
                 "the abort (at least what the client saw) and are checked by X-Request-Id"
                 + (" against GET /v1/billing/ledger, as is every completed request."
                    if per_request is not None else
                    "; this server has no per-request ledger endpoint, so the ids are listed.")),
    }


async def take_baseline(base_url: str, finance_key: str, tenants: list[str], frm: str,
                        to: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base_url, timeout=10.0) as http:
        return await snapshot(http, finance_key, tenants, frm, to)
