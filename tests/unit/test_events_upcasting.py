"""Wire form and upcasting: payloads round-trip, and an old version read through an upcaster is
the same event as the new version written today."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import builders as b
from tollgate_llm.domain.envelope import Event, Recorded, new_recorded
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.registry import EVENT_CLASSES, UPCASTERS, from_payload, to_payload, upcast
from tollgate_llm.domain.requests.events import FirstTokenStreamed, RequestEstimated

ALL_EXAMPLES = [
    b.admitted(), b.estimated(), b.rejected(), b.routed(), b.first_token(), b.renewed(),
    b.completed(), b.cancelled(), b.failed(), b.lease_expired(), b.refunded(), b.billed(),
    b.tenant_registered(), b.plan_changed(), b.limits_set(rpm=5), b.key_issued(),
    b.key_revoked(), b.price_set(),
]  # fmt: skip


@pytest.mark.parametrize("event", ALL_EXAMPLES, ids=lambda e: e.EVENT_TYPE)
def test_every_event_round_trips_through_its_payload(event: Event) -> None:
    payload = to_payload(event)
    again = from_payload(event.EVENT_TYPE, event.EVENT_VERSION, payload)
    assert again == event
    assert to_payload(again) == payload


@pytest.mark.parametrize("event", ALL_EXAMPLES, ids=lambda e: e.EVENT_TYPE)
def test_a_decoded_event_is_what_its_constructor_builds(event: Event) -> None:
    """from_payload sets a frozen event's slots itself (not through its __init__): the same
    event, hashing alike; a key the class lacks is dropped and a missing field refused, as the
    constructor's way did."""
    payload = to_payload(event)
    again = from_payload(event.EVENT_TYPE, event.EVENT_VERSION, payload)
    fields = {f.name: getattr(again, f.name) for f in dataclasses.fields(again)}  # type: ignore[arg-type]
    built = type(event)(**fields)
    assert type(again) is type(event)
    assert again == built and hash(again) == hash(built) and repr(again) == repr(built)
    extra = from_payload(event.EVENT_TYPE, event.EVENT_VERSION, {**payload, "later_field": 1})
    assert extra == event
    required = next(
        f.name for f in dataclasses.fields(event)  # type: ignore[arg-type]
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )  # fmt: skip
    without = {k: v for k, v in payload.items() if k != required}
    with pytest.raises(TypeError):
        from_payload(event.EVENT_TYPE, event.EVENT_VERSION, without)


def test_new_recorded_is_the_envelope_its_constructor_builds() -> None:
    event = b.routed()
    args = ("e1", "req_1", 3, "acme", b.T0, event, 42)
    assert new_recorded(*args) == Recorded(*args)
    assert new_recorded(*args[:6]) == Recorded(*args[:6])  # position 0 until stored
    assert hash(new_recorded(*args)) == hash(Recorded(*args))


@dataclass(frozen=True, slots=True)
class CheckedRouted(Event):
    """A RequestRouted whose __init__ checks its fields (a __post_init__)."""

    EVENT_TYPE: ClassVar[str] = "RequestRouted"
    request_id: str
    replica_id: str
    occupancy_ppm: int = 0
    region: str | None = None

    def __post_init__(self) -> None:
        if not self.replica_id:
            raise DomainError("no_replica", "a routed request names its replica")


def test_an_event_whose_init_checks_its_fields_is_decoded_through_it() -> None:
    old_class = EVENT_CLASSES["RequestRouted"]
    EVENT_CLASSES["RequestRouted"] = CheckedRouted
    try:
        payload = {"request_id": "r", "replica_id": "", "occupancy_ppm": 0, "region": None}
        with pytest.raises(DomainError):
            from_payload("RequestRouted", 1, payload)
        assert from_payload("RequestRouted", 1, {**payload, "replica_id": "a"}) == CheckedRouted(
            "r", "a"
        )
    finally:
        EVENT_CLASSES["RequestRouted"] = old_class


