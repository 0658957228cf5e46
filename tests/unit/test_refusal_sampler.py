"""domain/refusals.py: the first refusals of a key per window in full, the rest counted, and
every refusal in exactly one of the two."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from tollgate_llm.domain.refusals import RefusalSampler

T0 = datetime(2026, 12, 7, 8, 0, 0, tzinfo=UTC)


def test_the_first_of_a_window_are_recorded_in_full_and_the_rest_counted_once_it_closes() -> None:
    s = RefusalSampler(min_full_per_window=3, window_s=60)
    full = [s.record_in_full("k1", "t", "m", "free", "requests", T0 + timedelta(seconds=i))
            for i in range(10)]  # fmt: skip
    assert full == [True] * 3 + [False] * 7
    assert s.closed(T0 + timedelta(seconds=59)) == []  # the window is still open
    (counted,) = s.closed(T0 + timedelta(seconds=60))
    assert (counted.key_id, counted.reason, counted.count) == ("k1", "requests", 7)
    assert (counted.window_start, counted.window_s) == (T0, 60)
    assert s.closed(T0 + timedelta(seconds=61)) == [] and len(s) == 0  # once each
    # The key's plan may allow more (its requests per minute), never fewer than the minimum.
    assert [s.record_in_full("k2", "t", "m", "free", "requests", T0, per_window=5)
            for _ in range(6)] == [True] * 5 + [False]  # fmt: skip
    assert s.record_in_full("k3", "t", "m", "free", "requests", T0, per_window=1)
    assert s.record_in_full("k3", "t", "m", "free", "requests", T0, per_window=1)
    s.drain()
    # A new window starts from the full allowance again.
    assert s.record_in_full("k1", "t", "m", "free", "requests", T0 + timedelta(seconds=61))


def test_keys_reasons_and_models_are_counted_apart() -> None:
    s = RefusalSampler(min_full_per_window=0, window_s=60)
    refusals = [("a", "m", "requests"), ("a", "m", "requests"), ("a", "m", "budget"),
                ("a", "", "invalid"), ("b", "m", "tokens")]  # fmt: skip
    for key, model, reason in refusals:
        assert not s.record_in_full(key, "t", model, "free", reason, T0)
    got = {(c.key_id, c.model, c.reason): c.count for c in s.drain()}
    assert got == {("a", "m", "requests"): 2, ("a", "m", "budget"): 1, ("a", "", "invalid"): 1,
                   ("b", "m", "tokens"): 1}  # fmt: skip


@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 300)), max_size=300),
       st.integers(0, 5))  # fmt: skip
def test_every_refusal_is_recorded_in_full_or_counted_exactly_once(
    refusals: list[tuple[str, int]], full_per_window: int
) -> None:
    s = RefusalSampler(min_full_per_window=0, window_s=60)
    full: dict[tuple[str, int], int] = {}
    counted = 0
    for key, second in sorted(refusals, key=lambda r: r[1]):
        at = T0 + timedelta(seconds=second)
        if s.record_in_full(key, "t", "m", "free", "requests", at, per_window=full_per_window):
            window = second // 60
            full[(key, window)] = full.get((key, window), 0) + 1
        if second % 7 == 0:
            counted += sum(c.count for c in s.closed(at))
    counted += sum(c.count for c in s.drain())
    assert sum(full.values()) + counted == len(refusals)
    assert all(n <= full_per_window for n in full.values())  # the bound per key and window
