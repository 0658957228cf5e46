"""The output predictor's pure parts (`domain.prediction`): features from the tenant's own
history, the exported model's arithmetic, the coverage safety net, and the whole rule."""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from tollgate_llm.domain.prediction import (
    FEATURES,
    CoverageTracker,
    ExportedModel,
    Forecaster,
    History,
    Layer,
    Prediction,
    RequestShape,
)

AT = datetime(2026, 12, 1, 18, 0, tzinfo=UTC)
SHAPE = RequestShape("acme", "key-1", "llama-3.1-8b-2026-05", 500, 4096, 3, 7, AT)


def history(outputs: list[int], *, tenant: str = "acme", bucket: int = 7) -> History:
    h = History(min_history=5)
    for out in outputs:
        h.observe(tenant, "key-1", SHAPE.model, bucket, out)
    return h


def test_no_features_until_the_tenant_has_enough_history_for_the_model() -> None:
    h = history([100] * 4)
    assert h.features(SHAPE) is None
    h.observe("acme", "key-1", SHAPE.model, 7, 100)
    features = h.features(SHAPE)
    assert features is not None and len(features) == len(FEATURES)
    assert h.features(replace(SHAPE, model="llama-3.1-70b-2026-05")) is None


def test_features_read_the_request_and_the_tenants_own_history() -> None:
    h = history([100] * 10)
    f = dict(zip(FEATURES, h.features(SHAPE) or [], strict=True))
    assert f["log_prompt_tokens"] == pytest.approx(math.log1p(500) / 10)
    assert f["log_output_cap_tokens"] == pytest.approx(math.log1p(4096) / 10)
    assert f["tenant_mean"] == pytest.approx(math.log1p(100) / 10)
    assert f["tenant_std"] == pytest.approx(0.0, abs=1e-6)
    assert f["bucket_weight"] == 0.5 and f["has_system_prompt"] == 1.0
    assert f["hour_cos"] == pytest.approx(math.cos(2 * math.pi * 18 / 24))
    other_bucket = h.features(replace(SHAPE, system_prompt_bucket=9)) or []
    unseen = dict(zip(FEATURES, other_bucket, strict=True))
    assert unseen["bucket_weight"] == 0.0 and unseen["bucket_mean"] == f["tenant_mean"]


def test_another_tenants_history_never_changes_a_tenants_features() -> None:
    alone = history([100] * 10)
    shared = history([100] * 10)
    for out in (5000, 3, 700):
        shared.observe("globex", "key-9", SHAPE.model, 7, out)  # same model, same bucket number
    assert alone.features(SHAPE) == shared.features(SHAPE)


def linear(weights: list[float], bias: float, offsets: dict[str, float]) -> ExportedModel:
    return ExportedModel("op-1", 0.95, (Layer((tuple(weights),), (bias,)),), offsets)


def test_the_exported_model_is_plain_arithmetic_in_log_space() -> None:
    weights = [0.0] * len(FEATURES)
    weights[FEATURES.index("tenant_mean")] = 1.0
    model = linear(weights, 0.02, {"acme": 0.01})
    features = history([100] * 10).features(SHAPE)
    assert features is not None
    want = math.ceil(math.expm1((math.log1p(100) / 10 + 0.03) * 10))
    assert model.output_tokens("acme", features) == want
    assert model.output_tokens("globex", features) is None  # not in the training data


def test_a_hidden_layer_applies_relu() -> None:
    n = len(FEATURES)
    hidden = Layer((tuple([1.0] + [0.0] * (n - 1)), tuple([-1.0] + [0.0] * (n - 1))), (0.0, 0.0))
    out = Layer(((1.0, 1.0),), (0.0,))
    model = ExportedModel("op-2", 0.95, (hidden, out), {"acme": 0.0})
    x = [0.5] + [0.0] * (n - 1)
    assert model.output_tokens("acme", x) == math.ceil(math.expm1(5.0))  # relu(-0.5) is 0


def test_a_model_for_other_features_is_refused() -> None:
    with pytest.raises(ValueError, match="features"):
        ExportedModel("op-3", 0.95, (Layer(((0.0,),), (0.0,)),), {}, features=("x",))
    with pytest.raises(ValueError, match="inputs"):
        ExportedModel("op-3", 0.95, (Layer(((0.0,),), (0.0,)),), {})


def test_coverage_below_target_minus_margin_falls_back_until_the_model_is_replaced() -> None:
    tracker = CoverageTracker(0.95, margin=0.03, window=100, min_samples=50)
    for i in range(49):
        tracker.observe("acme", 100, 500 if i % 5 == 0 else 50)  # 80 % covered, too few yet
    assert not tracker.falling_back("acme")
    tracker.observe("acme", 100, 50)
    assert tracker.falling_back("acme")
    for _ in range(100):
        tracker.observe("acme", 100, 50)  # a good run after does not restore trust
    assert tracker.falling_back("acme") and tracker.coverage("acme") == (1.0, 100)
    assert not tracker.falling_back("globex")
    tracker.reset()
    assert not tracker.falling_back("acme") and tracker.coverage("acme") is None


