"""The edge's quota decision (DESIGN §5, seed 000 §6 and R4/R6): requests/min, tokens/min and
concurrent KV·seconds per key and model, over a view folded from events plus the edge's own
admissions that have not come back through the bus yet.

Quota is the tenant's contract (429); capacity is the fleet's (503, decided by the router in
`domain.capacity`). The retry budget is the one 503 decided here: it protects the fleet from a
retry storm, which no single tenant caused.

Exact rules, written down:
- Only an admission is charged (1 request, the reserved tokens, the estimated KV·s); a refusal is
  free. A request refused later by capacity is `void`ed: its charges are undone.
- tokens/min is charged `prompt + min(max_tokens, max_output)` and refunded by QuotaRefunded.
  `max_tokens` above `max_output` is clamped to `max_output` (not refused): the client asked for
  "up to" that many, and the clamp is visible as `Admitted.clamped_output`. A prompt above
  `max_context`, or a request that needs more tokens than the per-minute limit can ever hold, is
  invalid (400): retrying it can never succeed, so a 429 would be a lie.
- KV·s: admitted while in_flight + estimate ≤ cap, or while the tenant has nothing in flight for
  the model (a lone request is never refused for concurrency: max_context and max_output are what
  bound a single request). Enterprise (the reserved class, R2) uses max(cap, reserved floor).
- Stale view (the caller says so, e.g. the bus is lagging): tokens/min fails OPEN (checked never,
  still charged), KV·s fails CLOSED to min(cap, policy.stale_kv_gib_seconds), except that the
  reserved class still gets its floor: that capacity is held back for it in reserve-only replicas.
- Retry-After = max(base 5 s, seconds until the bucket holds enough) + jitter, jitter an integer
  uniform in [0, 5] s from the caller's draw u ∈ [0, 1) (floor(u × 6)).
- Retry budget (R6): over the last 60 s, every request seen once (admitted or refused, from any
  edge); when retries exceed 20 % of them (and at least 20 requests were seen), non-enterprise
  retries are shed with reason `retry_budget` (503) and Retry-After 30 + floor(u × 31) ∈ [30, 60].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from domain.control import Limits
from domain.cost import GIB, Estimate, est_kv_byte_seconds
from domain.errors import DomainError
from domain.events import (
    LeaseExpired,
    LeaseProgress,
    LeasesRenewed,
    QuotaRefunded,
    Recorded,
    RequestAdmitted,
    RequestCancelled,
    RequestCompleted,
    RequestEstimated,
    RequestFailed,
    RequestRejected,
)

__all__ = [
    "AdmissionPolicy",
    "ReserveQuota",
    "RateLimitInfo",
    "Admitted",
    "Rejected",
    "InFlight",
    "QuotaView",
    "HTTP_STATUS",
]

RESERVED_TIER: Final = "enterprise"
HTTP_STATUS: Final = {
    "requests": 429,
    "tokens": 429,
    "concurrency": 429,
    "invalid": 400,
    "retry_budget": 503,
    "capacity": 503,
}


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    retry_after_base_s: int = 5
    retry_after_jitter_s: int = 5
    retry_window_s: int = 60
    retry_budget_ppm: int = 200_000  # 20 % of the requests seen in the window
    retry_budget_min_requests: int = 20  # below this volume a ratio means nothing
    retry_shed_min_s: int = 30
    retry_shed_max_s: int = 60
    stale_kv_gib_seconds: int = 256  # the conservative cap when the view is stale
    lease_ttl_s: int = 15
    # How long a finished request's id is remembered so a redelivered event is not re-counted.
    tombstone_ttl_s: int = 600


@dataclass(frozen=True, slots=True)
class ReserveQuota:
    """One admission question from an edge. `now` and the jitter draw arrive with it."""

    request_id: str
    tenant_id: str
    key_id: str
    model: str
    tier: str
    edge_id: str
    prompt_tokens: int
    max_tokens: int | None  # None: the tenant's max_output
    kv_bytes_per_token: int
    tpot_us: int  # from cost.tpot_estimate_us
    now: datetime
    jitter: float  # a uniform draw in [0, 1), made by the caller
    is_retry: bool = False
    # An output-length prediction (capped at the reserved output) narrows the KV·s reservation
    # only; tokens/min is always charged on max_tokens as DESIGN §5 says.
    predicted_output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class RateLimitInfo:
    """X-RateLimit-* for one decision: remaining after it; reset = ms until the bucket is full."""

    limit_requests: int
    remaining_requests: int
    reset_requests_ms: int
    limit_tokens: int
    remaining_tokens: int
    reset_tokens_ms: int

    def headers(self) -> dict[str, str]:
        return {
            "X-RateLimit-Limit-Requests": str(self.limit_requests),
            "X-RateLimit-Remaining-Requests": str(self.remaining_requests),
            "X-RateLimit-Reset-Requests": _duration(self.reset_requests_ms),
            "X-RateLimit-Limit-Tokens": str(self.limit_tokens),
            "X-RateLimit-Remaining-Tokens": str(self.remaining_tokens),
            "X-RateLimit-Reset-Tokens": _duration(self.reset_tokens_ms),
        }


@dataclass(frozen=True, slots=True)
class Admitted:
    estimate: Estimate
    rate_limits: RateLimitInfo
    clamped_output: bool = False

    def headers(self) -> dict[str, str]:
        return self.rate_limits.headers()


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: str  # requests | tokens | concurrency | invalid | retry_budget
    retry_after_s: int  # 0 for invalid: retrying cannot help
    detail: str
    rate_limits: RateLimitInfo
    param: str | None = None  # for invalid: the request field at fault

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.reason]

    def headers(self) -> dict[str, str]:
        """X-RateLimit-* and, except for invalid, Retry-After."""
        headers = self.rate_limits.headers()
        if self.reason != "invalid":
            headers["Retry-After"] = str(self.retry_after_s)
        return headers


@dataclass(frozen=True, slots=True)
class InFlight:
    """A request holding KV, with its lease."""

    request_id: str
    tenant_id: str
    model: str
    edge_id: str
    kv_byte_seconds: int
    renewed_at: datetime
    progress: LeaseProgress | None


class _Bucket:
    """A token bucket: `level` tokens available at instant `at` (epoch seconds). Floats are fine
    here: this is an approximate, rebuildable view, never an event or a bill."""

    __slots__ = ("level", "at", "capacity", "rate")

    def __init__(self, capacity: int, at: float) -> None:
        self.capacity = capacity
        self.rate = capacity / 60.0
        self.level = float(capacity)
        self.at = at

    def refill(self, now: float, capacity: int) -> None:
        if capacity != self.capacity:  # the limit changed: keep the debt, rescale the ceiling
            self.level += capacity - self.capacity
            self.capacity = capacity
            self.rate = capacity / 60.0
        if now > self.at:
            level = self.level + (now - self.at) * self.rate
            self.level = level if level < capacity else float(capacity)
            self.at = now

    def reset_ms(self) -> int:
        missing = self.capacity - self.level
        if missing <= 0 or self.capacity <= 0:
            return 0
        # × 60,000 / capacity rather than / rate: rate = capacity / 60 is inexact in binary.
        return -int(-missing * 60_000 // self.capacity)


class _Request:
    __slots__ = (
        "request_id",
        "tenant_id",
        "key_id",
        "model",
        "edge_id",
        "admitted_s",
        "reserved_tokens",
        "kv_byte_seconds",
        "renewed_s",
        "renewed_at",
        "progress",
        "estimated",
        "in_flight",
        "refunded",
        "voided",
        "finished_s",
    )

    def __init__(
        self,
        request_id: str,
        tenant_id: str,
        key_id: str,
        model: str,
        edge_id: str,
        at: datetime,
        at_s: float,
    ) -> None:
        self.request_id = request_id
        self.tenant_id = tenant_id
        self.key_id = key_id
        self.model = model
        self.edge_id = edge_id
        self.admitted_s = at_s
        self.reserved_tokens = 0
        self.kv_byte_seconds = 0
        self.renewed_s = at_s
        self.renewed_at = at
        self.progress: LeaseProgress | None = None
        self.estimated = False
        self.in_flight = False
        self.refunded = False
        self.voided = False
        self.finished_s: float | None = None


class QuotaView:
    """Quota windows, in-flight KV and leases, folded from request events (`apply`) and updated
    at once by the edge's own decisions (`decide`). Rebuilding it from the same events gives the
    same counts; an event for a request already counted (locally or by redelivery) is skipped."""

    def __init__(
        self,
        limits_for: Callable[[str, str], Limits] | None = None,
        policy: AdmissionPolicy | None = None,
    ) -> None:
        # `limits_for(tenant_id, model)` (e.g. ControlView.limits) lets `apply` size the buckets
        # of keys this edge has not decided for yet; without it, `apply` uses the limits the
        # last decision saw for that tenant and model, and skips rate charges it cannot size.
        self._limits_for = limits_for
        self._known_limits: dict[tuple[str, str], Limits] = {}
        self.policy = policy or AdmissionPolicy()
        self._rpm: dict[tuple[str, str], _Bucket] = {}
        self._tpm: dict[tuple[str, str], _Bucket] = {}
        self._kv: dict[tuple[str, str], int] = {}
        self._requests: dict[str, _Request] = {}
        self._in_flight: dict[str, _Request] = {}
        self._orphan_estimates: dict[str, Recorded] = {}
        # Retry budget: per-second ring of (requests, retries) and their running sums.
        window = self.policy.retry_window_s
        self._ring_second = [-1] * window
        self._ring_requests = [0] * window
        self._ring_retries = [0] * window
        self._window_requests = 0
        self._window_retries = 0
        self._seen: dict[str, float] = {}  # request id -> first seen (epoch s), for the window
        self._handlers: dict[type, Callable[[Recorded], None]] = {
            RequestAdmitted: self._on_admitted,
            RequestEstimated: self._on_estimated,
            RequestCompleted: self._on_terminal,
            RequestCancelled: self._on_terminal,
            RequestFailed: self._on_terminal,
            LeaseExpired: self._on_terminal,
            QuotaRefunded: self._on_refunded,
            RequestRejected: self._on_rejected,
            LeasesRenewed: self._on_renewed,
        }

    # --- the decision -------------------------------------------------------------------------

    def decide(
        self, cmd: ReserveQuota, limits: Limits | None = None, *, stale: bool = False
    ) -> Admitted | Rejected:
        """Admit (and count at once) or refuse one request under `limits` (default: the
        `limits_for` resolver). `stale` says the folded view is behind: tokens/min then fails
        open and KV·s fails closed (module docstring)."""
        policy = self.policy
        if limits is None:
            if self._limits_for is None:
                raise DomainError("no_limits", "decide needs limits or a limits_for resolver")
            limits = self._limits_for(cmd.tenant_id, cmd.model)
        self._known_limits[(cmd.tenant_id, cmd.model)] = limits
        now_s = cmd.now.timestamp()
        jitter = cmd.jitter
        if not 0.0 <= jitter < 1.0:
            raise DomainError("bad_jitter", "jitter is a uniform draw in [0, 1)", field="jitter")
        bucket_key = (cmd.key_id, cmd.model)
        rpm = self._bucket(self._rpm, bucket_key, limits.rpm, now_s)
        tpm = self._bucket(self._tpm, bucket_key, limits.tpm, now_s)
        rid = cmd.request_id
        if rid in self._requests:
            raise DomainError("duplicate_request", f"request {rid} was already admitted")

        prompt = cmd.prompt_tokens
        max_output = limits.max_output
        max_tokens = cmd.max_tokens
        invalid = param = None
        if prompt < 0:
            invalid, param = "prompt_tokens is negative", "messages"
        elif max_tokens is not None and max_tokens < 1:
            invalid, param = "max_tokens must be at least 1", "max_tokens"
        elif prompt > limits.max_context:
            invalid = f"prompt of {prompt} tokens exceeds max_context {limits.max_context}"
            param = "messages"
        out = max_output if max_tokens is None or max_tokens > max_output else max_tokens
        reserved = prompt + out
        if invalid is None and reserved > limits.tpm:
            invalid = f"request needs {reserved} tokens, above the {limits.tpm} tokens/min limit"
            param = "max_tokens"
        if invalid is not None:
            return Rejected("invalid", 0, invalid, self._info(rpm, tpm), param)

        self._count_seen(rid, cmd.is_retry, now_s)
        if (
            cmd.is_retry
            and cmd.tier != RESERVED_TIER
            and self._window_requests >= policy.retry_budget_min_requests
            and self._window_retries * 1_000_000 > self._window_requests * policy.retry_budget_ppm
        ):
            spread = policy.retry_shed_max_s - policy.retry_shed_min_s + 1
            return Rejected(
                "retry_budget",
                policy.retry_shed_min_s + int(jitter * spread),
                f"retries are {self._window_retries} of {self._window_requests} requests in "
                f"the last {policy.retry_window_s} s; shedding retries",
                self._info(rpm, tpm),
            )
        if rpm.level < 1.0:
            return Rejected(
                "requests",
                self._retry_after(rpm, 1, jitter),
                f"{limits.rpm} requests/min for {cmd.model}",
                self._info(rpm, tpm),
            )
        if not stale and tpm.level < reserved:
            return Rejected(
                "tokens",
                self._retry_after(tpm, reserved, jitter),
                f"{reserved} tokens reserved (prompt + max output) exceed the "
                f"{max(0, int(tpm.level))} left of {limits.tpm} tokens/min for {cmd.model}",
                self._info(rpm, tpm),
            )

        kv_out = out
        predicted = cmd.predicted_output_tokens
        if predicted is not None and 0 <= predicted < out:
            kv_out = predicted
        kv = est_kv_byte_seconds(prompt, kv_out, cmd.kv_bytes_per_token, cmd.tpot_us)
        kv_key = (cmd.tenant_id, cmd.model)
        in_flight = self._kv.get(kv_key, 0)
        if in_flight:
            cap_gib_s = limits.kv_gib_seconds
            if stale and policy.stale_kv_gib_seconds < cap_gib_s:
                cap_gib_s = policy.stale_kv_gib_seconds
            if cmd.tier == RESERVED_TIER and limits.reserved_kv_gib_seconds > cap_gib_s:
                cap_gib_s = limits.reserved_kv_gib_seconds
            if in_flight + kv > cap_gib_s * GIB:
                return Rejected(
                    "concurrency",
                    self._retry_after(None, 0, jitter),
                    f"{_gib(in_flight)} GiB·s in flight + {_gib(kv)} GiB·s for this request "
                    f"exceed the {cap_gib_s} GiB·s concurrent KV limit for {cmd.model}"
                    + (" (stale view: conservative cap)" if stale else ""),
                    self._info(rpm, tpm),
                )

        rpm.level -= 1.0
        tpm.level -= reserved
        self._kv[kv_key] = in_flight + kv
        request = _Request(rid, cmd.tenant_id, cmd.key_id, cmd.model, cmd.edge_id, cmd.now, now_s)
        request.reserved_tokens = reserved
        request.kv_byte_seconds = kv
        request.estimated = True
        request.in_flight = True
        self._requests[rid] = request
        self._in_flight[rid] = request
        return Admitted(
            Estimate(prompt, out, kv, cmd.tpot_us),
            self._info(rpm, tpm),
            max_tokens is not None and max_tokens > max_output,
        )

    def void(self, request_id: str) -> None:
        """Undo an admission the edge did not go through with (the router refused capacity, the
        client left before routing): the request, tokens and KV·s it was charged come back."""
        request = self._requests.get(request_id)
        if request is None or request.voided:
            return
        request.voided = True
        bucket_key = (request.key_id, request.model)
        rpm = self._rpm.get(bucket_key)
        if rpm is not None:
            rpm.level = min(rpm.level + 1.0, float(rpm.capacity))
        tpm = self._tpm.get(bucket_key)
        if tpm is not None and request.estimated and not request.refunded:
            tpm.level = min(tpm.level + request.reserved_tokens, float(tpm.capacity))
        request.refunded = True
        self._release(request, request.admitted_s)

    def refund(self, request_id: str, used_tokens: int, at: datetime) -> None:
        """The edge's own refund at a terminal event, before its QuotaRefunded comes back (which
        is then skipped): tokens/min gets reserved − used back, and the KV·s lease is released."""
        request = self._requests.get(request_id)
        if request is None or request.refunded or request.voided:
            return
        request.refunded = True
        at_s = at.timestamp()
        tpm = self._tpm.get((request.key_id, request.model))
        if tpm is not None:
            tpm.refill(at_s, tpm.capacity)
            back = max(0, request.reserved_tokens - used_tokens)
            tpm.level = min(tpm.level + back, float(tpm.capacity))
        self._release(request, at_s)

    # --- folding ------------------------------------------------------------------------------

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
        self._count_seen(rid, event.is_retry, at_s)
        if rid in self._requests:
            return
        request = _Request(
            rid,
            event.tenant_id,
            event.key_id,
            event.model,
            event.edge_id,
            recorded.occurred_at,
            at_s,
        )
        self._requests[rid] = request
        limits = self._limits(event.tenant_id, event.model)
        if limits is not None:
            rpm = self._bucket(self._rpm, (event.key_id, event.model), limits.rpm, at_s)
            if at_s + 60.0 > rpm.at:  # an older charge would have refilled by now
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
        limits = self._limits(request.tenant_id, request.model)
        if limits is not None:
            tpm = self._bucket(self._tpm, (request.key_id, request.model), limits.tpm, at_s)
            if at_s + 60.0 > tpm.at:
                tpm.level -= event.reserved_tokens
        if request.finished_s is None:
            request.in_flight = True
            self._in_flight[request.request_id] = request
            key = (request.tenant_id, request.model)
            self._kv[key] = self._kv.get(key, 0) + event.kv_byte_seconds

    def _on_terminal(self, recorded: Recorded) -> None:
        event = recorded.event
        assert isinstance(event, RequestCompleted | RequestCancelled | RequestFailed | LeaseExpired)
        request = self._requests.get(event.request_id)
        if request is not None:
            self._release(request, recorded.occurred_at.timestamp())

    def _on_refunded(self, recorded: Recorded) -> None:
        event = recorded.event
        assert isinstance(event, QuotaRefunded)
        request = self._requests.get(event.request_id)
        if request is None or request.refunded or request.voided:
            return
        request.refunded = True
        at_s = recorded.occurred_at.timestamp()
        tpm = self._tpm.get((request.key_id, request.model))
        if tpm is not None:
            tpm.refill(at_s, tpm.capacity)
            tpm.level = min(tpm.level + event.refunded_tokens, float(tpm.capacity))
        self._release(request, at_s)

    def _on_rejected(self, recorded: Recorded) -> None:
        event = recorded.event
        assert isinstance(event, RequestRejected)
        self._count_seen(event.request_id, event.is_retry, recorded.occurred_at.timestamp())
        if event.request_id in self._requests:
            # Refused after quota admitted it (capacity): the admission did not happen.
            self.void(event.request_id)

    def _on_renewed(self, recorded: Recorded) -> None:
        event = recorded.event
        assert isinstance(event, LeasesRenewed)
        at = recorded.occurred_at
        at_s = at.timestamp()
        for progress in event.progress:
            request = self._in_flight.get(progress.request_id)
            if request is None or at_s < request.renewed_s:
                continue
            request.renewed_s = at_s
            request.renewed_at = at
            request.edge_id = event.edge_id
            request.progress = progress

    # --- in-flight set and leases -------------------------------------------------------------

    def expired(self, now: datetime, ttl_s: int | None = None) -> list[str]:
        """Requests in flight whose lease was not renewed for `ttl_s` (15 s): the sweeper's list."""
        ttl = self.policy.lease_ttl_s if ttl_s is None else ttl_s
        horizon = now.timestamp() - ttl
        return [rid for rid, request in self._in_flight.items() if request.renewed_s < horizon]

    def in_flight(self, tenant_id: str | None = None) -> list[InFlight]:
        return [
            InFlight(
                r.request_id,
                r.tenant_id,
                r.model,
                r.edge_id,
                r.kv_byte_seconds,
                r.renewed_at,
                r.progress,
            )
            for r in self._in_flight.values()
            if tenant_id is None or r.tenant_id == tenant_id
        ]

    def kv_in_flight(self, tenant_id: str, model: str) -> int:
        """Estimated KV byte-seconds in flight for a tenant and model."""
        return self._kv.get((tenant_id, model), 0)

    def progress(self, request_id: str) -> LeaseProgress | None:
        request = self._in_flight.get(request_id)
        return None if request is None else request.progress

    def retry_window(self) -> tuple[int, int]:
        """(requests, retries) seen in the retry-budget window as of the last update."""
        return (self._window_requests, self._window_retries)

    def prune(self, now: datetime) -> int:
        """Forget finished requests older than the tombstone TTL; returns how many. Called with
        every lease renewal (5 s), so memory stays bounded by traffic × TTL.

        Both maps keep insertion order, which is admission (first-seen) order, so the scan
        stops at the first entry younger than the horizon: it reads what is old enough to go,
        not the whole window. Scanning all of it held the edge's event loop for 25-45 ms every
        5 s once the 10-minute window held ~70k requests (traced: the slowest responses of an
        open-loop run all ended at those instants)."""
        horizon = now.timestamp() - self.policy.tombstone_ttl_s
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

    def _limits(self, tenant_id: str, model: str) -> Limits | None:
        if self._limits_for is not None:
            return self._limits_for(tenant_id, model)
        return self._known_limits.get((tenant_id, model))

    def _release(self, request: _Request, at_s: float) -> None:
        if request.finished_s is None:
            request.finished_s = at_s
        if request.in_flight:
            request.in_flight = False
            del self._in_flight[request.request_id]
            key = (request.tenant_id, request.model)
            left = self._kv[key] - request.kv_byte_seconds
            if left:
                self._kv[key] = left
            else:
                del self._kv[key]

    @staticmethod
    def _bucket(
        buckets: dict[tuple[str, str], _Bucket], key: tuple[str, str], capacity: int, now_s: float
    ) -> _Bucket:
        bucket = buckets.get(key)
        if bucket is None:
            bucket = buckets[key] = _Bucket(capacity, now_s)
        else:
            bucket.refill(now_s, capacity)
        return bucket

    def _count_seen(self, request_id: str, is_retry: bool, at_s: float) -> None:
        if request_id in self._seen:
            return
        self._seen[request_id] = at_s
        second = int(at_s)
        window = self.policy.retry_window_s
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

    def _expire_slots(self, second: int) -> None:
        # Drop any slot that fell out of the window, so the running sums cover only the last
        # `window` seconds. At most `window` slots; the common case is a cheap scan.
        window = self.policy.retry_window_s
        oldest = second - window
        ring_second = self._ring_second
        for slot in range(window):
            if -1 < ring_second[slot] <= oldest:
                self._window_requests -= self._ring_requests[slot]
                self._window_retries -= self._ring_retries[slot]
                ring_second[slot] = -1
                self._ring_requests[slot] = 0
                self._ring_retries[slot] = 0

    def _retry_after(self, bucket: _Bucket | None, needed: int, jitter: float) -> int:
        policy = self.policy
        base = policy.retry_after_base_s
        if bucket is not None and bucket.capacity > 0:
            missing = needed - bucket.level
            if missing > 0:
                wait = -int(-missing * 60 // bucket.capacity)
                base = max(base, wait)
        return base + int(jitter * (policy.retry_after_jitter_s + 1))

    @staticmethod
    def _info(rpm: _Bucket, tpm: _Bucket) -> RateLimitInfo:
        return RateLimitInfo(
            rpm.capacity,
            max(0, int(rpm.level)),
            rpm.reset_ms(),
            tpm.capacity,
            max(0, int(tpm.level)),
            tpm.reset_ms(),
        )


def _duration(ms: int) -> str:
    """OpenAI's reset format: "250ms", "1.5s", "6m0s"."""
    if ms < 1000:
        return f"{ms}ms"
    if ms < 60_000:
        return f"{ms / 1000:g}s"
    minutes, rest_ms = divmod(ms, 60_000)
    return f"{minutes}m{rest_ms // 1000}s"


def _gib(byte_seconds: int) -> str:
    return f"{byte_seconds / GIB:.1f}"
