"""The supervisors' back-off (streams/supervisor.py): a child that keeps dying young waits twice
as long each time, up to the cap; one that ran a while is started again after the first wait."""

from __future__ import annotations

from tollgate_llm.streams.supervisor import RestartBackoff


def test_a_child_dying_young_waits_twice_as_long_each_time_up_to_the_cap() -> None:
    backoff = RestartBackoff(first_s=1.0, max_s=10.0, healthy_after_s=30.0)
    assert [backoff.after_exit(0.1) for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_a_child_that_ran_a_while_starts_the_back_off_over() -> None:
    backoff = RestartBackoff(first_s=1.0, max_s=10.0, healthy_after_s=30.0)
    backoff.after_exit(0.1)
    backoff.after_exit(0.1)
    assert backoff.after_exit(45.0) == 1.0
    assert backoff.after_exit(0.1) == 1.0
