"""Money with its currency, as finance sees it: prices set under the currency setting, a request
admitted under the earlier USD price and one under the EUR price, and every output (the CLI's
JSON, CSV and table, the API's response models) naming each amount's currency, never one sum."""

from __future__ import annotations

import csv
import io
import json
import time
from datetime import UTC, datetime, timedelta

from tests.integration.test_cli import ok, run
from tests.integration.test_finance import MODEL, _project, _request
from tollgate_llm.api.http.schemas import Invoice, LedgerEntries, UsageRows
from tollgate_llm.api.services.control_service import ControlService


def _set_price(url: str, prompt: str, currency: str | None) -> str:
    done = run("prices", "set", "--model", MODEL, "--prompt", prompt, "--completion", "2",
               "--cached", "0.5", url=url, env={"TOLLGATE_CURRENCY": currency or ""})  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_price_set_in_eur_bills_in_eur_and_an_earlier_usd_bill_stays_usd(url: str) -> None:
    ok("tenants", "create", "acme", url=url)
    # Given a price set under the default setting (USD), a request admitted under it...
    assert "in USD" in _set_price(url, "1", None)
    time.sleep(0.01)
    admitted_under_usd = datetime.now(UTC)
    time.sleep(0.01)
    # ...and then the setting changed to EUR and a new price set
    assert "in EUR" in _set_price(url, "3", "EUR")
    time.sleep(0.01)
    # When both requests are billed after the change
    with ControlService.open(url) as service:
        view = service.view
        usd_request = _request(service.store, view, "acme", admitted_under_usd, 1000, 100, 0)
        eur_request = _request(service.store, view, "acme", datetime.now(UTC), 1000, 100, 0)
        _project(service.store.engine, service.store)

    # Then each bill is in its price's currency: the one admitted under USD stays USD
    invoice = json.loads(ok("ledger", "invoice", "acme", "--format", "json", url=url))
    Invoice.model_validate(invoice)  # the API's response model (/openapi.json) accepts it
    by_currency = {t["currency"]: t for t in invoice["totals"]}
    assert set(by_currency) == {"EUR", "USD"}
    assert by_currency["USD"]["amount_micros"] == 1_200  # 1000 × 1 + 100 × 2 (per 1M tokens)
    assert by_currency["EUR"]["amount_micros"] == 3_200
    # and the month is never one sum of the two
    assert (invoice["currency"], invoice["amount_micros"], invoice["amount"]) == (None, None, None)
    assert sorted(line["currency"] for line in invoice["lines"]) == ["EUR", "USD"]

    lines = list(csv.DictReader(io.StringIO(
        ok("ledger", "invoice", "acme", "--format", "csv", url=url)
    )))  # fmt: skip
    assert {(r["currency"], r["amount_micros"]) for r in lines} == {("USD", "1200"),
                                                                    ("EUR", "3200")}
    table = ok("ledger", "invoice", "acme", url=url)
    assert "total 0.003200 EUR, 0.001200 USD" in table  # the title: a total per currency
    assert "currency" in table

    # The bills end 2 s after their admission (the helper's request), so the ranged reads below
    # ask up to a minute ahead: their default end, now, would miss the EUR one on a fast store.
    until = ["--to", (datetime.now(UTC) + timedelta(minutes=1)).isoformat()]
    entries = json.loads(ok("ledger", "entries", "--tenant", "acme", "--format", "json", *until,
                            url=url))  # fmt: skip
    LedgerEntries.model_validate(entries)
    assert {e["request_id"]: e["currency"] for e in entries["data"]} == {
        usd_request: "USD", eur_request: "EUR",
    }
    rows = list(csv.DictReader(io.StringIO(
        ok("ledger", "entries", "--tenant", "acme", "--format", "csv", *until, url=url)
    )))  # fmt: skip
    assert {r["request_id"]: r["currency"] for r in rows} == {
        usd_request: "USD", eur_request: "EUR",
    }

    for group_by in ("hour", "day", "model", "key"):
        usage = json.loads(ok("ledger", "usage", "--tenant", "acme", "--group-by", group_by,
                              "--format", "json", *until, url=url))  # fmt: skip
        UsageRows.model_validate(usage)
        assert sorted((r["currency"], r["amount_micros"]) for r in usage["data"]) == [
            ("EUR", 3_200), ("USD", 1_200),
        ], group_by
    usage_table = ok("ledger", "usage", "--tenant", "acme", "--group-by", "model", *until,
                     url=url)
    assert "currency" in usage_table and "EUR" in usage_table and "USD" in usage_table


def test_a_currency_setting_that_is_not_an_iso_code_is_refused(url: str) -> None:
    done = run("prices", "set", "--model", MODEL, "--prompt", "1", "--completion", "2",
               "--cached", "0.5", url=url, env={"TOLLGATE_CURRENCY": "euro"})  # fmt: skip
    assert done.returncode != 0 and "currency" in done.stderr
    assert "Traceback" not in done.stderr


def test_flex_revenue_is_per_currency(engine) -> None:  # type: ignore[no-untyped-def]
    from tollgate_llm.ledger.finance import FinanceQueries
    from tollgate_llm.ledger.schema import ledger_entries

    when = datetime.now(UTC)
    with engine.begin() as conn:
        for n, (currency, amount) in enumerate((("USD", 700), ("EUR", 300), ("EUR", 100))):
            conn.execute(ledger_entries.insert().values(
                request_id=f"req-{n}", tenant_id="acme", key_id="key-1", model=MODEL,
                prompt_tokens=10, completion_tokens=5, cached_tokens=0,
                prompt_micros_per_mtok=1, completion_micros_per_mtok=1, cached_micros_per_mtok=1,
                amount_micros=amount, terminal="completed", admitted_at=when, finished_at=when,
                billed_at=when, position=n + 1, service_tier="flex", currency=currency,
            ))  # fmt: skip
    (row,) = FinanceQueries(engine).flex("acme", when - timedelta(hours=1),
                                         when + timedelta(hours=1))
    assert row["flex_requests"] == 3
    assert [(t["currency"], t["requests"], t["amount_micros"]) for t in row["flex_amounts"]] == [
        ("EUR", 2, 400), ("USD", 1, 700),
    ]
