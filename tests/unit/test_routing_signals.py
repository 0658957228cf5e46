"""The router's remaining pieces (issue 32): a request naming the policy's reference model routed
when the policy says so, the routed-requests counter, and the implicit signals seen without
content (the same client asking again on a larger model; a run that ran out of budget)."""

from __future__ import annotations

from tests import builders as b
from tests.unit.test_routing import LARGE, SMALL, Router, scores
from tollgate_llm.domain.feedback import REASK_WINDOW, Asked, ImplicitSignals
from tollgate_llm.domain.requests.events import FeedbackRecorded, RequestModelRouted

KEY = (b.TENANT, "key-1", b"digest-of-the-messages")


def asked(request_id: str, model: str = SMALL, price: int = 1, **kw: object) -> Asked:
    return Asked(request_id, b.TENANT, model, price, "p0.t0.ft.r0.b-1", ask_key=KEY, **kw)  # type: ignore[arg-type]


# --- the signals, as a pure memory -------------------------------------------------------------


def test_asking_the_same_again_soon_on_a_larger_model_scores_the_first_answer_0() -> None:
    signals = ImplicitSignals()
    assert signals.admitted(asked("r1", routed_from=LARGE), b.at(0)) is None
    signals.ended("r1", completed=True, now=b.at(3))
    signal = signals.admitted(asked("r2", LARGE, price=10), b.at(3) + REASK_WINDOW)
    assert signal == FeedbackRecorded(
        "r1", b.TENANT, SMALL, "p0.t0.ft.r0.b-1", 0, "reasked", "", LARGE
    )


def test_no_reask_signal_late_on_a_cheaper_model_by_the_router_or_before_the_answer_ended() -> None:
    def second(ended: bool, at: float, price: int, routed: bool = False) -> object:
        signals = ImplicitSignals()
        signals.admitted(asked("r1", price=5), b.at(0))
        if ended:
            signals.ended("r1", completed=True, now=b.at(1))
        return signals.admitted(asked("r2", price=price, routed=routed), b.at(at))

    assert second(True, 2, 10) is not None  # the one that is a re-ask, for contrast
    assert second(True, 1 + REASK_WINDOW.total_seconds() + 1, 10) is None  # too late
    assert second(True, 2, 5) is None  # not a larger model
    assert second(True, 2, 10, routed=True) is None  # the router chose it, not the client
    assert second(False, 2, 10) is None  # still in flight: a duplicate, not a re-ask


def test_a_cancelled_or_failed_answer_is_not_remembered_for_a_reask() -> None:
    signals = ImplicitSignals()
    signals.admitted(asked("r1"), b.at(0))
    signals.ended("r1", completed=False, now=b.at(1))
    assert signals.admitted(asked("r2", LARGE, price=10), b.at(2)) is None


def test_a_run_that_runs_out_of_budget_scores_its_last_completed_answer_0_once() -> None:
    signals = ImplicitSignals()
    run = (b.TENANT, "run-1")
    for i, at in enumerate((0, 5, 9)):
        signals.admitted(asked(f"r{i}", run=run), b.at(at))
    signals.ended("r0", completed=True, now=b.at(4))
    signals.ended("r1", completed=True, now=b.at(8))  # r2 is still in flight
    signal = signals.run_exhausted(*run)
    assert signal is not None and (signal.request_id, signal.source, signal.score_ppm) == (
        "r1", "exhausted", 0)  # fmt: skip
    assert signals.run_exhausted(*run) is None  # once per run
    assert signals.run_exhausted(b.TENANT, "another-run") is None


def test_the_memory_is_bounded() -> None:
    signals = ImplicitSignals(max_entries=3)
    for i in range(10):
        key = (b.TENANT, "k", bytes([i]))
        signals.admitted(Asked(f"r{i}", b.TENANT, SMALL, 1, "c", ask_key=key), b.at(i))
        if i % 2:
            signals.ended(f"r{i}", completed=True, now=b.at(i))
    assert len(signals.live) <= 3 and len(signals.asks) <= 3


# --- at the edge --------------------------------------------------------------------------------


