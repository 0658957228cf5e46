"""`tollgate router evaluate`: generated traffic (traffic.py, a known ground truth per task kind)
replayed through the real admission (`Admission.admit` with its RoutingStep, the quota views,
the fleet's replica choice over `engine_adapter.fleet.Fleet`, the Recorder deciding each
request's events), in simulated time, once per policy:

- `asked`: every request names the reference model (the large one): today without a router.
- `router`: every request asks for `auto`, with the tenants' consent (`RoutingAllowed`); the
  customers score a share of their answers (drawn from the ground truth), each score decided by
  `domain.feedback.decide_feedback` on the request's folded state and folded into the router's
  `QualityView` as the edge's feedback service does.
- `oracle`: every request names the cheapest model whose true quality meets the bar (with the
  consent to fall back to the large one when the small fleet is full, as the router sheds).

A request holds its KV on its replica from admission to its end (its model's TTFT and per-token
time), so a small fleet sized for part of the traffic refuses or sheds what routing sends it
beyond that. Figures per policy: cost, the saving against `asked`, bar attainment (the share of
answers from a model whose true quality meets the bar), share routed away from the reference,
capacity refusals, and the decisions' reasons; then the routing step's own cost at admission.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import itertools
import os
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import aiohttp
import orjson

from tollgate_llm.api.metrics import Metrics
from tollgate_llm.api.ports import EventSink, TokenEstimator
from tollgate_llm.api.router_evaluation.traffic import (
    LARGE,
    MODELS,
    PRICES,
    SMALL,
    SPEED_MS,
    TENANTS,
    Planned,
)
from tollgate_llm.api.services.admission import Admission, Refused, system_prompt_bucket
from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.chat_request import parse_chat_request
from tollgate_llm.api.services.outcomes import Outcomes
from tollgate_llm.api.services.recorder import Flight, Recorder
from tollgate_llm.api.services.routing_step import REFRESH_S, RoutingStep
from tollgate_llm.domain.admission import DEFAULT_POLICY
from tollgate_llm.domain.control_plane.decide import (
    AllowFallback,
    AllowRouting,
    ControlCommand,
    IssueApiKey,
    RegisterTenant,
    SetLimits,
    SetPrice,
)
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.cost import amount_micros, base_model
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.feedback import RecordFeedback, decide_feedback
from tollgate_llm.domain.governance.budgets import PathView
from tollgate_llm.domain.quota import QuotaView
from tollgate_llm.domain.refusals import RefusalSampler
from tollgate_llm.domain.remote_flex import RemoteFlex
from tollgate_llm.domain.requests.decide import AdmitRequest, CompleteRequest
from tollgate_llm.domain.requests.events import FeedbackRecorded, RequestModelRouted
from tollgate_llm.domain.router_model import RouterModel
from tollgate_llm.domain.routing import AUTO, QualityView, choose
from tollgate_llm.domain.views import AdmissionViews
from tollgate_llm.engine_adapter.estimators import WordTokenEstimator
from tollgate_llm.engine_adapter.fleet import Fleet
from tollgate_llm.engine_adapter.vllm_http import ReplicaMetrics
from tollgate_llm.ledger.store import AppendBatch, AppendResult

__all__ = ["POLICIES", "Setup", "evaluate", "inference"]

POLICIES = ("asked", "router", "oracle")
# `router_model`: the router with a model trained on the feedback logged so far, refitted this
# many times over the replay (as an operator would run `tollgate router train` nightly).
RETRAINS = 10
# Fits a model to the feedback of the log (predictor.router_train.fit, given by the caller: the
# replay itself never imports torch).
Train = Callable[[Sequence[FeedbackRecorded]], "RouterModel | None"]
VERSION = "2026-05"  # the versions the fleet serves: llama-3.1-8b-2026-05, ...
START = datetime(2026, 5, 4, 9, tzinfo=UTC)
BLOCK_TOKENS = 16


@dataclass(frozen=True)
class Setup:
    bar: float = 0.8
    exploration: float = 0.05
    on_capacity: str = "asked"
    feedback_share: float = 0.3  # of answers the customer scores
    # The small fleet is sized for part of the traffic (one replica with a fifth of the KV of
    # each large one): what routing sends it beyond that is shed or refused.
    small_replicas: int = 1
    small_kv_tokens: int = 40_000
    large_replicas: int = 4
    large_kv_tokens: int = 200_000
    seed: int = 0  # of the policy's draws (replica choice, exploration, feedback)


@dataclass
class Outcome:
    policy: str
    requests: int = 0
    admitted: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    cost_micros: int = 0
    met_bar: int = 0
    true_quality_sum: float = 0.0
    routed_away: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    served: Counter[tuple[str, str]] = field(default_factory=Counter)  # (kind, base model)
    kind_met: Counter[str] = field(default_factory=Counter)
    kind_admitted: Counter[str] = field(default_factory=Counter)
    drifted: Counter[str] = field(default_factory=Counter)  # the drifting kind after the drift
    scores: int = 0
    decisions_recorded: int = 0  # RequestModelRouted events the recorder decided
    route_ns: list[int] = field(default_factory=list)  # each routing decision's wall time
    route_cpu_ns: list[int] = field(default_factory=list)  # and its thread's CPU time
    trainings: list[dict[str, Any]] = field(default_factory=list)  # router_model: each refit

    def summary(self, asked: Outcome | None, oracle: Outcome | None) -> dict[str, Any]:
        def share(n: float, d: float) -> float | None:
            return round(n / d, 4) if d else None

        kinds = sorted(self.kind_admitted)
        return {
            "policy": self.policy,
            "requests": self.requests,
            "admitted": self.admitted,
            "refused": dict(sorted(self.refused.items())),
            "capacity_refusals": self.refused.get("capacity", 0),
            "cost_micros": self.cost_micros,
            "cost_per_admitted_micros": share(self.cost_micros, self.admitted),
            "saving_vs_asked": None if asked is None or not asked.cost_micros else round(
                1 - self.cost_micros / asked.cost_micros, 4),
            "cost_vs_oracle": None if oracle is None or not oracle.cost_micros else round(
                self.cost_micros / oracle.cost_micros, 4),
            "bar_attainment": share(self.met_bar, self.admitted),
            "mean_true_quality": share(self.true_quality_sum, self.admitted),
            "share_routed_away": share(self.routed_away, self.admitted),
            "reasons": dict(sorted(self.reasons.items())),
            "scores_recorded": self.scores,
            "decisions_recorded": self.decisions_recorded,
            "routing_step": _timing(self.route_ns),
            "routing_step_cpu": _timing(self.route_cpu_ns),
            "trainings": self.trainings,
            "by_kind": {k: {
                "admitted": self.kind_admitted[k],
                "small_share": share(self.served[(k, SMALL)], self.kind_admitted[k]),
                "bar_attainment": share(self.kind_met[k], self.kind_admitted[k]),
            } for k in kinds},
            "drifted_kind_after_drift": {
                "admitted": self.drifted["admitted"],
                "bar_attainment": share(self.drifted["met"], self.drifted["admitted"]),
                "last_quarter_attainment": share(self.drifted["late_met"], self.drifted["late"]),
            },
        }  # fmt: skip


class _Sink(EventSink):
    """Takes every append at once and keeps nothing but a count of the routing decisions: the
    replay needs the decided state (each flight's), not a log."""

    def __init__(self) -> None:
        self.routed = 0

    def commit(self, batch: AppendBatch) -> asyncio.Future[AppendResult]:
        self.routed += sum(isinstance(e.event, RequestModelRouted) for e in batch.events)
        future: asyncio.Future[AppendResult] = asyncio.get_running_loop().create_future()
        future.set_result(AppendResult(batch.stream_id))
        return future

    later = commit


@dataclass
class _Seat:
    """A replica as the fleet keeps it, with nothing behind it: the replay never opens a chat."""

    replica_id: str
    url: str
    model: str
    max_model_len: int | None = None

    def close(self) -> None:
        pass

    async def open_chat(self, body: dict[str, Any], **kw: Any) -> Any:
        raise AssertionError("the replay sends nothing to an engine")


class _Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> datetime:
        return self.now


class _World:
    """One policy's admission, built as the edge builds it (api/services/edge.py)."""

    def __init__(self, policy: str, setup: Setup, callers: dict[str, Caller]) -> None:
        self.policy = policy
        self.clock = _Clock()
        self.control = _control(policy, setup, callers)
        self.fleet = _fleet(setup)
        self.sink = _Sink()
        metrics = Metrics()
        metrics.models.known = frozenset(self.fleet.models())
        rng = random.Random(setup.seed)
        ids = itertools.count(1)
        self.new_id = lambda: f"evt-{next(ids)}"
        self.recorder = Recorder(self.sink, metrics, clock=self.clock, new_id=self.new_id)
        views = AdmissionViews(
            QuotaView(self.control.limits),
            PathView(backoff=DEFAULT_POLICY.backoff,
                     rates_for=lambda *level: self.control.hierarchy.level_rates(*level)),
            RemoteFlex("eval"),
        )  # fmt: skip
        outcomes = Outcomes(control=self.control, metrics=metrics, recorder=self.recorder,
                            refusals=RefusalSampler(), clock=self.clock)  # fmt: skip
        estimator = WordTokenEstimator()
        self.quality = QualityView()
        self.feedback: list[FeedbackRecorded] = []  # the log's feedback, for `router_model`
        self.admission = Admission(
            control=self.control, views=views, fleet=self.fleet, metrics=metrics,
            tokens=lambda model: estimator, recorder=self.recorder, reject=outcomes.reject,
            preempt=lambda ids, by: None, edge_id="eval", rng=rng, clock=self.clock,
            policy=DEFAULT_POLICY, predictor=None, tpot_target_us=40_000, quality=self.quality,
        )  # fmt: skip
        # Each routing decision's wall time, as admission made it during the replay.
        self.route_ns: list[int] = []
        self.route_cpu_ns: list[int] = []  # the same, as the thread's CPU time
        if policy.startswith("router"):
            self._time_routing()

    def _time_routing(self) -> None:
        """Time each `RoutingStep.route` as admission calls it, less the prompt count it makes
        for admission's quota step (which admission makes with or without a router)."""
        step = self.admission.router
        route, tokens, clock, samples = step.route, step.tokens, time.perf_counter_ns, self.route_ns
        counting = [0]

        class _Timed:
            def __init__(self, inner: TokenEstimator) -> None:
                self.inner = inner

            def prompt_tokens(self, messages: Any, tools: Any = None) -> int:
                t0 = clock()
                n = self.inner.prompt_tokens(messages, tools)
                counting[0] += clock() - t0
                return n

            def __getattr__(self, name: str) -> Any:
                return getattr(self.inner, name)

        cpu, cpu_samples = time.thread_time_ns, self.route_cpu_ns

        def timed(*args: Any) -> Any:
            counting[0] = 0
            c0 = cpu()
            t0 = clock()
            answer = route(*args)
            t1 = clock()
            c1 = cpu()
            samples.append(t1 - t0 - counting[0])
            cpu_samples.append(c1 - c0 - counting[0])
            return answer

        wrapped: dict[int, TokenEstimator] = {}

        def timed_tokens(model: str) -> TokenEstimator:
            inner = tokens(model)
            found = wrapped.get(id(inner))
            if found is None:
                found = wrapped[id(inner)] = cast(TokenEstimator, _Timed(inner))
            return found

        # Admission's own estimators the same objects, so that it takes the router's count.
        step.tokens = self.admission.tokens = timed_tokens
        step.route = timed  # type: ignore[method-assign]


async def evaluate(
    traffic: list[Planned], setup: Setup, train: Train | None = None
) -> dict[str, Any]:
    """Each policy replayed; with `train`, `router_model` too (the router reading a model
    refitted RETRAINS times on the feedback logged so far)."""
    callers = {
        t: Caller(f"key-{t}", t, "customer", "enterprise", "salt") for t in TENANTS
    }  # fmt: skip
    outcomes: dict[str, Outcome] = {}
    worlds: dict[str, _World] = {}
    load = os.getloadavg()
    for policy in POLICIES + (("router_model",) if train is not None else ()):
        worlds[policy] = _World(policy, setup, callers)
        outcomes[policy] = await _replay(worlds[policy], traffic, setup, callers, train)
    asked, oracle = outcomes["asked"], outcomes["oracle"]
    return {
        "setup": setup.__dict__,
        "load_average": {"before": [round(x, 2) for x in load],
                         "after": [round(x, 2) for x in os.getloadavg()]},  # fmt: skip
        "policies": {p: o.summary(asked, oracle) for p, o in outcomes.items()},
        "router_world": worlds["router"],  # for `inference`, popped by the caller
    }


async def _replay(
    world: _World, traffic: list[Planned], setup: Setup, callers: dict[str, Caller],
    train: Train | None = None,
) -> Outcome:  # fmt: skip
    policy = world.policy
    out = Outcome(policy)
    refit_every = max(1, len(traffic) // RETRAINS) if policy == "router_model" else 0
    refresh_at = START
    draws = random.Random(setup.seed + 1)
    ends: list[tuple[datetime, int, Flight, Planned]] = []
    late = len(traffic) * 3 // 4
    for n, planned in enumerate(traffic):
        at = START + timedelta(seconds=planned.at_s)
        while ends and ends[0][0] <= at:
            ended_at, _, flight, done = heapq.heappop(ends)
            world.clock.now = ended_at
            _end(world, flight, done, setup, draws, out)
        world.clock.now = at
        if at >= refresh_at:  # as the edge's runtime does, every REFRESH_S, off the request path
            world.admission.router.refresh()
            refresh_at = at + timedelta(seconds=REFRESH_S)
        if refit_every and n and n % refit_every == 0 and train is not None:
            _refit(world, train, n, out)
        out.requests += 1
        ask = AUTO if policy.startswith("router") else (
            planned.good_enough(setup.bar) if policy == "oracle" else LARGE
        )  # fmt: skip
        req = parse_chat_request(orjson.dumps({**planned.body, "model": ask}))
        model = world.admission.resolve_model(req.model)
        assert model is not None, ask
        answer = world.admission.admit(
            callers[planned.tenant], req, model, f"req_{n:032x}", None, False, {}
        )
        if isinstance(answer, Refused):
            reason = "capacity" if answer.error.status == 503 else answer.error.code or "other"
            out.refused[reason] += 1
            continue
        flight = answer.flight
        world.recorder.commit(flight, *answer.commands)
        routed = next(
            (c.routed for c in answer.commands if isinstance(c, AdmitRequest) and c.routed), None
        )
        _admitted(out, flight, planned, setup, n >= late, routed)
        ttft_ms, per_token_ms = SPEED_MS[base_model(flight.model)]
        ended_at = at + timedelta(milliseconds=ttft_ms + per_token_ms * planned.output_tokens)
        heapq.heappush(ends, (ended_at, n, flight, planned))
        if n % 64 == 0:
            await asyncio.sleep(0)  # the recorder's callbacks
    while ends:
        ended_at, _, flight, done = heapq.heappop(ends)
        world.clock.now = ended_at
        _end(world, flight, done, setup, draws, out)
    out.decisions_recorded = world.sink.routed
    out.route_ns, out.route_cpu_ns = world.route_ns, world.route_cpu_ns
    return out


def _refit(world: _World, train: Train, n: int, out: Outcome) -> None:
    started = time.monotonic()
    model = train(world.feedback)
    world.quality.use_model(model)
    out.trainings.append({
        "at_request": n, "feedback": len(world.feedback),
        "covered": len(world.quality.learned), "seconds": round(time.monotonic() - started, 2),
    })  # fmt: skip


def _timing(samples_ns: list[int]) -> dict[str, Any] | None:
    """p50 / p99 / p99.9 / max of the routing decisions timed in a replay, in µs."""
    if not samples_ns:
        return None
    s = sorted(samples_ns)

    def at(q: float) -> float:
        return round(s[min(len(s) - 1, int(len(s) * q))] / 1000, 2)

    return {"decisions": len(s), "p50_us": at(0.5), "p99_us": at(0.99), "p999_us": at(0.999),
            "max_us": round(s[-1] / 1000, 2)}  # fmt: skip


def _admitted(
    out: Outcome, flight: Flight, planned: Planned, setup: Setup, late: bool,
    routed: RequestModelRouted | None,
) -> None:  # fmt: skip
    served = base_model(flight.model)
    quality = planned.quality(served)
    met = quality >= setup.bar
    kind = planned.kind.name
    out.admitted += 1
    out.met_bar += met
    out.true_quality_sum += quality
    out.routed_away += served != LARGE
    out.served[(kind, served)] += 1
    out.kind_admitted[kind] += 1
    out.kind_met[kind] += met
    out.reasons[routed.reason if routed is not None else "as_asked"] += 1
    if planned.drifted and kind == "extract":
        out.drifted["admitted"] += 1
        out.drifted["met"] += met
        out.drifted["late"] += late
        out.drifted["late_met"] += late and met


def _end(
    world: _World, flight: Flight, planned: Planned, setup: Setup, draws: random.Random,
    out: Outcome,
) -> None:  # fmt: skip
    """The request completes with the engine's counts (its prompt as estimated, its answer as
    drawn); it is billed at its model's price in force at admission; its customer scores it
    with `feedback_share` of the time, 1 or 0 with the served model's true quality."""
    prompt = flight.state.prompt_tokens_est
    completion = planned.output_tokens
    p = flight.progress
    p.prompt_tokens, p.completion_tokens, p.engine_reported = prompt, completion, True
    ttft_ms, per_token_ms = SPEED_MS[base_model(flight.model)]
    command = CompleteRequest(prompt, completion, 0, "stop", ttft_ms, per_token_ms * 1000)
    world.recorder.commit(flight, command)
    world.admission.settle(flight, command)
    price = world.control.price(flight.model, flight.state.admitted_at or world.clock.now)
    out.cost_micros += amount_micros(price, prompt, completion, 0)
    if draws.random() >= setup.feedback_share:
        return
    good = draws.random() < planned.quality(base_model(flight.model))
    command_ = RecordFeedback(flight.request_id, flight.tenant_id, 1_000_000 if good else 0)
    for event in decide_feedback(flight.state, command_):
        out.scores += 1
        world.feedback.append(event)
        world.quality.apply(Recorded(
            world.new_id(), flight.request_id, flight.state.version + 1, flight.tenant_id,
            world.clock.now, event, out.scores,
        ))  # fmt: skip


def _control(policy: str, setup: Setup, callers: dict[str, Caller]) -> ControlView:
    view = ControlView()
    before = START - timedelta(days=1)
    commands: list[ControlCommand] = [
        SetPrice(m, *PRICES[m], effective_at=before, now=before) for m in MODELS
    ]
    for tenant, caller in callers.items():
        commands += [
            RegisterTenant(tenant, "enterprise", "salt"),
            IssueApiKey(tenant, caller.key_id, hashlib.sha256(tenant.encode()).hexdigest()),
            # Quota out of the way: the evaluation is of the router and capacity.
            SetLimits(tenant, "*", rpm=10**7, tpm=10**10, kv_gib_seconds=10**9),
        ]
        if policy.startswith("router"):
            commands.append(AllowRouting(
                tenant, MODELS, round(setup.bar * 1e6), round(setup.exploration * 1e6),
                setup.on_capacity,
            ))  # fmt: skip
        if policy == "oracle":
            commands.append(AllowFallback(tenant, SMALL, LARGE))
    from tollgate_llm.domain.control_plane.decide import decide_control

    for i, command in enumerate(commands):
        for event in decide_control(view, command):
            view.apply(Recorded(f"ctl-{i}", f"control-{i}", 1, "", before, event, i + 1))
    return view


def _fleet(setup: Setup) -> Fleet:
    # No scraper runs (no session is used): the KV each request holds is the fleet's own
    # in-flight count, from `choose` to `release`, on replicas that never go stale.
    fleet = Fleet(cast(aiohttp.ClientSession, None), stale_after_s=float("inf"))
    now = time.monotonic()
    for model, count, kv in (
        (SMALL, setup.small_replicas, setup.small_kv_tokens),
        (LARGE, setup.large_replicas, setup.large_kv_tokens),
    ):
        blocks = kv // BLOCK_TOKENS
        for i in range(count):
            seat = _Seat(f"{model}-{i}", f"sim://{model}/{i}", f"{model}-{VERSION}")
            fleet.add(seat)
            fleet.apply_scrape(
                fleet.state(seat.replica_id),
                ReplicaMetrics(num_gpu_blocks=blocks, block_size=BLOCK_TOKENS),
                scrape_started_at=now, now=now,
            )  # fmt: skip
    return fleet


def inference(world: _World, traffic: list[Planned], calls: int, runs: int) -> dict[str, Any]:
    """The router's cost at admission, on the `router` policy's admission after its replay (its
    statistics warm), call by call over the traffic's requests, p50 / p99 per run:
    `RoutingStep.route` (the consent looked up, the models on sale ordered by price, the task
    class, the choice) with the prompt as already counted (admission counts it once: the router
    hands its count to the quota step), the prompt count alone (`WordTokenEstimator`), and
    `domain.routing.choose` alone. Each as wall time and as the thread's CPU time (`_cpu`): on a
    shared machine the wall time's tail is mostly the time another process had the core.
    The step's own method is timed: the replay's wrapper (`_World._time_routing`), with its
    clocks and its samples, is no part of admission."""
    step = world.admission.router
    route = RoutingStep.route
    estimator = WordTokenEstimator()
    reqs = []
    for p in traffic[: min(len(traffic), 2_000)]:
        caller = Caller(f"key-{p.tenant}", p.tenant, "customer", "enterprise", "salt")
        req = parse_chat_request(orjson.dumps({**p.body, "model": AUTO}))
        reqs.append((caller, req, system_prompt_bucket(caller, req)))
    counted = _Counted({id(r.messages): estimator.prompt_tokens(r.messages) for _, r, _ in reqs})
    step.tokens = lambda model: counted
    policy = world.control.routing_book.routing(reqs[0][0].tenant_id)
    assert policy is not None
    on_sale = [f"{SMALL}-{VERSION}", f"{LARGE}-{VERSION}"]
    classes = [(t, c) for (t, _, c) in world.quality.classes] or [(reqs[0][0].tenant_id, "")]
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    names = ("route", "route_cpu", "count", "choose", "choose_cpu")
    found: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for _ in range(runs):
        samples: dict[str, list[int]] = {name: [] for name in names}
        for i in range(calls):
            caller, req, bucket = reqs[i % len(reqs)]
            c0, t0 = cpu(), clock()
            route(step, caller, req, AUTO, "req", False, bucket, None)
            t1, c1 = clock(), cpu()
            estimator.prompt_tokens(req.messages)
            t2 = clock()
            samples["route"].append(t1 - t0)
            samples["route_cpu"].append(c1 - c0)
            samples["count"].append(t2 - t1)
            tenant, cls = classes[i % len(classes)]
            tenant_policy = world.control.routing_book.routing(tenant) or policy
            c0, t0 = cpu(), clock()
            choose(tenant_policy, on_sale, world.quality, cls, 0.5)
            t1, c1 = clock(), cpu()
            samples["choose"].append(t1 - t0)
            samples["choose_cpu"].append(c1 - c0)
        for name, values in samples.items():
            found[name].append(_percentiles(values))
    out: dict[str, Any] = {
        "runs": runs, "calls_per_run": calls, "classes_known": len(world.quality.classes),
    }  # fmt: skip
    for name, values in found.items():
        out[f"{name}_p50_us"] = round(statistics.median(v[0] for v in values), 2)
        out[f"{name}_p99_us"] = round(statistics.median(v[1] for v in values), 2)
        out[f"{name}_p99_us_runs"] = [round(v[1], 2) for v in values]
    return out


class _Counted:
    """The prompt counts admission has already made, by request."""

    def __init__(self, counts: dict[int, int]) -> None:
        self.counts = counts

    def prompt_tokens(self, messages: Any, tools: Any = None) -> int:
        return self.counts[id(messages)]


def _percentiles(samples_ns: list[int]) -> tuple[float, float]:
    samples_ns.sort()
    return samples_ns[len(samples_ns) // 2] / 1000, samples_ns[int(len(samples_ns) * 0.99)] / 1000
