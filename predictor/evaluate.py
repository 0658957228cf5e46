"""`tollgate predictor evaluate`: replay a held-out slice of the log through admission
(`domain.admission.decide` over a fresh `QuotaView`, in the log's own time) with each
reservation policy, and compare what they reserve, refuse and over-admit.

Policies: `max_tokens` (reserve the output cap: today's rule), `predicted` (the model, through
the same `Forecaster` the edge runs, with its coverage fallback), and `oracle` (reserve exactly
what each request produced: what a perfect predictor would do, the yardstick for *false*
refusals). Each request arrives at its recorded admission instant with its recorded prompt
estimate and cap, ends at its recorded end with its engine counts, and is refunded then (the
overage charged); a request a policy refuses never runs in that replay.

Figures, per policy:
- reserved/actual: Σ reserved output / Σ produced output over its admitted, completed requests.
- coverage: share of its predicted, completed requests that produced ≤ their reservation.
- refused for tokens/min and for KV·s; false refusals: those the oracle admitted.
- peak over-admission: a shadow tokens/min bucket per tenant and model, charged each admitted
  request's *actual* use at its admission (the exact accounting); its deepest debt, as a share
  of the limit. Reserving max_tokens never goes below zero on it; a predictor that
  under-reserves does, by as much as it let a tenant exceed its limit.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Literal

from tollgate_llm.domain import admission
from tollgate_llm.domain.control_plane.state import ControlView, Limits
from tollgate_llm.domain.prediction import CoverageTracker, Forecaster, History, Prediction
from tollgate_llm.domain.quota import QuotaView
from tollgate_llm.domain.reservations import Bucket
from tollgate_llm.predictor.dataset import LoggedRequest, timeline
from tollgate_llm.predictor.model_file import ModelFile
from tollgate_llm.predictor.runtime import COVERAGE_MARGIN, COVERAGE_MIN_SAMPLES, COVERAGE_WINDOW

Policy = Literal["max_tokens", "predicted", "oracle"]
POLICIES: tuple[Policy, ...] = ("max_tokens", "predicted", "oracle")


@dataclass
class Outcome:
    policy: str
    requests: int = 0
    admitted: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    refused_ids: dict[str, set[str]] = field(default_factory=dict)
    reserved_output_tokens: int = 0
    produced_output_tokens: int = 0
    predicted: int = 0
    covered: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    over_admission_peak: float = 0.0  # deepest shadow debt / limit
    over_admission_by_tenant: dict[str, float] = field(default_factory=dict)
    by_tenant: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def reserved_per_actual(self) -> float | None:
        if not self.produced_output_tokens:
            return None
        return self.reserved_output_tokens / self.produced_output_tokens

    @property
    def coverage(self) -> float | None:
        return self.covered / self.predicted if self.predicted else None

    def summary(self, oracle: Outcome | None) -> dict[str, Any]:
        false = {}
        if oracle is not None:
            admitted_by_oracle = _admitted_ids(oracle)
            for reason in ("tokens", "concurrency"):
                false[reason] = len(self.refused_ids.get(reason, set()) & admitted_by_oracle)
        return {
            "policy": self.policy,
            "requests": self.requests,
            "admitted": self.admitted,
            "refused": dict(sorted(self.refused.items())),
            "false_refusals": false,
            "reserved_per_actual": _round(self.reserved_per_actual),
            "coverage": _round(self.coverage),
            "predicted": self.predicted,
            "fallbacks": dict(sorted(self.fallbacks.items())),
            "peak_over_admission": round(self.over_admission_peak, 4),
            "peak_over_admission_by_tenant": {
                t: round(v, 4) for t, v in sorted(self.over_admission_by_tenant.items())
            },
            "by_tenant": {
                t: {
                    **v,
                    "reserved_per_actual": _round(v["reserved"] / v["produced"])
                    if v["produced"]
                    else None,
                    "coverage": _round(v["covered"] / v["predicted"]) if v["predicted"] else None,
                }
                for t, v in sorted(self.by_tenant.items())
            },  # fmt: skip
        }


def _admitted_ids(outcome: Outcome) -> set[str]:
    return outcome.refused_ids.get("__admitted__", set())


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


@dataclass
class Replay:
    """The slice and the world it is replayed in."""

    requests: list[LoggedRequest]  # the slice, in admission order
    before: list[LoggedRequest]  # what came before it: the history the edge would have had
    control: ControlView
    limits_override: dict[str, int] = field(default_factory=dict)  # e.g. {"tpm": 200_000}
    time_scale: float = 1.0  # > 1 stretches the slice's instants (a compressed generation run)
    # Each tenant's tokens/min as this multiple of its own offered load (the tokens its slice
    # used per minute): the same pressure on every tenant, whatever its size.
    tpm_per_offered: float | None = None
    tpm: dict[tuple[str, str], int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.tpm_per_offered is not None and self.requests:
            start, end = self.requests[0].shape.at, self.requests[-1].shape.at
            minutes = max(1e-9, (end - start).total_seconds() * self.time_scale / 60)
            used: dict[tuple[str, str], int] = {}
            for q in self.requests:
                key = (q.shape.tenant_id, q.shape.model)
                used[key] = used.get(key, 0) + q.used_tokens
            for key, tokens in used.items():
                self.tpm[key] = max(1, round(self.tpm_per_offered * tokens / minutes))

    def limits(self, tenant_id: str, model: str, at: datetime) -> Limits:
        found = self.control.limits(tenant_id, model, at)
        if self.limits_override:
            found = replace(found, **self.limits_override)
        tpm = self.tpm.get((tenant_id, model))
        return replace(found, tpm=tpm) if tpm is not None else found


def run(replay: Replay, policy: Policy, model: ModelFile | None = None) -> Outcome:
    if policy == "predicted" and model is None:
        raise ValueError("the predicted policy needs a model")
    outcome = Outcome(policy)
    outcome.refused_ids["__admitted__"] = set()
    start = replay.requests[0].shape.at if replay.requests else None

    def scaled(at: datetime) -> datetime:
        assert start is not None
        return start + (at - start) * replay.time_scale

    forecaster = None
    if policy == "predicted" and model is not None:
        forecaster = Forecaster(
            model.model,
            History(model.min_history),
            CoverageTracker(model.model.quantile, margin=COVERAGE_MARGIN,
                            window=COVERAGE_WINDOW, min_samples=COVERAGE_MIN_SAMPLES),
        )  # fmt: skip
        for is_end, q in timeline(replay.before):
            if is_end and q.terminal == "completed":
                s = q.shape
                forecaster.history.observe(
                    s.tenant_id, s.key_id, s.model, s.system_prompt_bucket, q.completion_tokens,
                    prompt_tokens=s.prompt_tokens,
                )  # fmt: skip
    view = QuotaView()
    shadow: dict[tuple[str, str], Bucket] = {}
    ends: list[tuple[datetime, int, LoggedRequest, int | None]] = []
    seq = 0

    def finish(until: datetime) -> None:
        while ends and ends[0][0] <= until:
            at, _, q, reserved = heapq.heappop(ends)
            view.refund(q.request_id, q.used_tokens, at)
            if forecaster is not None and q.terminal == "completed":
                forecaster.observe(q.shape, reserved, q.completion_tokens)

    for q in replay.requests:
        s = q.shape
        now = scaled(s.at)
        finish(now)
        limits = replay.limits(s.tenant_id, s.model, s.at)
        predicted: int | None = None
        if policy == "oracle":
            predicted = q.completion_tokens
        elif forecaster is not None:
            answer = forecaster.predict(replace(s, at=now))
            if isinstance(answer, Prediction):
                predicted = answer.output_tokens
            else:
                outcome.fallbacks[answer] = outcome.fallbacks.get(answer, 0) + 1
        outcome.requests += 1
        decision = admission.decide(
            view,
            admission.ReserveQuota(
                request_id=q.request_id, tenant_id=s.tenant_id, key_id=s.key_id, model=s.model,
                tier=q.tier, edge_id="replay", prompt_tokens=s.prompt_tokens,
                max_tokens=s.output_cap_tokens,
                kv_bytes_per_token=replay.control.model_profile(s.model).kv_bytes_per_token,
                tpot_us=q.tpot_us, now=now, jitter=0.0,
                predicted_output_tokens=predicted,
            ),
            limits,
        )  # fmt: skip
        if isinstance(decision, admission.Rejected):
            outcome.refused[decision.reason] = outcome.refused.get(decision.reason, 0) + 1
            outcome.refused_ids.setdefault(decision.reason, set()).add(q.request_id)
            continue
        outcome.admitted += 1
        outcome.refused_ids["__admitted__"].add(q.request_id)
        reserved = decision.estimate.reserved_output_tokens
        was_predicted = predicted is not None and policy == "predicted"
        ended = scaled(q.ended_at or s.at)
        heapq.heappush(ends, (ended, seq, q, reserved if was_predicted else None))
        seq += 1
        bucket = shadow.get((s.tenant_id, s.model))
        if bucket is None:
            bucket = shadow[(s.tenant_id, s.model)] = Bucket(limits.tpm, now.timestamp())
        bucket.refill(now.timestamp(), limits.tpm)
        bucket.level -= q.used_tokens
        if bucket.level < 0 and limits.tpm:
            debt = -bucket.level / limits.tpm
            outcome.over_admission_peak = max(outcome.over_admission_peak, debt)
            was = outcome.over_admission_by_tenant.get(s.tenant_id, 0.0)
            outcome.over_admission_by_tenant[s.tenant_id] = max(was, debt)
        if q.terminal == "completed":
            outcome.reserved_output_tokens += reserved
            outcome.produced_output_tokens += q.completion_tokens
            tenant = outcome.by_tenant.setdefault(
                s.tenant_id,
                {"admitted": 0, "reserved": 0, "produced": 0, "predicted": 0, "covered": 0},
            )
            tenant["admitted"] += 1
            tenant["reserved"] += reserved
            tenant["produced"] += q.completion_tokens
            if was_predicted:
                outcome.predicted += 1
                outcome.covered += q.completion_tokens <= reserved
                tenant["predicted"] += 1
                tenant["covered"] += q.completion_tokens <= reserved
    return outcome


def evaluate(replay: Replay, model: ModelFile) -> dict[str, Any]:
    outcomes = {p: run(replay, p, model) for p in POLICIES}
    oracle = outcomes["oracle"]
    result = {p: o.summary(oracle) for p, o in outcomes.items()}
    slice_from = replay.requests[0].shape.at if replay.requests else None
    slice_to = replay.requests[-1].shape.at if replay.requests else None
    base = result["max_tokens"]["false_refusals"].get("tokens", 0)
    with_model = result["predicted"]["false_refusals"].get("tokens", 0)
    return {
        "model_version": model.version,
        "quantile": model.model.quantile,
        "slice": {
            "from": slice_from.isoformat() if slice_from else None,
            "to": slice_to.isoformat() if slice_to else None,
            "requests": len(replay.requests),
            "time_scale": replay.time_scale,
            "limits_override": replay.limits_override,
            "tpm_per_offered": replay.tpm_per_offered,
            "tpm": {f"{t}/{m}": v for (t, m), v in sorted(replay.tpm.items())},
        },
        "policies": result,
        "false_token_refusals_reduction": (base / with_model) if with_model else None,
    }


def held_out(
    requests: list[LoggedRequest], model: ModelFile, since: datetime | None = None
) -> tuple[list[LoggedRequest], list[LoggedRequest]]:
    """(before, slice): the slice is what was admitted from `since`, by default from the
    model's holdout instant (or, for a model trained on everything, after its window)."""
    cut = since or model.holdout_from or (model.window_to + timedelta(microseconds=1))
    return [q for q in requests if q.shape.at < cut], [q for q in requests if q.shape.at >= cut]
