"""Profile loading, validation and the fitted length distributions."""

from __future__ import annotations

import math
import random

import pytest

from tollgate_llm.loadgen.profiles import (
    Dist,
    ProfileError,
    available_profiles,
    load_profile,
    parse_profile,
    sample_request,
    tenant_mix,
)
from tollgate_llm.loadgen.prompts import build_messages, expected_prompt_tokens
from tollgate_llm.loadgen.stats import percentile

N = 40_000


def quantile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def test_every_shipped_profile_loads_and_states_its_source() -> None:
    names = available_profiles()
    for required in ("seeds", "chat", "summarisation", "agent", "noisy-neighbour",
                     "max-tokens-4096", "disconnect", "mix"):
        assert required in names
    for name in names:
        profile = load_profile(name)
        assert profile.source.strip(), name
        assert profile.classes, name


def test_seeds_profile_quantiles_match_the_seed_numbers() -> None:
    cls = load_profile("seeds").classes[0]
    rng = random.Random(1234)
    prompts = [cls.prompt_tokens.sample(rng) for _ in range(N)]
    outputs = [cls.output_tokens.sample(rng) for _ in range(N)]
    p50, p95 = quantile(prompts, 0.50), quantile(prompts, 0.95)
    assert p50 == pytest.approx(800, rel=0.04)
    assert p95 == pytest.approx(6000, rel=0.06)
    assert p95 / p50 == pytest.approx(7.5, rel=0.07)
    assert quantile(outputs, 0.50) == pytest.approx(300, rel=0.04)
    assert quantile(outputs, 0.95) == pytest.approx(1200, rel=0.06)


def test_lognormal_fit_is_exact_in_closed_form() -> None:
    d = Dist.lognormal_from_quantiles(800, 6000)
    assert math.exp(d.a) == pytest.approx(800)
    assert math.exp(d.a + 1.6448536269514722 * d.b) == pytest.approx(6000)


@pytest.mark.parametrize("name", ["chat", "summarisation", "agent"])
def test_other_lognormal_profiles_hit_their_declared_quantiles(name: str) -> None:
    cls = load_profile(name).classes[0]
    d = cls.prompt_tokens
    rng = random.Random(7)
    xs = [d.sample(rng) for _ in range(N)]
    assert quantile(xs, 0.5) == pytest.approx(d.p50, rel=0.05)
    assert quantile(xs, 0.95) == pytest.approx(d.p95, rel=0.07)


def test_noisy_neighbour_and_max_tokens_profiles() -> None:
    nn = load_profile("noisy-neighbour")
    assert nn.default_rate * 60 == pytest.approx(20, rel=1e-3)
    assert nn.classes[0].prompt_tokens.sample(random.Random(0)) == 150_000
    spec = sample_request(load_profile("max-tokens-4096").classes[0],
                          (("demo-free", 1.0),), random.Random(0), 0.5)
    assert spec.max_tokens == 4096 and spec.ignore_eos is False


def test_mix_imports_classes_and_keeps_the_noisy_neighbour_on_its_own_stream() -> None:
    mix = load_profile("mix")
    side = mix.side_streams
    assert [c.name for c in side] == ["noisy-neighbour"]
    assert side[0].rate_per_min == pytest.approx(20)
    weights = {c.name: c.weight for c in mix.weighted}
    assert sum(weights.values()) == pytest.approx(1.0)
    assert weights["seeds"] == pytest.approx(0.35)
    agent = next(c for c in mix.weighted if c.name == "agent")
    assert agent.retry.max_retries == 3 and agent.retry.idempotency_key


def test_disconnect_profile_always_streams_and_drops() -> None:
    cls = load_profile("disconnect").classes[0]
    rng = random.Random(3)
    specs = [sample_request(cls, (("t", 1.0),), rng, 0.0) for _ in range(500)]
    assert all(s.stream and s.disconnect_after is not None for s in specs)
    assert all(1 <= s.disconnect_after <= 100 for s in specs)  # type: ignore[operator]


def test_tenant_mix_falls_back_to_uniform_for_unknown_names() -> None:
    seeds = load_profile("seeds")
    assert dict(tenant_mix(seeds, ["demo-free", "demo-standard"])) == {
        "demo-free": 0.2, "demo-standard": 0.5}
    assert dict(tenant_mix(seeds, ["acme", "globex"])) == {"acme": 1.0, "globex": 1.0}


BASE = {"name": "x", "source": "test",
        "classes": [{"name": "c", "model": "m", "prompt_tokens": 100, "output_tokens": 10}]}


@pytest.mark.parametrize(("change", "message"), [
    ({"source": ""}, "source"),
    ({"arrival": "weird"}, "arrival"),
    ({"classes": []}, "at least one"),
    ({"bogus": 1}, "unknown key"),
    ({"arrival": "bursty", "burst": 20, "burst_fraction": 0.1}, "burst x burst_fraction"),
    ({"classes": [{"name": "c", "model": "m", "prompt_tokens": {"dist": "lognormal", "p50": 800,
                                                               "p95": 600},
                   "output_tokens": 10}]}, "p95"),
    ({"classes": [{"name": "c", "model": "m", "prompt_tokens": 100}]}, "output_tokens"),
    ({"classes": [{"name": "c", "prompt_tokens": 100, "output_tokens": 1}]}, "model"),
    ({"classes": [{"name": "c", "model": "m", "prompt_tokens": 100, "output_tokens": 1,
                   "stream": 0, "disconnect": {"probability": 1}}]}, "disconnect needs"),
    ({"classes": [{"name": "c", "model": "m", "prompt_tokens": 100, "output_tokens": 1,
                   "retry": {"max_retries": 99}}]}, "max_retries"),
    ({"classes": [{"profile": "no-such-profile"}]}, "unknown profile"),
])
def test_invalid_profiles_are_refused_with_a_clear_error(change: dict, message: str) -> None:
    with pytest.raises(ProfileError, match=message):
        parse_profile({**BASE, **change})


def test_unknown_profile_name_lists_the_known_ones() -> None:
    with pytest.raises(ProfileError, match="seeds"):
        load_profile("nope")


@pytest.mark.parametrize("target", [8, 9, 50, 800, 6_000, 150_000])
def test_prompts_have_the_target_length_on_the_simulator(target: int) -> None:
    from tollgate_llm.engine_adapter.simulator.tokenizer import count_prompt_tokens

    messages = build_messages(target, random.Random(target))
    assert count_prompt_tokens(messages) == target
    assert expected_prompt_tokens(messages) == target


def test_shared_prefix_prompts_are_exact_and_share_the_system_message() -> None:
    from tollgate_llm.engine_adapter.simulator.tokenizer import count_prompt_tokens

    rng = random.Random(0)
    a = build_messages(6_000, rng, 4_000, "t/agent")
    b = build_messages(9_000, rng, 4_000, "t/agent")
    assert count_prompt_tokens(a) == 6_000 and count_prompt_tokens(b) == 9_000
    assert a[0] == b[0] and a[0]["role"] == "system"
    assert a[1]["content"].split()[:4] != b[1]["content"].split()[:4]  # unique nonce


def test_percentile_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(map(float, range(1, 101))), 99) == 99.0
