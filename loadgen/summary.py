"""The end-of-run summary: per-tenant and per-tier tables, reconciliation, the JSON result."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from tollgate_llm.loadgen.stats import Group, Stats


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _row(name: str, tier: str, g: Group) -> list[str]:
    j = g.to_json()
    s = j["status"]
    return [
        name, tier, str(g.requests), str(s["ok"]), str(s["cancelled"]), str(s["429"]),
        str(s["503"]), str(s["4xx"]), str(s["5xx"] + s["error"]),
        f"{g.prompt_tokens:,}", f"{g.completion_tokens:,}",
        _ms(j["ttft_ms"]["p50"]), _ms(j["ttft_ms"]["p99"]),
        _ms(j["tpot_ms"]["p50"]), _ms(j["tpot_ms"]["p99"]),
    ]


COLUMNS = ("tenant", "tier", "requests", "ok", "cancelled", "429", "503", "4xx", "errors",
           "prompt tok", "completion tok", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
           "TPOT p99 ms")


def print_summary(console: Console, stats: Stats, meta: dict[str, Any]) -> None:
    table = Table(title=f"tollgate loadgen — {meta['profile']} ({meta['mode']}-loop, "
                        f"{meta['client']} client), stopped by {meta['stop_reason']}",
                  title_justify="left")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("tenant", "tier") else "right")
    for (tenant, tier), g in sorted(stats.by_tenant.items()):
        table.add_row(*_row(tenant, tier, g))
    table.add_section()
    for tier, g in sorted(stats.by_tier.items()):
        table.add_row(*_row("(all)", tier, g))
    table.add_section()
    table.add_row(*_row("total", "", stats.total), style="bold")
    console.print(table)
    refusals = stats.total.reasons.most_common(8)
    if refusals:
        console.print("refusals and errors: " + ", ".join(f"{k} ×{v}" for k, v in refusals))
    if stats.dropped:
        console.print(f"[yellow]{stats.dropped} open-loop arrivals were not sent: the generator's "
                      f"--max-in-flight cap was reached (the server is slower than the offered "
                      f"load)[/yellow]")
    cpu = meta["generator_cpu"]
    console.print(
        f"wall {meta['wall_s']:.1f} s, {stats.sent} HTTP requests, offered "
        f"{meta['offered_rps']:.1f} req/s; generator CPU (this process only, not the server): "
        f"{cpu['user_s']:.2f} s user + {cpu['system_s']:.2f} s system = "
        f"{cpu['percent_of_one_core']:.0f}% of one core, {cpu['us_per_request']:.0f} µs/request"
    )
    if meta["mode"] == "open":
        console.print(
            f"offered = the HTTP requests the run actually sent (retries and replays included) "
            f"over its whole wall time; it differs from the target {meta['rate']:g} req/s "
            f"because arrivals are random (bursty ones more so), arrivals over --max-in-flight "
            f"are dropped, and the drain adds time without arrivals",
            style="dim",
        )


def print_reconciliation(console: Console, rec: dict[str, Any]) -> None:
    if not rec.get("available"):
        console.print(f"[yellow]reconciliation unavailable: {rec.get('reason')}[/yellow]")
        return
    table = Table(title=f"Reconciliation with the finance ledger (waited {rec['waited_s']} s"
                        f"{', TIMED OUT' if rec['timed_out'] else ''})", title_justify="left")
    for col in ("tenant", "completed", "client prompt/completion", "ledger Δ req",
                "ledger Δ prompt/completion", "difference prompt/completion", "cancelled",
                "cancelled: client saw", "verdict"):
        table.add_column(col, justify="left" if col in ("tenant", "verdict") else "right")
    for tenant, r in sorted(rec["tenants"].items()):
        c, led, d = r["client_completed"], r["ledger_delta"], r["difference_ledger_minus_client"]
        verdict = r["verdict"]
        style = "green" if verdict in ("exact", "consistent") else "bold red"
        table.add_row(
            tenant, str(c["requests"]), f"{c['prompt_tokens']:,}/{c['completion_tokens']:,}",
            str(led["requests"]), f"{led['prompt_tokens']:,}/{led['completion_tokens']:,}",
            f"{d['prompt_tokens']:+,}/{d['completion_tokens']:+,}",
            str(r["cancelled"]["requests"] + r["cancelled_before_response"]
                + r["failed_after_admission"]["requests"]),
            f"{r['cancelled']['completion_chunks_seen']:,} chunks",
            f"[{style}]{verdict}[/{style}]",
        )
    console.print(table)
    replays = sum(r["replayed_not_billed"] for r in rec["tenants"].values())
    console.print(
        f"completed = requests whose final usage a client read, each billed once; `ok` above also "
        f"counts the Idempotency-Key replays ({replays} in this run), answered from the stored "
        f"response: an `ok` for the client, not a new completion in the ledger\n"
        f"exact = zero difference; consistent = a difference the cancelled or failed requests "
        f"account for: at most one ledger entry each and no negative tokens (they are billed "
        f"what the engine made before they ended, which the clients never saw in a final usage)",
        style="dim",
    )
    for tenant, r in sorted(rec["tenants"].items()):
        pr = r.get("by_request")
        if not pr:
            continue
        c = pr["cancelled"]
        console.print(
            f"  {tenant}: by request id, {pr['completed_exact']}/{pr['completed_checked']} "
            f"completed billed exactly; {len(pr['completed_mismatch'])} differ, "
            f"{len(pr['completed_missing'])} missing, {len(pr['refused_but_billed'])} refused "
            f"but charged ({pr['refused_after_admission']} refused after admission, charged "
            f"nothing); cancelled {c['requests']}: billed {c['billed_completion_tokens']:,} "
            f"completion tokens, clients saw {c['client_saw_chunks']:,} chunks"
            + ("" if c["billed_at_least_seen"] else
               f" [bold red]— UNDER-BILLED: {len(c['not_billed'])} cancelled requests have no "
               f"ledger entry[/bold red]"))
    console.print(rec["note"], style="dim")


def result_json(stats: Stats, meta: dict[str, Any], reconciliation: dict[str, Any] | None,
                kv_samples: list[tuple[float, str, str, float]],
                include_requests: bool = True) -> dict[str, Any]:
    return {
        "meta": meta,
        "requests": stats.sent,
        "logical_requests": len({a.seq for a in stats.attempts}),
        "dropped_arrivals": stats.dropped,
        "total": stats.total.to_json(),
        "by_tenant": [{"tenant": t, "tier": tier, **g.to_json()}
                      for (t, tier), g in sorted(stats.by_tenant.items())],
        "by_tier": {tier: g.to_json() for tier, g in sorted(stats.by_tier.items())},
        "by_class": {c: g.to_json() for c, g in sorted(stats.by_class.items())},
        "reconciliation": reconciliation,
        "kv_occupancy_samples": [
            {"t": round(t, 3), "replica": r, "model": m, "value": v} for t, r, m, v in kv_samples
        ],
        "attempts": [a.to_json() for a in stats.attempts] if include_requests else None,
    }
