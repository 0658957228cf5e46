"""Output-length prediction at admission (DESIGN §5 "Output-length prediction", issue 18): the
features a prediction may use, the per-tenant history they are drawn from, the exported
model's arithmetic, and the online safety net that turns it off for a tenant whose realised
coverage falls short.

Pure: the trained weights arrive as numbers (`predictor/` trains them with torch and loads the
exported file); nothing here imports torch, reads a clock or keeps more than a bounded window.

No tenant's data reaches another tenant's prediction: the shared weights see only coarse
features of the request itself (sizes, hour) and statistics of the *same* tenant's own recent
outputs; the per-tenant parameters (a calibration scale and offset, and the online adjustment
of `Forecaster`) are learned from that tenant alone and used only for it. The system prompt
enters as a bucket of a hash keyed by the tenant, so the same bucket number means unrelated
prompts for two tenants, and only the tenant's own history of that bucket is ever read.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from operator import mul
from typing import Final, Literal

__all__ = [
    "FEATURES",
    "SYSTEM_PROMPT_BUCKETS",
    "CoverageTracker",
    "ExportedModel",
    "Forecaster",
    "History",
    "Layer",
    "Prediction",
    "RequestShape",
    "Skip",
]

SYSTEM_PROMPT_BUCKETS: Final = 64
# The features, in the order the model reads them. Log sizes are scaled to about [0, 1].
FEATURES: Final = (
    "log_prompt_tokens",  # ln(1 + prompt) / 10
    "log_output_cap_tokens",  # ln(1 + min(max_tokens, max_output)) / 10
    "log_message_count",  # ln(1 + messages) / 5
    "hour_sin",  # hour of the day (UTC), on the circle
    "hour_cos",
    "has_system_prompt",
    "tenant_mean",  # the tenant's (and model's) recent outputs: mean of ln(1 + out) / 10
    "tenant_std",  # ... and their spread
    "bucket_mean",  # the same for this system-prompt bucket (the tenant's mean when unseen)
    "bucket_weight",  # min(seen, 20) / 20: how much the bucket mean is worth
    "key_mean",  # the same for this API key (the tenant's mean when unseen)
    # The tenant's own recent outputs regressed on its prompt sizes (least squares over the
    # same window), read at this request's prompt: where a tenant's answers follow its prompts
    # (summaries of documents) this is the answer's expected size, where they do not (chat) it
    # is the tenant's mean. The shared weights cannot learn that per tenant from the raw size.
    "tenant_prompt_fit",
    "tenant_prompt_fit_std",  # ... and the spread of the tenant's outputs around that fit
)
_LOG_SCALE: Final = 10.0
_HISTORY_WINDOW: Final = 256  # recent outputs kept per (tenant, model)
# Per bucket and per key: about the last 65 answers. At 0.1 (~20) the averages were noisy
# enough that the model's errors came in runs, and held-out coverage of one tenant fell to
# 0.91-0.92 where this gives 0.93.
_EWMA_ALPHA: Final = 0.03
_BUCKET_FULL: Final = 20
_MAX_SLOPE: Final = 2.0  # of the prompt fit: answers growing faster than prompt² are noise

Skip = Literal["no_model", "unknown_tenant", "little_history", "low_coverage"]


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What admission knows of a request before it runs (never its text)."""

    tenant_id: str
    key_id: str
    model: str
    prompt_tokens: int
    output_cap_tokens: int  # min(max_tokens, max_output)
    message_count: int
    system_prompt_bucket: int  # -1: no system prompt
    at: datetime


@dataclass(frozen=True, slots=True)
class Prediction:
    output_tokens: int
    model_version: str


# --- the tenant's own recent history ---------------------------------------------------------


class _Ewma:
    __slots__ = ("mean", "seen")

    def __init__(self) -> None:
        self.mean = 0.0
        self.seen = 0

    def add(self, value: float) -> None:
        self.seen += 1
        # The first values are averaged plainly, so a young mean is not dominated by its seed.
        alpha = max(_EWMA_ALPHA, 1.0 / self.seen)
        self.mean += alpha * (value - self.mean)


