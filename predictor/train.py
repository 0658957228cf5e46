"""`tollgate predictor train`: fit the output-length quantile model on the event log with torch
(CPU), calibrate it per tenant, and export it as plain arithmetic (`predictor.model_file`).

- Examples: completed and cancelled requests (`predictor.dataset.examples`), the latest
  `holdout` share of requests held out for `tollgate predictor evaluate`.
- Model: over `domain.prediction.FEATURES`, linear in log space by default (`hidden` > 0 adds
  a ReLU layer of that width), fitted with the pinball (quantile) loss at `quantile`; a
  cancelled request is a lower bound (its answer would have been at least that long), so only
  falling short of it is penalised. Linear, because on the generated traffic it reserved as
  little as 8 or 16 hidden units did (reserved/actual 2.35 vs 2.33 and 2.31, coverage 0.947 vs
  0.945 and 0.951: one log, one seed each) at a third of their inference time (p99 17 µs vs
  26-33 µs with 8, on this shared 2-core machine), which is what the admission path pays.
- Calibration: a `calibration` share of the training examples (every fifth) is not fitted on; each
  tenant's offset is the conformal quantile of its residuals there, so its coverage on fresh
  traffic is the target, after a per-tenant scale of the shared score (`SCALES`, the one that
  reserves least there at that coverage: a tenant whose answers its shape does not announce
  keeps ~0, its own constant quantile, rather than the shared score's noise). A tenant with
  fewer than `min_calibration` such requests gets no offset, and so no predictions (it
  reserves its cap).
- Bounded and reproducible: at most `max_requests` requests are read and `max_seconds` spent
  fitting (whichever of that and `max_epochs` comes first); one thread, a fixed seed and
  deterministic algorithms give the same weights from the same log.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tollgate_llm.domain.prediction import FEATURES, ExportedModel, Layer
from tollgate_llm.ledger.store import EventStore
from tollgate_llm.predictor import model_file
from tollgate_llm.predictor.dataset import Example, examples, read_requests, split_at


@dataclass(frozen=True)
class TrainConfig:
    quantile: float = 0.95
    seed: int = 0
    hidden: int = 0  # ReLU units of a hidden layer; 0: linear in log space
    holdout: float = 0.2  # the latest share of requests, kept for `evaluate`
    calibration: float = 0.2  # the share of the training examples (evenly taken) for the offsets
    min_history: int = 20
    min_calibration: int = 50
    max_requests: int = 500_000
    max_epochs: int = 300
    max_seconds: float = 120.0
    batch: int = 256
    learning_rate: float = 0.01

    def __post_init__(self) -> None:
        if not 0.5 <= self.quantile < 1.0:
            raise ValueError("quantile must be in [0.5, 1): the reservation is a high quantile")
        if not 0.0 <= self.holdout < 1.0 or not 0.0 < self.calibration < 1.0:
            raise ValueError("holdout is in [0, 1) and calibration in (0, 1)")
        if self.hidden < 0 or self.max_epochs < 1 or self.max_seconds <= 0:
            raise ValueError("hidden is ≥ 0; max_epochs and max_seconds are positive")


class NotEnoughData(ValueError):
    pass


def train(
    store: EventStore, config: TrainConfig, *, now: datetime | None = None
) -> model_file.ModelFile:
    import torch  # the predictor extra; only training needs it

    started = time.monotonic()
    requests = read_requests(store, max_requests=config.max_requests)
    holdout_from = split_at(requests, config.holdout)
    fit_requests = [q for q in requests if holdout_from is None or q.shape.at < holdout_from]
    found = examples(fit_requests, config.min_history)
    if len(found) < 2 * config.min_calibration:
        raise NotEnoughData(
            f"{len(found)} usable requests (completed or cancelled, with {config.min_history} "
            f"earlier answers of their tenant); at least {2 * config.min_calibration} are needed"
        )
    # Calibration examples are taken evenly through the window (every fifth), not as its last
    # stretch: a tenant's errors come in runs while its history features drift, so a
    # contiguous stretch calibrates to whichever run it held. Measured on the benchmark's log
    # (three seeds, held-out coverage per tenant): evenly 0.93 / 0.96 / 0.95, the last stretch
    # 0.93 / 0.98 / 0.97 (summarisation / chat / agents), reserving more for the same safety.
    every = max(2, round(1 / config.calibration))
    fit = [e for i, e in enumerate(found) if i % every != every - 1]
    calibrate = [e for i, e in enumerate(found) if i % every == every - 1]

    torch.manual_seed(config.seed)
    random.seed(config.seed)
    torch.use_deterministic_algorithms(True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net, epochs, loss = _fit(torch, fit, config, started)
    finally:
        torch.set_num_threads(threads)
    layers = [
        {"weights": layer.weight.detach().tolist(), "bias": layer.bias.detach().tolist()}
        for layer in net
        if isinstance(layer, torch.nn.Linear)
    ]
    exported = tuple(
        Layer(tuple(tuple(float(w) for w in row) for row in spec["weights"]),
              tuple(float(b) for b in spec["bias"]))
        for spec in layers
    )  # fmt: skip
    offsets, scales, tenants = _calibrate(exported, calibrate, fit, config)
    trained_at = (now or datetime.now(UTC)).replace(microsecond=0)
    version = model_file.new_version(trained_at, layers)
    model = ExportedModel(version, config.quantile, exported, offsets, FEATURES, scales)
    return model_file.ModelFile(
        model=model,
        trained_at=trained_at,
        window_from=fit_requests[0].shape.at,
        window_to=fit_requests[-1].shape.at,
        holdout_from=holdout_from,
        examples=len(found),
        seed=config.seed,
        min_history=config.min_history,
        training={
            "loss": "pinball",
            "final_loss": round(loss, 6),
            "epochs": epochs,
            "seconds": round(time.monotonic() - started, 2),
            "hidden": config.hidden,
            "fit_examples": len(fit),
            "calibration_examples": len(calibrate),
            "requests_read": len(requests),
            "torch": torch.__version__,
        },
        tenants=tenants,
    )


def _fit(
    torch: Any, fit: list[Example], config: TrainConfig, started: float
) -> tuple[Any, int, float]:
    x = torch.tensor([e.features for e in fit], dtype=torch.float32)
    y = torch.tensor([e.target for e in fit], dtype=torch.float32)
    censored = torch.tensor([e.censored for e in fit], dtype=torch.bool)
    if config.hidden:
        net = torch.nn.Sequential(
            torch.nn.Linear(len(FEATURES), config.hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(config.hidden, 1),
        )
    else:  # linear in log space
        net = torch.nn.Sequential(torch.nn.Linear(len(FEATURES), 1))
    with torch.no_grad():  # start at the overall quantile: most of the fit is then the shape
        net[-1].bias.fill_(float(torch.quantile(y, config.quantile)))
    optimiser = torch.optim.Adam(net.parameters(), lr=config.learning_rate)
    q = config.quantile
    generator = torch.Generator().manual_seed(config.seed)
    n = len(fit)
    loss_value = math.inf
    epochs = 0
    while epochs < config.max_epochs:
        epochs += 1
        order = torch.randperm(n, generator=generator)
        total = 0.0
        for start in range(0, n, config.batch):
            idx = order[start : start + config.batch]
            predicted = net(x[idx]).squeeze(1)
            residual = y[idx] - predicted
            pinball = torch.maximum(q * residual, (q - 1) * residual)
            # A cancelled answer is a lower bound: only predicting below it costs anything.
            lower = q * torch.clamp(residual, min=0.0)
            loss = torch.where(censored[idx], lower, pinball).mean()
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            total += float(loss.detach()) * len(idx)
        loss_value = total / n
        if time.monotonic() - started > config.max_seconds:
            break
    return net, epochs, loss_value


# The scales tried per tenant: from "ignore the shared score" (the tenant's constant quantile)
# to leaning on it harder than it was fitted.
SCALES = tuple(round(0.1 * i, 1) for i in range(16))


def _calibrate(
    layers: tuple[Layer, ...], calibrate: list[Example], fit: list[Example], config: TrainConfig
) -> tuple[dict[str, float], dict[str, float], dict[str, dict[str, Any]]]:
    """Each tenant's scale and offset, on its calibration requests only. For each scale s in
    `SCALES`, the offset is the conformal `quantile` of the residuals y − s·score (the
    ⌈(n + 1)·q'⌉-th smallest, q' = q + √(q(1 − q)/n)), so that P(actual ≤ prediction) ≥ q on
    exchangeable traffic with a standard error to spare; of those equally safe pairs, the
    tenant keeps the one that reserves the fewest tokens there (each capped at the request's
    own cap). Only its own requests decide them."""
    raw = ExportedModel("calibrating", config.quantile, layers, {})
    cap_at = FEATURES.index("log_output_cap_tokens")
    by_tenant: dict[str, list[tuple[float, float, float]]] = {}
    for e in calibrate:
        if e.censored:
            continue
        by_tenant.setdefault(e.tenant_id, []).append(
            (e.target, raw.score(e.features), e.features[cap_at])
        )
    fitted: dict[str, int] = {}
    for e in fit:
        fitted[e.tenant_id] = fitted.get(e.tenant_id, 0) + 1
    offsets: dict[str, float] = {}
    scales: dict[str, float] = {}
    tenants: dict[str, dict[str, Any]] = {}
    for tenant, rows in sorted(by_tenant.items()):
        n = len(rows)
        info: dict[str, Any] = {"fit_examples": fitted.get(tenant, 0), "calibration_examples": n}
        if n >= config.min_calibration:
            # One binomial standard error above the quantile: the offset is an estimate from
            # n residuals, and one that falls short trips the coverage fallback (the tenant
            # then reserves its cap until the next training) far more often than one above.
            q = config.quantile
            rank = min(n, math.ceil((n + 1) * (q + math.sqrt(q * (1 - q) / n))))
            best: tuple[float, float, float] | None = None  # (reserved, scale, offset)
            for scale in SCALES:
                residuals = sorted(y - scale * s for y, s, _ in rows)
                offset = residuals[rank - 1]
                reserved = sum(
                    math.expm1(min(cap, scale * s + offset) * 10.0) for _, s, cap in rows
                )
                if best is None or reserved < best[0] - 1e-9 * best[0]:
                    best = (reserved, scale, offset)
            assert best is not None
            _, scales[tenant], offsets[tenant] = best
            info["offset"] = round(offsets[tenant], 6)
            info["scale"] = scales[tenant]
        else:
            info["offset"] = None  # too few: this tenant reserves its cap
        tenants[tenant] = info
    return offsets, scales, tenants


def train_and_save(
    store: EventStore, config: TrainConfig, directory: Path
) -> tuple[Path, model_file.ModelFile]:
    mf = train(store, config)
    return model_file.save(mf, directory), mf
