"""Model profiles as control-plane data: registered (effective-dated, history kept), read from a
Hugging Face config.json, the built-in profiles as defaults, and a model with none refused with
a message that says what to register."""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests import builders as b
from tollgate_llm.domain.control_plane.decide import (
    ControlCommand,
    RegisterModelProfile,
    RegisterReplica,
    decide_control,
)
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.cost import ModelProfile, profile_from_hf_config
from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.errors import DomainError


def view_of(*timed: tuple[float, Event]) -> ControlView:
    view = ControlView()
    for i, (seconds, event) in enumerate(timed, start=1):
        view.apply(b.record(event, version=i, seconds=seconds, position=i))
    return view


def register(**kw: object) -> RegisterModelProfile:
    fields: dict[str, object] = {
        "model": "tiny-llama", "layers": 2, "kv_heads": 2, "head_dim": 32, "dtype_bytes": 2,
        "now": b.at(0),
    }  # fmt: skip
    return RegisterModelProfile(**{**fields, **kw})  # type: ignore[arg-type]


def refused(view: ControlView, command: ControlCommand) -> DomainError:
    with pytest.raises(DomainError) as err:
        decide_control(view, command)
    return err.value


def test_register_records_the_shape_effective_now() -> None:
    (event,) = decide_control(ControlView(), register(max_model_len=4096))
    assert event == b.model_profile_registered()


def test_a_registered_profile_is_in_force_for_the_model_and_its_versions() -> None:
    view = view_of((0, b.model_profile_registered()))
    profile = view.model_profile("tiny-llama-2026-05")
    assert profile.kv_bytes_per_token == 2 * 2 * 2 * 32 * 2 == 512
    assert profile.max_model_len == 4096


def test_a_version_profile_wins_over_the_base_name() -> None:
    view = view_of(
        (0, b.model_profile_registered()),
        (1, b.model_profile_registered(model="tiny-llama-2026-05", layers=4)),
    )
    assert view.model_profile("tiny-llama-2026-05").layers == 4
    assert view.model_profile("tiny-llama-2026-06").layers == 2


def test_history_is_kept_and_asked_as_of_an_instant() -> None:
    later = b.at(60)
    view = view_of(
        (0, b.model_profile_registered()),
        (10, b.model_profile_registered(layers=8, effective_at=later)),
    )
    assert view.model_profile("tiny-llama", b.at(30)).layers == 2
    assert view.model_profile("tiny-llama", b.at(61)).layers == 8
    assert [p.layers for _, p in view.model_profiles("tiny-llama")] == [2, 8]


def test_a_backdated_event_is_not_in_force_before_it_was_recorded() -> None:
    view = view_of((100, b.model_profile_registered(effective_at=b.at(0))))
    with pytest.raises(DomainError):
        view.model_profile("tiny-llama", b.at(50))


def test_built_in_profiles_are_defaults_that_a_registration_overrides() -> None:
    assert ControlView().model_profile("llama-3.1-8b-2026-05").kv_bytes_per_token == 131_072
    fp8 = b.model_profile_registered(
        model="llama-3.1-8b", layers=32, kv_heads=8, head_dim=128, dtype_bytes=1
    )
    view = view_of((0, fp8))
    assert view.model_profile("llama-3.1-8b-2026-05").kv_bytes_per_token == 65_536


def test_no_profile_names_what_to_register() -> None:
    with pytest.raises(DomainError) as err:
        ControlView().model_profile("tiny-llama-2026-05")
    assert err.value.rule == "no_model_profile"
    assert "tollgate models register --model tiny-llama-2026-05" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_replica_of_a_model_without_profile_is_refused() -> None:
    command = RegisterReplica("r1", "tiny-llama-2026-05", "http://127.0.0.1:8000")
    assert refused(ControlView(), command).rule == "no_model_profile"
    assert decide_control(view_of((0, b.model_profile_registered())), command)


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        ({"layers": 0}, "bad_profile"),
        ({"kv_heads": 0}, "bad_profile"),
        ({"attention": "mha"}, "bad_profile"),
        ({"max_model_len": 0}, "bad_profile"),
        ({"model": ""}, "bad_model"),
        ({"model": "*"}, "bad_model"),
        ({"effective_at": b.at(0) - timedelta(seconds=1)}, "profile_backdated"),
    ],
)
def test_bad_profiles_are_refused(change: dict[str, object], rule: str) -> None:
    assert refused(ControlView(), register(**change)).rule == rule


def test_mla_needs_its_latent_rank() -> None:
    mla = register(attention="mla", kv_heads=0, head_dim=0, kv_lora_rank=512, rope_dim=64)
    (event,) = decide_control(ControlView(), mla)
    view = view_of((0, event))
    assert view.model_profile("tiny-llama").kv_bytes_per_token == (512 + 64) * 2 * 2
    assert refused(ControlView(), register(attention="mla", kv_lora_rank=0)).rule == (
        "bad_profile"
    )


# --- config.json ---------------------------------------------------------------------------------


def test_profile_from_a_llama_config() -> None:
    config = {
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "hidden_size": 4096, "torch_dtype": "bfloat16", "max_position_embeddings": 131072,
    }  # fmt: skip
    profile = profile_from_hf_config("llama-3.1-8b", config)
    assert profile == ModelProfile("llama-3.1-8b", 32, 8, 128, 2, max_model_len=131072)


def test_profile_from_a_deepseek_style_mla_config() -> None:
    config = {
        "num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "dtype": "bfloat16",
    }  # fmt: skip
    profile = profile_from_hf_config("ds", config)
    assert profile.attention == "mla" and profile.kv_bytes_per_token == (512 + 64) * 2 * 61


def test_profile_from_a_multimodal_config_reads_its_text_model() -> None:
    config = {"text_config": {"num_hidden_layers": 2, "num_attention_heads": 4,
              "head_dim": 32, "num_key_value_heads": 2}, "torch_dtype": "float16"}  # fmt: skip
    assert profile_from_hf_config("m", config).kv_bytes_per_token == 2 * 2 * 2 * 32 * 2


def test_a_config_without_layers_names_the_field() -> None:
    with pytest.raises(DomainError) as err:
        profile_from_hf_config("m", {"num_attention_heads": 4, "hidden_size": 128})
    assert err.value.field == "num_hidden_layers"
