"""The quota view (seed 000 §6, R4): per tenant and model, the requests/min and tokens/min token
buckets and the estimated KV·seconds in flight; and, across all tenants, the retry-budget window.

It is a fold of request events (`apply`) kept current by the edge's own admissions (`charge`,
`refund`, `void`) before those come back through the log; an event for a request already counted
(locally or by redelivery) is skipped, so rebuilding it from the same events gives the same
counts. The rules that read it are `domain.admission`'s.

Limits are enforced where they are set: a tenant's limits bound the tenant as a whole, whatever
number of keys it spreads its traffic over.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Final, TypeAlias

from domain.control_plane.state import Limits
from domain.envelope import Event, Recorded
from domain.requests.events import (
    LeaseExpired,
    QuotaRefunded,
    RequestAdmitted,
    RequestCancelled,
    RequestCompleted,
    RequestEstimated,
    RequestFailed,
    RequestPreempted,
    RequestRejected,
)

__all__ = ["Bucket", "QuotaKey", "QuotaView", "quota_key"]

# What a bucket and the KV allowance are kept for: (tenant_id, model version).
QuotaKey: TypeAlias = tuple[str, str]

# How long a finished request's id is remembered so a redelivered event is not re-counted.
TOMBSTONE_TTL_S: Final = 600
_MINUTE_S: Final = 60.0


def quota_key(tenant_id: str, model: str) -> QuotaKey:
    return (tenant_id, model)


class Bucket:
    """A token bucket refilling `capacity` per minute: `level` tokens available at instant `at`
    (epoch seconds). Floats are fine here: this is an approximate, rebuildable view, never an
    event or a bill."""

    __slots__ = ("level", "at", "capacity", "rate")

    def __init__(self, capacity: int, at: float) -> None:
        self.capacity = capacity
        self.rate = capacity / _MINUTE_S
        self.level = float(capacity)
        self.at = at

    def refill(self, now: float, capacity: int) -> None:
        if capacity != self.capacity:  # the limit changed: keep the debt, rescale the ceiling
            self.level += capacity - self.capacity
            self.capacity = capacity
            self.rate = capacity / _MINUTE_S
        if now > self.at:
            level = self.level + (now - self.at) * self.rate
            self.level = level if level < capacity else float(capacity)
            self.at = now

    def give_back(self, amount: float) -> None:
        level = self.level + amount
        self.level = level if level < self.capacity else float(self.capacity)

    def reset_ms(self) -> int:
        """Milliseconds until the bucket is full again."""
        missing = self.capacity - self.level
        if missing <= 0 or self.capacity <= 0:
            return 0
        # × 60,000 / capacity rather than / rate: rate = capacity / 60 is inexact in binary.
        return -int(-missing * 60_000 // self.capacity)

    def refill_s(self, needed: float) -> int:
        """Whole seconds until the bucket holds `needed`."""
        missing = needed - self.level
        if missing <= 0 or self.capacity <= 0:
            return 0
        return -int(-missing * 60 // self.capacity)


class _Request:
    __slots__ = (
        "request_id",
        "key",
        "admitted_s",
        "reserved_tokens",
        "kv_byte_seconds",
        "estimated",
        "in_flight",
        "refunded",
        "voided",
        "finished_s",
        "overage_tokens",
    )

    def __init__(self, request_id: str, key: QuotaKey, at_s: float) -> None:
        self.request_id = request_id
        self.key = key
        self.admitted_s = at_s
        self.reserved_tokens = 0
        self.kv_byte_seconds = 0
        self.estimated = False
        self.in_flight = False
        self.refunded = False
        self.voided = False
        self.finished_s: float | None = None
        self.overage_tokens = 0  # used beyond the reservation: charged at the refund


class QuotaView:
    def __init__(
        self,
        limits_for: Callable[[str, str], Limits] | None = None,
        *,
        retry_window_s: int = 60,
        tombstone_ttl_s: int = TOMBSTONE_TTL_S,
    ) -> None:
        # `limits_for(tenant_id, model)` (e.g. ControlView.limits) lets `apply` size the buckets
        # of tenants this edge has not decided for yet; without it, `apply` uses the limits the
        # last decision saw for that key, and skips rate charges it cannot size.
        self._limits_for = limits_for
        self._known_limits: dict[QuotaKey, Limits] = {}
        self.tombstone_ttl_s = tombstone_ttl_s
        self._rpm: dict[QuotaKey, Bucket] = {}
        self._tpm: dict[QuotaKey, Bucket] = {}
        self._kv: dict[QuotaKey, int] = {}
        # One key tuple per tenant and model, shared by its requests (`charge`).
        self._keys: dict[QuotaKey, QuotaKey] = {}
        self._requests: dict[str, _Request] = {}
        self._in_flight: dict[str, _Request] = {}
        self._orphan_estimates: dict[str, Recorded] = {}
        # Retry budget: per-second ring of (requests, retries) and their running sums.
        self.retry_window_s = retry_window_s
        self._ring_second = [-1] * retry_window_s
        self._ring_requests = [0] * retry_window_s
        self._ring_retries = [0] * retry_window_s
        self._window_requests = 0
        self._window_retries = 0
        self._seen: dict[str, float] = {}  # request id -> first seen (epoch s), for the window
        self._handlers: dict[type[Event], Callable[[Recorded], None]] = {
            RequestAdmitted: self._on_admitted,
            RequestEstimated: self._on_estimated,
            RequestCompleted: self._on_terminal,
            RequestCancelled: self._on_terminal,
            RequestFailed: self._on_terminal,
            LeaseExpired: self._on_terminal,
            RequestPreempted: self._on_terminal,
            QuotaRefunded: self._on_refunded,
            RequestRejected: self._on_rejected,
        }

    # --- what a decision reads ----------------------------------------------------------------

    def windows(self, key: QuotaKey, limits: Limits, now_s: float) -> tuple[Bucket, Bucket]:
        """The requests/min and tokens/min buckets of `key`, refilled to `now_s` under `limits`."""
        self._known_limits[key] = limits
        # `_bucket`'s, for both, without its two calls: this runs on every decision.
        rpm = self._rpm.get(key)
        if rpm is None:
            rpm = self._rpm[key] = Bucket(limits.rpm, now_s)
        else:
            rpm.refill(now_s, limits.rpm)
        tpm = self._tpm.get(key)
        if tpm is None:
            tpm = self._tpm[key] = Bucket(limits.tpm, now_s)
        else:
            tpm.refill(now_s, limits.tpm)
        return rpm, tpm

    def kv_in_flight(self, tenant_id: str, model: str) -> int:
        """Estimated KV byte-seconds in flight for a tenant and model."""
        return self._kv.get((tenant_id, model), 0)

    def knows(self, request_id: str) -> bool:
        return request_id in self._requests

    def retry_window(self) -> tuple[int, int]:
        """(requests, retries) seen in the retry-budget window as of the last update."""
        return (self._window_requests, self._window_retries)

    def in_flight(self, tenant_id: str | None = None) -> list[str]:
        """The ids of the requests holding KV, in admission order."""
        return [
            rid for rid, r in self._in_flight.items() if tenant_id is None or r.key[0] == tenant_id
        ]

    # --- the edge's own decisions -------------------------------------------------------------

    def see(self, request_id: str, is_retry: bool, at_s: float) -> None:
        """Count a request in the retry-budget window once, whatever becomes of it."""
        if request_id in self._seen:
            return
        self._seen[request_id] = at_s
        second = int(at_s)
        window = self.retry_window_s
        slot = second % window
        current = self._ring_second[slot]
        if current != second:
            if current > second:  # older than the window: it no longer counts
                return
            self._window_requests -= self._ring_requests[slot]
            self._window_retries -= self._ring_retries[slot]
            self._ring_second[slot] = second
            self._ring_requests[slot] = 0
            self._ring_retries[slot] = 0
            self._expire_slots(second)
        self._ring_requests[slot] += 1
        self._window_requests += 1
        if is_retry:
            self._ring_retries[slot] += 1
            self._window_retries += 1

    def charge(
        self,
        request_id: str,
        key: QuotaKey,
        at_s: float,
        windows: tuple[Bucket, Bucket],
        reserved_tokens: int,
        kv_byte_seconds: int,
    ) -> None:
        """Count an admission at once: one request, its reserved tokens, its KV·s in flight."""
        rpm, tpm = windows
        rpm.level -= 1.0
        tpm.level -= reserved_tokens
        # The request keeps the shared key, not the caller's new tuple: one object fewer kept
        # per admission (objects kept are what sets off the garbage collector, mid-decision).
        key = self._keys.setdefault(key, key)
        self._kv[key] = self._kv.get(key, 0) + kv_byte_seconds
        request = _Request(request_id, key, at_s)
        request.reserved_tokens = reserved_tokens
        request.kv_byte_seconds = kv_byte_seconds
        request.estimated = True
        request.in_flight = True
        self._requests[request_id] = request
        self._in_flight[request_id] = request

    def void(self, request_id: str) -> None:
        """Undo an admission the edge did not go through with (the router refused capacity, the
        client left before routing): the request, tokens and KV·s it was charged come back."""
        request = self._requests.get(request_id)
        if request is None or request.voided:
            return
        request.voided = True
        rpm = self._rpm.get(request.key)
        if rpm is not None:
            rpm.give_back(1.0)
        tpm = self._tpm.get(request.key)
        if tpm is not None and request.estimated and not request.refunded:
            tpm.give_back(request.reserved_tokens)
        request.refunded = True
        self._release(request, request.admitted_s)

    def withdraw(self, request_id: str) -> None:
        """Void an admission and forget the request, so that the same request can be decided
        again (for another model it may be served by, with the tenant's consent)."""
        self.void(request_id)
        self._requests.pop(request_id, None)

    def refund(self, request_id: str, used_tokens: int, at: datetime) -> None:
        """The edge's own refund at a terminal event, before its QuotaRefunded comes back (which
        is then skipped): tokens/min gets reserved − used back, and the KV·s lease is released.
        A request that used more than it reserved (an output-length prediction fell short, or
        the prompt estimate did) is charged the difference instead: the bucket may go below
        zero and refills from there, so what a tenant gets per minute is what it used."""
        request = self._requests.get(request_id)
        if request is None:
            return
        self._note_used(request, used_tokens)
        self._refund(request, max(0, request.reserved_tokens - used_tokens), at.timestamp())

    # --- folding ------------------------------------------------------------------------------

    def folded_types(self) -> frozenset[str]:
        """The event types `apply` folds (a reader of the log may skip every other)."""
        return frozenset(kind.EVENT_TYPE for kind in self._handlers)

    def apply(self, recorded: Recorded) -> None:
        """Fold one recorded event; events the quota does not depend on are ignored."""
        handler = self._handlers.get(type(recorded.event))
        if handler is not None:
            handler(recorded)

    def _on_admitted(self, recorded: Recorded) -> None:
        event = recorded.event
        assert isinstance(event, RequestAdmitted)
        rid = event.request_id
        at_s = recorded.occurred_at.timestamp()
        self.see(rid, event.is_retry, at_s)
        if rid in self._requests:
            return
        key = (event.tenant_id, event.model)
        self._requests[rid] = _Request(rid, key, at_s)
        limits = self._limits(key)
        if limits is not None:
            rpm = self._bucket(self._rpm, key, limits.rpm, at_s)
            if at_s + _MINUTE_S > rpm.at:  # an older charge would have refilled by now
                rpm.level -= 1.0
        orphan = self._orphan_estimates.pop(rid, None)
        if orphan is not None:
            self._on_estimated(orphan)

    def _on_estimated(self, recorded: Recorded) -> None:
        event = recorded.event
        assert isinstance(event, RequestEstimated)
        request = self._requests.get(event.request_id)
        if request is None:
            # The admission is not here yet (a tenant's events are ordered, so this only happens
            # when a view starts mid-stream): hold the estimate until it arrives.
            self._orphan_estimates[event.request_id] = recorded
            return
        if request.estimated or request.voided:
            return
        request.estimated = True
        request.reserved_tokens = event.reserved_tokens
        request.kv_byte_seconds = event.kv_byte_seconds
        at_s = recorded.occurred_at.timestamp()
        limits = self._limits(request.key)
        if limits is not None:
            tpm = self._bucket(self._tpm, request.key, limits.tpm, at_s)
            if at_s + _MINUTE_S > tpm.at:
                tpm.level -= event.reserved_tokens
        if request.finished_s is None:
            request.in_flight = True
            self._in_flight[request.request_id] = request
            self._kv[request.key] = self._kv.get(request.key, 0) + event.kv_byte_seconds

    def _on_terminal(self, recorded: Recorded) -> None:
        request = self._requests.get(recorded.stream_id)
        if request is not None:
            event = recorded.event
            assert isinstance(
                event,
                RequestCompleted | RequestCancelled | RequestFailed | LeaseExpired
                | RequestPreempted,
            )
            # A preemption was our decision: refunded in full, nothing used is charged.
            if not request.refunded and not isinstance(event, RequestPreempted):
                self._note_used(request, event.prompt_tokens + event.completion_tokens)
            self._release(request, recorded.occurred_at.timestamp())

    def _on_refunded(self, recorded: Recorded) -> None:
        event = recorded.event
        assert isinstance(event, QuotaRefunded)
        request = self._requests.get(event.request_id)
        if request is not None:
            self._refund(request, event.refunded_tokens, recorded.occurred_at.timestamp())

    def _on_rejected(self, recorded: Recorded) -> None:
        event = recorded.event
        assert isinstance(event, RequestRejected)
        self.see(event.request_id, event.is_retry, recorded.occurred_at.timestamp())
        if event.request_id in self._requests:
            # Refused after quota admitted it (capacity): the admission did not happen.
            self.void(event.request_id)

    def prune(self, now: datetime) -> int:
        """Forget finished requests older than the tombstone TTL; returns how many. Called with
        every lease renewal (0.5 s), so memory stays bounded by traffic × TTL.

        Both maps keep insertion order, which is admission (first-seen) order, so the scan
        stops at the first entry younger than the horizon: it reads what is old enough to go,
        not the whole window. Scanning all of it held the edge's event loop for 25-45 ms every
        5 s once the 10-minute window held ~70k requests (traced: the slowest responses of an
        open-loop run all ended at those instants)."""
        horizon = now.timestamp() - self.tombstone_ttl_s
        stale = []
        for rid, r in self._requests.items():
            if r.admitted_s >= horizon:
                break  # admitted later still: too young, and so is everything after it
            if not r.in_flight and (
                r.finished_s if r.finished_s is not None else r.admitted_s
            ) < horizon:
                stale.append(rid)
        for rid in stale:
            del self._requests[rid]
        seen_stale = []
        for rid, seen in self._seen.items():
            if seen >= horizon:
                break
            seen_stale.append(rid)
        for rid in seen_stale:
            del self._seen[rid]
        return len(stale)

    # --- helpers ------------------------------------------------------------------------------

    def _limits(self, key: QuotaKey) -> Limits | None:
        if self._limits_for is not None:
            return self._limits_for(*key)
        return self._known_limits.get(key)

    @staticmethod
    def _note_used(request: _Request, used_tokens: int) -> None:
        if request.estimated and used_tokens > request.reserved_tokens:
            request.overage_tokens = used_tokens - request.reserved_tokens

    def _refund(self, request: _Request, tokens: int, at_s: float) -> None:
        if request.refunded or request.voided:
            return
        request.refunded = True
        tpm = self._tpm.get(request.key)
        if tpm is not None:
            tpm.refill(at_s, tpm.capacity)
            # QuotaRefunded never carries a negative refund; the overage its terminal event
            # showed is charged here instead (seen once: `refunded` guards both).
            tpm.give_back(tokens - request.overage_tokens)
        self._release(request, at_s)

    def _release(self, request: _Request, at_s: float) -> None:
        if request.finished_s is None:
            request.finished_s = at_s
        if request.in_flight:
            request.in_flight = False
            del self._in_flight[request.request_id]
            left = self._kv[request.key] - request.kv_byte_seconds
            if left:
                self._kv[request.key] = left
            else:
                del self._kv[request.key]

    @staticmethod
    def _bucket(
        buckets: dict[QuotaKey, Bucket], key: QuotaKey, capacity: int, now_s: float
    ) -> Bucket:
        bucket = buckets.get(key)
        if bucket is None:
            bucket = buckets[key] = Bucket(capacity, now_s)
        else:
            bucket.refill(now_s, capacity)
        return bucket

    def _expire_slots(self, second: int) -> None:
        # Drop any slot that fell out of the window, so the running sums cover only the last
        # `window` seconds. At most `window` slots; the common case is a cheap scan.
        window = self.retry_window_s
        oldest = second - window
        ring_second = self._ring_second
        for slot in range(window):
            if -1 < ring_second[slot] <= oldest:
                self._window_requests -= self._ring_requests[slot]
                self._window_retries -= self._ring_retries[slot]
                ring_second[slot] = -1
                self._ring_requests[slot] = 0
                self._ring_retries[slot] = 0
