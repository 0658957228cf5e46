"""The flex service class end to end, with the official openai SDK and httpx: idle capacity only,
the flex price from the price book, OpenAI's 429 `resource_unavailable` (unbilled), and
preemption for interactive work — RequestPreempted with the engine's counts, billed nothing,
the flex client told in its stream, finance shown the waste.

Its own server: one replica with a tiny KV cache (64 blocks of 16 = 1,024 tokens), slow steps,
scheduling by `priority` as `vllm serve --scheduling-policy priority` does."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import OpenAI

from tests.e2e.conftest import MODEL, Server, auth, poll, running_server

pytestmark = pytest.mark.e2e

CONFIG = {"num_gpu_blocks": 64, "max_model_len": 1024, "step_base_ms": 60, "speed": 1,
          "scheduling_policy": "priority"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory, "flex", [(MODEL, CONFIG)]) as server:
        server.cli("prices", "flex-discount", "--model", MODEL, "--percent", "40")
        yield server


def sdk(server: Server, who: str) -> OpenAI:
    return OpenAI(base_url=f"{server.base}/v1", api_key=server.keys[who], max_retries=0,
                  timeout=60)


def words(n: int) -> str:
    return " ".join(["abc"] * n)


def wait_idle(server: Server) -> None:
    replica = server.replicas[0]
    poll("the replica to be idle",
         lambda: replica.metric("vllm:num_requests_running") == 0
         and replica.metric("vllm:kv_cache_usage_perc") < 0.05, timeout=60, every=0.2)


def test_a_flex_request_is_served_echoed_and_billed_at_the_flex_price(fleet: Server) -> None:
    wait_idle(fleet)
    client = sdk(fleet, "demo-standard")
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there!"}], max_tokens=6,
        service_tier="flex",
    )
    completion = raw.parse()
    assert completion.service_tier == "flex"
    request_id = raw.headers["x-request-id"]
    admitted = fleet.wait_event(request_id, "RequestAdmitted")
    assert admitted["service_tier"] == "flex"
    replica = fleet.replicas[0].record(request_id)
    assert replica is not None and replica["priority"] > 2  # below every interactive tier
    entry = fleet.wait_billed(request_id)
    assert entry["service_tier"] == "flex"
    # The demo list price of llama-3.1-8b is 0.15 / 0.60 / 0.075 per 1M; 40 % off.
    assert (entry["prompt_micros_per_mtok"], entry["completion_micros_per_mtok"],
            entry["cached_micros_per_mtok"]) == (90_000, 360_000, 45_000)
    usage = completion.usage
    assert usage is not None
    assert (entry["prompt_tokens"], entry["completion_tokens"]) == (
        usage.prompt_tokens, usage.completion_tokens)
    # The default class is not discounted, and says so.
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=2,
        service_tier="auto",
    )
    assert plain.service_tier == "default"


def test_a_bad_service_tier_is_a_400_naming_it(fleet: Server) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        sdk(fleet, "demo-standard").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            service_tier="priority",
        )
    assert err.value.body["param"] == "service_tier"  # type: ignore[index]


def test_flex_without_idle_capacity_is_a_429_resource_unavailable_not_billed(
    fleet: Server,
) -> None:
    wait_idle(fleet)
    replica = fleet.replicas[0]
    # ~560 prompt tokens hold 0.55-0.70 of the KV: above the flex ceiling (0.50) for its run.
    body = {"model": MODEL, "messages": [{"role": "user", "content": words(550)}],
            "max_tokens": 120, "ignore_eos": True, "stream": True}
    client = sdk(fleet, "demo-standard")
    with httpx.Client(timeout=60) as http, http.stream(
        "POST", f"{fleet.base}/v1/chat/completions", headers=auth(fleet.keys["demo-enterprise"]),
        json=body,
    ) as stream:
        assert stream.status_code == 200
        held = stream.iter_lines()  # kept: a dropped iterator closes the response
        next(held)
        poll("the KV to pass the flex ceiling",
             lambda: replica.metric("vllm:kv_cache_usage_perc") > 0.5, timeout=10)

        def flex_refused() -> openai.RateLimitError | None:
            try:
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                    service_tier="flex",
                )
            except openai.RateLimitError as exc:
                return exc
            return None

        refused = poll("a flex refusal", flex_refused, timeout=10, every=0.3)
        error = refused.body
        assert isinstance(error, dict)
        assert error["type"] == "resource_unavailable" and error["code"] == "resource_unavailable"
        request_id = refused.response.headers["x-request-id"]
        assert 5 <= int(refused.response.headers["retry-after"]) <= 10
        rejected = fleet.wait_event(request_id, "RequestRejected")
        assert rejected["reason"] == "capacity"
        assert fleet.ledger(request_id) is None  # a refusal is never billed
        # Interactive traffic is admitted beside it.
        ok = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert ok.service_tier == "default"


def test_interactive_work_preempts_flex_work_which_is_told_and_billed_nothing(
    fleet: Server,
) -> None:
    wait_idle(fleet)
    replica = fleet.replicas[0]
    free = fleet.new_tenant("preempting", plan="free", rpm=600)
    with httpx.Client(timeout=60) as http:
        flex_body = {"model": MODEL, "messages": [{"role": "user", "content": words(350)}],
                     "max_tokens": 400, "ignore_eos": True, "stream": True,
                     "stream_options": {"include_usage": True}, "service_tier": "flex"}
        with http.stream("POST", f"{fleet.base}/v1/chat/completions",
                         headers=auth(fleet.keys["demo-standard"]), json=flex_body) as flex:
            assert flex.status_code == 200, flex.read()
            flex_id = flex.headers["x-request-id"]
            lines = flex.iter_lines()
            next(lines)
            poll("the flex request's KV", lambda: replica.metric("vllm:kv_cache_usage_perc")
                 > 0.3, timeout=10)
            # Enterprise fills the replica past free's ceiling (0.60) beside the flex request.
            big = {"model": MODEL, "messages": [{"role": "user", "content": words(250)}],
                   "max_tokens": 200, "ignore_eos": True, "stream": True}
            with http.stream("POST", f"{fleet.base}/v1/chat/completions",
                             headers=auth(fleet.keys["demo-enterprise"]), json=big) as ent:
                assert ent.status_code == 200
                held = ent.iter_lines()  # kept: a dropped iterator closes the response
                next(held)

                def free_admitted() -> httpx.Response | None:
                    r = http.post(f"{fleet.base}/v1/chat/completions", headers=auth(free.secret),
                                  json={"model": MODEL, "max_tokens": 4,
                                        "messages": [{"role": "user", "content": "hi"}]})
                    assert r.status_code in (200, 503), r.text
                    events = fleet.event_types(flex_id)
                    return r if r.status_code == 200 and "RequestPreempted" in events else None

                answered = poll("a free request admitted by preemption", free_admitted,
                                timeout=20, every=0.3)
                rest = [line for line in lines if line]
        # The flex client got an error object in its stream, then [DONE].
        assert rest[-1] == "data: [DONE]"
        assert '"code":"preempted"' in rest[-2] and '"type":"resource_unavailable"' in rest[-2]
    preempted = fleet.wait_event(flex_id, "RequestPreempted")
    assert preempted["preempted_for"].startswith("req_")
    assert preempted["completion_tokens"] >= 1  # the engine's own count
    record = replica.record(flex_id)
    assert record is not None and record["finish_reason"] == "abort"
    assert preempted["completion_tokens"] == record["completion_tokens"]
    refund = fleet.wait_event(flex_id, "QuotaRefunded")
    assert refund["used_tokens"] == 0
    entry = fleet.wait_billed(flex_id)
    assert entry["terminal"] == "preempted" and entry["amount_micros"] == 0
    assert entry["completion_tokens"] == 0
    assert fleet.wait_billed(answered.headers["x-request-id"])["amount_micros"] > 0
    fleet.assert_lifecycle([flex_id])
    waste = poll("the preemption waste view", lambda: fleet.query(
        "SELECT * FROM finance_preemption_waste WHERE model = ?", (MODEL,)))
    assert waste[0]["preempted_requests"] >= 1
    assert waste[0]["completion_tokens"] >= preempted["completion_tokens"]


def test_the_finance_page_shows_flex_revenue_and_preemption_waste(fleet: Server) -> None:
    # Runs after the preemption above (same module server): one preempted request at least.
    with httpx.Client(base_url=fleet.base, timeout=30) as browser:
        signed_in = browser.post("/ui/login", data={"key": fleet.keys["finance"]})
        assert signed_in.status_code == 303, signed_in.text
        page = browser.get("/ui/finance")
        assert page.status_code == 200
        card = page.text.split('id="flex-card"', 1)[1].split("</section>", 1)[0]
    assert MODEL in card
    row = card.split(MODEL, 1)[1].split("</tr>", 1)[0]
    numbers = re.findall(r'<td class="num">([^<]*)</td>', row)
    amount, currency = numbers[1].split()  # the amount says its currency: "0.000003 USD"
    flex_requests, revenue, preempted = int(numbers[0]), float(amount), int(numbers[2])
    assert currency == "USD"
    assert flex_requests >= 1 and revenue > 0 and preempted >= 1
