"""What a request costs: the KV-cache model that admission reserves against (DESIGN §5) and the
per-token prices that billing posts. Integer arithmetic throughout: bytes, byte-seconds,
microseconds and micro-units of currency, never floats.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from tollgate_llm.domain.errors import DomainError

KIB = 1024
GIB = 1024**3
US_PER_S = 1_000_000
TOKENS_PER_MTOK = 1_000_000

# R1: a TPOT measurement older than this is not trusted; the estimate falls back to 2 × target.
TPOT_MEASUREMENT_MAX_AGE_S = 60
# R1: the measured TPOT is clamped to [target, 4 × target] so one stuck replica cannot drive the
# estimate (and so admission) to zero, and a quiet fleet never makes the estimate optimistic.
TPOT_CLAMP_FACTOR = 4
TPOT_STALE_FACTOR = 2


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """The serving-relevant shape of a model: enough to size its KV cache per token."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    attention: Literal["gqa", "mla"] = "gqa"
    kv_lora_rank: int = 0
    rope_dim: int = 0
    max_model_len: int = 131_072

    @property
    def kv_bytes_per_token(self) -> int:
        if self.attention == "mla":
            # MLA caches one compressed latent (plus the decoupled RoPE key) per layer, shared
            # by all heads: that is why a far larger model can hold less KV per token.
            return (self.kv_lora_rank + self.rope_dim) * self.dtype_bytes * self.layers
        # Dense / GQA: a K and a V vector per KV head per layer.
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


# Built-in defaults: a registered profile (`tollgate models register`, ControlView.model_profile)
# wins over these for the same model.
PROFILES: dict[str, ModelProfile] = {
    p.name: p
    for p in (
        # 2 × 32 × 8 × 128 × 2 = 131,072 B = 128 KiB per token.
        ModelProfile("llama-3.1-8b", layers=32, kv_heads=8, head_dim=128, dtype_bytes=2),
        # 2 × 80 × 8 × 128 × 2 = 327,680 B = 320 KiB per token (seed 000 §2, seed 004).
        ModelProfile("llama-3.1-70b", layers=80, kv_heads=8, head_dim=128, dtype_bytes=2),
        # (512 + 64) × 2 × 78 = 89,856 B ≈ 88 KiB per token (seed 004, MLA). kv_heads/head_dim
        # are the uncompressed shape, kept for the naive comparison only.
        ModelProfile(
            "glm-5.2",
            layers=78,
            kv_heads=64,
            head_dim=256,
            dtype_bytes=2,
            attention="mla",
            kv_lora_rank=512,
            rope_dim=64,
            max_model_len=1_048_576,
        ),
    )
}

# A pinned weights version is the base name plus "-YYYY-MM" (DESIGN §5, "Model versions").
_VERSION_SUFFIX = re.compile(r"-(\d{4})-(\d{2})$")


@functools.lru_cache(maxsize=1024)  # a handful of model names, asked ~10 times per request
def base_model(model: str) -> str:
    """`llama-3.1-8b-2026-05` -> `llama-3.1-8b`; a base name maps to itself."""
    match = _VERSION_SUFFIX.search(model)
    if match is None or not 1 <= int(match.group(2)) <= 12:
        return model
    return model[: match.start()]


def profile_for(model: str) -> ModelProfile:
    """The built-in profile of a model name or pinned version; unknown models are a domain
    error. The gateway asks `ControlView.model_profile`, which also knows registered ones."""
    found = PROFILES.get(model) or PROFILES.get(base_model(model))
    if found is None:
        raise DomainError("unknown_model", f"no model profile for {model!r}", field="model")
    return found


def check_profile(profile: ModelProfile) -> None:
    """A profile the KV model can use: every dimension it multiplies is positive."""
    if profile.attention not in ("gqa", "mla"):
        raise DomainError("bad_profile", f"attention {profile.attention!r} is not gqa or mla")
    needed = ("layers", "dtype_bytes") + (
        ("kv_lora_rank",) if profile.attention == "mla" else ("kv_heads", "head_dim")
    )
    for name in needed:
        if getattr(profile, name) <= 0:
            raise DomainError("bad_profile", f"{name} must be a positive integer", field=name)
    if min(profile.kv_lora_rank, profile.rope_dim) < 0:
        raise DomainError("bad_profile", "kv_lora_rank and rope_dim must be non-negative")
    if profile.max_model_len <= 0:
        raise DomainError("bad_profile", "max_model_len must be positive", field="max_model_len")


# torch dtype names in a Hugging Face config.json -> bytes per element of the KV cache (which has
# the model's dtype unless the engine is told otherwise, e.g. vLLM's --kv-cache-dtype).
HF_DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1,
}  # fmt: skip