def test_coverage_at_the_margin_holds() -> None:
    tracker = CoverageTracker(0.95, margin=0.03, window=100, min_samples=100)
    for i in range(100):
        tracker.observe("acme", 100, 500 if i >= 92 else 50)  # 92 %: exactly target − margin
    assert not tracker.falling_back("acme")
    tracker.observe("acme", 100, 500)  # a hit slides out, a miss in: 91 %
    assert tracker.falling_back("acme")


def test_the_forecaster_says_why_it_does_not_predict() -> None:
    weights = [0.0] * len(FEATURES)
    weights[FEATURES.index("tenant_mean")] = 1.0
    model = linear(weights, 0.0, {"acme": 0.0})
    f = Forecaster(None, History(min_history=3), CoverageTracker(0.95, min_samples=10))
    assert f.predict(SHAPE) == "no_model"
    f.replace_model(model)
    assert f.predict(replace(SHAPE, tenant_id="globex")) == "unknown_tenant"
    assert f.predict(SHAPE) == "little_history"
    for _ in range(3):
        f.observe(SHAPE, None, 99)
    assert f.predict(SHAPE) == Prediction(99, "op-1")
    for _ in range(10):
        f.observe(SHAPE, 99, 500)
    assert f.predict(SHAPE) == "low_coverage"
    f.replace_model(model)  # retrained: trusted again
    assert isinstance(f.predict(SHAPE), Prediction)


def test_the_prompt_fit_follows_prompts_only_where_the_tenants_answers_do() -> None:
    follows, ignores = History(min_history=5), History(min_history=5)
    for prompt in (1000, 2000, 4000, 8000) * 5:
        follows.observe("acme", "key-1", SHAPE.model, 7, prompt // 10, prompt_tokens=prompt)
        ignores.observe("acme", "key-1", SHAPE.model, 7, 300, prompt_tokens=prompt)
    for history_, want in ((follows, 300), (ignores, 300)):
        f = dict(zip(FEATURES, history_.features(replace(SHAPE, prompt_tokens=3000)) or [],
                     strict=True))  # fmt: skip
        # ln(1 + out) tracks ln(1 + prompt) − ln 10 closely: the fit reads 3000 → ~300
        assert math.expm1(f["tenant_prompt_fit"] * 10) == pytest.approx(want, rel=0.02)
    f = dict(zip(FEATURES, follows.features(replace(SHAPE, prompt_tokens=1000)) or [],
                 strict=True))  # fmt: skip
    assert math.expm1(f["tenant_prompt_fit"] * 10) == pytest.approx(100, rel=0.02)
    assert f["tenant_prompt_fit_std"] < 0.01 < f["tenant_std"]  # the fit explains the spread
    g = dict(zip(FEATURES, ignores.features(replace(SHAPE, prompt_tokens=1000)) or [],
                 strict=True))  # fmt: skip
    assert g["tenant_prompt_fit"] == pytest.approx(g["tenant_mean"])


def test_online_calibration_moves_only_the_tenant_whose_outcomes_miss() -> None:
    weights = [0.0] * len(FEATURES)
    weights[FEATURES.index("tenant_mean")] = 1.0
    model = linear(weights, 0.0, {"acme": 0.0, "globex": 0.0})
    f = Forecaster(model, History(min_history=3), CoverageTracker(0.95, min_samples=1000))
    other = replace(SHAPE, tenant_id="globex", key_id="key-9")
    for _ in range(3):
        f.observe(SHAPE, None, 100)
        f.observe(other, None, 100)
    before = f.predict(SHAPE)
    assert isinstance(before, Prediction) and before.output_tokens == 100
    for _ in range(20):
        f.observe(SHAPE, 100, 200)  # misses: acme's answers outgrew its predictions
    raised = f.predict(SHAPE)
    assert isinstance(raised, Prediction) and raised.output_tokens > 100
    assert f.adjustment("acme") == pytest.approx(min(0.1, 20 * 0.005 * 0.95))
    assert f.adjustment("globex") == 0.0 and f.predict(other) == before
    for _ in range(1000):
        f.observe(other, 100, 10)  # always covered: globex is reserved less, within the bound
    lowered = f.predict(other)
    assert f.adjustment("globex") == pytest.approx(-0.1)
    assert isinstance(lowered, Prediction) and lowered.output_tokens < 100
    f.replace_model(model)
    assert f.adjustment("acme") == 0.0 and f.adjustment("globex") == 0.0


def test_online_calibration_holds_coverage_at_the_quantile() -> None:
    import random

    weights = [0.0] * len(FEATURES)
    weights[FEATURES.index("tenant_mean")] = 1.0
    # Trained offset far too low: the raw prediction is the median-ish mean of the history.
    model = linear(weights, 0.0, {"acme": 0.0})
    f = Forecaster(model, History(min_history=3), CoverageTracker(0.95, min_samples=10**6))
    rng = random.Random(3)
    for _ in range(3):
        f.observe(SHAPE, None, 100)
    covered = total = 0
    for i in range(20_000):
        answer = f.predict(SHAPE)
        assert isinstance(answer, Prediction)
        out = max(1, round(100 * math.exp(rng.gauss(0.0, 0.4))))
        if i >= 5_000:
            total += 1
            covered += out <= answer.output_tokens
        f.observe(SHAPE, answer.output_tokens, out)
    assert covered / total == pytest.approx(0.95, abs=0.01)
