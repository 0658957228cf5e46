"""The autoscaling signal of this edge's fleet, every second, per model version: a sample of the
fleet (the last scrapes) through `domain.autoscale.Autoscaler`; the result on /metrics
(`tollgate_desired_replicas{model}`, for a Kubernetes HPA or KEDA external metric) and on
`GET /v1/fleet` with the terms that produced it.

With an `Actuator` (`tollgate serve --autoscale`, simulated replicas) the loop also acts: it
adds replicas up to the signal (each serving after the actuator's cold start) and drains, then
removes, the least loaded one when the signal comes down.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, Protocol

from tollgate_llm.api.metrics import Metrics
from tollgate_llm.domain.autoscale import Autoscaler, FleetSample, ScalePolicy, ScaleTerms
from tollgate_llm.engine_adapter.fleet import Fleet

log = logging.getLogger("tollgate.scaling")


class Actuator(Protocol):
    """Adds and removes replicas of a model (simulated ones in embedded mode)."""

    def starting(self, model: str) -> int:
        """Replicas asked for and not serving yet."""
        ...

    async def add(self, model: str) -> None:
        """Start a replica; it joins the fleet after the cold start."""
        ...

    async def remove(self, replica_id: str) -> None:
        """Stop a replica the fleet has drained and forgotten."""
        ...


class ScalingLoop:
    def __init__(
        self,
        fleet: Fleet,
        metrics: Metrics,
        *,
        policy: ScalePolicy | None = None,
        actuator: Actuator | None = None,
        clock: Callable[[], float] = time.monotonic,
        deferred_items: Callable[[str], int] = lambda model: 0,
    ) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.policy = policy or ScalePolicy()
        self.actuator = actuator
        # Batch items of a model still to run (flex work held back for idle capacity).
        self.deferred_items = deferred_items
        self.clock = clock
        self.scalers: dict[str, Autoscaler] = {}

    async def step(self) -> dict[str, ScaleTerms]:
        now = self.clock()
        out: dict[str, ScaleTerms] = {}
        for model in self.fleet.models():
            sample = self._sample(model, now)
            if sample is None:
                continue
            scaler = self.scalers.setdefault(model, Autoscaler(self.policy))
            terms = scaler.observe(sample)
            out[model] = terms
            self.metrics.fleet.desired_replicas.labels(model).set(terms.desired_replicas)
            self.metrics.fleet.fleet_replicas.labels(model).set(sample.replicas)
            if self.actuator is not None:
                await self._act(model, terms.desired_replicas)
        return out

    def _sample(self, model: str, now: float) -> FleetSample | None:
        states = [s for s in self.fleet.replicas(model) if not s.draining]
        capacities = [s.capacity_tokens for s in states if s.capacity_tokens]
        if not capacities:
            return None  # nothing scraped yet: no capacity to plan in
        held = [s.scraped_occupancy_ppm * s.capacity_tokens // 1_000_000 for s in states]
        used = sum(held)
        waiting = sum(s.metrics.waiting for s in states if s.metrics is not None)
        mean_tokens = used / max(1, sum(s.metrics.running for s in states if s.metrics))
        starting = self.actuator.starting(model) if self.actuator is not None else 0
        return FleetSample(
            at_s=now,
            replicas=len(states),
            starting=starting,
            kv_capacity_tokens=int(statistics.median(capacities)),
            kv_used_tokens=used,
            peak_used_tokens=max(held),
            # a queued request will hold about what a running one holds, and so will a batch
            # item still to run
            waiting_tokens=int(waiting * mean_tokens),
            deferred_tokens=int(self.deferred_items(model) * mean_tokens),
            reserved_only=sum(1 for s in states if s.reserved_only),
        )

    async def _act(self, model: str, desired: int) -> None:
        assert self.actuator is not None
        live = [s for s in self.fleet.replicas(model) if not s.draining]
        have = len(live) + self.actuator.starting(model)
        for _ in range(desired - have):
            log.info("scaling %s up to %d replicas", model, desired)
            await self.actuator.add(model)
        if desired < have and not self.actuator.starting(model) and len(live) > 1:
            # Drain the least loaded shared replica; it is removed once it serves nothing.
            victim = min(
                (s for s in live if not s.reserved_only),
                key=lambda s: s.effective_occupancy_ppm(),
                default=None,
            )
            if victim is not None:
                log.info("scaling %s down to %d replicas: draining %s", model, desired,
                         victim.replica_id)
                self.fleet.drain(victim.replica_id)
        for s in list(self.fleet.replicas(model)):
            if s.draining and self.fleet.drained(s.replica_id):
                self.fleet.remove(s.replica_id)
                await self.actuator.remove(s.replica_id)

    def view(self) -> dict[str, Any]:
        """GET /v1/fleet: every replica as the router sees it, and per model the signal."""
        models: dict[str, Any] = {}
        for model in self.fleet.models():
            scaler = self.scalers.get(model)
            models[model] = {
                "replicas": len([s for s in self.fleet.replicas(model) if not s.draining]),
                "starting": self.actuator.starting(model) if self.actuator else 0,
                "desired_replicas": scaler.terms.desired_replicas if scaler and scaler.terms
                else None,
                "terms": asdict(scaler.terms) if scaler and scaler.terms else None,
            }
        replicas = [
            {
                "replica_id": s.replica_id,
                "model": s.model,
                "healthy": s.healthy,
                "draining": s.draining,
                "reserved_only": s.reserved_only,
                "kv_occupancy": round(s.kv_usage, 4),
                "effective_occupancy": round(s.effective_occupancy_ppm() / 1e6, 4),
                "kv_capacity_tokens": s.capacity_tokens,
                "running": s.metrics.running if s.metrics else None,
                "waiting": s.metrics.waiting if s.metrics else None,
                "last_error": s.last_error,
            }
            for s in self.fleet.replicas()
        ]
        return {"policy": asdict(self.policy), "models": models, "replicas": replicas}