def profile_from_hf_config(name: str, config: Mapping[str, Any]) -> ModelProfile:
    """A profile from a Hugging Face `config.json` (already parsed): dense / GQA from
    num_hidden_layers, num_key_value_heads and head_dim (or hidden_size / num_attention_heads);
    MLA when it has kv_lora_rank (DeepSeek-style, with qk_rope_head_dim). Multimodal configs
    nest the language model under `text_config`. A missing field is a DomainError naming it."""
    text = config.get("text_config")
    if isinstance(text, Mapping):
        config = {**config, **text}

    def need(*keys: str) -> int:
        for key in keys:
            value = config.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        raise DomainError(
            "bad_hf_config", f"config.json has no integer {' or '.join(keys)}", field=keys[0]
        )

    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    if dtype not in HF_DTYPE_BYTES:
        raise DomainError("bad_hf_config", f"unknown dtype {dtype!r} in config.json", field="dtype")
    layers = need("num_hidden_layers", "n_layer", "num_layers")
    max_len = config.get("max_position_embeddings")
    max_model_len = max_len if isinstance(max_len, int) and max_len > 0 else 131_072
    if config.get("kv_lora_rank"):
        profile = ModelProfile(
            name, layers=layers, kv_heads=need("num_attention_heads"),
            head_dim=need("qk_nope_head_dim", "v_head_dim"), dtype_bytes=HF_DTYPE_BYTES[dtype],
            attention="mla", kv_lora_rank=need("kv_lora_rank"), rope_dim=need("qk_rope_head_dim"),
            max_model_len=max_model_len,
        )  # fmt: skip
    else:
        heads = need("num_attention_heads", "n_head")
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or need("hidden_size", "n_embd") // heads
        profile = ModelProfile(
            name, layers=layers, kv_heads=kv_heads, head_dim=head_dim,
            dtype_bytes=HF_DTYPE_BYTES[dtype], max_model_len=max_model_len,
        )  # fmt: skip
    check_profile(profile)
    return profile


def est_kv_byte_seconds(
    prompt_tokens: int, output_tokens: int, kv_bytes_per_token: int, tpot_us: int
) -> int:
    """(prompt + out/2) × kv_bytes × out × tpot, in byte-seconds, rounded up.

    The KV grows one token per decode step, so its average residency over the decode is the
    prompt plus half the output; it is held for out × TPOT. Computed as
    ceil((2·prompt + out) · kv · out · tpot_us / (2 · 10^6)) so no precision is lost.
    """
    if min(prompt_tokens, output_tokens, kv_bytes_per_token, tpot_us) < 0:
        raise DomainError("negative_tokens", "KV estimate inputs must be non-negative")
    numerator = (2 * prompt_tokens + output_tokens) * kv_bytes_per_token * output_tokens * tpot_us
    return -(-numerator // (2 * US_PER_S))


def tpot_estimate_us(
    measured_p95_us: int | None, measured_age_s: float | None, target_us: int
) -> int:
    """The TPOT admission estimates with (R1): the fleet's measured p95 clamped to
    [target, 4 × target]; 2 × target when there is no measurement or it is older than 60 s."""
    if (
        measured_p95_us is None
        or measured_age_s is None
        or measured_age_s > TPOT_MEASUREMENT_MAX_AGE_S
    ):
        return TPOT_STALE_FACTOR * target_us
    return min(max(measured_p95_us, target_us), TPOT_CLAMP_FACTOR * target_us)


@dataclass(frozen=True, slots=True)
class Estimate:
    """What admission reserves for a request. Never billed: billing uses engine counts.

    `reserved_output_tokens` is what tokens/min and KV·s were charged for the output; it is the
    output cap unless an output-length prediction narrowed it. `output_cap_tokens` is what the
    request may produce (the engine's max_tokens): a prediction never shortens an answer.
    0 means "equal to the reservation" (an estimate made without a prediction)."""

    prompt_tokens: int
    reserved_output_tokens: int
    kv_byte_seconds: int
    tpot_us: int
    output_cap_tokens: int = 0
    predictor_version: str = ""  # the model that predicted the reservation; "" for none

    @property
    def max_output_tokens(self) -> int:
        """The engine request's max_tokens."""
        return self.output_cap_tokens or self.reserved_output_tokens

    @property
    def reserved_tokens(self) -> int:
        """The tokens/min charge: prompt + reserved output."""
        return self.prompt_tokens + self.reserved_output_tokens


def estimate(
    prompt_tokens: int, reserved_output_tokens: int, kv_bytes_per_token: int, tpot_us: int
) -> Estimate:
    return Estimate(
        prompt_tokens,
        reserved_output_tokens,
        est_kv_byte_seconds(prompt_tokens, reserved_output_tokens, kv_bytes_per_token, tpot_us),
        tpot_us,
    )


# An ISO 4217 alphabetic code: what a price, a bill and every amount shown are in.
CURRENCY_CODE: Final = re.compile(r"[A-Z]{3}")


@dataclass(frozen=True, slots=True)
class Price:
    """A model's price per million tokens, in micro-units of the currency (as in force at the
    instant a request is billed for: see `ControlView.price`)."""

    model: str
    prompt_micros_per_mtok: int
    completion_micros_per_mtok: int
    cached_micros_per_mtok: int
    currency: str = "USD"  # ISO 4217: the unit of the micro-units above


def amount_micros(
    price: Price, prompt_tokens: int, completion_tokens: int, cached_tokens: int
) -> int:
    """The charge for one request, in micro-units.

    Cached prompt tokens are billed at the cached rate and the rest of the prompt at the prompt
    rate. The exact sum is in micro-units × tokens / 10^6; it is rounded once, half up, to a
    whole micro-unit: floor((sum + 500,000) / 1,000,000). Rounding per request (not per line) keeps
    one ledger entry's amount reproducible from its own columns.
    """
    if min(prompt_tokens, completion_tokens, cached_tokens) < 0:
        raise DomainError("negative_tokens", "token counts must be non-negative")
    if cached_tokens > prompt_tokens:
        raise DomainError("cached_exceeds_prompt", "cached tokens exceed prompt tokens")
    total = (
        (prompt_tokens - cached_tokens) * price.prompt_micros_per_mtok
        + cached_tokens * price.cached_micros_per_mtok
        + completion_tokens * price.completion_micros_per_mtok
    )
    return (total + TOKENS_PER_MTOK // 2) // TOKENS_PER_MTOK
