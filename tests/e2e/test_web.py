"""The /ui pages (issue 4) in a real headless Chromium against `tollgate serve` (embedded: demo
tenants, simulated fleet) run as a subprocess.

Chromium is Debian's `chromium` package; if /usr/bin/chromium is missing the fixture installs it
with apt-get (as root), so these tests never skip. Screenshots land in test-output/screenshots/.

The browser signs in as a person does: the session cookie `POST /ui/login` answers (a signed,
expiring session, never the key) is set in Chromium over its DevTools protocol, and the page is
read and photographed through it. No key ever goes in a URL.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import pytest
from websockets.sync.client import connect

from tests.e2e.conftest import (
    FAST,
    MODEL,
    REPO,
    TOLLGATE,
    _stop_process,
    auth,
    free_port,
    poll,
    running_server,
    short_body,
    spawn,
    wait_http,
)

pytestmark = pytest.mark.e2e

SLOW_MODEL = "llama-3.1-70b-2026-05"
SCREENSHOTS = REPO / "test-output" / "screenshots"
CHROMIUM = Path("/usr/bin/chromium")
EVENT_ORDER = ("RequestAdmitted", "RequestEstimated", "RequestRouted", "FirstTokenStreamed",
               "RequestCompleted", "QuotaRefunded", "UsageBilled")
CUSTOMERS = ("demo-free", "demo-standard", "demo-enterprise")


def ensure_chromium() -> Path:
    """Debian's chromium, installed on first use on a fresh machine (the lead's `./dev test`
    set-up may do the same with `apt-get install -y --no-install-recommends chromium`)."""
    if CHROMIUM.exists():
        return CHROMIUM
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        pytest.fail("chromium is missing: run `apt-get update && apt-get install -y chromium`")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for args in ([apt, "update"], [apt, "install", "-y", "--no-install-recommends", "chromium"]):
        done = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
        if done.returncode != 0:
            pytest.fail(f"{' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    assert CHROMIUM.exists(), "apt-get installed chromium but /usr/bin/chromium is missing"
    return CHROMIUM


@dataclass
class UiServer:
    tmp: Path
    port: int
    proc: subprocess.Popen[bytes]
    keys: dict[str, str]
    chromium: Path
    requests: dict[str, list[str]] = field(default_factory=dict)  # tenant -> request ids
    stalled: str = ""  # a request whose edge died: the sweeper expires it (anomalies)
    sessions: dict[str, str] = field(default_factory=dict)  # key name -> session cookie

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def db_url(self) -> str:
        return f"sqlite:///{self.tmp / 'data' / 'tollgate.db'}"

    def url(self, path: str, **params: str) -> str:
        return f"{self.base}{path}" + ("?" + urlencode(params) if params else "")

    def session(self, key: str) -> str:
        """The session cookie signing in with `key` gives (through the login form)."""
        if key not in self.sessions:
            r = httpx.post(f"{self.base}/ui/login", data={"key": self.keys[key]}, timeout=10)
            assert r.status_code == 303, r.text
            self.sessions[key] = r.cookies["tollgate_session"]
            assert self.keys[key] not in self.sessions[key]
        return self.sessions[key]

    def browser(self, key: str, url: str, screenshot: Path | None = None) -> str:
        """Open `url` in headless Chromium signed in as `key`; its DOM (and a screenshot)."""
        profile = self.tmp / f"chromium-{uuid.uuid4().hex[:8]}"
        port = free_port()
        cmd = [
            str(self.chromium), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--disable-dev-shm-usage", "--hide-scrollbars",
            "--window-size=1280,1600", f"--remote-debugging-port={port}",
            "--remote-allow-origins=*", f"--user-data-dir={profile}", "about:blank",
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            ws_url = poll("chromium's DevTools endpoint", lambda: _page_socket(port, proc), 60)
            with connect(ws_url, max_size=None, open_timeout=30) as ws:
                devtools = DevTools(ws)
                devtools.call("Page.enable")
                devtools.call("Network.enable")
                devtools.call(
                    "Network.setCookie", name="tollgate_session", value=self.session(key),
                    url=f"{self.base}/ui/", httpOnly=True, sameSite="Strict",
                )
                devtools.call("Page.navigate", url=url)
                devtools.wait("Page.loadEventFired")
                html = devtools.call(
                    "Runtime.evaluate", expression="document.documentElement.outerHTML",
                    returnByValue=True,
                )["result"]["value"]
                if screenshot is not None:
                    devtools.call(
                        "Emulation.setDeviceMetricsOverride", width=1280, height=1600,
                        deviceScaleFactor=1, mobile=False,
                    )
                    data = devtools.call("Page.captureScreenshot", format="png")["data"]
                    screenshot.write_bytes(base64.b64decode(data))
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            shutil.rmtree(profile, ignore_errors=True)
        return str(html)

    def dom(self, url: str, key: str) -> str:
        out = self.browser(key, url)
        assert "<html" in out, out[:500]
        return out

    def screenshot(self, name: str, url: str, key: str) -> Path:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / f"{name}.png"
        path.unlink(missing_ok=True)
        self.browser(key, url, screenshot=path)
        assert_real_png(path, 1280, 1600)
        return path


def _page_socket(port: int, proc: subprocess.Popen[bytes]) -> str | None:
    if proc.poll() is not None:
        pytest.fail(f"chromium exited: {proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
    try:
        pages = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=2).json()
    except httpx.HTTPError:
        return None
    return next((p["webSocketDebuggerUrl"] for p in pages if p.get("type") == "page"), None)


class DevTools:
    """The few Chrome DevTools protocol calls the tests need, over one page's websocket."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.next_id = 0
        self.events: list[str] = []

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == self.next_id:
                assert "error" not in message, message
                return dict(message.get("result", {}))
            if "method" in message:
                self.events.append(message["method"])

    def wait(self, event: str) -> None:
        while event not in self.events:
            message = json.loads(self.ws.recv(timeout=60))
            if "method" in message:
                self.events.append(message["method"])