def test_a_request_naming_the_reference_model_is_routed_only_when_the_policy_says_so() -> None:
    router = Router()
    scores(router.quality, SMALL, *[0.95] * 80)
    router.consent()
    out = router.chat(LARGE)
    assert "X-Tollgate-Routed-To" not in out.headers  # named, and not routed: served as asked
    router.consent(route_reference=True)
    out = router.chat(LARGE)
    assert out.headers["X-Tollgate-Routed-To"] == SMALL
    routed = next(e for e in router.events() if isinstance(e, RequestModelRouted))
    assert (routed.asked_model, routed.served_model, routed.reason) == (LARGE, SMALL, "meets_bar")
    # The cheaper model named is never routed (only the reference is).
    out = router.chat(SMALL)
    assert "X-Tollgate-Routed-To" not in out.headers


def test_routed_requests_are_counted_by_model_asked_served_and_reason() -> None:
    router = Router()
    router.consent()
    scores(router.quality, SMALL, *[0.95] * 80)
    router.chat()
    router.chat()
    metrics = router.edge.metrics
    value = metrics.registry.get_sample_value(
        "tollgate_requests_routed_total", {"asked": "auto", "served": SMALL, "reason": "meets_bar"}
    )
    assert value == 2


def test_the_same_client_asking_again_on_the_large_model_records_reasked_on_the_first() -> None:
    router = Router()
    router.consent()
    scores(router.quality, SMALL, *[0.95] * 80)
    router.chat()  # auto: the small model answers
    first = router.n
    router.clock.advance(30)
    router.chat(LARGE)  # the same messages, by name on the large model, half a minute later
    stream = router.sink.store.read_stream(f"req_{first:032x}")
    (signal,) = [r.event for r in stream if isinstance(r.event, FeedbackRecorded)]
    assert (signal.source, signal.score_ppm, signal.model, signal.routed_from) == (
        "reasked", 0, SMALL, LARGE)  # fmt: skip


def test_without_consent_no_implicit_signal_is_kept() -> None:
    router = Router()
    router.chat(SMALL)
    router.clock.advance(5)
    router.chat(LARGE)
    assert not router.edge.admission.router.signals.live
    events = router.sink.store.read_stream(f"req_{1:032x}")
    assert not any(isinstance(r.event, FeedbackRecorded) for r in events)


# --- drift: only the model the router relies on latches a class ------------------------------


def test_exploring_a_model_that_scores_badly_does_not_latch_the_class() -> None:
    from tests.unit.test_routing import CLS, policy
    from tollgate_llm.domain.routing import DRIFT_MIN, QualityView, choose

    view = QualityView()
    scores(view, SMALL, *[0.0] * DRIFT_MIN, routed_from=LARGE)  # explored, and bad
    routed = choose(policy(exploration_ppm=200_000), [SMALL, LARGE], view, CLS, 0.99)
    assert routed.reason == "below_bar"  # not "latched": its upper bound rules it out instead
    assert choose(policy(exploration_ppm=200_000), [SMALL, LARGE], view, CLS, 0.0).reason \
        == "below_bar"  # fmt: skip


def test_a_proven_model_whose_recent_routed_answers_fall_below_the_bar_latches_the_class() -> None:
    from tests.unit.test_routing import CLS, policy
    from tollgate_llm.domain.routing import DRIFT_MIN, QualityView, choose

    view = QualityView()
    scores(view, SMALL, *[1.0] * 300)
    assert choose(policy(), [SMALL, LARGE], view, CLS, 0.99).reason == "meets_bar"
    scores(view, SMALL, *[0.4] * DRIFT_MIN, routed_from=LARGE, at=b.at(5))
    assert choose(policy(), [SMALL, LARGE], view, CLS, 0.99).reason == "latched"
    # Another model's window is its own: the large model's routed scores never latch the small.
    other = QualityView()
    scores(other, SMALL, *[1.0] * 300)
    scores(other, LARGE, *[0.0] * DRIFT_MIN, routed_from=LARGE, at=b.at(5))
    assert choose(policy(), [SMALL, LARGE], other, CLS, 0.99).reason == "meets_bar"