class _Window:
    """The last `_HISTORY_WINDOW` (x, y) pairs of a (tenant, model): y the log output, x the log
    prompt size, with running sums for their moments."""

    __slots__ = ("values", "total", "squares", "xs", "xy", "xx", "_stats")

    def __init__(self) -> None:
        self.values: deque[tuple[float, float]] = deque()
        self.total = 0.0
        self.squares = 0.0
        self.xs = 0.0
        self.xy = 0.0
        self.xx = 0.0
        self._stats: tuple[float, float, float, float, float] | None = None

    def add(self, value: float, x: float = 0.0) -> None:
        self._stats = None
        values = self.values
        if len(values) == _HISTORY_WINDOW:
            old, old_x = values.popleft()
            self.total -= old
            self.squares -= old * old
            self.xs -= old_x
            self.xy -= old_x * old
            self.xx -= old_x * old_x
        values.append((value, x))
        self.total += value
        self.squares += value * value
        self.xs += x
        self.xy += x * value
        self.xx += x * x

    def stats(self) -> tuple[float, float, float, float, float]:
        """(mean, standard deviation, mean x, slope on x, residual standard deviation), kept
        until the next value: requests far outnumber the answers that change them."""
        found = self._stats
        if found is None:
            n = len(self.values)
            mean = self.total / n
            var = max(0.0, self.squares / n - mean * mean)
            mean_x = self.xs / n
            var_x = self.xx / n - mean_x * mean_x
            slope = 0.0
            if var_x > 1e-6:  # prompts that vary: about 1 % in size, or more
                cov = self.xy / n - mean_x * mean
                slope = min(_MAX_SLOPE, max(-_MAX_SLOPE, cov / var_x))
            residual = max(0.0, var - slope * slope * max(0.0, var_x))
            found = self._stats = (mean, math.sqrt(var), mean_x, slope, math.sqrt(residual))
        return found


class History:
    """Each tenant's recent output lengths: a window per (tenant, model), a moving average per
    (tenant, model, system-prompt bucket) and per (tenant, key). Fed with the engine's count of
    every completed request; bounded by the tenants, models, buckets and keys that exist.

    Training replays the log through this same class, in the same order (a request's features
    are taken at its admission, its output is seen at its end), so the model learns from
    exactly what the edge will compute."""

    def __init__(self, min_history: int = 20) -> None:
        self.min_history = min_history
        self._tenants: dict[tuple[str, str], _Window] = {}
        self._buckets: dict[tuple[str, str, int], _Ewma] = {}
        self._keys: dict[tuple[str, str], _Ewma] = {}

    def observe(
        self, tenant_id: str, key_id: str, model: str, system_prompt_bucket: int,
        output_tokens: int, *, prompt_tokens: int = 0,
    ) -> None:
        """One completed request: its engine output count, and the prompt size its shape had
        at admission (the estimate the features read, not the engine's count)."""
        value = math.log1p(max(0, output_tokens)) / _LOG_SCALE
        window = self._tenants.get((tenant_id, model))
        if window is None:
            window = self._tenants[(tenant_id, model)] = _Window()
        window.add(value, math.log1p(max(0, prompt_tokens)) / _LOG_SCALE)
        bucket = self._buckets.get((tenant_id, model, system_prompt_bucket))
        if bucket is None:
            bucket = self._buckets[(tenant_id, model, system_prompt_bucket)] = _Ewma()
        bucket.add(value)
        key = self._keys.get((tenant_id, key_id))
        if key is None:
            key = self._keys[(tenant_id, key_id)] = _Ewma()
        key.add(value)

    def seen(self, tenant_id: str, model: str) -> int:
        window = self._tenants.get((tenant_id, model))
        return 0 if window is None else len(window.values)

    def features(self, shape: RequestShape) -> list[float] | None:
        """The feature vector of `shape` (in `FEATURES` order), or None when the tenant has
        fewer than `min_history` recent outputs for the model."""
        window = self._tenants.get((shape.tenant_id, shape.model))
        if window is None or len(window.values) < self.min_history:
            return None
        tenant_mean, tenant_std, mean_x, slope, fit_std = window.stats()
        x = math.log1p(max(0, shape.prompt_tokens)) / _LOG_SCALE
        bucket = self._buckets.get((shape.tenant_id, shape.model, shape.system_prompt_bucket))
        if bucket is None:
            bucket_mean, bucket_weight = tenant_mean, 0.0
        else:
            bucket_mean = bucket.mean
            bucket_weight = min(bucket.seen, _BUCKET_FULL) / _BUCKET_FULL
        key = self._keys.get((shape.tenant_id, shape.key_id))
        # By the hour: finer, and a model trained on a few hours of log would learn the
        # minute as a proxy for *when* it was trained, which says nothing of tomorrow.
        angle = shape.at.hour * (2 * math.pi / 24)
        return [
            x,
            math.log1p(max(0, shape.output_cap_tokens)) / _LOG_SCALE,
            math.log1p(max(0, shape.message_count)) / 5.0,
            math.sin(angle),
            math.cos(angle),
            1.0 if shape.system_prompt_bucket >= 0 else 0.0,
            tenant_mean,
            tenant_std,
            bucket_mean,
            bucket_weight,
            tenant_mean if key is None else key.mean,
            tenant_mean + slope * (x - mean_x),
            fit_std,
        ]