def assert_real_png(path: Path, width: int, height: int) -> None:
    assert path.exists(), f"no screenshot at {path}"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    w, h = struct.unpack(">II", data[16:24])
    assert (w, h) == (width, height), f"{path} is {w}x{h}"
    # A blank or single-colour page compresses to a few kilobytes; a rendered page does not.
    assert len(data) > 30_000, f"{path} is only {len(data)} bytes: an empty page?"


def _chat(server: UiServer, key: str, model: str, tokens: int, stream: bool) -> str:
    body = {"model": model, "max_tokens": tokens, "stream": stream,
            "messages": [{"role": "user", "content": f"Tell me about {key} and {model}."}]}
    with httpx.stream("POST", f"{server.base}/v1/chat/completions", json=body,
                      headers=auth(server.keys[key]), timeout=60) as r:
        r.read()
        assert r.status_code == 200, r.text
        return r.headers["x-request-id"]


def _inject_stalled_request(server: UiServer) -> str:
    """A request admitted by an edge that then died (no renewals, no terminal event): the lease
    sweeper expires it and bills its last known progress, and the support page must flag it."""
    from tollgate_llm.domain.requests.events import RequestAdmitted, RequestEstimated
    from tollgate_llm.ledger.engine import create_engine_from_url
    from tollgate_llm.ledger.store import NewEvent, SqlEventStore

    rid = f"req_{uuid.uuid4().hex}"
    # Past the 15 s lease TTL, but not before the demo prices exist (no price: no bill).
    first = server.requests["demo-free"][0]
    timeline = httpx.get(f"{server.base}/v1/requests/{first}/events",
                         headers=auth(server.keys["support"]), timeout=10).json()
    admitted = datetime.fromisoformat(timeline["events"][0]["occurred_at"].replace("Z", "+00:00"))
    at = max(datetime.now(UTC) - timedelta(seconds=20), admitted + timedelta(milliseconds=1))
    engine = create_engine_from_url(server.db_url)
    try:
        store = SqlEventStore(engine)
        store.append(rid, 0, [
            NewEvent(str(uuid.uuid4()), rid, "demo-standard", at, RequestAdmitted(
                request_id=rid, tenant_id="demo-standard", key_id="key_dead0000edge0000",
                model=MODEL, tier="standard", edge_id="edge-that-died")),
            NewEvent(str(uuid.uuid4()), rid, "demo-standard", at, RequestEstimated(
                request_id=rid, prompt_tokens=12, reserved_output_tokens=64, reserved_tokens=76,
                kv_byte_seconds=1 << 20, tpot_us=80_000)),
        ])
    finally:
        engine.dispose()
    return rid


