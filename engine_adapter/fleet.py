"""The fleet: replicas per model version, a /metrics scraper, and the power-of-two-choices router.

The policy (tier ceilings, p2c) is pure and lives in `domain.capacity`; this module only keeps the
soft per-router state it needs: last scrape, optimistic in-flight KV, health, measured TPOT.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import math
import random
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp

from tollgate_llm.domain.capacity import (
    DEFAULT_FLEX,
    PPM,
    AdapterRef,
    CapacityRefusal,
    Choice,
    FlexPolicy,
    Placed,
    Placement,
    Preemption,
    Refusal,
    ReplicaLoad,
    TpotEstimate,
    UnknownModel,
    adapter_rounds,
    effective_occupancy_ppm,
    place,
    place_flex,
    preemption_plan,
    slot_plan,
    tier_ceiling_ppm,
)
from tollgate_llm.domain.residency import REGION_UNAVAILABLE, in_region
from tollgate_llm.engine_adapter.lora import (
    AdapterBound,
    ReplicaLoras,
    ScrapedReplica,
    fetch_adapters,
)
from tollgate_llm.engine_adapter.vllm_http import (
    ReplicaMetrics,
    ReplicaSlow,
    ReplicaUnavailable,
    check_health,
    fetch_metrics,
)

__all__ = [
    "Choice", "Fleet", "OthersFlex", "Refusal", "ReplicaState", "ScrapedReplica", "TpotEstimate",
    "UnknownModel", "histogram_quantile",
]

TPOT_WINDOW_S = 30.0


@dataclass
class ReplicaState:
    replica: ScrapedReplica
    reserved_only: bool = False
    region: str = ""  # where it runs (`--replica MODEL=URL@REGION`); "" when not given
    healthy: bool = False
    last_error: str | None = None
    metrics: ReplicaMetrics | None = None
    scraped_at: float | None = None  # monotonic
    scraped_occupancy_ppm: int = PPM
    capacity_tokens: int = 0
    # Tokens dispatched by this router that the last scrape may not show yet, by dispatch id, in
    # dispatch order: (dispatched_at, tokens).
    inflight: dict[int, tuple[float, int]] = field(default_factory=dict)
    inflight_tokens: int = 0
    # Flex requests this router runs there, in dispatch order: dispatch id -> (request id,
    # estimated KV tokens). What preemption may free.
    flex: dict[int, tuple[str, int]] = field(default_factory=dict)
    # KV of preempted flex requests that the last scrape may still show, with the instant the
    # preemption was decided: subtracted from the occupancy until a scrape started after it.
    freed: list[tuple[float, int]] = field(default_factory=list)
    freed_tokens: int = 0
    health_ok: bool = True
    slow: bool = False  # its last probe timed out (connected, no answer): see Fleet._scrape
    draining: bool = False  # takes no new request; removed once what it serves has ended
    # (scraped_at, cumulative TPOT bucket counts) within the TPOT window
    tpot_samples: deque[tuple[float, tuple[tuple[float, int], ...]]] = field(default_factory=deque)
    # Its LoRA slots and the adapters it holds (engine_adapter/lora.py).
    loras: ReplicaLoras = field(default_factory=ReplicaLoras)

    @property
    def replica_id(self) -> str:
        return self.replica.replica_id

    @property
    def model(self) -> str:
        return self.replica.model

    @property
    def kv_usage(self) -> float:
        """Last scraped KV occupancy, 0..1 (for dashboards; routing uses the ppm fields)."""
        return self.scraped_occupancy_ppm / PPM if self.scraped_at is not None else 0.0

    def effective_occupancy_ppm(self) -> int:
        return effective_occupancy_ppm(
            self.scraped_occupancy_ppm,
            self.inflight_tokens - self.freed_tokens,
            self.capacity_tokens,
        )

    def take_scrape(self, m: ReplicaMetrics, *, scrape_started_at: float, now: float) -> None:
        """A scrape asked for at `scrape_started_at` and read at `now` (monotonic seconds)."""
        self.metrics = m
        self.scraped_at = now
        self.loras.reported = m.max_loras
        self.slow = False
        self.scraped_occupancy_ppm = max(0, min(PPM, round(m.kv_cache_usage * PPM)))
        cap = m.kv_capacity_tokens
        if cap:
            self.capacity_tokens = cap
        # What was dispatched before this scrape was asked for is now in the engine's own number
        # (queued or running); keep only what went out while the scrape was in flight.
        while self.inflight:
            first = next(iter(self.inflight))
            at, tokens = self.inflight[first]
            if at >= scrape_started_at:
                break
            del self.inflight[first]
            self.inflight_tokens -= tokens
        while self.freed and self.freed[0][0] < scrape_started_at:  # the engine's number shows it
            self.freed_tokens -= self.freed.pop(0)[1]
        self.healthy = self.health_ok and self.capacity_tokens > 0
        unhealthy = self.last_error or "no capacity info / health failed"
        self.last_error = None if self.healthy else unhealthy
        window = self.tpot_samples
        if window and m.tpot_count < (window[-1][1][-1][1] if window[-1][1] else 0):
            window.clear()  # counters went backwards: the replica restarted
        window.append((now, m.tpot_buckets))
        while len(window) > 1 and window[1][0] <= now - TPOT_WINDOW_S:
            window.popleft()

    def free(self, victims: set[str], now: float) -> None:
        """Stop counting the victims as flex work here, and count their KV as free until a
        scrape that started after their abort shows it."""
        for dispatch_id, (rid, tokens) in list(self.flex.items()):
            if rid in victims:
                del self.flex[dispatch_id]
                self.freed.append((now, tokens))
                self.freed_tokens += tokens

    def load(self) -> ReplicaLoad:
        cap = self.capacity_tokens
        flex = tuple(
            (rid, tokens * PPM // cap if cap > 0 else PPM) for rid, tokens in self.flex.values()
        )
        occupancy = self.effective_occupancy_ppm()
        return ReplicaLoad(self.replica_id, occupancy, self.reserved_only, flex, self.region)


class OthersFlex(Protocol):
    """Flex work that other edges serve on the replicas (`domain.remote_flex.RemoteFlex`, folded
    from the shared log): consulted only when an interactive request found no room."""

    def preemptible(self, replica_id: str) -> tuple[tuple[str, int], ...]:
        """(request id, estimated KV tokens) of those no edge asked to preempt, oldest first."""
        ...

    def asked_tokens(self, replica_id: str) -> int:
        """The KV tokens of those asked to preempt that have not ended yet."""
        ...


class Fleet:
    """Registry, scraper and router. One per gateway process; all methods run on one event loop."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        scrape_interval_s: float = 0.25,
        health_every: int = 8,
        stale_after_s: float = 2.0,
        slow_grace_s: float = 10.0,
        scrape_timeout_s: float = 1.0,
        flex: FlexPolicy = DEFAULT_FLEX,
    ) -> None:
        self._session = session
        self.flex_policy = flex
        self.scrape_interval_s = scrape_interval_s
        self.health_every = health_every
        self.stale_after_s = stale_after_s
        self.slow_grace_s = slow_grace_s
        self.scrape_timeout_s = scrape_timeout_s
        self._by_model: dict[str, list[ReplicaState]] = {}
        self._by_id: dict[str, ReplicaState] = {}
        self._ids = itertools.count(1)
        self._task: asyncio.Task[None] | None = None
        self._tick = 0
        self._tpot: dict[str, tuple[int, int, float]] = {}  # model -> (p95_us, samples, at)
        # Flex work of other edges sharing these replicas (set by the wiring when edges share a
        # store); None: this router's own flex work is all it may preempt.
        self.others_flex: OthersFlex | None = None

    # -- registry

    def add(self, replica: ScrapedReplica, reserved_only: bool = False, region: str = "") -> None:
        """Route to `replica` (built by the caller: the composition root, or a test), which
        runs in `region` ("": not said, so it serves no request pinned to regions)."""
        if replica.replica_id in self._by_id:
            raise ValueError(f"replica {replica.replica_id!r} already registered")
        state = ReplicaState(replica, reserved_only=reserved_only, region=region)
        self._by_id[replica.replica_id] = state
        self._by_model.setdefault(replica.model, []).append(state)

    def remove(self, replica_id: str) -> None:
        state = self._by_id.pop(replica_id)
        state.replica.close()
        states = self._by_model[state.replica.model]
        states.remove(state)
        if not states:
            del self._by_model[state.replica.model]

    def drain(self, replica_id: str) -> None:
        """Route nothing new to the replica (the requests it serves run to their end)."""
        self._by_id[replica_id].draining = True

    def drained(self, replica_id: str) -> bool:
        """A draining replica that serves nothing any more: neither its last scrape nor this
        router's dispatches since show a request on it."""
        s = self._by_id[replica_id]
        m = s.metrics
        return s.draining and not s.inflight and (m is None or m.running + m.waiting == 0)

    def models(self) -> list[str]:
        return sorted(self._by_model)

    @property
    def serves(self) -> Mapping[str, object]:
        """The model versions with replicas, for membership tests (`model in fleet.serves`)."""
        return self._by_model

    def context_tokens(self, model: str) -> int | None:
        known = [
            s.replica.max_model_len
            for s in self._by_model.get(model, ())
            if s.replica.max_model_len is not None
        ]
        return min(known) if known else None

    def replicas(self, model: str | None = None) -> list[ReplicaState]:
        if model is None:
            return list(self._by_id.values())
        return list(self._by_model.get(model, ()))

    def state(self, replica_id: str) -> ReplicaState:
        return self._by_id[replica_id]

    def healthy_count(self, model: str | None = None) -> int:
        """Replicas that would receive traffic now (healthy and freshly scraped)."""
        now = time.monotonic()
        return sum(1 for s in self.replicas(model) if self._is_routable(s, now))

    # -- scraping

    async def start(self) -> None:
        """Scrape every replica once, then keep scraping in the background."""
        await self.refresh(check_health_too=True)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="fleet-scraper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for state in self._by_id.values():
            state.replica.close()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.scrape_interval_s)
            self._tick += 1
            await self.refresh(check_health_too=self._tick % self.health_every == 0)

    async def refresh(self, *, check_health_too: bool = False) -> None:
        states = list(self._by_id.values())
        if states:
            await asyncio.gather(*(self._scrape(s, check_health_too) for s in states))
        self._update_tpot(time.monotonic())

    async def _scrape(self, s: ReplicaState, check_health_too: bool) -> None:
        started = time.monotonic()
        url = s.replica.url
        try:
            if check_health_too:
                m, ok = await asyncio.gather(
                    fetch_metrics(self._session, url, timeout_s=self.scrape_timeout_s),
                    check_health(self._session, url, timeout_s=self.scrape_timeout_s),
                )
                s.health_ok = ok
                if s.loras.max_loras:
                    served = getattr(s.replica, "served_model", s.replica.model)
                    s.loras.sync(await fetch_adapters(self._session, url, served))
            else:
                m = await fetch_metrics(self._session, url, timeout_s=self.scrape_timeout_s)
        except ReplicaSlow as e:
            # Busy, not dead (a vLLM API server on a loaded host can stall for seconds while its
            # engine generates): keep routing on the last scrape and this router's own
            # dispatches, which only overstate the load, for up to `slow_grace_s`.
            s.slow = True
            s.last_error = str(e)
            return
        except ReplicaUnavailable as e:
            s.healthy = False
            s.last_error = str(e)
            return
        except ValueError as e:  # unparsable exposition
            s.healthy = False
            s.last_error = f"bad /metrics: {e}"
            return
        self.apply_scrape(s, m, scrape_started_at=started, now=time.monotonic())

    def apply_scrape(
        self, s: ReplicaState, m: ReplicaMetrics, *, scrape_started_at: float, now: float
    ) -> None:
        """Take a scrape into the replica's state (public so tests can feed scrapes directly)."""
        s.take_scrape(m, scrape_started_at=scrape_started_at, now=now)

    def _is_routable(self, s: ReplicaState, now: float) -> bool:
        if s.draining or not s.healthy or s.scraped_at is None or s.capacity_tokens <= 0:
            return False
        age = now - s.scraped_at
        if s.slow:  # connected, not answering: its last scrape holds for the grace only
            return age <= self.slow_grace_s
        # It answered its last probe. A scrape older than that is our own scraper running late
        # (this loop busy), not the replica's silence: route on it while the scraper runs.
        return age <= self.stale_after_s or self.scraping

    @property
    def scraping(self) -> bool:
        """Whether the periodic scraper is running (after `start`, until `stop`)."""
        return self._task is not None and not self._task.done()

    # -- routing

    def choose(
        self, model: str, tier: str, est_kv_tokens: int, rng: random.Random, *,
        service_tier: str = "default", request_id: str = "",
        regions: frozenset[str] | None = None, adapter: AdapterRef | None = None,
    ) -> Choice[ScrapedReplica] | Refusal | UnknownModel:  # fmt: skip
        """Pick a replica of `model` for a request of `tier` by p2c, under the tier's ceiling
        (a flex request: under the flex ceiling).

        `regions` (a pinned tenant's): only replicas in them are considered, for every step
        below (placement, preemption, other edges' flex work), so none elsewhere is ever chosen
        (`domain.residency`); with none of the model there, the refusal is `region_unavailable`.

        `adapter`: only replicas with a slot for it, those holding it first (`_bind`).

        An interactive request that no replica has room for, where some replica would have room
        without flex work this router runs there, is placed there and its `Choice.preempt` names
        the flex requests to abort (their KV is counted free from now). On success the request's
        estimated KV is added to the replica's optimistic in-flight count until the next scrape
        (or `release`).
        """
        states = self._by_model.get(model)
        if not states:
            return UnknownModel(model)
        if regions is not None:
            states = [s for s in states if in_region(s.region, regions)]
            if not states:
                return Refusal(model, REGION_UNAVAILABLE, 0)
        now = time.monotonic()
        routable = {s.replica_id: s for s in states if self._is_routable(s, now)}
        loads = [s.load() for s in routable.values()]
        flex = service_tier == "flex"
        rounds = [loads] if adapter is None else adapter_rounds(
            adapter.engine_name, loads, lambda rid: routable[rid].loras.slots()
        )  # fmt: skip
        ceiling = self.flex_policy.ceiling_ppm if flex else tier_ceiling_ppm(tier)
        decision: Placement | CapacityRefusal = CapacityRefusal("no_adapter_slot", ceiling)
        victims: tuple[str, ...] = ()
        remote: tuple[str, ...] = ()
        for candidates in rounds:
            if candidates or adapter is None:
                decision, victims, remote = _place(self, tier, candidates, routable, rng, flex, now)
            if isinstance(decision, Placement):
                break
        if isinstance(decision, CapacityRefusal):
            return Refusal(
                model, decision.detail, decision.ceiling_ppm, decision.best_occupancy_ppm,
                decision.reason,
            )  # fmt: skip
        s = routable[decision.replica_id]
        dispatch_id = next(self._ids)
        tokens = max(0, est_kv_tokens)
        s.inflight[dispatch_id] = (now, tokens)
        s.inflight_tokens += tokens
        if flex:
            s.flex[dispatch_id] = (request_id, tokens)
        replica: ScrapedReplica = s.replica
        if adapter is not None:
            replica = _bind(s, adapter, dispatch_id, self._session)
        return Choice(replica, decision.occupancy_ppm, tokens, dispatch_id, victims, remote,
                      s.region)  # fmt: skip

    def release(self, choice: Choice[Placed]) -> None:
        """The request ended. If no scrape has absorbed it yet, stop counting its KV."""
        s = self._by_id.get(choice.replica_id)
        if s is None:
            return
        s.loras.release(choice.dispatch_id)
        s.flex.pop(choice.dispatch_id, None)
        entry = s.inflight.pop(choice.dispatch_id, None)
        if entry is not None:
            s.inflight_tokens -= entry[1]

    # -- measured TPOT

    def _update_tpot(self, now: float) -> None:
        for model, states in self._by_model.items():
            merged: dict[float, int] = {}
            for s in states:
                if len(s.tpot_samples) < 2 or not s.healthy:
                    continue
                old = dict(s.tpot_samples[0][1])
                for bound, count in s.tpot_samples[-1][1]:
                    merged[bound] = merged.get(bound, 0) + count - old.get(bound, 0)
            buckets = sorted(merged.items())
            p95 = histogram_quantile(0.95, buckets)
            if p95 is not None:
                self._tpot[model] = (round(p95 * 1_000_000), buckets[-1][1], now)

    def tpot_p95(self, model: str) -> TpotEstimate | None:
        """p95 TPOT over the last 30 s from /metrics bucket deltas, and how old that reading is.
        None until a window has held at least one finished request."""
        got = self._tpot.get(model)
        if got is None:
            return None
        p95_us, samples, at = got
        return TpotEstimate(p95_us, samples, time.monotonic() - at)


