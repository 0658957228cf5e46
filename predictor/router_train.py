"""`tollgate router train`: fit the router's quality model (`domain.router_model`) with torch
(CPU) on the tenants' feedback in the event log, calibrate its margin on held-out feedback, and
export it as plain weights (`predictor.router_file`). The only router module that imports torch,
and only when it fits.

- Examples: `FeedbackRecorded` events with a task class (a customer's score weighs 1, a signal
  seen without content `domain.routing.IMPLICIT_WEIGHT`, as the router's statistics weigh them),
  summed per (tenant, serving model, class): the fit is on those sums, so its cost is the number
  of classes, not of events.
- Model: per tenant, logistic over `domain.router_model.features` (the model, the model with
  each part of the class), weighted cross-entropy against the mean score, a N(0, 1) prior on
  each weight (L2), L-BFGS; one thread, a fixed seed, deterministic.
- Calibration: every `holdout_every`-th feedback event (in log order) is held out of the fit;
  on the tenant's held-out classes with at least `min_holdout_weight` of it, the model's error
  (estimate - held-out mean) gives `bias` (its weighted mean) and `spread` (its variance beyond
  the held-out means' own binomial noise, by moments). A tenant with fewer than
  `min_holdout_classes` such classes gets no model: the router keeps Wilson's bound for it.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tollgate_llm.domain.requests.events import FeedbackRecorded
from tollgate_llm.domain.router_model import (
    MODEL_MIN_EVIDENCE,
    RouterModel,
    TenantRouterModel,
    features,
)
from tollgate_llm.domain.routing import IMPLICIT_WEIGHT
from tollgate_llm.ledger.store import EventStore
from tollgate_llm.predictor import router_file

__all__ = ["RouterTrainConfig", "fit", "read_feedback", "train_and_save"]


@dataclass(frozen=True)
class RouterTrainConfig:
    seed: int = 0
    holdout_every: int = 5
    min_holdout_weight: float = 5.0
    min_holdout_classes: int = 3
    min_evidence: float = MODEL_MIN_EVIDENCE
    prior: float = 1.0  # the L2 weight: a N(0, 1/prior) prior on each logit weight
    max_iterations: int = 200
    max_events: int = 2_000_000


class NotEnoughFeedback(ValueError):
    pass


# (tenant, model, class) -> [score sum, weight]
Sums = dict[tuple[str, str, str], list[float]]


def _sums(events: Iterable[FeedbackRecorded]) -> Sums:
    out: Sums = defaultdict(lambda: [0.0, 0.0])
    for e in events:
        if not e.task_class:
            continue
        w = 1.0 if e.source == "client" else IMPLICIT_WEIGHT
        s = out[(e.tenant_id, e.model, e.task_class)]
        s[0] += e.score_ppm / 1_000_000 * w
        s[1] += w
    return out


def fit(
    feedback: Sequence[FeedbackRecorded], config: RouterTrainConfig | None = None,
    version: str = "",
) -> RouterModel | None:  # fmt: skip
    """The model fitted to `feedback` (in log order), None when no tenant has enough of it."""
    import torch  # the predictor extra; only training needs it

    config = config or RouterTrainConfig()
    torch.manual_seed(config.seed)
    torch.use_deterministic_algorithms(True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        every = config.holdout_every
        fitted = _sums(e for i, e in enumerate(feedback) if i % every != every - 1)
        held = _sums(e for i, e in enumerate(feedback) if i % every == every - 1)
        tenants: dict[str, TenantRouterModel] = {}
        for tenant in sorted({t for t, _, _ in fitted}):
            mine = {(m, c): s for (t, m, c), s in fitted.items() if t == tenant}
            weights = _fit_tenant(torch, mine, config)
            out = _calibrate(weights, held, tenant, config)
            if out is None:
                continue
            bias, spread = out
            evidence = {k: round(s[1], 3) for k, s in sorted(mine.items())}
            tenants[tenant] = TenantRouterModel(weights, bias, spread, evidence)
    finally:
        torch.set_num_threads(threads)
    if not tenants:
        return None
    model = RouterModel("", tenants, config.min_evidence)
    name = version or router_file.new_version(
        datetime.now(UTC), router_file.tenants_json(model)
    )  # fmt: skip
    return RouterModel(name, tenants, config.min_evidence)


def _fit_tenant(
    torch: Any, sums: dict[tuple[str, str], list[float]], config: RouterTrainConfig
) -> dict[str, float]:
    keys = sorted(sums)
    names = sorted({f for m, c in keys for f in features(m, c)})
    index = {f: i for i, f in enumerate(names)}
    x = torch.zeros(len(keys), len(names), dtype=torch.float64)
    for row, (m, c) in enumerate(keys):
        for f in features(m, c):
            x[row, index[f]] = 1.0
    weight = torch.tensor([sums[k][1] for k in keys], dtype=torch.float64)
    target = torch.tensor([min(1.0, sums[k][0] / sums[k][1]) for k in keys], dtype=torch.float64)
    theta = torch.zeros(len(names), dtype=torch.float64, requires_grad=True)
    optimiser = torch.optim.LBFGS(
        [theta], max_iter=config.max_iterations, line_search_fn="strong_wolfe"
    )

    def loss() -> Any:
        optimiser.zero_grad()
        bce = torch.nn.functional.binary_cross_entropy_with_logits(
            x @ theta, target, weight=weight, reduction="sum"
        )
        total = bce + 0.5 * config.prior * (theta * theta).sum()
        total.backward()
        return total

    optimiser.step(loss)
    return {f: round(float(w), 6) for f, w in zip(names, theta.detach().tolist(), strict=True)}


def _calibrate(
    weights: dict[str, float], held: Sums, tenant: str, config: RouterTrainConfig
) -> tuple[float, float] | None:
    """(bias, spread) of the model's error on the tenant's held-out classes (module docstring),
    None with fewer than `min_holdout_classes` of them."""
    probe = TenantRouterModel(weights, 0.0, 0.0, {})
    rows = []
    for (t, m, c), (score, n) in held.items():
        if t != tenant or n < config.min_holdout_weight:
            continue
        p = probe.probability(m, c)
        rows.append((p - min(1.0, score / n), n, p * (1 - p) / n))
    if len(rows) < config.min_holdout_classes:
        return None
    total = sum(n for _, n, _ in rows)
    bias = sum(r * n for r, n, _ in rows) / total
    excess = sum(n * ((r - bias) ** 2 - noise) for r, n, noise in rows) / total
    return round(bias, 6), round(math.sqrt(max(0.0, excess)), 6)


def read_feedback(store: EventStore, max_events: int) -> list[FeedbackRecorded]:
    """The log's feedback, oldest first (the latest `max_events` of it)."""
    found: list[FeedbackRecorded] = []
    position = 0
    types = (FeedbackRecorded.EVENT_TYPE,)
    while records := store.read_all(position, 1000, event_types=types):
        found.extend(r.event for r in records if isinstance(r.event, FeedbackRecorded))
        position = records[-1].position
    return found[-max_events:]


def train_and_save(
    store: EventStore, config: RouterTrainConfig, directory: Path
) -> tuple[Path, RouterModel, dict[str, Any]]:
    started = time.monotonic()
    feedback = read_feedback(store, config.max_events)
    model = fit(feedback, config)
    if model is None:
        raise NotEnoughFeedback(
            f"{len(feedback)} feedback events: no tenant has {config.min_holdout_classes} "
            f"classes with {config.min_holdout_weight:g} held-out scores to calibrate on"
        )
    training = {
        "feedback_events": len(feedback), "seed": config.seed,
        "holdout_every": config.holdout_every, "seconds": round(time.monotonic() - started, 2),
        "trained_at": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
    }  # fmt: skip
    return router_file.save(model, training, directory), model, training