@pytest.fixture(scope="module")
def ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UiServer]:
    chromium = ensure_chromium()
    tmp = tmp_path_factory.mktemp("web")
    port = free_port()
    log = tmp / "serve.log"
    proc = spawn([*TOLLGATE, "serve", "--port", str(port), "--sim-speed", "20"], log,
                 env={"TOLLGATE_DATA_DIR": str(tmp / "data")})
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", proc, log, timeout=60)
        keys = json.loads((tmp / "data" / "demo-keys.json").read_text())
        server = UiServer(tmp, port, proc, keys, chromium)
        for i, tenant in enumerate(CUSTOMERS):
            ids = [
                _chat(server, tenant, MODEL, 16 + 8 * i, stream=False),
                _chat(server, tenant, MODEL, 24, stream=True),
                _chat(server, tenant, SLOW_MODEL, 12 + 4 * i, stream=True),
            ]
            server.requests[tenant] = ids
        server.stalled = _inject_stalled_request(server)
        wanted = {rid for ids in server.requests.values() for rid in ids} | {server.stalled}

        def all_billed() -> bool:
            r = httpx.get(f"{server.base}/v1/billing/ledger", headers=auth(keys["finance"]),
                          timeout=10)
            return wanted <= {e["request_id"] for e in r.json()["data"]}

        poll("every request (and the stalled one, via the sweeper) to be billed", all_billed,
             timeout=60, every=0.5)
        yield server
    finally:
        _stop_process(proc, grace=10)
        if proc.returncode not in (0, -15, None):
            sys.stderr.write(log.read_text()[-3000:])


# --- support ---------------------------------------------------------------------------------


def test_support_page_shows_the_timeline(ui: UiServer) -> None:
    rid = ui.requests["demo-standard"][1]  # a streamed completion
    url = ui.url("/ui/support", request_id=rid)
    dom = ui.dom(url, "support")
    api = httpx.get(f"{ui.base}/v1/requests/{rid}/events", headers=auth(ui.keys["support"]),
                    timeout=10).json()

    assert f'<code id="request-id">{rid}</code>' in dom
    types = re.findall(r'<tr class="event[^"]*" data-type="(\w+)"', dom)
    assert types == [e["type"] for e in api["events"]]
    assert tuple(types) == EVENT_ORDER
    for event in api["events"]:  # the time and state after of every event
        assert event["occurred_at"][:19].replace("T", " ") in dom
        assert f'class="badge {event["state_after"]}"' in dom
    assert 'id="anomalies"' in dom and 'id="no-anomalies"' in dom
    assert f'<code id="replica">{api["replica_id"]}</code>' in dom
    assert re.search(r'id="occupancy">\d+\.\d %', dom)
    assert f'id="ttft">{api["ttft_ms"]:,} ms' in dom
    assert 'id="tpot">' in dom and 'id="plan">standard<' in dom
    assert f"<dt>max_output</dt><dd>{api['limits_at_admission']['max_output']:,}</dd>" in dom
    amount, currency = api["billing"]["amount_micros"], api["billing"]["currency"]
    assert currency == "USD"  # the demo's prices, set under the default currency setting
    assert f"<strong>billed {amount // 1_000_000}.{amount % 1_000_000:06d} USD</strong>" in dom
    assert "reserved tokens +" in dom and "refunded tokens +" in dom  # quota effects
    assert 'id="who"' in dom and "support key" in dom  # the cookie session, key gone from URL

    ui.screenshot("support-timeline", url, "support")


def test_support_page_highlights_anomalies(ui: UiServer) -> None:
    url = ui.url("/ui/support", request_id=ui.stalled)
    dom = ui.dom(url, "support")
    assert ui.stalled in dom
    anomalies = re.findall(r'<li class="anomaly"><strong[^>]*>(\w+)</strong>', dom)
    assert "lease_expired" in anomalies, anomalies
    assert re.search(r'<tr class="event flagged" data-type="LeaseExpired"', dom)
    assert 'class="badge lease_expired"' in dom
    ui.screenshot("support-anomaly", url, "support")