def _place(
    fleet: Fleet, tier: str, loads: list[ReplicaLoad], routable: dict[str, ReplicaState],
    rng: random.Random, flex: bool, now: float,
) -> tuple[Placement | CapacityRefusal, tuple[str, ...], tuple[str, ...]]:  # fmt: skip
    """The placement among `loads` (p2c under the ceiling, then flex preemption: this
    router's flex work, then other edges'), the flex requests it preempts, and those of
    them that other edges serve."""
    decision = (
        place_flex(loads, rng.sample, fleet.flex_policy)
        if flex
        else place(tier, loads, rng.sample)
    )
    if not isinstance(decision, CapacityRefusal) or flex:
        return decision, (), ()
    plan = preemption_plan(tier, loads)
    if plan is None and fleet.others_flex is not None:
        among = {load.replica_id: routable[load.replica_id] for load in loads}
        decision, plan = _with_others_flex(fleet.others_flex, tier, among, rng, decision)
    if plan is None:
        return decision, (), ()
    s = routable[plan.replica_id]
    own = {rid for rid, _ in s.flex.values()}
    remote = tuple(v for v in plan.victims if v not in own)
    s.free(own.intersection(plan.victims), now)
    return Placement(plan.replica_id, plan.occupancy_ppm), plan.victims, remote