@dataclass(frozen=True, slots=True)
class RequestRoutedV2(Event):
    """A fake v2 of RequestRouted that adds the routing score's pool."""

    EVENT_TYPE: ClassVar[str] = "RequestRouted"
    EVENT_VERSION: ClassVar[int] = 2
    request_id: str
    replica_id: str
    occupancy_ppm: int
    pool: str


def _routed_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "pool": "shared"}


@pytest.fixture
def routed_v2() -> Iterator[None]:
    """Registers the fake v2 and its upcaster for one test, then restores the registry."""
    old_class = EVENT_CLASSES["RequestRouted"]
    EVENT_CLASSES["RequestRouted"] = RequestRoutedV2
    UPCASTERS[("RequestRouted", 1)] = _routed_v1_to_v2
    try:
        yield
    finally:
        EVENT_CLASSES["RequestRouted"] = old_class
        del UPCASTERS[("RequestRouted", 1)]


@settings(max_examples=100, deadline=None)
@given(
    request_id=st.text(min_size=1, max_size=20),
    replica_id=st.text(min_size=1, max_size=20),
    occupancy_ppm=st.integers(0, 1_000_000),
)
def test_upcasting_is_stable(request_id: str, replica_id: str, occupancy_ppm: int) -> None:
    old_class = EVENT_CLASSES["RequestRouted"]
    EVENT_CLASSES["RequestRouted"] = RequestRoutedV2
    UPCASTERS[("RequestRouted", 1)] = _routed_v1_to_v2
    try:
        v1_payload = {
            "request_id": request_id,
            "replica_id": replica_id,
            "occupancy_ppm": occupancy_ppm,
        }
        from_v1 = from_payload("RequestRouted", 1, v1_payload)
        from_upcast = from_payload("RequestRouted", 2, upcast("RequestRouted", 1, v1_payload))
        assert (
            from_v1
            == from_upcast
            == RequestRoutedV2(request_id, replica_id, occupancy_ppm, "shared")
        )
        # v2 written today round-trips, and reading it again changes nothing
        payload = to_payload(from_v1)
        assert from_payload("RequestRouted", 2, payload) == from_v1
        assert upcast("RequestRouted", 2, payload) == payload
    finally:
        EVENT_CLASSES["RequestRouted"] = old_class
        del UPCASTERS[("RequestRouted", 1)]


def test_a_version_newer_than_the_code_is_refused(routed_v2: None) -> None:
    with pytest.raises(DomainError) as err:
        from_payload("RequestRouted", 3, {})
    assert err.value.rule == "event_version_too_new"


def test_a_missing_upcaster_is_loud(routed_v2: None) -> None:
    del UPCASTERS[("RequestRouted", 1)]
    try:
        with pytest.raises(DomainError) as err:
            from_payload("RequestRouted", 1, {})
        assert err.value.rule == "no_upcaster"
    finally:
        UPCASTERS[("RequestRouted", 1)] = _routed_v1_to_v2


def test_events_carry_no_floats() -> None:
    for event in ALL_EXAMPLES:
        for f in dataclasses.fields(event):  # type: ignore[arg-type]
            assert not isinstance(getattr(event, f.name), float), (event.EVENT_TYPE, f.name)


def test_a_v1_estimate_reads_as_having_reserved_its_whole_cap_without_a_predictor() -> None:
    v1 = {"request_id": "r", "prompt_tokens": 800, "reserved_output_tokens": 1000,
          "reserved_tokens": 1800, "kv_byte_seconds": 5, "tpot_us": 50_000}
    read = from_payload("RequestEstimated", 1, v1)
    assert read == RequestEstimated("r", 800, 1000, 1800, 5, 50_000, 1000, "", 0, -1)
    assert RequestEstimated.EVENT_VERSION == 2


def test_a_v1_first_token_reads_as_having_reported_no_engine_counts() -> None:
    read = from_payload("FirstTokenStreamed", 1, {"request_id": "r", "ttft_ms": 180})
    assert read == FirstTokenStreamed("r", 180, 0, 0)
    assert FirstTokenStreamed.EVENT_VERSION == 2