def test_customer_sees_another_tenants_request_as_unknown(ui: UiServer) -> None:
    own = ui.requests["demo-free"][0]
    other = ui.requests["demo-enterprise"][0]
    unknown = f"req_{uuid.uuid4().hex}"
    pages = {}
    for rid in (own, other, unknown):
        r = httpx.get(ui.url("/ui/support", request_id=rid), headers=auth(ui.keys["demo-free"]),
                      timeout=10)
        pages[rid] = r
    assert pages[own].status_code == 200 and own in pages[own].text
    assert pages[other].status_code == pages[unknown].status_code == 404
    assert "demo-enterprise" not in pages[other].text

    def normalised(text: str, rid: str) -> str:
        return text.replace(rid, "REQ")

    other_dom = ui.dom(ui.url("/ui/support", request_id=other), "demo-free")
    unknown_dom = ui.dom(ui.url("/ui/support", request_id=unknown), "demo-free")
    assert normalised(other_dom, other) == normalised(unknown_dom, unknown)
    assert f"no request {other}" in other_dom and "RequestAdmitted" not in other_dom
    # and the support key does see it
    assert "RequestAdmitted" in ui.dom(ui.url("/ui/support", request_id=other), "support")


def test_request_id_is_escaped(ui: UiServer) -> None:
    evil = '<script>alert(1)</script>"><img src=x onerror=alert(2)>'
    r = httpx.get(ui.url("/ui/support", request_id=evil), headers=auth(ui.keys["support"]),
                  timeout=10)
    assert r.status_code == 400
    assert "<script>alert(1)" not in r.text and "<img src=x" not in r.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&#34;&gt;&lt;img" in r.text
    assert "script-src" not in r.headers["content-security-policy"]  # no script at all


# --- finance ---------------------------------------------------------------------------------


