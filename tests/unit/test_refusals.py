"""The refusal and authentication-failure budgets (api/services/refusals.py) on a controlled
clock."""

from __future__ import annotations

import math

import pytest

from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.api.services.refusals import RefusalLimits, TokenBuckets, source_of


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_holds_a_minute_and_refills_continuously() -> None:
    clock = Clock()
    buckets = TokenBuckets(clock=clock)
    assert [buckets.spend("k", 6) for _ in range(6)] == [0.0] * 6
    assert buckets.spend("k", 6) == pytest.approx(10.0)  # one token per 10 s
    assert buckets.wait_s("k", 6) == pytest.approx(10.0)
    clock.now += 5
    assert buckets.wait_s("k", 6) == pytest.approx(5.0)
    clock.now += 5
    assert buckets.spend("k", 6) == 0.0
    assert buckets.spend("k", 6) > 0
    clock.now += 3600  # never more than a minute's worth
    assert [buckets.spend("k", 6) for _ in range(7)].count(0.0) == 6


def test_a_rate_of_zero_refuses_at_once() -> None:
    buckets = TokenBuckets(clock=Clock())
    assert math.isinf(buckets.wait_s("k", 0))
    assert math.isinf(buckets.spend("k", 0))


def test_the_table_stays_bounded() -> None:
    clock = Clock()
    buckets = TokenBuckets(max_entries=100, clock=clock)
    for i in range(1000):
        buckets.spend(f"k{i}", 10)
        clock.now += 0.01
    assert len(buckets) <= 100
    clock.now += 61  # idle for a minute: full again, forgotten first
    buckets.spend("new", 10)
    assert len(buckets) == 1


def test_an_address_over_its_failures_is_refused_until_it_refills() -> None:
    clock = Clock()
    limits = RefusalLimits(refusals_per_minute=lambda t: 10, auth_failures_per_minute=3,
                           clock=clock)
    for _ in range(3):
        limits.check_source("10.0.0.1")
        limits.failed_authentication("10.0.0.1")
    with pytest.raises(ApiError) as caught:
        limits.check_source("10.0.0.1")
    assert caught.value.status == 429
    assert caught.value.headers["Retry-After"] == "20"
    limits.check_source("10.0.0.2")  # another address is not affected
    clock.now += 20
    limits.check_source("10.0.0.1")


def test_refusals_are_budgeted_per_key_at_the_tenants_rate() -> None:
    clock = Clock()
    rates = {"small": 2, "big": 100}
    limits = RefusalLimits(refusals_per_minute=rates.__getitem__, auth_failures_per_minute=0,
                           clock=clock)
    for _ in range(2):
        assert limits.over_budget("key-a", "small") == 0
        limits.refused("key-a", "small")
    assert limits.over_budget("key-a", "small") == pytest.approx(30.0)
    assert limits.over_budget("key-b", "big") == 0
    error = limits.throttled(30.0)
    assert (error.status, error.code, error.headers["Retry-After"]) == (
        429, "refused_requests_rate_limited", "30")


def test_no_limit_when_switched_off() -> None:
    limits = RefusalLimits(refusals_per_minute=lambda t: 1, auth_failures_per_minute=0)
    for _ in range(1000):
        limits.check_source("10.0.0.1")
        limits.failed_authentication("10.0.0.1")


def test_sources_are_addresses_and_ipv6_slash_64s() -> None:
    assert source_of(("192.0.2.7", 5000)) == "192.0.2.7"
    assert source_of(["2001:db8:1:2:aaaa::1", 5000]) == "2001:db8:1:2::/64"
    assert source_of(("2001:db8:1:2:bbbb::9", 1)) == source_of(("2001:db8:1:2::5", 2))
    assert source_of(None) is None


def test_a_forwarded_client_is_believed_only_from_a_trusted_proxy() -> None:
    from tollgate_llm.api.services.refusals import TrustedProxies

    proxies = TrustedProxies(["10.0.0.0/8", "127.0.0.1/32"])
    # The nearest untrusted hop, read right to left: the left part is the client's own words.
    assert proxies.client(("127.0.0.1", 1), "198.51.100.9, 203.0.113.5, 10.1.2.3") == (
        "203.0.113.5"
    )
    assert proxies.client(("10.0.0.2", 1), "203.0.113.5") == "203.0.113.5"
    # From anyone else the header is ignored, or a client could name any address it likes.
    assert proxies.client(("192.0.2.7", 1), "203.0.113.5") == "192.0.2.7"
    assert TrustedProxies([]).client(("127.0.0.1", 1), "203.0.113.5") == "127.0.0.1"
    # A malformed chain: the last trusted hop is all that is known.
    assert proxies.client(("127.0.0.1", 1), "203.0.113.5, not-an-ip") == "127.0.0.1"
    assert proxies.client(("127.0.0.1", 1), "10.0.0.9") == "10.0.0.9"  # all trusted: the first


def test_every_authentication_path_shares_one_limit_per_address() -> None:
    from tollgate_llm.api.services.errors import ApiError

    limits = RefusalLimits(refusals_per_minute=lambda _t: 60, auth_failures_per_minute=3)

    def bad() -> None:
        raise ApiError(401, "bad key")

    for _ in range(3):
        with pytest.raises(ApiError) as failed:
            limits.authenticate("192.0.2.1", bad)
        assert failed.value.status == 401
    # Limited now, whatever the credentials: a good one is not even looked at.
    with pytest.raises(ApiError) as limited:
        limits.authenticate("192.0.2.1", lambda: "caller")
    assert limited.value.status == 429
    assert limits.authenticate("192.0.2.2", lambda: "caller") == "caller"
