"""Money with its currency over HTTP: a server's prices set in USD, then a price set under the
EUR setting; the request billed before stays USD, the one after is EUR, and the billing JSON,
CSV and invoice (and the CLI's table) say so, never summing the two."""

from __future__ import annotations

import csv
import io
import os
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import httpx
import pytest

from tests.e2e.conftest import (
    FAST,
    MODEL,
    REPO,
    TOLLGATE,
    Server,
    auth,
    poll,
    running_server,
    short_body,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def own_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # Its own server: a price set here must not re-price the shared server's later requests.
    with running_server(tmp_path_factory, "currency", [(MODEL, FAST)]) as s:
        yield s


def _billed(server: Server, secret: str) -> dict:  # type: ignore[type-arg]
    r = httpx.post(f"{server.base}/v1/chat/completions", json=short_body(), headers=auth(secret),
                   timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    return dict(server.wait_billed(r.headers["x-request-id"]))


def test_a_price_set_under_eur_bills_in_eur_and_the_usd_bill_before_it_stays_usd(
    own_server: Server,
) -> None:
    server = own_server
    tenant = server.new_tenant("money")
    finance = server.keys["finance"]
    # Given a request billed at the demo's price, set under the default setting
    before = _billed(server, tenant.secret)
    assert before["currency"] == "USD"
    # When a price is set under the EUR setting (the setting's option on `prices set`)
    assert "in EUR" in server.cli("prices", "set", "--model", MODEL, "--prompt", "1",
                                  "--completion", "2", "--cached", "0.5", "--currency", "EUR")
    deadline = time.monotonic() + 15
    while (after := _billed(server, tenant.secret))["currency"] != "EUR":
        assert time.monotonic() < deadline, "the edge never priced in EUR"
    # Then the later request is billed in EUR and the earlier one is still USD
    period = datetime.now(UTC).strftime("%Y-%m")
    ledger = httpx.get(f"{server.base}/v1/billing/ledger", params={"tenant": tenant.name},
                       headers=auth(finance), timeout=30).json()["data"]  # fmt: skip
    currency_of = {e["request_id"]: e["currency"] for e in ledger}
    assert currency_of[before["request_id"]] == "USD"
    assert currency_of[after["request_id"]] == "EUR"

    r = httpx.get(f"{server.base}/v1/billing/ledger", headers=auth(finance), timeout=30,
                  params={"tenant": tenant.name, "format": "csv"})  # fmt: skip
    rows = {row["request_id"]: row for row in csv.DictReader(io.StringIO(r.text))}
    assert rows[before["request_id"]]["currency"] == "USD"
    assert rows[after["request_id"]]["currency"] == "EUR"

    invoice = httpx.get(f"{server.base}/v1/billing/invoices/{tenant.name}",
                        params={"period": period}, headers=auth(finance), timeout=30).json()
    totals = {t["currency"]: t["amount_micros"] for t in invoice["totals"]}
    assert set(totals) == {"USD", "EUR"}
    assert totals["EUR"] == sum(e["amount_micros"] for e in ledger if e["currency"] == "EUR")
    assert invoice["currency"] is None and invoice["amount_micros"] is None  # never one sum

    usage = httpx.get(f"{server.base}/v1/billing/usage", headers=auth(finance), timeout=30,
                      params={"tenant": tenant.name, "group_by": "model"}).json()["data"]
    assert {row["currency"] for row in usage} == {"USD", "EUR"}

    table = server.cli("ledger", "invoice", tenant.name)
    assert " EUR, " in table and table.count("USD") >= 2 and "currency" in table


def _cli_refused(server: Server, *args: str) -> str:
    """A `tollgate` command expected to fail: its one-line error."""
    done = subprocess.run(
        [*TOLLGATE, *args, "--database-url", server.db_url], cwd=REPO, capture_output=True,
        text=True, timeout=60, env={**os.environ, "TOLLGATE_DATA_DIR": str(server.data_dir)},
    )  # fmt: skip
    assert done.returncode != 0, done.stdout
    return done.stderr


def test_budgets_and_runs_say_their_currency_and_count_only_spend_priced_in_it(
    own_server: Server,
) -> None:
    server = own_server
    tenant = server.new_tenant("budget-eur", plan="enterprise")
    # Given the model priced in EUR (the setting's option on `prices set`)
    server.cli("prices", "set", "--model", MODEL, "--prompt", "1", "--completion", "2",
               "--cached", "0.5", "--currency", "EUR")  # fmt: skip
    deadline = time.monotonic() + 15
    while _billed(server, tenant.secret)["currency"] != "EUR":
        assert time.monotonic() < deadline, "the edge never priced in EUR"
    # A budget in a currency no price is in is refused, naming the field and the currencies.
    refused = _cli_refused(server, "budgets", "set", "--tenant", tenant.name, "--period", "day",
                           "--amount", "5", "--currency", "JPY")  # fmt: skip
    assert "currency" in refused and "JPY" in refused and "EUR" in refused
    # When the organization has a USD budget of one micro-dollar (--usd: --amount in USD)
    out = server.cli("budgets", "set", "--tenant", tenant.name, "--period", "day",
                     "--usd", "0.000001")  # fmt: skip
    assert out.strip().endswith("0.000001 USD")
    # Then a request priced in EUR is not counted by it: served.
    assert _billed(server, tenant.secret)["currency"] == "EUR"
    # When its monthly budget is one micro-euro
    out = server.cli("budgets", "set", "--tenant", tenant.name, "--period", "month",
                     "--amount", "0.000001", "--currency", "EUR")  # fmt: skip
    assert out.strip().endswith("0.000001 EUR")

    # Then a request priced in EUR is refused by it, in EUR, once the edge knows the budget.
    def refusal() -> dict | None:  # type: ignore[type-arg]
        r = httpx.post(f"{server.base}/v1/chat/completions", json=short_body(),
                       headers=auth(tenant.secret), timeout=30)  # fmt: skip
        return r.json()["error"] if r.status_code == 400 else None

    error = poll("the EUR budget at the edge", refusal, timeout=15)
    assert "EUR" in error["message"] and "USD" not in error["message"], error
    assert "(0.000001 EUR)" in error["message"]
    # And the spend tree (CLI) shows each budget with its currency and the spend per currency.
    shown = server.cli("budgets", "show", "--tenant", tenant.name)
    org_row = next(line for line in shown.splitlines() if line.startswith("org "))
    assert "0.000001 EUR" in org_row and "0.000001 USD" in org_row and " EUR" in org_row
    # Runs: a cost limit in the deployment's currency unless named; every amount says its own.
    server.cli("budgets", "set", "--tenant", tenant.name, "--period", "month", "--clear")
    runs = f"{server.base}/v1/runs"
    bad = httpx.post(runs, headers=auth(tenant.secret), timeout=10,
                     json={"max_cost": "1", "currency": "JPY"})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "currency", bad.text
    created = httpx.post(runs, headers=auth(tenant.secret), timeout=10,
                         json={"id": "eur-run", "max_cost": "1", "currency": "EUR"})  # fmt: skip
    assert created.status_code == 200, created.text
    limits = created.json()["limits"]
    assert (limits["max_cost"], limits["currency"], limits["max_cost_usd"]) == ("1", "EUR", None)
    r = httpx.post(f"{server.base}/v1/chat/completions", json=short_body(), timeout=30,
                   headers={**auth(tenant.secret), "X-Tollgate-Run-Id": "eur-run"})  # fmt: skip
    assert r.status_code == 200, r.text
    server.wait_billed(r.headers["x-request-id"])
    usage = poll("the run's bill", lambda: (
        u if float((u := httpx.get(f"{runs}/eur-run", headers=auth(tenant.secret),
                                   timeout=10).json()["usage"])["cost"]) > 0 else None
    ), timeout=15)  # fmt: skip
    assert (usage["currency"], usage["cost_usd"], usage["reserved"]) == ("EUR", None, "0")