# --- the exported model ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Layer:
    """y = W·x + b, ReLU on every layer but the last. `weights` is one row per output."""

    weights: tuple[tuple[float, ...], ...]
    bias: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class ExportedModel:
    """A trained quantile model as plain arithmetic: layers over `FEATURES` (one: linear in log
    space; more: ReLU between them) whose output is ln(1 + output tokens) / 10 at the
    `quantile`, and each tenant's calibration: the tenant's quantile is `scale × output +
    offset` (same units; a tenant without a scale has 1). A tenant without an offset was not
    calibrated: no prediction. The scale lets one tenant lean on the shared score less than
    another: where nothing in a request's shape tells its answer (an agent's step), the best
    p95 is nearly the tenant's own constant p95, scale ≈ 0.

    Evaluating it is C-level `sum(map(mul, ...))` calls, one per unit: about a microsecond for
    the linear model, ten for 16 hidden units (bench/output_prediction.py times the whole
    `predict`), so admission never needs torch."""

    version: str
    quantile: float
    layers: tuple[Layer, ...]
    tenant_offsets: Mapping[str, float]
    features: tuple[str, ...] = FEATURES
    tenant_scales: Mapping[str, float] = field(default_factory=dict)
    # (row, bias) pairs per hidden layer, and the last layer's: laid out once, read per call.
    _hidden: tuple[tuple[tuple[tuple[float, ...], float], ...], ...] = field(
        init=False, repr=False, compare=False
    )
    _last: tuple[tuple[float, ...], float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if tuple(self.features) != FEATURES:
            raise ValueError(f"model features {self.features} are not this code's {FEATURES}")
        width = len(FEATURES)
        for i, layer in enumerate(self.layers):
            if len(layer.weights) != len(layer.bias) or any(
                len(row) != width for row in layer.weights
            ):
                raise ValueError(f"layer {i} does not take {width} inputs")
            width = len(layer.bias)
        if width != 1:
            raise ValueError("the last layer has one output")
        pairs = [tuple(zip(la.weights, la.bias, strict=True)) for la in self.layers]
        object.__setattr__(self, "_hidden", tuple(pairs[:-1]))
        object.__setattr__(self, "_last", pairs[-1][0])

    def score(self, features: Sequence[float]) -> float:
        """The network's output for `features`, before any tenant's offset."""
        xs: Sequence[float] = features
        for pairs in self._hidden:
            xs = [h if (h := sum(map(mul, row, xs), b)) > 0.0 else 0.0 for row, b in pairs]
        row, b = self._last
        return sum(map(mul, row, xs), b)

    def output_tokens(
        self, tenant_id: str, features: Sequence[float], adjustment: float = 0.0
    ) -> int | None:
        """The tenant's quantile, its offset (plus an online `adjustment`, same units)
        applied; None for a tenant the model has no offset for."""
        offset = self.tenant_offsets.get(tenant_id)
        if offset is None:
            return None
        scale = self.tenant_scales.get(tenant_id, 1.0)
        scaled = (scale * self.score(features) + offset + adjustment) * _LOG_SCALE
        if scaled > 20.0:  # e^20 tokens: beyond any cap; the cap decides
            return 1 << 30
        # Rounded up, less a hair: expm1(log1p(n)) may come back as n + 1e-13.
        return max(1, math.ceil(math.expm1(scaled) - 1e-9))


# --- the online safety net -------------------------------------------------------------------


@dataclass(slots=True)
class _Coverage:
    outcomes: deque[bool] = field(default_factory=deque)
    covered: int = 0
    fallen_back: bool = False


class CoverageTracker:
    """Realised coverage per tenant: the share of its last `window` completed, predicted
    requests whose engine count was at most the output reserved for them. Once it falls below
    `target − margin` (with at least `min_samples` seen), the tenant falls back to reserving its
    cap until the model is replaced (`reset`): a model that no longer fits a tenant is not
    trusted again on the strength of a few lucky requests."""

    def __init__(
        self, target: float, *, margin: float = 0.03, window: int = 500, min_samples: int = 100
    ) -> None:
        if not 0.0 < target < 1.0:
            raise ValueError("the target quantile is in (0, 1)")
        self.target = target
        self.margin = margin
        self.window = window
        self.min_samples = min(min_samples, window)
        self._tenants: dict[str, _Coverage] = {}

    def observe(self, tenant_id: str, reserved_output_tokens: int, output_tokens: int) -> None:
        c = self._tenants.get(tenant_id)
        if c is None:
            c = self._tenants[tenant_id] = _Coverage()
        hit = output_tokens <= reserved_output_tokens
        c.outcomes.append(hit)
        c.covered += hit
        if len(c.outcomes) > self.window:
            c.covered -= c.outcomes.popleft()
        if (
            not c.fallen_back
            and len(c.outcomes) >= self.min_samples
            and c.covered < (self.target - self.margin) * len(c.outcomes)
        ):
            c.fallen_back = True

    def falling_back(self, tenant_id: str) -> bool:
        c = self._tenants.get(tenant_id)
        return c is not None and c.fallen_back

    def coverage(self, tenant_id: str) -> tuple[float, int] | None:
        """(realised coverage, requests it is over), or None before any."""
        c = self._tenants.get(tenant_id)
        if c is None or not c.outcomes:
            return None
        return c.covered / len(c.outcomes), len(c.outcomes)

    def tenants(self) -> list[str]:
        return sorted(self._tenants)

    def reset(self) -> None:
        """A new model: every tenant starts again from nothing."""
        self._tenants.clear()


# --- the whole rule --------------------------------------------------------------------------


# Online calibration step, in the model's units (ln(1 + tokens) / 10): a miss raises the
# tenant's prediction by 0.95 × 0.05 in ln (~5 %), a covered request lowers it by 0.05 × that.
ADJUST_STEP: Final = 0.005
ADJUST_BOUND: Final = 0.1  # at most ×e (or ÷e) from what training calibrated


class Forecaster:
    """Whether and what to predict for one request: a prediction when a model is loaded, knows
    the tenant, the tenant has enough history and its realised coverage holds; otherwise the
    reason it is skipped (the request then reserves its cap). `observe` feeds both the history
    and the coverage with each completed request's engine count.

    Each tenant's calibration is also kept up online (adaptive conformal inference): every
    predicted request that completes moves that tenant's adjustment by `step × (miss − (1 −
    q))`, up by a miss and down a little by a covered answer, so that over any long stretch its
    realised coverage converges to the quantile q: no less (a model drifting away from a
    tenant is corrected before the coverage fallback has to latch), and no more (a tenant the
    training offset over-covered is reserved less). Only the tenant's own outcomes move it; a
    new model starts again from its trained offsets. `step=0` turns it off."""

    def __init__(
        self,
        model: ExportedModel | None,
        history: History,
        coverage: CoverageTracker,
        *,
        step: float = ADJUST_STEP,
        bound: float = ADJUST_BOUND,
    ) -> None:
        self.model = model
        self.history = history
        self.coverage = coverage
        self.step = step
        self.bound = bound
        self._adjust: dict[str, float] = {}

    def replace_model(self, model: ExportedModel | None) -> None:
        self.model = model
        self.coverage.reset()
        self._adjust.clear()

    def adjustment(self, tenant_id: str) -> float:
        """The tenant's online calibration adjustment (0 before any outcome)."""
        return self._adjust.get(tenant_id, 0.0)

    def predict(self, shape: RequestShape) -> Prediction | Skip:
        model = self.model
        if model is None:
            return "no_model"
        if shape.tenant_id not in model.tenant_offsets:
            return "unknown_tenant"
        if self.coverage.falling_back(shape.tenant_id):
            return "low_coverage"
        features = self.history.features(shape)
        if features is None:
            return "little_history"
        tokens = model.output_tokens(
            shape.tenant_id, features, self._adjust.get(shape.tenant_id, 0.0)
        )
        assert tokens is not None  # the tenant's offset is there
        return Prediction(tokens, model.version)

    def observe(
        self, shape: RequestShape, reserved_output_tokens: int | None, output_tokens: int
    ) -> None:
        """A completed request: its engine count, and the output it reserved when a prediction
        did (None: it reserved its cap, which says nothing of the model's coverage)."""
        self.history.observe(
            shape.tenant_id, shape.key_id, shape.model, shape.system_prompt_bucket, output_tokens,
            prompt_tokens=shape.prompt_tokens,
        )  # fmt: skip
        if reserved_output_tokens is not None:
            self.coverage.observe(shape.tenant_id, reserved_output_tokens, output_tokens)
            model = self.model
            if self.step and model is not None:
                miss = 1.0 if output_tokens > reserved_output_tokens else 0.0
                tenant = shape.tenant_id
                moved = self._adjust.get(tenant, 0.0) + self.step * (miss - (1 - model.quantile))
                self._adjust[tenant] = min(self.bound, max(-self.bound, moved))
