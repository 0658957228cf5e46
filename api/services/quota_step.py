"""The quota step of admission: the request's prompt counted, the output predictor asked, and
the quota and hierarchy budgets decided and charged (`domain.admission` over
`domain.views.AdmissionViews`) for serving it with one model. Admission
(api/services/admission.py) asks it for the model asked (or routed) and again for each
fallback; the decision itself is `domain.admission`'s.

Nothing here waits on anything remote: the views are local and the fleet's TPOT the last scrape.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from tollgate_llm.api.metrics import Metrics
from tollgate_llm.api.ports import Clock, Fleet, OutputPredictor, TokenEstimator
from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.chat_request import ChatRequest
from tollgate_llm.api.services.end_user_step import end_user_path
from tollgate_llm.domain import admission
from tollgate_llm.domain.admission import AdmissionPolicy
from tollgate_llm.domain.control_plane.adapters import adapter_tpot_us
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.cost import tpot_estimate_us
from tollgate_llm.domain.prediction import Prediction, RequestShape
from tollgate_llm.domain.runs.state import Run
from tollgate_llm.domain.views import AdmissionViews

__all__ = ["Decision", "QuotaStep"]

Decision = admission.Admitted | admission.Rejected


class QuotaStep:
    """Built by `Admission` from what it is given, so the edge's wiring stays as it is."""

    def __init__(
        self, *, control: ControlView, views: AdmissionViews, fleet: Fleet, metrics: Metrics,
        tokens: Callable[[str], TokenEstimator], edge_id: str, rng: random.Random, clock: Clock,
        policy: AdmissionPolicy, predictor: OutputPredictor | None, tpot_target_us: int,
    ) -> None:  # fmt: skip
        self.control = control
        self.views = views
        self.fleet = fleet
        self.metrics = metrics
        self.tokens = tokens
        self.edge_id = edge_id
        self.rng = rng
        self.clock = clock
        self.policy = policy
        self.predictor = predictor
        self.tpot_target_us = tpot_target_us

    def reserve(
        self, caller: Caller, req: ChatRequest, model: str, request_id: str, is_retry: bool,
        system_prompt_bucket: int, run: Run | None = None,
        counted: tuple[TokenEstimator, int] | None = None, lora_rank: int | None = None,
    ) -> tuple[Decision, RequestShape | None]:
        """The quota decision for serving `req` with `model` (charged to the views if
        admitted), and what the output predictor was asked about it. `counted`: the prompt
        already counted (by the router), taken when `model`'s estimator is the one that did.
        `lora_rank`: served through an adapter of that rank, whose matrices stretch each decode
        step (`adapter_tpot_us`): the base model's KV is held that much longer."""
        measured = self.fleet.tpot_p95(model)
        limits = self.control.limits(caller.tenant_id, model)
        estimator = self.tokens(model)
        prompt_tokens = (
            counted[1] if counted is not None and counted[0] is estimator
            else estimator.prompt_tokens(req.messages, req.upstream.get("tools"))
        )  # fmt: skip
        now = self.clock()
        shape = predicted = None
        if self.predictor is not None:
            shape = RequestShape(
                caller.tenant_id, caller.key_id, model, prompt_tokens,
                admission.output_cap(req.max_tokens, limits), len(req.messages),
                system_prompt_bucket, now,
            )
            answer = self.predictor.predict(shape)
            if isinstance(answer, Prediction):
                predicted = answer
            self.metrics.count_prediction(caller.tenant_id, None if predicted else str(answer))
        cmd = admission.ReserveQuota(
                request_id=request_id,
                tenant_id=caller.tenant_id,
                key_id=caller.key_id,
                model=model,
                tier=caller.tier,
                edge_id=self.edge_id,
                prompt_tokens=prompt_tokens,
                max_tokens=req.max_tokens,
                min_tokens=req.upstream.get("min_tokens"),
                kv_bytes_per_token=self.control.model_profile(model).kv_bytes_per_token,
                tpot_us=adapter_tpot_us(tpot_estimate_us(
                    measured.p95_us if measured else None,
                    measured.age_s if measured else None,
                    self.tpot_target_us,
                ), lora_rank or 0),
                now=now,
                jitter=self.rng.random(),
                is_retry=is_retry,
                predicted_output_tokens=predicted.output_tokens if predicted else None,
                predictor_version=predicted.model_version if predicted else "",
                context_tokens=self.fleet.context_tokens(model),
        )  # fmt: skip
        path = self.control.hierarchy.policy(caller.tenant_id, caller.key_id, model, now, run)
        path = end_user_path(self.control, self.views, path, model, req)
        price = lambda: self.control.price(model, now)  # noqa: E731 - only on a path
        return self.views.charge(cmd, limits, path, price, self.policy), shape