def _bind(
    s: ReplicaState, adapter: AdapterRef, dispatch_id: int, session: aiohttp.ClientSession
) -> AdapterBound:
    """Hold the adapter's slot on the chosen replica for this request, and the replica as
    the request will open it: loading the adapter first where it is not held yet.

    `Fleet.choose` offers an adapter's request only the replicas with a slot for it, in two
    rounds (`domain.capacity.adapter_rounds`): those that hold it, then those that would load
    it (into a free slot, or the slot of their least recently used idle adapter). With no slot
    on any replica of the model the refusal is `no_adapter_slot` (a 503, like any capacity)."""
    plan = slot_plan(adapter.engine_name, s.loras.slots())
    assert plan is not None  # adapter_rounds offered only replicas with a slot
    s.loras.take(adapter, plan, dispatch_id)
    url, name = s.replica.url, adapter.engine_name
    return AdapterBound(
        s.replica, adapter, lambda: s.loras.ready(name, session, url),
        lambda: s.loras.gone(name),
    )  # fmt: skip


def _with_others_flex(
    others: OthersFlex, tier: str, routable: dict[str, ReplicaState], rng: random.Random,
    refused: CapacityRefusal,
) -> tuple[Placement | CapacityRefusal, Preemption | None]:  # fmt: skip
    """The interactive request again, with the flex work other edges serve counted: the KV
    of what some edge already asked to preempt as free (it is being aborted), and the rest
    as preemptible behind this router's own flex work (which is aborted first: at once,
    where another edge's takes a trip through the log)."""
    loads, widened = [], False
    for s in routable.values():
        load = s.load()
        theirs = others.preemptible(s.replica_id)
        asked = others.asked_tokens(s.replica_id)
        cap = s.capacity_tokens
        if (theirs or asked) and cap > 0:
            widened = True
            load = ReplicaLoad(
                load.replica_id, max(0, load.occupancy_ppm - asked * PPM // cap),
                load.reserved_only,
                (*((rid, tokens * PPM // cap) for rid, tokens in theirs), *load.flex),
                load.region,
            )
        loads.append(load)
    if not widened:
        return refused, None
    placed = place(tier, loads, rng.sample)
    if isinstance(placed, Placement):
        return placed, None
    return refused, preemption_plan(tier, loads)


def histogram_quantile(q: float, buckets: list[tuple[float, int]]) -> float | None:
    """Prometheus-style quantile from cumulative (upper bound, count) buckets, linear within a
    bucket. None when the buckets hold no observation."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    counts = [c for _, c in buckets]
    i = bisect.bisect_left(counts, rank)
    i = min(i, len(buckets) - 1)
    upper, c_hi = buckets[i]
    lower, c_lo = (0.0, 0) if i == 0 else buckets[i - 1]
    if math.isinf(upper):
        return lower  # as Prometheus: the highest finite bound
    if c_hi == c_lo:
        return upper
    return lower + (upper - lower) * (rank - c_lo) / (c_hi - c_lo)
