"""The router's trained estimate (issue 32): a logistic model of a model's quality on a task
class, fitted with torch offline from the tenants' feedback (`predictor/router_train.py`) and
exported as plain weights; here only the arithmetic admission reads, and its coverage guard.

Per tenant (no tenant's feedback reaches another's estimate: a system-prompt bucket is keyed by
the tenant), the logit of the mean score of `model` on a class is the sum of the weights of its
features: the model alone, and the model with each part of the class (prompt band, tools,
response format, run membership, system-prompt bucket). So a class pools what its model showed
on classes that share its parts, and two bands of one system prompt learn from each other.

The estimate is used only where the data supports it: a (model, class) the fit saw at least
`min_evidence` of (weighted as `domain.routing` weighs feedback), for a tenant whose error could
be measured on held-out feedback. Its lower bound is the estimate less a calibrated margin:
`max(0, bias) + Z * sqrt(spread^2 + p(1 - p) / n)` where `bias` is how much the model
over-estimated, on average, the held-out feedback of the tenant's classes, `spread^2` the
variance of that error beyond the held-out means' own sampling noise (method of moments), and
`p(1 - p) / n` the estimate's own sampling noise at the class's evidence. Elsewhere the router
keeps Wilson's bound on the class's own feedback (`domain.routing.QualityView.estimate`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Final

__all__ = ["MODEL_MIN_EVIDENCE", "RouterModel", "TenantRouterModel", "features", "margin"]

# Fitted feedback a (model, class) needs before its learned estimate is used (else Wilson).
MODEL_MIN_EVIDENCE: Final = 30.0
Z: Final = 1.645  # one-sided 95 %, as Wilson's bound in domain.routing


def features(model: str, cls: str) -> Iterator[str]:
    """The features of `model` on `cls` ("p1.t0.ft.r0.b7"): the model, and the model with each
    part of the class."""
    yield model
    for part in cls.split("."):
        yield f"{model}|{part}"


def margin(p: float, evidence: float, bias: float, spread: float) -> float:
    """How far below the estimate `p` its lower bound is (module docstring)."""
    return max(0.0, bias) + Z * math.sqrt(spread * spread + p * (1.0 - p) / max(evidence, 1.0))


@dataclass(frozen=True, slots=True)
class TenantRouterModel:
    weights: Mapping[str, float]  # feature -> weight on the logit; absent: 0
    bias: float  # mean (estimate - held-out mean) over the tenant's held-out classes
    spread: float  # the standard deviation of that error beyond sampling noise
    evidence: Mapping[tuple[str, str], float]  # (model, class) -> feedback weight fitted on

    def probability(self, model: str, cls: str) -> float:
        w = self.weights
        logit = sum(w.get(f, 0.0) for f in features(model, cls))
        return 1.0 / (1.0 + math.exp(-max(-40.0, min(40.0, logit))))


@dataclass(frozen=True, slots=True)
class RouterModel:
    version: str
    tenants: Mapping[str, TenantRouterModel]
    min_evidence: float = MODEL_MIN_EVIDENCE

    def lower_bound_ppm(self, tenant_id: str, model: str, cls: str) -> int | None:
        """The learned lower bound of `model`'s quality on `cls`, in ppm; None where the
        coverage guard says the data does not support it (the caller keeps Wilson's)."""
        t = self.tenants.get(tenant_id)
        if t is None:
            return None
        n = t.evidence.get((model, cls), 0.0)
        if n < self.min_evidence:
            return None
        p = t.probability(model, cls)
        return max(0, int((p - margin(p, n, t.bias, t.spread)) * 1_000_000))

    def table(self) -> dict[tuple[str, str, str], int]:
        """Every covered (tenant, model, class) with its lower bound: computed once when the
        model is loaded, so that admission reads a number, not the arithmetic."""
        out: dict[tuple[str, str, str], int] = {}
        for tenant_id, t in self.tenants.items():
            for model, cls in t.evidence:
                low = self.lower_bound_ppm(tenant_id, model, cls)
                if low is not None:
                    out[(tenant_id, model, cls)] = low
        return out
