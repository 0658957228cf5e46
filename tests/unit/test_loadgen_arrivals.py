"""Open-loop arrival processes: Poisson and the bursty (Markov-modulated) one."""

from __future__ import annotations

import random
import statistics

import pytest

from tollgate_llm.loadgen.arrivals import Bursty, Poisson, arrival_times, make_arrivals


def counts_per_window(times: list[float], horizon: float, window: float) -> list[int]:
    n = int(horizon / window)
    counts = [0] * n
    for t in times:
        i = int(t / window)
        if i < n:
            counts[i] += 1
    return counts


def test_poisson_rate_and_dispersion() -> None:
    times = arrival_times(Poisson(20.0, random.Random(1)), 2_000.0)
    assert len(times) / 2_000.0 == pytest.approx(20.0, rel=0.02)
    counts = counts_per_window(times, 2_000.0, 1.0)
    # Poisson: variance equals the mean (index of dispersion 1)
    assert statistics.pvariance(counts) / statistics.mean(counts) == pytest.approx(1.0, abs=0.12)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(1 / 20.0, rel=0.03)


def test_bursty_keeps_the_mean_rate_but_is_overdispersed() -> None:
    process = Bursty(20.0, random.Random(2), burst=4.0, burst_fraction=0.1, burst_mean_s=2.0)
    times = arrival_times(process, 4_000.0)
    assert len(times) / 4_000.0 == pytest.approx(20.0, rel=0.05)
    counts = counts_per_window(times, 4_000.0, 1.0)
    dispersion = statistics.pvariance(counts) / statistics.mean(counts)
    assert dispersion > 3.0  # bursts: far more variable than Poisson
    assert max(counts) > 60  # inside a burst the rate reaches ~4x


def test_bursty_rates() -> None:
    b = Bursty(10.0, random.Random(0), burst=4.0, burst_fraction=0.2)
    assert b.high == pytest.approx(40.0)
    # 0.2 * 40 + 0.8 * low = 10
    assert 0.2 * b.high + 0.8 * b.low == pytest.approx(10.0)


def test_same_seed_same_arrivals() -> None:
    a = arrival_times(make_arrivals("bursty", 5.0, random.Random(9)), 100.0)
    b = arrival_times(make_arrivals("bursty", 5.0, random.Random(9)), 100.0)
    assert a == b


@pytest.mark.parametrize("kwargs", [
    {"burst": 0.5}, {"burst_fraction": 0.0}, {"burst": 20.0, "burst_fraction": 0.1},
])
def test_bursty_refuses_impossible_parameters(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Bursty(1.0, random.Random(0), **kwargs)
