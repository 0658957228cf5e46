"""The edge's quota decision (`domain.admission.decide` over a `domain.quota.QuotaView`): the
three layers in order, rate-limit figures, Retry-After, the retry budget, stale-view policies, and
folding from events without double counting."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from tests import builders as b
from tollgate_llm.domain import admission
from tollgate_llm.domain.admission import AdmissionPolicy, Admitted, Rejected, ReserveQuota
from tollgate_llm.domain.control_plane.state import Limits
from tollgate_llm.domain.cost import GIB, est_kv_byte_seconds
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.quota import QuotaView
from tollgate_llm.domain.requests.events import RequestPreempted

LIMITS = Limits(rpm=60, tpm=10_000, max_context=4_000, max_output=1_000, kv_gib_seconds=16)
ENTERPRISE = replace(LIMITS, kv_gib_seconds=16, reserved_kv_gib_seconds=64)
KV_8B = 131_072
TPOT = 50_000


class Desk(QuotaView):
    """A quota view with the limits and policy its decisions use (what an edge holds)."""

    def __init__(self, limits: Limits | None, policy: AdmissionPolicy, **view: Any) -> None:
        resolver = None if limits is None else (lambda tenant, model: limits)
        super().__init__(resolver, **view)
        self.limits = limits
        self.policy = policy

    def decide(
        self, cmd: ReserveQuota, limits: Limits | None = None, *, stale: bool = False
    ) -> Admitted | Rejected:
        chosen = limits or self.limits
        assert chosen is not None
        return admission.decide(self, cmd, chosen, stale=stale, policy=self.policy)


def quota(limits: Limits = LIMITS, **policy: Any) -> Desk:
    return Desk(limits, AdmissionPolicy(**policy))


_n = iter(range(10**9))


def ask(seconds: float = 0, **kw: Any) -> ReserveQuota:
    base = ReserveQuota(
        request_id=f"r{next(_n)}",
        tenant_id=b.TENANT,
        key_id=b.KEY,
        model=b.MODEL,
        tier="standard",
        edge_id="edge-1",
        prompt_tokens=100,
        max_tokens=100,
        kv_bytes_per_token=KV_8B,
        tpot_us=TPOT,
        now=b.at(seconds),
        jitter=0.0,
    )
    return replace(base, **kw)


def admitted(decision: Admitted | Rejected) -> Admitted:
    assert isinstance(decision, Admitted), decision
    return decision


def rejected(decision: Admitted | Rejected, reason: str) -> Rejected:
    assert isinstance(decision, Rejected), decision
    assert decision.reason == reason, decision
    return decision


# --- layer 1: requests/min ----------------------------------------------------------------------


def test_requests_per_minute_bucket_refills_at_rpm_per_60_s() -> None:
    view = quota(replace(LIMITS, rpm=3))
    for _ in range(3):
        admitted(view.decide(ask(0)))
    refusal = rejected(view.decide(ask(0)), "requests")
    assert refusal.rate_limits.remaining_requests == 0
    # 3 rpm refills one request every 20 s: Retry-After is max(5, 20) + jitter 0
    assert refusal.retry_after_s == 20
    admitted(view.decide(ask(20)))


# --- layer 2: tokens/min ------------------------------------------------------------------------


def test_tokens_are_charged_prompt_plus_max_output_and_refunded() -> None:
    view = quota(replace(LIMITS, kv_gib_seconds=10**6))
    first = admitted(view.decide(ask(0, prompt_tokens=1000, max_tokens=1000)))
    assert first.estimate.reserved_tokens == 2000
    assert first.rate_limits.remaining_tokens == 8000
    for _ in range(4):
        admitted(view.decide(ask(0, prompt_tokens=1000, max_tokens=1000)))
    rejected(view.decide(ask(0, prompt_tokens=1000, max_tokens=1000)), "tokens")
    # the first request used only 1,090 tokens: 910 come back at once
    view.refund(first_id(view), used_tokens=1090, at=b.at(0))
    assert admitted(view.decide(ask(0, prompt_tokens=400, max_tokens=500)))


def first_id(view: QuotaView) -> str:
    return view.in_flight()[0]


def test_max_tokens_above_max_output_is_clamped() -> None:
    decision = admitted(quota().decide(ask(prompt_tokens=10, max_tokens=50_000)))
    assert decision.estimate.reserved_output_tokens == 1_000 and decision.clamped_output
    unset = admitted(quota().decide(ask(prompt_tokens=10, max_tokens=None)))
    assert unset.estimate.reserved_output_tokens == 1_000 and not unset.clamped_output


def test_prompt_above_max_context_is_invalid() -> None:
    refusal = rejected(quota().decide(ask(prompt_tokens=4_001)), "invalid")
    assert refusal.retry_after_s == 0 and refusal.param == "messages"


def test_a_prompt_that_fills_the_models_context_is_invalid() -> None:
    # Within the tenant's max_context, but the engine could produce nothing after it.
    refusal = rejected(quota().decide(ask(prompt_tokens=2_048, context_tokens=2_048)), "invalid")
    assert refusal.param == "messages" and "context of 2048" in refusal.detail.replace(",", "")
    admitted(quota().decide(ask(prompt_tokens=2_047, context_tokens=2_048)))
    admitted(quota().decide(ask(prompt_tokens=2_048, context_tokens=None)))  # unknown: no rule


def test_a_request_larger_than_the_tokens_per_minute_limit_is_invalid() -> None:
    view = quota(replace(LIMITS, tpm=1_000))
    rejected(view.decide(ask(prompt_tokens=900, max_tokens=200)), "invalid")


def test_min_tokens_above_the_output_it_may_produce_is_invalid() -> None:
    refusal = rejected(quota().decide(ask(max_tokens=50_000, min_tokens=1_001)), "invalid")
    assert refusal.param == "min_tokens" and "1000" in refusal.detail.replace(",", "")
    admitted(quota().decide(ask(max_tokens=50_000, min_tokens=1_000)))


def test_max_tokens_zero_is_invalid() -> None:
    assert rejected(quota().decide(ask(max_tokens=0)), "invalid").param == "max_tokens"


# --- layer 3: concurrent KV·s -------------------------------------------------------------------


def kv_of(prompt: int, out: int) -> int:
    return est_kv_byte_seconds(prompt, out, KV_8B, TPOT)


def test_kv_seconds_in_flight_is_capped_per_tenant_and_model() -> None:
    view = quota(replace(LIMITS, tpm=10**9))
    one = kv_of(1000, 1000)  # (1000 + 500) × 128 KiB × 1000 × 0.05 s ≈ 9.2 GiB·s
    assert (
        admitted(view.decide(ask(prompt_tokens=1000, max_tokens=1000))).estimate.kv_byte_seconds
        == one
    )
    refusal = rejected(view.decide(ask(prompt_tokens=1000, max_tokens=1000)), "concurrency")
    assert "16 GiB·s" in refusal.detail
    assert view.kv_in_flight(b.TENANT, b.MODEL) == one
    # another model of the same tenant has its own allowance
    admitted(view.decide(ask(prompt_tokens=1000, max_tokens=1000, model="llama-3.1-8b")))


def test_a_lone_request_above_the_cap_is_admitted() -> None:
    view = quota(replace(LIMITS, tpm=10**9, kv_gib_seconds=1))
    admitted(view.decide(ask(prompt_tokens=4000, max_tokens=1000)))
    rejected(view.decide(ask(prompt_tokens=10, max_tokens=10)), "concurrency")


def test_kv_comes_back_on_the_terminal_event() -> None:
    view = quota(replace(LIMITS, tpm=10**9))
    admitted(view.decide(ask(prompt_tokens=1000, max_tokens=1000)))
    rid = first_id(view)
    view.apply(b.record(b.completed(request_id=rid), version=3, seconds=1))
    assert view.kv_in_flight(b.TENANT, b.MODEL) == 0
    admitted(view.decide(ask(2, prompt_tokens=1000, max_tokens=1000)))


def test_a_preemption_frees_the_kv_and_charges_no_overage() -> None:
    """Preempted work was our decision: even past its reservation, nothing used is charged."""
    view = quota(replace(LIMITS, tpm=10**9))
    admitted(view.decide(ask(prompt_tokens=100, max_tokens=10)))
    rid = first_id(view)
    preempted = RequestPreempted(rid, 100, 500, 0, "replica-1", "req_interactive")
    view.apply(b.record(preempted, version=3))
    assert view.kv_in_flight(b.TENANT, b.MODEL) == 0
    view.apply(b.record(b.refunded(request_id=rid, refunded_tokens=110), version=4))
    after = admitted(view.decide(ask(0, prompt_tokens=1, max_tokens=1))).rate_limits
    assert after.remaining_tokens == 10**9 - 2


def test_enterprise_is_admitted_up_to_its_reserved_floor() -> None:
    view = quota(replace(ENTERPRISE, tpm=10**9))
    for _ in range(6):  # 6 × 9.2 ≈ 55 GiB·s: above the 16 cap, within the 64 floor
        admitted(view.decide(ask(tier="enterprise", prompt_tokens=1000, max_tokens=1000)))
    rejected(
        view.decide(ask(tier="enterprise", prompt_tokens=1000, max_tokens=1000)), "concurrency"
    )
    # the floor is the reserved class's only: a standard key of the same limits stops at 16
    other = quota(replace(ENTERPRISE, tpm=10**9))
    admitted(other.decide(ask(prompt_tokens=1000, max_tokens=1000)))
    rejected(other.decide(ask(prompt_tokens=1000, max_tokens=1000)), "concurrency")


# --- stale view ---------------------------------------------------------------------------------


def test_stale_view_fails_open_on_tokens() -> None:
    view = quota(replace(LIMITS, tpm=2_000, kv_gib_seconds=10**6))
    admitted(view.decide(ask(prompt_tokens=900, max_tokens=900)))
    rejected(view.decide(ask(prompt_tokens=900, max_tokens=900)), "tokens")
    admitted(view.decide(ask(prompt_tokens=900, max_tokens=900), stale=True))


def test_stale_view_fails_closed_on_kv_to_the_conservative_cap() -> None:
    limits = replace(LIMITS, tpm=10**9, kv_gib_seconds=1000)
    view = quota(limits, stale_kv_gib_seconds=10)
    admitted(view.decide(ask(prompt_tokens=1000, max_tokens=1000)))
    admitted(view.decide(ask(prompt_tokens=1000, max_tokens=1000)))  # fresh: cap 1000
    refusal = rejected(
        view.decide(ask(prompt_tokens=1000, max_tokens=1000), stale=True), "concurrency"
    )
    assert "stale" in refusal.detail


def test_stale_view_still_honours_the_reserved_floor() -> None:
    view = quota(replace(ENTERPRISE, tpm=10**9), stale_kv_gib_seconds=1)
    for _ in range(6):
        admitted(
            view.decide(ask(tier="enterprise", prompt_tokens=1000, max_tokens=1000), stale=True)
        )


# --- rate-limit figures and Retry-After ---------------------------------------------------------


def test_rate_limits_report_limit_remaining_and_reset() -> None:
    decision = admitted(quota().decide(ask(prompt_tokens=1000, max_tokens=1000)))
    info = decision.rate_limits
    assert (info.limit_requests, info.remaining_requests) == (60, 59)
    assert (info.limit_tokens, info.remaining_tokens) == (10_000, 8_000)
    # 1 request at 1/s refills in 1 s; 2,000 tokens at 10,000/60 per s in 12 s
    assert (info.reset_requests_ms, info.reset_tokens_ms) == (1_000, 12_000)


def test_limits_bind_the_tenant_whatever_key_it_uses() -> None:
    view = quota(replace(LIMITS, rpm=2))
    admitted(view.decide(ask(0, key_id="k1")))
    admitted(view.decide(ask(0, key_id="k2")))
    rejected(view.decide(ask(0, key_id="k3")), "requests")


@pytest.mark.parametrize(("jitter", "expected"), [(0.0, 5), (0.5, 8), (0.999, 10)])
def test_retry_after_is_base_plus_jitter(jitter: float, expected: int) -> None:
    view = quota(replace(LIMITS, tpm=10**9, kv_gib_seconds=1))
    admitted(view.decide(ask(prompt_tokens=1000, max_tokens=1000)))
    refusal = rejected(
        view.decide(ask(prompt_tokens=1000, max_tokens=1000, jitter=jitter)), "concurrency"
    )
    assert refusal.retry_after_s == expected


def test_jitter_outside_unit_interval_is_a_domain_error() -> None:
    with pytest.raises(DomainError):
        quota().decide(ask(jitter=1.0))


# --- retry budget (R6) --------------------------------------------------------------------------


def test_retries_above_20_percent_are_shed_except_enterprise() -> None:
    view = quota(replace(LIMITS, rpm=10**6, tpm=10**9, kv_gib_seconds=10**6))
    for i in range(80):
        admitted(view.decide(ask(i * 0.5, key_id=f"k{i}")))
    for i in range(20):  # 20 retries of 100 seen: exactly 20 %, not above
        admitted(view.decide(ask(40, key_id=f"r{i}", is_retry=True)))
    shed = rejected(view.decide(ask(40, is_retry=True, jitter=0.5)), "retry_budget")
    assert 30 <= shed.retry_after_s <= 60
    assert shed.retry_after_s == 30 + 15
    admitted(view.decide(ask(40, is_retry=True, tier="enterprise")))
    admitted(view.decide(ask(40)))  # first attempts are never shed by the budget
    # a minute later the storm has left the window
    admitted(view.decide(ask(101, is_retry=True)))


def test_retry_budget_needs_volume() -> None:
    view = quota(replace(LIMITS, rpm=10**6, tpm=10**9, kv_gib_seconds=10**6))
    for _ in range(5):
        admitted(view.decide(ask(0, is_retry=True)))


def test_retries_seen_from_other_edges_count_once() -> None:
    view = quota(replace(LIMITS, rpm=10**6, tpm=10**9, kv_gib_seconds=10**6))
    for i in range(30):
        ev = b.rejected(request_id=f"x{i}", is_retry=True)
        view.apply(b.record(ev, seconds=1))
        view.apply(b.record(ev, seconds=1))  # redelivered
    assert view.retry_window() == (30, 30)
    rejected(view.decide(ask(2, is_retry=True)), "retry_budget")


# --- folding: the same view from events, no double counting -------------------------------------


def events_for(rid: str, seconds: float = 0) -> list[Any]:
    return [
        b.record(b.admitted(request_id=rid), version=1, seconds=seconds),
        b.record(
            b.estimated(request_id=rid, reserved_tokens=2000, kv_byte_seconds=kv_of(1000, 1000)),
            version=2,
            seconds=seconds,
        ),
    ]


def test_rebuilt_view_equals_the_live_view() -> None:
    limits = replace(LIMITS, tpm=10**9)
    live = quota(limits)
    rebuilt = quota(limits)
    decision = admitted(live.decide(ask(0, request_id="a", prompt_tokens=1000, max_tokens=1000)))
    assert decision.estimate.kv_byte_seconds == kv_of(1000, 1000)
    records = events_for("a")
    for r in records:
        live.apply(r)  # its own events coming back: already counted
        rebuilt.apply(r)
        rebuilt.apply(r)  # redelivery
    assert live.kv_in_flight(b.TENANT, b.MODEL) == rebuilt.kv_in_flight(b.TENANT, b.MODEL)
    assert live.in_flight() == rebuilt.in_flight()
    a = live.decide(ask(0, prompt_tokens=10, max_tokens=10))
    c = rebuilt.decide(ask(0, prompt_tokens=10, max_tokens=10))
    assert a.rate_limits == c.rate_limits


def test_refund_event_after_local_refund_is_not_counted_twice() -> None:
    view = quota(replace(LIMITS, kv_gib_seconds=10**6))
    admitted(view.decide(ask(0, request_id="a", prompt_tokens=1000, max_tokens=1000)))
    view.refund("a", used_tokens=1000, at=b.at(0))
    after_local = admitted(view.decide(ask(0, prompt_tokens=1, max_tokens=1))).rate_limits
    view.apply(b.record(b.refunded(request_id="a", refunded_tokens=1000), version=4))
    again = admitted(view.decide(ask(0, prompt_tokens=1, max_tokens=1))).rate_limits
    assert again.remaining_tokens == after_local.remaining_tokens - 2


def test_void_undoes_an_admission_refused_by_capacity() -> None:
    view = quota(replace(LIMITS, rpm=1))
    admitted(view.decide(ask(0, request_id="a")))
    view.void("a")
    assert view.kv_in_flight(b.TENANT, b.MODEL) == 0
    admitted(view.decide(ask(0)))  # the request slot came back
    # the capacity rejection's event later changes nothing more
    view.apply(b.record(b.rejected(request_id="a", reason="capacity"), version=3))
    assert len(view.in_flight()) == 1


def test_duplicate_request_id_is_a_domain_error() -> None:
    view = quota()
    admitted(view.decide(ask(0, request_id="a")))
    with pytest.raises(DomainError) as err:
        view.decide(ask(0, request_id="a"))
    assert err.value.rule == "duplicate_request"


def test_estimate_before_admission_is_held_until_it_arrives() -> None:
    view = quota()
    admit, estimate = events_for("a")
    view.apply(estimate)
    assert view.kv_in_flight(b.TENANT, b.MODEL) == 0
    view.apply(admit)
    assert view.kv_in_flight(b.TENANT, b.MODEL) == kv_of(1000, 1000)


def test_works_without_a_resolver_once_a_decision_saw_the_limits() -> None:
    view = Desk(None, AdmissionPolicy())
    assert isinstance(view.decide(ask(0), LIMITS), Admitted)
    for r in events_for("other"):
        view.apply(r)
    assert len(view.in_flight()) == 2


def test_lease_expired_event_releases_kv_and_prune_forgets_finished() -> None:
    view = quota()
    admitted(view.decide(ask(0, request_id="a")))
    view.apply(b.record(b.lease_expired(request_id="a"), version=3, seconds=16))
    assert view.in_flight() == [] and view.kv_in_flight(b.TENANT, b.MODEL) == 0
    assert view.prune(b.at(16 + 601)) == 1


def test_gib() -> None:
    assert GIB == 2**30


def test_prune_forgets_exactly_what_a_full_scan_would() -> None:
    """prune stops at the first request admitted after the horizon; what it forgets must still
    be every finished request older than the tombstone TTL, and nothing else (a long-running
    request admitted early is kept, and pruned once it has finished long enough ago)."""
    view = quota(replace(LIMITS, rpm=10**6, tpm=10**9, kv_gib_seconds=10**6))
    long_running = "r-long"
    admitted(view.decide(ask(0, request_id=long_running)))
    for i in range(1, 50):
        admitted(view.decide(ask(i * 20, request_id=f"r{i}")))
        if i % 7:  # most finish 5 s after admission; every seventh is still running
            view.refund(f"r{i}", 10, b.at(i * 20 + 5))
    ttl = view.tombstone_ttl_s

    def expected_at(t: float) -> set[str]:
        return {
            f"r{i}" for i in range(1, 50) if i % 7 and i * 20 + 5 < t - ttl
        }

    before = set(view._requests)
    t = 30 * 20 + ttl  # the horizon falls mid-history
    assert view.prune(b.at(t)) == len(expected_at(t))
    assert before - set(view._requests) == expected_at(t)
    assert long_running in view._requests and len(view.in_flight()) >= 1

    view.refund(long_running, 10, b.at(t))  # finishes now: forgotten one TTL later
    assert view.prune(b.at(t + 1)) == 0 and long_running in view._requests
    view.prune(b.at(t + ttl + 1))
    assert long_running not in view._requests


# --- output-length prediction -------------------------------------------------------------------


def test_a_prediction_is_what_tokens_and_kv_are_charged_and_the_cap_stays() -> None:
    view = quota(replace(LIMITS, kv_gib_seconds=10**6))
    decision = admitted(
        view.decide(ask(0, prompt_tokens=100, max_tokens=1000, predicted_output_tokens=60,
                        predictor_version="op-1"))
    )
    est = decision.estimate
    assert (est.reserved_output_tokens, est.output_cap_tokens, est.max_output_tokens) == (
        60, 1000, 1000,
    )
    assert est.reserved_tokens == 160 and est.predictor_version == "op-1"
    assert est.kv_byte_seconds == kv_of(100, 60)
    assert decision.rate_limits.remaining_tokens == 10_000 - 160


def test_a_prediction_is_floored_at_min_tokens_and_capped_at_the_output_cap() -> None:
    view = quota(replace(LIMITS, kv_gib_seconds=10**6))
    floored = admitted(view.decide(ask(max_tokens=1000, predicted_output_tokens=60,
                                       min_tokens=200)))
    assert floored.estimate.reserved_output_tokens == 200
    capped = admitted(view.decide(ask(max_tokens=300, predicted_output_tokens=5000,
                                      predictor_version="op-1")))
    # the model was asked (its version is recorded) but the cap is what may be produced
    assert (capped.estimate.reserved_output_tokens, capped.estimate.predictor_version) == (
        300, "op-1",
    )
    zero = admitted(view.decide(ask(max_tokens=300, predicted_output_tokens=0)))
    assert zero.estimate.reserved_output_tokens == 1


def test_without_a_prediction_the_cap_is_reserved_and_no_version_recorded() -> None:
    est = admitted(quota().decide(ask(max_tokens=500, predictor_version="op-1"))).estimate
    assert (est.reserved_output_tokens, est.output_cap_tokens, est.predictor_version) == (
        500, 500, "",
    )


def test_a_prediction_admits_what_the_cap_would_refuse() -> None:
    roomy = replace(LIMITS, kv_gib_seconds=10**6)
    with_cap, predicted = quota(roomy), quota(roomy)
    for _ in range(9):
        admitted(with_cap.decide(ask(0, prompt_tokens=100, max_tokens=1000)))
    rejected(with_cap.decide(ask(0, prompt_tokens=100, max_tokens=1000)), "tokens")
    for _ in range(9):
        admitted(predicted.decide(ask(0, prompt_tokens=100, max_tokens=1000,
                                      predicted_output_tokens=100)))
    admitted(predicted.decide(ask(0, prompt_tokens=100, max_tokens=1000,
                                  predicted_output_tokens=100)))


def test_under_prediction_is_charged_at_the_refund_and_the_bucket_recovers() -> None:
    view = quota(replace(LIMITS, kv_gib_seconds=10**6))
    admitted(view.decide(ask(0, request_id="a", prompt_tokens=100, max_tokens=1000,
                             predicted_output_tokens=100)))
    # it produced 900 output tokens, 800 beyond its reservation of 200: those are charged now
    view.refund("a", used_tokens=1000, at=b.at(0))
    after = admitted(view.decide(ask(0, prompt_tokens=1, max_tokens=1))).rate_limits
    assert after.remaining_tokens == 10_000 - 1000 - 2


def test_the_overage_can_take_the_bucket_below_zero_then_it_refills() -> None:
    view = quota(replace(LIMITS, tpm=1000, kv_gib_seconds=10**6))
    admitted(view.decide(ask(0, request_id="a", prompt_tokens=100, max_tokens=800,
                             predicted_output_tokens=50)))
    view.refund("a", used_tokens=1500, at=b.at(0))  # 1,350 more than the 150 it reserved
    # 1000 − 1500 = −500 left: 2 tokens need 502, i.e. 30.12 s of refill at 1000/min
    refusal = rejected(view.decide(ask(0, prompt_tokens=1, max_tokens=1)), "tokens")
    assert refusal.rate_limits.remaining_tokens == 0
    rejected(view.decide(ask(30, prompt_tokens=1, max_tokens=1)), "tokens")
    admitted(view.decide(ask(31, prompt_tokens=1, max_tokens=1)))


def test_the_folded_view_charges_the_overage_as_the_edge_did() -> None:
    limits = replace(LIMITS, kv_gib_seconds=10**6)
    live, rebuilt = quota(limits), quota(limits)
    admitted(live.decide(ask(0, request_id="req-1", prompt_tokens=800, max_tokens=1000,
                             predicted_output_tokens=100)))
    live.refund("req-1", used_tokens=812 + 300, at=b.at(1))  # 212 above the 900 reserved
    estimated = b.estimated(reserved_output_tokens=100, reserved_tokens=900)
    for r in (
        b.record(b.admitted(), version=1),
        b.record(estimated, version=2),
        b.record(b.completed(), version=3, seconds=1),  # 812 prompt + 300 completion
        b.record(b.refunded(refunded_tokens=0), version=4, seconds=1),
    ):
        live.apply(r)
        rebuilt.apply(r)
        rebuilt.apply(r)
    a = live.decide(ask(1, prompt_tokens=1, max_tokens=1)).rate_limits
    c = rebuilt.decide(ask(1, prompt_tokens=1, max_tokens=1)).rate_limits
    assert a == c and c.remaining_tokens == 10_000 - 1112 - 2 + 166  # and 1 s of refill
