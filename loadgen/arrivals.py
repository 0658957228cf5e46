"""Arrival processes for open-loop load: the gaps between request starts.

- Poisson: exponential gaps at rate R (memoryless, the textbook open-loop load).
- Bursty: a two-state Markov-modulated Poisson process. Bursts last Exp(burst_mean_s) and take
  `burst_fraction` of the time on average; inside a burst the rate is `burst` x R, outside it is
  lowered so that the long-run mean stays R. Counts per window are over-dispersed (variance above
  the mean), which is what fills the KV cache in real traffic (seed 002 §7: "bursty arrivals").
"""

from __future__ import annotations

import math
import random


class Poisson:
    def __init__(self, rate: float, rng: random.Random) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = rate
        self.rng = rng

    def next_gap(self) -> float:
        return self.rng.expovariate(self.rate)


class Bursty:
    def __init__(self, rate: float, rng: random.Random, burst: float = 4.0,
                 burst_fraction: float = 0.1, burst_mean_s: float = 2.0) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        if not 0 < burst_fraction < 1 or burst < 1 or burst * burst_fraction > 1:
            raise ValueError("need 0 < burst_fraction < 1, burst >= 1, burst*fraction <= 1")
        self.rng = rng
        self.rate = rate
        self.high = rate * burst
        self.low = rate * (1 - burst * burst_fraction) / (1 - burst_fraction)
        self.mean_on = burst_mean_s
        self.mean_off = burst_mean_s * (1 - burst_fraction) / burst_fraction
        self.in_burst = rng.random() < burst_fraction
        self.left = rng.expovariate(1 / (self.mean_on if self.in_burst else self.mean_off))

    def next_gap(self) -> float:
        gap = 0.0
        while True:
            rate = self.high if self.in_burst else self.low
            candidate = self.rng.expovariate(rate) if rate > 0 else math.inf
            if candidate < self.left:  # an arrival before the state changes
                self.left -= candidate
                return gap + candidate
            gap += self.left  # memoryless: switch state and draw again
            self.in_burst = not self.in_burst
            self.left = self.rng.expovariate(1 / (self.mean_on if self.in_burst else self.mean_off))


def make_arrivals(kind: str, rate: float, rng: random.Random, burst: float = 4.0,
                  burst_fraction: float = 0.1, burst_mean_s: float = 2.0) -> Poisson | Bursty:
    if kind == "poisson" or burst <= 1:
        return Poisson(rate, rng)
    if kind == "bursty":
        return Bursty(rate, rng, burst, burst_fraction, burst_mean_s)
    raise ValueError(f"unknown arrival process {kind!r}")


def arrival_times(process: Poisson | Bursty, horizon_s: float) -> list[float]:
    """Arrival instants in [0, horizon_s) (for tests and plans)."""
    out, t = [], 0.0
    while True:
        t += process.next_gap()
        if t >= horizon_s:
            return out
        out.append(t)
