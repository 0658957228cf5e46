"""Cheap limits on requests that cost us without being admitted: refused requests per key, and
failed authentications per client address.

A refused request is not admitted, so the quota never sees it, yet each one is answered, counted
and (for a bad body or an unknown model) recorded as a `RequestRejected` event. Without a limit a
key could write refusals into the permanent log as fast as it can send them. Each key gets as many
refusals per minute as its plan gives it requests per minute; past that, a request that would be
refused is answered 429 without being recorded. A client address that fails authentication too
often is refused every authentication for a while, whatever key it sends: a key is 240 random
bits, so this is about the cost of answering and about noise, not about guessing.

Both are token buckets in this process (per edge, like the quota view): a dict lookup on the
ordinary path, no I/O, memory bounded by `max_entries`.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from tollgate_llm.api.services.chat_request import parse_chat_request
from tollgate_llm.api.services.errors import ApiError

# Statuses that count as refusals of the request itself (a bad body, an unknown model, a body over
# the size limit); quota and capacity answers are limits already, and 401/403 are counted per
# source before a key is known.
REFUSED_STATUSES = frozenset({400, 404, 413, 422})

T = TypeVar("T")


class TokenBuckets:
    """Per-key token buckets refilled continuously at `per_minute` tokens a minute, holding at most
    `per_minute` (a full minute's burst). A key absent from the table has a full bucket."""

    def __init__(
        self, *, max_entries: int = 100_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_entries = max_entries
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, as of)

    def wait_s(self, key: str, per_minute: int) -> float:
        """Seconds until `key` has a token (0: it has one now). Spends nothing."""
        state = self._buckets.get(key)
        if state is None:
            return 0.0 if per_minute > 0 else math.inf
        tokens = self._refilled(state, per_minute, self.clock())
        return 0.0 if tokens >= 1 else self._until_one(tokens, per_minute)

    def spend(self, key: str, per_minute: int) -> float:
        """Take a token if there is one and return 0; else return the seconds until there is."""
        now = self.clock()
        state = self._buckets.get(key)
        tokens = float(per_minute) if state is None else self._refilled(state, per_minute, now)
        if tokens < 1:
            return self._until_one(tokens, per_minute)
        if state is None and len(self._buckets) >= self.max_entries:
            self._prune(now)
        self._buckets[key] = (tokens - 1, now)
        return 0.0

    def __len__(self) -> int:
        return len(self._buckets)

    @staticmethod
    def _refilled(state: tuple[float, float], per_minute: int, now: float) -> float:
        tokens, since = state
        return min(float(per_minute), tokens + (now - since) * per_minute / 60)

    @staticmethod
    def _until_one(tokens: float, per_minute: int) -> float:
        return math.inf if per_minute <= 0 else (1 - tokens) * 60 / per_minute

    def _prune(self, now: float) -> None:
        """Forget the buckets untouched for a minute: at any rate they have refilled, so
        forgetting them changes nothing. If the table is still full, forget everything: a moment
        without the limit rather than unbounded memory."""
        idle = [k for k, (_, since) in self._buckets.items() if now - since >= 60]
        for key in idle:
            del self._buckets[key]
        if len(self._buckets) >= self.max_entries:
            self._buckets.clear()


class RefusalLimits:
    """The two limits as the routes use them; each raises the 429 it decides."""

    def __init__(
        self,
        *,
        refusals_per_minute: Callable[[str], int],
        auth_failures_per_minute: int,
        trusted_proxies: Iterable[str] = (),
        max_entries: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.refusals_per_minute = refusals_per_minute  # tenant id -> its budget
        self.auth_failures_per_minute = auth_failures_per_minute
        self.proxies = TrustedProxies(trusted_proxies)
        self.refusals = TokenBuckets(max_entries=max_entries, clock=clock)
        self.auth_failures = TokenBuckets(max_entries=max_entries, clock=clock)

    # --- per source ----------------------------------------------------------------------------

    def source(
        self, client: tuple[str, int] | list[object] | None, forwarded_for: str | None
    ) -> str | None:
        """The address a limit is kept for: the TCP peer, or, when the peer is a trusted proxy,
        the client it forwarded for (`X-Forwarded-For`)."""
        return source_of(self.proxies.client(client, forwarded_for))

    def authenticate(self, source: str | None, attempt: Callable[[], T]) -> T:
        """Every way of proving who one is goes through here — an API key on any route, the
        sign-in form, a session's bearer header, the batch runner's token, the metrics token:
        an address over its failures is refused (429) before its credentials are looked at,
        and each 401 counts against it. (A limit kept per route had side doors: 300 bad keys
        on the sign-in form were never limited, and an address limited on /v1 still signed in
        on /ui.)"""
        self.check_source(source)
        try:
            return attempt()
        except ApiError as exc:
            if exc.status == 401:
                self.failed_authentication(source)
            raise

    def check_source(self, source: str | None) -> None:
        """Refuse a client address that has used up its authentication failures."""
        if source is None or self.auth_failures_per_minute <= 0:
            return
        wait = self.auth_failures.wait_s(source, self.auth_failures_per_minute)
        if wait:
            raise _too_many(
                "too many failed authentications from this address",
                wait,
                "authentication_failures_rate_limited",
            )

    def failed_authentication(self, source: str | None) -> None:
        if source is not None and self.auth_failures_per_minute > 0:
            self.auth_failures.spend(source, self.auth_failures_per_minute)

    # --- per key -------------------------------------------------------------------------------

    def over_budget(self, key_id: str, tenant_id: str) -> float:
        """Seconds until the key may be refused again (0: it may be now)."""
        return self.refusals.wait_s(key_id, self.refusals_per_minute(tenant_id))

    def refused(self, key_id: str, tenant_id: str) -> None:
        self.refusals.spend(key_id, self.refusals_per_minute(tenant_id))

    def throttled(self, wait_s: float) -> ApiError:
        return _too_many(
            "too many refused requests from this key (bad bodies, unknown models); fix the "
            "requests or retry after the Retry-After delay",
            wait_s,
            "refused_requests_rate_limited",
        )


def refused_before_admission(raw: bytes, resolve_model: Callable[[str], str | None]) -> bool:
    """Whether the edge would refuse this body before admission (a bad body or an unknown model):
    asked only for a key over its refusal budget, so that such a request is not recorded."""
    try:
        request = parse_chat_request(raw)
    except ApiError:
        return True
    return resolve_model(request.model) is None


class TrustedProxies:
    """The proxies (`--trusted-proxies`, CIDRs) whose `X-Forwarded-For` is believed. Behind a
    load balancer every client would otherwise share the balancer's address, and one client's
    failures would lock everyone out; a header from anyone else is ignored, or a client could
    name any address it likes."""

    def __init__(self, networks: Iterable[str]) -> None:
        self.networks = tuple(ipaddress.ip_network(n.strip(), strict=False) for n in networks)

    def trusts(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in network for network in self.networks)

    def client(
        self, peer: tuple[str, int] | list[object] | None, forwarded_for: str | None
    ) -> str | None:
        """The client's address: the peer's, or, while the peer and each hop before it are
        trusted, the nearest untrusted address of `X-Forwarded-For` (read right to left: the
        left part is whatever the client wrote)."""
        if not peer:
            return None
        host = str(peer[0])
        if not self.networks or not forwarded_for or not self.trusts(host):
            return host
        for hop in reversed(forwarded_for.split(",")):
            hop = hop.strip()
            try:
                ipaddress.ip_address(hop)
            except ValueError:
                return host  # a malformed chain: the last trusted hop is what is known
            if not self.trusts(hop):
                return hop
            host = hop
        return host


def source_of(client: tuple[str, int] | list[object] | str | None) -> str | None:
    """The address a limit is kept for: the client's IP, or for IPv6 its /64 (what one host or
    one customer site is usually given)."""
    if not client:
        return None
    host = client if isinstance(client, str) else str(client[0])
    if ":" not in host:
        return host
    try:
        return str(ipaddress.IPv6Network((host, 64), strict=False))
    except ValueError:
        return host


def _too_many(message: str, wait_s: float, code: str) -> ApiError:
    retry_after = 60 if math.isinf(wait_s) else max(1, math.ceil(wait_s))
    return ApiError(
        429, message, type="requests", code=code, headers={"Retry-After": str(retry_after)}
    )