def _invoice(ui: UiServer, tenant: str) -> dict:
    r = httpx.get(f"{ui.base}/v1/billing/invoices/{tenant}", headers=auth(ui.keys["finance"]),
                  timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_finance_page_all_tenants(ui: UiServer) -> None:
    url = ui.url("/ui/finance")
    dom = ui.dom(url, "finance")
    for tenant in CUSTOMERS:
        assert f'<tr class="tenant-row" data-tenant="{tenant}">' in dom
        assert f'<tr class="invoice-line" data-tenant="{tenant}">' in dom
    chart = re.search(r'<svg id="tokens-chart".*?</svg>', dom, re.S)
    assert chart, "no usage chart"
    assert len(re.findall(r'<rect class="bar"', chart.group(0))) >= 3  # a bar per tenant at least
    assert '<polyline class="amount-line"' in chart.group(0)
    assert '<svg id="totals-chart"' in dom
    invoices = [_invoice(ui, t) for t in CUSTOMERS]
    assert {i["currency"] for i in invoices} == {"USD"}
    total = sum(i["amount_micros"] for i in invoices)
    assert f'id="invoice-total">{total // 1_000_000}.{total % 1_000_000:06d} USD<' in dom
    for kind in ("usage", "ledger"):
        assert f'href="/ui/export/billing/{kind}?' in dom
        assert f"/v1/billing/{kind}?" in dom
    ui.screenshot("finance-all-tenants", url, "finance")


def test_finance_page_one_tenant_invoice_and_csv(ui: UiServer) -> None:
    invoice = _invoice(ui, "demo-standard")
    url = ui.url("/ui/finance", tenant="demo-standard", period=invoice["period"],
                 stack="kind")
    dom = ui.dom(url, "finance")
    assert f'id="invoice-total">{invoice["amount"]} {invoice["currency"]}<' in dom
    assert len(re.findall(r'<tr class="invoice-line">', dom)) == len(invoice["lines"]) == 2
    assert 'data-tenant="demo-free"' not in dom
    assert ">completion<" in dom and ">cached<" in dom  # the token-kind legend
    ui.screenshot("finance-one-tenant", url, "finance")

    # The CSV links give what the /v1/billing/* CSV endpoints give.
    links = re.findall(r'<a class="csv" href="([^"]+)"', dom)
    assert len(links) == 3
    with httpx.Client(base_url=ui.base, timeout=10) as browser:
        browser.cookies.set("tollgate_session", ui.session("finance"), path="/ui")
        for link in links:
            href = link.replace("&amp;", "&")
            mine = browser.get(href)
            assert mine.status_code == 200 and mine.headers["content-type"].startswith("text/csv")
            assert "attachment" in mine.headers["content-disposition"]
            api = httpx.get(ui.base + href.replace("/ui/export", "/v1"),
                            headers=auth(ui.keys["finance"]), timeout=10)
            assert api.status_code == 200
            assert mine.text == api.text and mine.text.count("\n") >= 2


def test_customer_finance_page_shows_only_its_tenant(ui: UiServer) -> None:
    dom = ui.dom(ui.url("/ui/finance"), "demo-free")
    assert 'data-tenant="demo-free"' in dom
    assert "demo-standard" not in dom and "demo-enterprise" not in dom
    invoice = _invoice(ui, "demo-free")
    assert f'id="invoice-total">{invoice["amount"]} {invoice["currency"]}<' in dom

    r = httpx.get(ui.url("/ui/finance", tenant="demo-standard"),
                  headers=auth(ui.keys["demo-free"]), timeout=10)
    assert r.status_code == 403 and "only its own tenant" in r.text
    r = httpx.get(f"{ui.base}/ui/export/billing/invoices/demo-standard",
                  headers=auth(ui.keys["demo-free"]), timeout=10)
    assert r.status_code == 403


def test_finance_chart_draws_an_amount_line_per_currency(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A tenant billed in USD, then (a price set under the EUR setting) in EUR: the usage chart
    has one amount line per currency, each named by its code, its points the ledger's amounts
    in that currency. Its own server: the EUR price must not re-price the module's."""
    chromium = ensure_chromium()
    with running_server(tmp_path_factory, "web-currency", [(MODEL, FAST)]) as server:
        tenant = server.new_tenant("money")

        def billed() -> dict:
            r = httpx.post(f"{server.base}/v1/chat/completions", json=short_body(),
                           headers=auth(tenant.secret), timeout=30)  # fmt: skip
            assert r.status_code == 200, r.text
            return dict(server.wait_billed(r.headers["x-request-id"]))

        assert billed()["currency"] == "USD"
        server.cli("prices", "set", "--model", MODEL, "--prompt", "1", "--completion", "2",
                   "--cached", "0.5", "--currency", "EUR")  # fmt: skip
        poll("a request billed in EUR", lambda: billed()["currency"] == "EUR", timeout=30)
        ledger = httpx.get(f"{server.base}/v1/billing/ledger", params={"tenant": tenant.name},
                           headers=auth(server.keys["finance"]), timeout=30).json()["data"]
        billed_micros = {c: sum(e["amount_micros"] for e in ledger if e["currency"] == c)
                         for c in ("USD", "EUR")}  # fmt: skip

        assert server.proc is not None
        ui = UiServer(server.tmp, server.port, server.proc, server.keys, chromium)
        url = ui.url("/ui/finance", tenant=tenant.name)
        dom = ui.dom(url, "finance")
        chart = re.search(r'<svg id="tokens-chart".*?</svg>', dom, re.S)
        assert chart, "no usage chart"
        lines = re.findall(r'<g class="amount" data-currency="([A-Z]{3})">(.*?)</g>',
                           chart.group(0), re.S)  # fmt: skip
        assert [code for code, _ in lines] == ["EUR", "USD"]
        for code, drawn in lines:
            assert drawn.count('<polyline class="amount-line"') == 1, code
            assert re.search(rf'<text class="amount-label"[^>]*>{code}</text>', drawn), code
            # Every dot says its currency; together they are that currency's bills, no other.
            dots = re.findall(r"<title>[^<]* · amount (\d+)\.(\d{6}) ([A-Z]{3})</title>", drawn)
            assert dots and {c for _, _, c in dots} == {code}
            assert sum(int(w) * 1_000_000 + int(f) for w, f, _ in dots) == billed_micros[code]
        assert "amount EUR (right axis)" in dom and "amount USD (right axis)" in dom
        assert ">amount (EUR, USD)</text>" in chart.group(0)
        ui.screenshot("finance-two-currencies", url, "finance")


# --- login -----------------------------------------------------------------------------------


def test_login_sets_a_signed_session_and_a_key_in_a_url_is_refused(ui: UiServer) -> None:
    with httpx.Client(base_url=ui.base, timeout=10) as browser:
        r = browser.get("/ui/support")
        assert r.status_code == 401 and 'action="/ui/login"' in r.text
        assert 'name="next" value="/ui/support"' in r.text

        r = browser.post("/ui/login", data={"key": "tg_not-a-key", "next": "/ui/finance"})
        assert r.status_code == 401 and "invalid or revoked API key" in r.text
        assert "set-cookie" not in r.headers

        r = browser.post("/ui/login", data={"key": ui.keys["support"], "next": "//evil.example/"})
        assert r.status_code == 303 and r.headers["location"] == "/ui/support"
        cookie = r.headers["set-cookie"]
        assert cookie.startswith("tollgate_session=") and "HttpOnly" in cookie
        assert "SameSite=strict" in cookie and "Path=/ui" in cookie
        session = browser.cookies["tollgate_session"]
        assert ui.keys["support"] not in cookie and ui.keys["support"] not in session
        assert browser.get("/ui/support").status_code == 200

        r = browser.post("/ui/logout")
        assert r.status_code == 303
        assert browser.get("/ui/support").status_code == 401

        # A key in a URL is never used (nor echoed), whatever the session.
        rid = ui.requests["demo-standard"][0]
        r = browser.get(f"/ui/support?request_id={rid}&key={quote(ui.keys['support'])}")
        assert r.status_code == 400 and "never accepted in a URL" in r.text
        assert "set-cookie" not in r.headers and ui.keys["support"] not in r.text

        # A forged or altered session, and the old raw-key cookie, are a sign-in page.
        key_id, expiry, signature = session.rsplit(".", 2)
        for forged in (f"{key_id}.{int(expiry) + 3600}.{signature}", f"{key_id}.{expiry}.x",
                       "tg_revoked-or-wrong"):
            browser.cookies.clear()
            browser.cookies.set("tollgate_session", forged, path="/ui")
            r = browser.get("/ui/finance")
            assert r.status_code == 401 and "sign in" in r.text.lower(), forged
        browser.cookies.clear()
        browser.cookies.set("tollgate_key", ui.keys["finance"], path="/ui")
        r = browser.get("/ui/finance")
        assert r.status_code == 401 and "tollgate_key=" in r.headers.get("set-cookie", "")


def test_the_sign_in_form_shows_an_error_only_after_a_refused_key(ui: UiServer) -> None:
    error = re.compile(r'<div class="msg error" id="login-error" role="alert">([^<]*)</div>')
    with httpx.Client(base_url=ui.base, timeout=10) as browser:
        for path in ("/ui/login", "/ui/", "/ui/finance", "/ui/support"):  # nothing sent yet
            r = browser.get(path)
            assert 'action="/ui/login"' in r.text, path
            assert "msg error" not in r.text and 'role="alert"' not in r.text, path

        r = browser.post("/ui/login", data={"key": "tg_not-a-key"})
        assert r.status_code == 401
        shown = error.search(r.text)
        assert shown and "invalid or revoked API key" in shown.group(1)
        shown = error.search(browser.post("/ui/login", data={"key": " "}).text)
        assert shown and shown.group(1) == "Enter an API key."

        # A session that ran out is a reason to sign in again, said without an error.
        browser.cookies.set("tollgate_session", "key-1.1.x", path="/ui")
        r = browser.get("/ui/finance")
        assert r.status_code == 401 and "msg error" not in r.text
        assert '<div class="msg info" id="login-notice">' in r.text


def test_a_revoked_key_ends_its_sessions(ui: UiServer) -> None:
    out = subprocess.run(
        [*TOLLGATE, "keys", "issue", "--tenant", "demo-free", "--database-url", ui.db_url],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    secret, key_id = lines[-1].strip(), lines[0].split(" key ")[1].split()[0]
    poll("the edge to know the key", lambda: httpx.get(
        f"{ui.base}/v1/models", headers=auth(secret), timeout=5).status_code == 200)
    with httpx.Client(base_url=ui.base, timeout=10) as browser:
        assert browser.post("/ui/login", data={"key": secret}).status_code == 303
        assert browser.get("/ui/finance").status_code == 200
        revoked = subprocess.run(
            [*TOLLGATE, "keys", "revoke", key_id, "--tenant", "demo-free", "--database-url",
             ui.db_url], capture_output=True, text=True, timeout=60, cwd=REPO,
        )
        assert revoked.returncode == 0, revoked.stderr
        poll("the session to end", lambda: browser.get("/ui/finance").status_code == 401)


def test_usage_chart_layout() -> None:
    """The chart maths without a browser: the axis spans the hours with data, gaps between them
    are zero-filled, a long span is drawn per day, stacks add up to the axis."""
    from tollgate_llm.api.http.charts import time_chart

    def row(when: datetime, tenant: str, tokens: int) -> dict:
        return {"tenant": tenant, "model": MODEL, "period_start": when.isoformat(),
                "requests": 1, "prompt_tokens": tokens, "completion_tokens": tokens,
                "cached_tokens": 0, "amount_micros": tokens * 10, "currency": "USD"}

    t0 = datetime(2026, 11, 1, tzinfo=UTC)
    chart, unit = time_chart([row(t0, "a", 50), row(t0, "b", 25),
                              row(t0 + timedelta(hours=5), "a", 10)], "tenant")
    # The first hour with data to the last; one currency, one amount line.
    assert unit == "hour" and [s.name for s in chart.amounts] == ["USD"]
    assert len(chart.amounts[0].dots) == 6 and chart.y2_label == "amount (USD)"
    assert [name for name, _ in chart.legend] == ["a", "b"]
    assert len(chart.bars) == 3 and chart.y_ticks[-1].label == "200"
    assert [t.label for t in chart.x_ticks] == [f"11-01 {h:02d}:00" for h in range(6)]
    chart, unit = time_chart([row(t0, "a", 5), row(t0 + timedelta(days=9), "a", 5)], "kind")
    assert unit == "day" and len(chart.amounts[0].dots) == 10
    assert {name for name, _ in chart.legend} == {"prompt (uncached)", "cached", "completion"}


def test_an_hour_of_usage_is_one_bar_across_the_chart() -> None:
    from tollgate_llm.api.http.charts import time_chart

    at = datetime(2026, 12, 7, 9, 30, tzinfo=UTC)
    rows = [{"tenant": "a", "model": MODEL, "period_start": at.isoformat(), "requests": 1,
             "prompt_tokens": 40, "completion_tokens": 10, "cached_tokens": 0,
             "amount_micros": 500, "currency": "USD"}]  # fmt: skip
    chart, unit = time_chart(rows, "tenant")
    assert unit == "hour" and len(chart.amounts[0].dots) == 1 and len(chart.bars) == 1
    assert [t.label for t in chart.x_ticks] == ["12-07 09:00"]
    left, _, right, _ = chart.plot
    bar = chart.bars[0]
    assert abs((bar.x + bar.w / 2) - (left + right) / 2) < 0.01  # centred, alone on the axis


def test_each_currency_is_its_own_amount_line_named_by_its_code() -> None:
    """A range billed in two currencies (the setting changed in the middle): one amount line per
    currency, each over every bucket, its points the amounts of that currency alone (never a sum
    of the two), its dots and its label saying the code."""
    from tollgate_llm.api.http.charts import time_chart

    t0 = datetime(2026, 12, 1, 10, tzinfo=UTC)

    def row(hours: int, tenant: str, currency: str, amount_micros: int) -> dict:
        return {"tenant": tenant, "model": MODEL, "period_start": (t0 + timedelta(hours=hours))
                .isoformat(), "requests": 1, "prompt_tokens": 10, "completion_tokens": 10,
                "cached_tokens": 0, "amount_micros": amount_micros, "currency": currency}

    rows = [row(0, "a", "USD", 400_000), row(0, "b", "USD", 100_000),
            row(1, "a", "USD", 200_000), row(1, "a", "EUR", 300_000),
            row(2, "b", "EUR", 800_000), row(2, "a", "USD", 800_000)]  # fmt: skip
    chart, unit = time_chart(rows, "tenant")
    assert unit == "hour"
    assert [s.name for s in chart.amounts] == ["EUR", "USD"]
    assert chart.y2_label == "amount (EUR, USD)"
    assert chart.y2_ticks[-1].label == "1.00"  # the axis fits the largest of either currency
    _, top, _, bottom = chart.plot

    def amounts_of(currency: str) -> list[float]:
        series = next(s for s in chart.amounts if s.name == currency)
        ys = [float(p.split(",")[1]) for p in series.points.split()]
        assert ys == [y for _, y, _ in series.dots]
        return [round((bottom - y) / (bottom - top) * 1.0, 3) for y in ys]  # axis top = 1.00

    assert amounts_of("USD") == [0.5, 0.2, 0.8]
    assert amounts_of("EUR") == [0.0, 0.3, 0.8]
    eur, usd = chart.amounts
    assert eur.colour != usd.colour and eur.dash != usd.dash
    assert eur.dots[1][2] == "2026-12-01 11:00 · amount 0.300000 EUR"
    assert usd.dots[0][2] == "2026-12-01 10:00 · amount 0.500000 USD"
    # Each line's code is written by its last point; the two lines end at one point here, and
    # their codes are one above the other, not on top of each other.
    assert eur.label_at[0] == eur.dots[-1][0] and usd.label_at[0] == usd.dots[-1][0]
    assert abs(eur.label_at[1] - usd.label_at[1]) >= 12
