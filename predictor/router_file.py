"""The router's model file (`tollgate router train` writes it, `tollgate serve` reads it): JSON,
versioned, plain weights per tenant with their calibrated margin and their coverage
(`domain.router_model`). Reading one needs neither torch nor numpy."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from tollgate_llm.domain.router_model import MODEL_MIN_EVIDENCE, RouterModel, TenantRouterModel
from tollgate_llm.predictor.model_file import newest, read_bounded, write_whole

FORMAT = "tollgate-router-model"
FORMAT_VERSION = 1
PREFIX = "router-model-"


class RouterFileError(ValueError):
    """A file that is not a router model, or not one this code reads; the message says why."""


def new_version(trained_at: datetime, tenants: dict[str, Any]) -> str:
    """`rm-<UTC instant>-<8 hex of the weights>`: ordered by training time."""
    digest = hashlib.sha256(json.dumps(tenants, sort_keys=True).encode()).hexdigest()[:8]
    return f"rm-{trained_at.strftime('%Y%m%dT%H%M%SZ')}-{digest}"


def tenants_json(model: RouterModel) -> dict[str, Any]:
    return {
        tenant: {
            "weights": dict(sorted(t.weights.items())),
            "bias": t.bias,
            "spread": t.spread,
            "evidence": sorted([m, c, n] for (m, c), n in t.evidence.items()),
        }
        for tenant, t in sorted(model.tenants.items())
    }


def to_json(model: RouterModel, training: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "version": model.version,
        "estimate": "sigmoid(sum of the weights of `model` and `model|<class part>`), per tenant",
        "lower_bound": "estimate - max(0, bias) - 1.645 * sqrt(spread^2 + p(1-p)/evidence)",
        "min_evidence": model.min_evidence,
        "training": training,
        "tenants": tenants_json(model),
    }


def from_json(data: Any) -> RouterModel:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise RouterFileError(f"not a {FORMAT} file")
    if data.get("format_version") != FORMAT_VERSION:
        raise RouterFileError(
            f"format_version {data.get('format_version')!r}; this code reads {FORMAT_VERSION}"
        )
    try:
        tenants = {
            str(tenant): TenantRouterModel(
                {str(f): float(w) for f, w in t["weights"].items()},
                float(t["bias"]),
                float(t["spread"]),
                {(str(m), str(c)): float(n) for m, c, n in t["evidence"]},
            )
            for tenant, t in data["tenants"].items()
        }
        return RouterModel(
            str(data["version"]), tenants, float(data.get("min_evidence", MODEL_MIN_EVIDENCE))
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise RouterFileError(f"malformed router model file: {exc}") from None


def save(model: RouterModel, training: dict[str, Any], directory: Path) -> Path:
    return write_whole(directory, f"{PREFIX}{model.version}.json", to_json(model, training))


def load(path: Path) -> RouterModel:
    return from_json(read_bounded(path, RouterFileError))


def latest(directory: Path) -> Path | None:
    """The newest router model file in `directory`, or None."""
    return newest(directory, f"{PREFIX}rm-*.json")
