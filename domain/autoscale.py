"""How many replicas a model version should have, ahead of the load (seed 000 §9, seed 002:
"scale ahead of demand using traffic forecasts").

Every step the fleet of one model is sampled (`FleetSample`): the KV-cache tokens its replicas
hold, what waits at the engines, what is reserved and what is deferred. Holt's linear trend
(double exponential smoothing: a level and a trend) forecasts the tokens held one replica cold
start ahead (seed 000: 30–90 s to load weights), so a replica asked for now serves before the
load it was asked for arrives.

What is forecast is the KV held, measured, not arrivals × the estimated KV·s per request: the
held tokens are the quantity that crosses a replica's ceiling, they average over every request
in flight (so a step's sample is not the noise of a few arrivals, which a 60-step-ahead trend
amplifies), and they carry none of the estimates' bias (admission reserves the whole output
at a clamped TPOT, 2–10× what a request holds, by a factor that moves with the traffic mix).
Holt was chosen over a seasonal model because the horizon (a minute or two) is far shorter
than any daily cycle, and over a moving average because a ramp is exactly what it must see early.

Replicas are not evenly loaded (a router balances on what each holds now, not on what its
requests will grow to), and the fullest one reaches the ceiling first: the forecast is scaled
by the fleet's peak-to-mean occupancy, smoothed, so the plan is for the fullest replica.

Desired = the reserved-only replicas (never spare for other traffic) + what the forecast,
the waiting and the deferred work need at the target occupancy, at least `min_replicas`.
Hysteresis: more replicas are asked for at once; fewer only after the need stayed below the
current count for `scale_down_after_s`, one at a time, so the signal does not flap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from tollgate_llm.domain.errors import DomainError

__all__ = ["Autoscaler", "FleetSample", "ScalePolicy", "ScaleTerms"]

PPM: Final = 1_000_000


@dataclass(frozen=True, slots=True)
class ScalePolicy:
    # Plan replicas to hold this much KV: under the standard tier's 0.85 admission ceiling, with
    # room for the forecast's error.
    target_occupancy_ppm: int = 700_000
    cold_start_s: float = 60.0
    scale_down_after_s: float = 120.0
    min_replicas: int = 1
    step_s: float = 1.0
    level_smoothing: float = 0.3  # Holt's alpha
    trend_smoothing: float = 0.05  # Holt's beta
    peak_smoothing: float = 0.1  # of the peak-to-mean occupancy ratio

    def __post_init__(self) -> None:
        if not 0 < self.target_occupancy_ppm <= PPM:
            raise DomainError("bad_policy", "target occupancy must be within (0, 1]")
        if self.step_s <= 0 or self.cold_start_s < 0 or self.scale_down_after_s < 0:
            raise DomainError("bad_policy", "step, cold start and cool-down must be >= 0")
        for alpha in (self.level_smoothing, self.trend_smoothing, self.peak_smoothing):
            if not 0 < alpha <= 1:
                raise DomainError("bad_policy", "smoothing factors must be within (0, 1]")


@dataclass(frozen=True, slots=True)
class FleetSample:
    """One model's fleet at one step. Tokens are KV-cache tokens."""

    at_s: float
    replicas: int  # replicas serving the model now
    kv_capacity_tokens: int  # per replica
    kv_used_tokens: int  # held across the replicas now (scraped occupancy × capacity)
    peak_used_tokens: int | None = None  # held by the fullest replica (None: as the mean)
    waiting_tokens: int = 0  # requests queued at the engines (admitted, not yet running)
    reserved_only: int = 0  # replicas only the reserved class may enter
    deferred_tokens: int = 0  # flex / batch work held back for idle capacity
    starting: int = 0  # replicas asked for that do not serve yet


@dataclass(frozen=True, slots=True)
class ScaleTerms:
    """The signal and the terms that produced it (GET /v1/fleet shows them)."""

    at_s: float
    held_tokens: int  # measured now
    level_tokens: float
    trend_tokens_per_s: float
    forecast_tokens: float  # held one cold start ahead
    peak_ratio: float  # the fullest replica over the mean, smoothed
    waiting_tokens: int  # queued at the engines
    deferred_tokens: int  # batch work still to run
    needed_tokens: float  # max(forecast, held now) + waiting + deferred
    raw_replicas: int  # what the demand needs, before hysteresis
    desired_replicas: int


class Autoscaler:
    """The signal for one model version. Pure: every instant arrives with the sample."""

    def __init__(self, policy: ScalePolicy | None = None) -> None:
        self.policy = policy or ScalePolicy()
        self._level: float | None = None
        self._trend = 0.0
        self._peak_ratio = 1.0
        self._last_at: float | None = None
        self._desired: int | None = None
        self._below_since: float | None = None
        self.terms: ScaleTerms | None = None

    def observe(self, sample: FleetSample) -> ScaleTerms:
        p = self.policy
        if self._last_at is not None and sample.at_s <= self._last_at:
            raise DomainError("stale_sample", "fleet samples must move forward in time")
        self._last_at = sample.at_s
        held = float(sample.kv_used_tokens)
        if self._level is None:
            self._level = held
        else:
            previous = self._level
            a, b = p.level_smoothing, p.trend_smoothing
            self._level = a * held + (1 - a) * (previous + self._trend)
            self._trend = b * (self._level - previous) + (1 - b) * self._trend
        if sample.peak_used_tokens is not None and held > 0 and sample.replicas > 0:
            mean = held / sample.replicas
            ratio = min(float(sample.replicas), max(1.0, sample.peak_used_tokens / mean))
            c = p.peak_smoothing
            self._peak_ratio = c * ratio + (1 - c) * self._peak_ratio
        ahead = p.cold_start_s / p.step_s
        forecast = max(0.0, self._level + self._trend * ahead)
        needed = (
            max(forecast, held) * self._peak_ratio + sample.waiting_tokens + sample.deferred_tokens
        )
        per_replica = sample.kv_capacity_tokens * p.target_occupancy_ppm / PPM
        shared = -int(-needed // per_replica) if per_replica > 0 else 0
        raw = max(p.min_replicas, sample.reserved_only + shared)
        desired = self._hysteresis(raw, sample)
        self.terms = ScaleTerms(
            at_s=sample.at_s,
            held_tokens=sample.kv_used_tokens,
            level_tokens=self._level,
            trend_tokens_per_s=self._trend / p.step_s,
            forecast_tokens=forecast,
            peak_ratio=self._peak_ratio,
            waiting_tokens=sample.waiting_tokens,
            deferred_tokens=sample.deferred_tokens,
            needed_tokens=needed,
            raw_replicas=raw,
            desired_replicas=desired,
        )
        return self.terms

    def _hysteresis(self, raw: int, sample: FleetSample) -> int:
        current = self._desired
        if current is None:
            # Start from what runs: a fresh signal must not ask to remove a live fleet at once.
            current = max(raw, sample.replicas + sample.starting)
        if raw >= current:
            self._below_since = None
            self._desired = raw
            return raw
        if self._below_since is None:
            self._below_since = sample.at_s
        if sample.at_s - self._below_since >= self.policy.scale_down_after_s:
            self._below_since = sample.at_s  # the next step down waits a whole cool-down again
            current -= 1
        self._desired = current
        return current
