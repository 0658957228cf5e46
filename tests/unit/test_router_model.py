"""The router's trained estimate (issue 32, item 2): a logistic model fitted with torch on the
log's feedback, exported as plain weights, read at admission where its coverage guard holds
(Wilson's bound elsewhere); and the routing decision kept per class between feedbacks."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests import builders as b
from tests.fakes import InMemoryEventStore
from tests.unit.test_routing import CLS, LARGE, SMALL, Router, policy, scores
from tollgate_llm.domain.requests.events import FeedbackRecorded, RequestModelRouted
from tollgate_llm.domain.router_model import RouterModel, TenantRouterModel
from tollgate_llm.domain.routing import QualityView, choose, task_class
from tollgate_llm.ledger.store import NewEvent
from tollgate_llm.predictor import router_file
from tollgate_llm.predictor.router_train import (
    NotEnoughFeedback,
    RouterTrainConfig,
    fit,
    train_and_save,
)

GOOD = task_class(3, 100, False, "json_object", False)  # the small model does it well
BAD = task_class(9, 6_000, True, "text", False)  # it does not
RARE = task_class(11, 100, False, "text", True)  # seen a few times only
ROOT = Path(__file__).resolve().parents[2]


def feedback(seed: int = 1, per_group: int = 200) -> list[FeedbackRecorded]:
    """Customers' scores, 1 or 0, drawn from a known truth: the small model is good on GOOD
    (0.95) and bad on BAD (0.5), the large one good on both; RARE has five scores."""
    rng = random.Random(seed)
    truth = {(SMALL, GOOD): 0.95, (SMALL, BAD): 0.5, (LARGE, GOOD): 0.96, (LARGE, BAD): 0.93}
    plan = [key for key in truth for _ in range(per_group)] + [(SMALL, RARE)] * 5
    rng.shuffle(plan)
    out = []
    for i, (model, cls) in enumerate(plan):
        good = rng.random() < truth.get((model, cls), 0.95)
        out.append(FeedbackRecorded(f"req-{i}", b.TENANT, model, cls, 1_000_000 * good, "client"))
    return out


@pytest.fixture(scope="module")
def trained() -> RouterModel:
    model = fit(feedback(), version="rm-test")
    assert model is not None
    return model


def test_training_ranks_a_known_good_class_above_a_known_bad_one(trained: RouterModel) -> None:
    t = trained.tenants[b.TENANT]
    assert t.probability(SMALL, GOOD) > 0.88 and t.probability(SMALL, BAD) < 0.62
    good = trained.lower_bound_ppm(b.TENANT, SMALL, GOOD)
    bad = trained.lower_bound_ppm(b.TENANT, SMALL, BAD)
    assert good is not None and bad is not None
    assert good >= 800_000 > bad  # the bar: met on the good class only
    assert t.spread >= 0 and abs(t.bias) < 0.05  # measured on the held-out fifth
    # Reproducible: the same log and seed give the same weights.
    again = fit(feedback(), version="rm-test")
    assert again is not None and again.tenants[b.TENANT].weights == t.weights
    # No tenant's feedback reaches another's estimate.
    assert trained.lower_bound_ppm("another-tenant", SMALL, GOOD) is None


def test_a_class_with_too_little_data_is_not_covered(trained: RouterModel) -> None:
    assert trained.tenants[b.TENANT].evidence[(SMALL, RARE)] < trained.min_evidence
    assert trained.lower_bound_ppm(b.TENANT, SMALL, RARE) is None
    assert (b.TENANT, SMALL, RARE) not in trained.table()
    # Too little held-out feedback to measure the model's error: no model at all.
    assert fit(feedback(per_group=10), RouterTrainConfig(min_holdout_weight=5)) is None


def test_the_exported_file_loads_without_torch(trained: RouterModel, tmp_path: Path) -> None:
    path = router_file.save(trained, {"seed": 0}, tmp_path)
    assert router_file.latest(tmp_path) == path
    code = (
        "import sys; from pathlib import Path; from tollgate_llm.predictor import router_file; "
        f"m = router_file.load(Path({str(path)!r})); "
        "assert 'torch' not in sys.modules, 'torch loaded'; "
        f"print(m.version, m.lower_bound_ppm({b.TENANT!r}, {SMALL!r}, {GOOD!r}))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)  # fmt: skip
    assert out.stdout.split() == ["rm-test", str(trained.lower_bound_ppm(b.TENANT, SMALL, GOOD))]
    assert router_file.load(path) == trained
    (tmp_path / "bad.json").write_text('{"format": "tollgate-router-model", "format_version": 1}')
    with pytest.raises(router_file.RouterFileError):
        router_file.load(tmp_path / "bad.json")


def test_training_reads_the_log_s_feedback_and_writes_the_newest_file(tmp_path: Path) -> None:
    store = InMemoryEventStore()
    with pytest.raises(NotEnoughFeedback):
        train_and_save(store, RouterTrainConfig(), tmp_path)
    for i, event in enumerate(feedback()):
        store.append(event.request_id, 0, [
            NewEvent(f"fb-{i}", event.request_id, event.tenant_id, b.at(i), event)])  # fmt: skip
    path, model, training = train_and_save(store, RouterTrainConfig(), tmp_path)
    assert training["feedback_events"] == 805 and router_file.latest(tmp_path) == path
    assert path.name == f"router-model-{model.version}.json"
    assert model.version.startswith("rm-") and router_file.load(path).tenants == model.tenants
    # The same log and seed: the same weights as fitting the events directly.
    direct = fit(feedback(), version="x")
    assert direct is not None and direct.tenants == model.tenants


def hand_model(evidence: float, p_logit: float = 4.0) -> RouterModel:
    """A model that says the small model is good (sigmoid(4) = 0.98) on CLS, seen `evidence`
    times."""
    tenant = TenantRouterModel({SMALL: p_logit}, 0.0, 0.02, {(SMALL, CLS): evidence})
    return RouterModel("rm-hand", {b.TENANT: tenant})


def test_admission_routes_on_the_model_where_it_covers_the_class() -> None:
    router = Router()
    router.consent()
    assert router.chat().headers["X-Tollgate-Routed-To"] == LARGE  # no feedback: the reference
    router.quality.use_model(hand_model(evidence=100))
    out = router.chat()
    assert out.headers["X-Tollgate-Routed-To"] == SMALL
    assert out.headers["X-Tollgate-Routing-Reason"] == "meets_bar"
    routed = next(e for e in router.events() if isinstance(e, RequestModelRouted))
    assert routed.served_model == SMALL and routed.estimate_ppm >= 800_000
    assert routed.alternatives[0].endswith("/model")  # the estimate says where it came from
    # A model that says the class is bad keeps it on the reference.
    router.quality.use_model(hand_model(evidence=100, p_logit=0.0))
    assert router.chat().headers["X-Tollgate-Routed-To"] == LARGE


def test_a_class_with_too_little_data_falls_back_to_wilson() -> None:
    router = Router()
    router.consent()
    router.quality.use_model(hand_model(evidence=10))  # under the guard's 30
    out = router.chat()
    assert out.headers["X-Tollgate-Routed-To"] == LARGE  # Wilson's bound: no evidence
    scores(router.quality, SMALL, *[0.95] * 80)  # Wilson's evidence
    out = router.chat()
    assert out.headers["X-Tollgate-Routed-To"] == SMALL
    routed = next(e for e in router.events() if isinstance(e, RequestModelRouted))
    assert not routed.alternatives[0].endswith("/model")


def test_the_decision_kept_for_a_class_is_made_again_when_its_inputs_change() -> None:
    view = QualityView()
    scores(view, SMALL, *[0.95] * 60)
    ladder = [SMALL, LARGE]
    assert choose(policy(), ladder, view, CLS, 0.99).served_model == SMALL
    # Another policy (a stricter bar), another price order: decided again.
    assert choose(policy(bar_ppm=990_000), ladder, view, CLS, 0.99).served_model == LARGE
    reordered = choose(policy(), [LARGE, SMALL], view, CLS, 0.99)  # the other way round
    assert (reordered.reference_model, reordered.reason) == (SMALL, "below_bar")
    # Feedback of the class's shape, folded: decided again as it is folded.
    kept = policy()
    assert choose(kept, ladder, view, CLS, 0.99).served_model == SMALL
    scores(view, SMALL, *[0.0] * 60)
    assert choose(kept, ladder, view, CLS, 0.99).served_model == LARGE
    # The same inputs: the same answer object, nothing made again.
    assert choose(kept, ladder, view, CLS, 0.5) is choose(kept, ladder, view, CLS, 0.5)
    # A model loaded: every class kept is decided again then, not by its next request.
    before = view.plans[b.TENANT][CLS]
    view.use_model(hand_model(evidence=100))
    after = view.plans[b.TENANT][CLS]
    assert after is not before and after.meets is not None and after.meets.served_model == SMALL
    assert choose(kept, ladder, view, CLS, 0.5) is after.meets
