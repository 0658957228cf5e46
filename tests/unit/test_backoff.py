"""One backoff policy for every refusal: base + jitter, never shorter than a bucket's refill; a
shed retry waits 30–60 s; the tier, never the client, sets the engine priority."""

from __future__ import annotations

import pytest

from tollgate_llm.domain.backoff import ENGINE_PRIORITY, BackoffPolicy, engine_priority
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.types import TIERS


@pytest.mark.parametrize(("jitter", "expected"), [(0.0, 5), (0.5, 8), (0.999, 10)])
def test_retry_after_is_base_plus_jitter(jitter: float, expected: int) -> None:
    assert BackoffPolicy().retry_after_s(jitter) == expected


def test_retry_after_is_never_shorter_than_the_refill() -> None:
    assert BackoffPolicy().retry_after_s(0.0, refill_s=20) == 20


def test_a_shed_retry_waits_thirty_to_sixty_seconds() -> None:
    policy = BackoffPolicy()
    assert policy.shed_after_s(0.0) == 30 and policy.shed_after_s(0.999) == 60


def test_the_budget_needs_volume_and_more_than_twenty_percent() -> None:
    policy = BackoffPolicy()
    assert not policy.over_budget(19, 19)
    assert not policy.over_budget(100, 20)
    assert policy.over_budget(100, 21)


def test_jitter_outside_the_unit_interval_is_refused() -> None:
    with pytest.raises(DomainError):
        BackoffPolicy().retry_after_s(1.0)


def test_every_tier_has_an_engine_priority_and_enterprise_comes_first() -> None:
    assert set(ENGINE_PRIORITY) == set(TIERS)
    assert engine_priority("enterprise") < engine_priority("standard") < engine_priority("free")
    assert engine_priority("unknown") == engine_priority("free")
