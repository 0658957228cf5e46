"""The autoscaling signal on a fluid model of a fleet: under a ramp it asks for a replica at
least one cold start before a replica would cross 0.85 KV occupancy; under a flat load it does not
flap; it scales down only after the cool-down, one replica at a time."""

from __future__ import annotations

import pytest

from tollgate_llm.domain.autoscale import Autoscaler, FleetSample, ScalePolicy
from tollgate_llm.domain.errors import DomainError

CAPACITY = 100_000  # KV tokens per replica
TOKENS_S_PER_REQUEST = 20_000.0  # KV token·s one request holds: by Little's law, held = rate × it


def held(rate: float) -> float:
    return rate * TOKENS_S_PER_REQUEST


def sample(t: float, rate: float, replicas: int) -> FleetSample:
    return FleetSample(
        at_s=t, replicas=replicas, kv_capacity_tokens=CAPACITY, kv_used_tokens=int(held(rate))
    )


def ramp_lead(policy: ScalePolicy, slope: float) -> float:
    """Seconds between the signal's first ask for a third replica and the instant the two it has
    would cross 0.85 occupancy, under arrivals growing by `slope` requests/s every second."""
    scaler = Autoscaler(policy)
    first_ask = crossing = None
    t = 0
    while crossing is None:
        t += 1
        rate = 1.0 + slope * t
        terms = scaler.observe(sample(float(t), rate, 2))
        if first_ask is None and terms.desired_replicas > 2:
            first_ask = t
        if held(rate) / (2 * CAPACITY) >= 0.85:
            crossing = t
    assert first_ask is not None, "the signal never asked"
    return crossing - first_ask


@pytest.mark.parametrize("slope", [0.004, 0.02, 0.05])
def test_under_a_ramp_it_asks_a_cold_start_before_occupancy_crosses_085(slope: float) -> None:
    # From 1 request/s, the two replicas reach 0.85 at 8.5 requests/s: after 1,875 s, 375 s and
    # 150 s of these ramps. (A surge that gets there sooner than one cold start after it begins
    # cannot be led by a whole cold start: the signal asks as soon as its trend shows — 33 s
    # ahead for a ramp that takes 37 s.)
    policy = ScalePolicy(cold_start_s=60)
    assert ramp_lead(policy, slope) >= policy.cold_start_s


def test_without_the_trend_a_steep_ramp_is_seen_too_late() -> None:
    # The same ramp with the forecast's trend term smoothed away: the target occupancy's
    # margin alone does not buy a cold start, which is what the forecast is for.
    no_trend = ScalePolicy(cold_start_s=60, trend_smoothing=1e-9)
    assert ramp_lead(no_trend, 0.05) < no_trend.cold_start_s


def test_closed_loop_a_ramp_never_pushes_a_replica_past_085() -> None:
    policy = ScalePolicy(cold_start_s=60)
    scaler = Autoscaler(policy)
    running, starting = 2, []  # replicas serving; (ready_at) of those asked for
    peak = 0.0
    for t in range(1, 1800):
        running += sum(1 for ready in starting if ready <= t)
        starting = [ready for ready in starting if ready > t]
        rate = 1.0 + 0.004 * t
        peak = max(peak, held(rate) / (running * CAPACITY))
        desired = scaler.observe(sample(float(t), rate, running + len(starting))).desired_replicas
        for _ in range(desired - running - len(starting)):
            starting.append(t + int(policy.cold_start_s))
    assert running > 2 and peak < 0.85, (running, peak)


def test_a_flat_load_does_not_flap() -> None:
    scaler = Autoscaler(ScalePolicy(cold_start_s=60))
    seen = [scaler.observe(sample(float(t), 5.0, 2)).desired_replicas for t in range(1, 1200)]
    changes = sum(1 for a, b in zip(seen, seen[1:], strict=False) if a != b)
    assert changes <= 1, seen[:50]  # at most the first settle onto the load


def test_it_scales_down_only_after_the_cool_down_one_replica_at_a_time() -> None:
    policy = ScalePolicy(cold_start_s=10, scale_down_after_s=60)
    scaler = Autoscaler(policy)
    for t in range(1, 600):  # long enough for the calibration and hysteresis to settle
        terms = scaler.observe(sample(float(t), 8.0, 4))
    high = terms.desired_replicas
    assert terms.raw_replicas == high
    downs = []
    for t in range(600, 900):
        desired = scaler.observe(sample(float(t), 0.5, high)).desired_replicas
        if desired < high:
            downs.append((t, desired))
            high = desired
    assert downs and downs[0][0] >= 600 + policy.scale_down_after_s
    steps = [b - a for (a, _), (b, _) in zip(downs, downs[1:], strict=False)]
    assert all(step >= policy.scale_down_after_s for step in steps)
    assert [d for _, d in downs] == list(range(downs[0][1], downs[0][1] - len(downs), -1))


def test_reserved_replicas_waiting_and_deferred_work_are_terms() -> None:
    scaler = Autoscaler(ScalePolicy())
    quiet = FleetSample(1.0, 3, CAPACITY, 0, reserved_only=2)
    assert scaler.observe(quiet).desired_replicas == 3  # never below what runs at the start
    busy = Autoscaler(ScalePolicy(min_replicas=1))
    terms = busy.observe(FleetSample(1.0, 1, CAPACITY, 0, waiting_tokens=140_000,
                                     deferred_tokens=70_000, reserved_only=1))
    assert terms.needed_tokens == 210_000 and terms.raw_replicas == 1 + 3


def test_samples_must_move_forward() -> None:
    scaler = Autoscaler()
    scaler.observe(sample(5.0, 1.0, 1))
    with pytest.raises(DomainError):
        scaler.observe(sample(5.0, 1.0, 1))


def test_an_unevenly_loaded_fleet_is_planned_for_its_fullest_replica() -> None:
    even, uneven = Autoscaler(ScalePolicy()), Autoscaler(ScalePolicy())
    for t in range(1, 120):  # 2 replicas holding 120k tokens: 60k each, or 90k and 30k
        a = even.observe(FleetSample(float(t), 2, CAPACITY, 120_000, peak_used_tokens=60_000))
        b = uneven.observe(FleetSample(float(t), 2, CAPACITY, 120_000, peak_used_tokens=90_000))
    assert a.peak_ratio == 1.0 and a.desired_replicas == 2
    assert b.peak_ratio > 1.45 and b.desired_replicas == 3
