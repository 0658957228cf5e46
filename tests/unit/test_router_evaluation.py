"""`tollgate router evaluate` (issue 32, item 5): generated traffic with a known ground truth
replayed through the real admission per policy; the figures mean what they say."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from tollgate_llm.api.router_evaluation.replay import Setup, evaluate
from tollgate_llm.api.router_evaluation.traffic import LARGE, SMALL, generate


def run(requests: int = 1_500, **kw: object) -> dict:  # type: ignore[type-arg]
    traffic = generate(requests, 20.0, 3, 0.5)
    result = asyncio.run(evaluate(traffic, replace(Setup(), **kw)))  # type: ignore[arg-type]
    result.pop("router_world")
    return result["policies"]  # type: ignore[no-any-return]


def test_the_ground_truth_names_the_cheapest_model_good_enough_and_the_drift_changes_it() -> None:
    traffic = generate(400, 20.0, 3, 0.5)
    extract = [p for p in traffic if p.kind.name == "extract"]
    assert {p.good_enough(0.8) for p in extract if not p.drifted} == {SMALL}
    assert {p.good_enough(0.8) for p in extract if p.drifted} == {LARGE}
    assert {p.good_enough(0.8) for p in traffic if p.kind.name == "agent"} == {LARGE}
    assert generate(50, 20.0, 3, 0.5) == generate(50, 20.0, 3, 0.5)  # seeded


def test_each_policy_s_figures_against_the_others() -> None:
    policies = run()
    asked, router, oracle = policies["asked"], policies["router"], policies["oracle"]
    for p in policies.values():
        assert p["admitted"] + sum(p["refused"].values()) == p["requests"] == 1_500
    # Always the reference: nothing saved, nothing routed, the bar always met.
    assert (asked["saving_vs_asked"], asked["share_routed_away"], asked["bar_attainment"]) == (
        0.0, 0.0, 1.0)  # fmt: skip
    # The oracle meets the bar on every answer, at the lowest cost.
    assert oracle["bar_attainment"] == 1.0 and oracle["saving_vs_asked"] > 0.2
    assert router["cost_micros"] >= oracle["cost_micros"] or router["bar_attainment"] < 1.0
    # Every admitted routed request's decision was decided and recorded with it.
    assert router["decisions_recorded"] == router["admitted"]
    assert asked["decisions_recorded"] == oracle["decisions_recorded"] == 0
    assert set(router["reasons"]) <= {"meets_bar", "explore", "below_bar", "latched",
                                      "shed_capacity"}  # fmt: skip
    assert router["scores_recorded"] > 300  # the customers' feedback, ~30 % of the answers


def test_without_exploration_or_feedback_the_router_never_leaves_the_reference() -> None:
    router = run(400, exploration=0.0, feedback_share=0.0)["router"]
    assert router["share_routed_away"] == 0.0 and router["saving_vs_asked"] == 0.0
    assert router["reasons"] == {"below_bar": router["admitted"]}


def test_a_small_fleet_without_room_sheds_to_the_reference_or_refuses_per_policy() -> None:
    shed = run(1_000, exploration=0.2, small_kv_tokens=2_000)["router"]
    assert shed["reasons"].get("shed_capacity", 0) > 0 and shed["capacity_refusals"] == 0
    refused = run(1_000, exploration=0.2, small_kv_tokens=2_000, on_capacity="refuse")["router"]
    assert refused["capacity_refusals"] > 0 and "shed_capacity" not in refused["reasons"]


def test_the_router_with_a_trained_model_is_judged_beside_it_and_each_decision_is_timed() -> None:
    from tollgate_llm.predictor.router_train import fit

    traffic = generate(1_500, 20.0, 3, 0.5)
    result = asyncio.run(evaluate(traffic, Setup(exploration=0.2, feedback_share=1.0), fit))
    result.pop("router_world")
    policies = result["policies"]
    learned = policies["router_model"]
    assert learned["admitted"] + sum(learned["refused"].values()) == 1_500
    assert learned["decisions_recorded"] == learned["admitted"]
    # Refitted on the feedback logged so far, nine times over the replay; the later fits
    # cover classes (the earlier may have too little feedback to calibrate on).
    fits = learned["trainings"]
    assert [f["at_request"] for f in fits] == list(range(150, 1_500, 150))
    assert fits[-1]["feedback"] > fits[0]["feedback"] and fits[-1]["covered"] > 0
    # Every routing decision was timed as admission made it; the others route nothing.
    for name in ("router", "router_model"):
        assert policies[name]["routing_step"]["decisions"] == 1_500
    assert policies["asked"]["routing_step"] is None
    assert len(result["load_average"]["before"]) == 3
