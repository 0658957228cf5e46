"""The KV cost model and prices, checked against the seeds' arithmetic."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tollgate_llm.domain.cost import (
    GIB,
    KIB,
    Price,
    amount_micros,
    base_model,
    est_kv_byte_seconds,
    estimate,
    profile_for,
    tpot_estimate_us,
)
from tollgate_llm.domain.errors import DomainError


def test_llama_8b_gqa_is_128_kib_per_token() -> None:
    assert profile_for("llama-3.1-8b").kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072


def test_llama_70b_gqa_is_320_kib_per_token() -> None:
    # seed 004: 2 × 80 × 8 × 128 × 2 = 327,680 B ≈ 320 KiB
    assert profile_for("llama-3.1-70b").kv_bytes_per_token == 327_680 == 320 * KIB


def test_glm_mla_is_89_856_bytes_per_token() -> None:
    # seed 004: (kv_lora_rank 512 + rope 64) × 2 B × 78 layers
    glm = profile_for("glm-5.2")
    assert glm.kv_bytes_per_token == (512 + 64) * 2 * 78 == 89_856
    # the naive per-head cache of the same shape would be ~4.9 MB/token: MLA is ~55× smaller
    assert 2 * glm.layers * glm.kv_heads * glm.head_dim * glm.dtype_bytes == 5_111_808


def test_a_pinned_version_maps_to_its_base_profile() -> None:
    assert base_model("llama-3.1-8b-2026-05") == "llama-3.1-8b"
    assert base_model("llama-3.1-8b") == "llama-3.1-8b"
    assert base_model("glm-5.2-2026-13") == "glm-5.2-2026-13"  # not a month: not a version
    assert profile_for("llama-3.1-70b-2026-05").kv_bytes_per_token == 327_680


def test_unknown_model_is_a_domain_error() -> None:
    with pytest.raises(DomainError) as err:
        profile_for("gpt-9")
    assert err.value.rule == "unknown_model"


def test_128k_context_on_70b_holds_40_gib() -> None:
    # seed 000 §2: one 128k-context request holds 40 GiB of KV.
    assert 40 * GIB == 131_072 * 327_680


def test_kv_seconds_of_a_typical_chat_on_70b() -> None:
    # (800 + 300/2) × 327,680 B × 300 × 0.040 s = 3,735,552,000 B·s ≈ 3.48 GiB·s
    assert est_kv_byte_seconds(800, 300, 327_680, 40_000) == 3_735_552_000


def test_kv_seconds_round_up() -> None:
    # (0 + 1/2) × 1 × 1 × 1 µs = 0.5e-6 B·s -> 1
    assert est_kv_byte_seconds(0, 1, 1, 1) == 1
    assert est_kv_byte_seconds(0, 0, 327_680, 40_000) == 0


@given(
    st.integers(0, 200_000), st.integers(0, 10_000), st.integers(1, 400_000), st.integers(1, 10**6)
)
def test_kv_seconds_is_the_exact_ceiling(prompt: int, out: int, kv: int, tpot: int) -> None:
    from fractions import Fraction

    exact = (Fraction(prompt) + Fraction(out, 2)) * kv * out * Fraction(tpot, 10**6)
    got = est_kv_byte_seconds(prompt, out, kv, tpot)
    assert got - 1 < exact <= got


def test_output_length_enters_squared() -> None:
    # doubling the output roughly doubles residency and duration: ≈ 4× when out ≫ prompt
    short = est_kv_byte_seconds(100, 1000, 327_680, 40_000)
    long = est_kv_byte_seconds(100, 2000, 327_680, 40_000)
    assert 3.5 < long / short < 4


def test_estimate_reserves_prompt_plus_output() -> None:
    e = estimate(800, 300, 327_680, 40_000)
    assert e.reserved_tokens == 1100 and e.kv_byte_seconds == 3_735_552_000


@pytest.mark.parametrize(
    ("measured", "age", "expected"),
    [
        (30_000, 1.0, 50_000),  # faster than target: floored at target (never optimistic)
        (120_000, 1.0, 120_000),  # loaded fleet: the measurement is used (R1)
        (900_000, 1.0, 200_000),  # one stuck replica: clamped at 4 × target
        (120_000, 61.0, 100_000),  # older than 60 s: 2 × target
        (120_000, 60.0, 120_000),  # exactly 60 s is still fresh
        (None, 0.0, 100_000),  # no measurement: 2 × target
        (None, None, 100_000),
    ],
)
def test_tpot_estimate(measured: int | None, age: float | None, expected: int) -> None:
    assert tpot_estimate_us(measured, age, 50_000) == expected


def test_amount_bills_cached_prompt_tokens_at_the_cached_rate() -> None:
    price = Price("llama-3.1-8b", 200_000, 600_000, 50_000)
    # (812 − 512) × 0.2 + 512 × 0.05 + 300 × 0.6 = 265.6 micro-units -> 266
    assert amount_micros(price, 812, 300, 512) == 266


def test_amount_rounds_half_up() -> None:
    price = Price("m", 500_000, 0, 0)
    assert amount_micros(price, 1, 0, 0) == 1  # exactly 0.5 -> 1
    assert amount_micros(price, 3, 0, 0) == 2  # 1.5 -> 2
    assert amount_micros(Price("m", 499_999, 0, 0), 1, 0, 0) == 0


def test_amount_of_a_million_tokens_is_the_list_price() -> None:
    price = Price("m", 3_000_000, 15_000_000, 300_000)
    assert amount_micros(price, 1_000_000, 1_000_000, 0) == 18_000_000


def test_amount_refuses_cached_above_prompt() -> None:
    with pytest.raises(DomainError) as err:
        amount_micros(Price("m", 1, 1, 1), 10, 0, 11)
    assert err.value.rule == "cached_exceeds_prompt"
