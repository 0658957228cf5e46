"""Money with its currency over HTTP: a server's prices set in USD, then a price set under the
EUR setting; the request billed before stays USD, the one after is EUR, and the billing JSON,
CSV and invoice (and the CLI's table) say so, never summing the two."""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import httpx
import pytest

from tests.e2e.conftest import FAST, MODEL, Server, auth, running_server, short_body

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
