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
from typing import TypeAlias

from tollgate_llm.domain.control_plane.state import Limits
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.requests.events import (
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
from tollgate_llm.domain.reservations import TOMBSTONE_TTL_S, Bucket, Hold, Reservations

__all__ = ["QuotaKey", "QuotaView", "quota_key"]

# What a bucket and the KV allowance are kept for: (tenant_id, model version).
QuotaKey: TypeAlias = tuple[str, str]


def quota_key(tenant_id: str, model: str) -> QuotaKey:
    return (tenant_id, model)


_Request: TypeAlias = Hold[QuotaKey]


class QuotaView(Reservations[QuotaKey, _Request]):
    """The organization's buckets and KV·s per tenant and model (`domain.reservations`: one
    hold per request, at its one key) and, across all tenants, the retry-budget window."""

    def __init__(
        self,
        limits_for: Callable[[str, str], Limits] | None = None,
        *,
        retry_window_s: int = 60,
        tombstone_ttl_s: int = TOMBSTONE_TTL_S,
    ) -> None:
        super().__init__(tombstone_ttl_s)
        # `limits_for(tenant_id, model)` (e.g. ControlView.limits) lets `apply` size the buckets
        # of tenants this edge has not decided for yet; without it, `apply` uses the limits the
        # last decision saw for that key, and skips rate charges it cannot size.
        self._limits_for = limits_for
        self._known_limits: dict[QuotaKey, Limits] = {}
        # One keys tuple per tenant and model, shared by its requests' holds (`charge`).
        self._keys: dict[QuotaKey, tuple[QuotaKey]] = {}
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
        self._handlers = {
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
            rpm = self._found_bucket(self._rpm, key, limits.rpm, now_s)
        else:
            rpm.refill(now_s, limits.rpm)
        tpm = self._tpm.get(key)
        if tpm is None:
            tpm = self._found_bucket(self._tpm, key, limits.tpm, now_s)
        else:
            tpm.refill(now_s, limits.tpm)
        return rpm, tpm

    def kv_in_flight(self, tenant_id: str, model: str) -> int:
        """Estimated KV byte-seconds in flight for a tenant and model."""
        return self._kv.get((tenant_id, model), 0)

    def retry_window(self) -> tuple[int, int]:
        """(requests, retries) seen in the retry-budget window as of the last update."""
        return (self._window_requests, self._window_retries)

    def in_flight(self, tenant_id: str | None = None) -> list[str]:
        """The ids of the requests holding KV, in admission order."""
        return [
            rid for rid, r in self._in_flight.items()
            if tenant_id is None or r.rate_keys[0][0] == tenant_id
        ]  # fmt: skip

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
        # The hold keeps the shared keys tuple, not a new one: one object fewer kept per
        # admission (objects kept are what sets off the garbage collector, mid-decision).
        keys = self._keys.get(key)
        if keys is None:
            keys = self._keys[key] = (key,)
        request = Hold(request_id, keys, keys, at_s, reserved_tokens, kv_byte_seconds, True)
        self._take(request)
        self._in_flight[request_id] = request

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

    def _on_admitted(self, recorded: Recorded) -> None:
        event = recorded.event
        assert isinstance(event, RequestAdmitted)
        rid = event.request_id
        at_s = recorded.occurred_at.timestamp()
        self.see(rid, event.is_retry, at_s)
        if rid in self._requests:
            return
        key = (event.tenant_id, event.model)
        keys = self._keys.get(key)
        if keys is None:
            keys = self._keys[key] = (key,)
        self._requests[rid] = Hold(rid, keys, keys, at_s)
        limits = self._limits(key)
        if limits is not None:
            self._bucket(self._rpm, key, limits.rpm, at_s).take_logged(1.0, at_s)
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
        key = request.rate_keys[0]
        limits = self._limits(key)
        if limits is not None:
            self._bucket(self._tpm, key, limits.tpm, at_s).take_logged(event.reserved_tokens, at_s)
        if request.finished_s is None:
            self._hold_kv(request)
            self._in_flight[request.request_id] = request

    def _on_terminal(self, recorded: Recorded) -> None:
        request = self._requests.get(recorded.stream_id)
        if request is not None:
            event = recorded.event
            assert isinstance(
                event,
                RequestCompleted
                | RequestCancelled
                | RequestFailed
                | LeaseExpired
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
        """`Reservations.prune`, and the retry window's first-seen instants of the same age."""
        pruned = super().prune(now)
        horizon = now.timestamp() - self.tombstone_ttl_s
        seen_stale = []
        for rid, seen in self._seen.items():
            if seen >= horizon:
                break
            seen_stale.append(rid)
        for rid in seen_stale:
            del self._seen[rid]
        return pruned

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
        # QuotaRefunded never carries a negative refund; the overage its terminal event showed
        # is charged here instead (seen once: `refunded` guards both).
        if self._refund_tokens(request, tokens, at_s):
            self._release(request, at_s)

    def _released(self, hold: _Request) -> None:
        del self._in_flight[hold.request_id]

    def _bucket(
        self, buckets: dict[QuotaKey, Bucket], key: QuotaKey, capacity: int, now_s: float
    ) -> Bucket:
        bucket = self._found_bucket(buckets, key, capacity, now_s)
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
