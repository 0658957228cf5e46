"""The run itself: open-loop schedulers or closed-loop workers, bounded in requests and time,
with retries/replays per class, a /metrics sampler, and a clean stop on Ctrl-C."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from tollgate_llm.loadgen.arrivals import make_arrivals
from tollgate_llm.loadgen.clients import Attempt, make_client, prepare
from tollgate_llm.loadgen.profiles import (
    Profile,
    RequestClass,
    RequestSpec,
    sample_request,
    tenant_mix,
    tier_of,
    weighted_choice,
)
from tollgate_llm.loadgen.prompts import build_messages
from tollgate_llm.loadgen.stats import Stats

_KV_RE = re.compile(r"^tollgate_replica_kv_occupancy\{([^}]*)\}\s+(\S+)", re.M)
_LAG_RE = re.compile(r"^tollgate_billing_lag_events\s+(\S+)", re.M)
_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass
class RunConfig:
    base_url: str
    keys: dict[str, str]  # tenant -> customer key
    profile: Profile
    tiers: dict[str, str] = field(default_factory=dict)
    rate: float | None = None  # open loop (req/s of the weighted classes)
    concurrency: int | None = None  # closed loop
    duration_s: float = 30.0
    max_requests: int = 10_000
    seed: int = 0
    client: str = "openai"
    stream_ratio: float = 0.8
    burst: float | None = None
    drain_s: float = 30.0
    max_in_flight: int = 2_000
    timeout_s: float = 120.0
    models: tuple[str, ...] = ()  # override every class's model mix
    sample_metrics: bool = True
    metrics_interval_s: float = 0.5

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency else "open"


def parse_metrics(text: str) -> tuple[list[tuple[str, str, float]], float | None]:
    kv = []
    for labels, value in _KV_RE.findall(text):
        named = dict(_LABEL_RE.findall(labels))
        with contextlib.suppress(ValueError):
            kv.append((named.get("replica", "?"), named.get("model", "?"), float(value)))
    lag = _LAG_RE.search(text)
    return kv, (float(lag.group(1)) if lag else None)


class Runner:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.stats = Stats()
        self.run_id = uuid.uuid4().hex[:10]
        self.tenants = tenant_mix(cfg.profile, sorted(cfg.keys))
        self.budget = cfg.max_requests
        self.stopping = False
        self.interrupts = 0
        self.stop = asyncio.Event()
        self.t0 = 0.0
        self.deadline = 0.0
        self.seq = 0
        self.request_tasks: set[asyncio.Task[Any]] = set()
        self.kv_samples: list[tuple[float, str, str, float]] = []
        self.billing_lag: float | None = None
        self.stop_reason = ""
        self.wall_s = 0.0
        self.client = make_client(cfg.client, cfg.base_url, cfg.timeout_s,
                                  max(64, min(cfg.max_in_flight, 4_096)))
        weighted = cfg.profile.weighted
        self.weighted = tuple((c, c.weight) for c in weighted)

    # --- bounds ---------------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0 if self.t0 else 0.0

    def _take(self) -> bool:
        """One more HTTP request may be sent (retries and replays count too)."""
        if self.stopping or self.stop.is_set():
            return False
        if time.perf_counter() >= self.deadline:
            self.stop_reason = self.stop_reason or "duration"
            return False
        if self.budget <= 0:
            self.stop_reason = self.stop_reason or "max-requests"
            return False
        self.budget -= 1
        return True

    async def _sleep(self, seconds: float) -> bool:
        """Sleep unless stopped; False when the run is stopping."""
        seconds = min(seconds, self.deadline - time.perf_counter())
        if seconds > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), seconds)
        return not (self.stopping or self.stop.is_set() or time.perf_counter() >= self.deadline)

    def install_signal_handlers(self) -> None:
        """Ctrl-C / SIGTERM: stop sending, cancel what is in flight, still summarise; a second
        Ctrl-C also cuts the reconciliation wait short."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGINT, self.interrupt)
            loop.add_signal_handler(signal.SIGTERM, self.interrupt)

    def interrupt(self) -> None:
        self.interrupts += 1
        self.stop_reason = "interrupted"
        self.stop.set()

    # --- requests ---------------------------------------------------------------------------

    def _spec(self, cls: RequestClass) -> RequestSpec:
        spec = sample_request(cls, self.tenants, self.rng, self.cfg.stream_ratio)
        if self.cfg.models:
            spec.model = self.rng.choice(self.cfg.models)
        self.seq += 1
        spec.seq = self.seq
        return spec

    async def _execute(self, spec: RequestSpec) -> None:
        """One logical request: the first send (budget already taken), retries on refusal or
        transport error, and an optional replay of a completed request (same Idempotency-Key)."""
        messages = build_messages(spec.prompt_tokens, self.rng, spec.shared_prefix_tokens,
                                  f"{spec.tenant}/{spec.cls}")
        prepared = prepare(spec, self.cfg.keys[spec.tenant], messages)
        retry = spec.retry
        idem = None
        if retry.idempotency_key and (retry.max_retries > 0 or spec.replay):
            idem = f"lg-{self.run_id}-{spec.seq}"
        attempt = 0
        while True:
            a = await self._send(prepared, attempt, idem)
            retryable = a.status in retry.on_status or (a.kind == "error" and not a.status)
            if retryable and attempt < retry.max_retries:
                wait = retry.backoff_s * (2**attempt) * self.rng.random()
                if retry.honour_retry_after and a.retry_after is not None:
                    wait = max(wait, min(a.retry_after, retry.max_wait_s))
                if not await self._sleep(wait) or not self._take():
                    return
                attempt += 1
                continue
            break
        if spec.replay and a.kind == "ok" and self._take():
            await self._send(prepared, attempt + 1, idem)

    async def _send(self, prepared: Any, attempt: int, idem: str | None) -> Attempt:
        spec = prepared.spec
        a = Attempt(
            seq=spec.seq, attempt=attempt, tenant=spec.tenant,
            tier=tier_of(spec.tenant, self.cfg.tiers), model=spec.model, cls=spec.cls,
            stream=spec.stream, t_start=self.elapsed(), target_prompt_tokens=spec.prompt_tokens,
            max_tokens=spec.max_tokens,
        )
        headers = {"x-stainless-retry-count": str(attempt)}
        if idem:
            headers["Idempotency-Key"] = idem
        self.stats.started()
        try:
            await self.client.send(prepared, a, headers)
        except Exception as exc:  # noqa: BLE001 - a client bug must show, not kill the worker
            a.kind, a.reason = "error", f"{type(exc).__name__}: {exc}"[:200]
        finally:
            self.stats.finished(a)
        return a

    def _spawn(self, spec: RequestSpec) -> None:
        task = asyncio.create_task(self._execute(spec))
        self.request_tasks.add(task)
        task.add_done_callback(self.request_tasks.discard)

    # --- producers --------------------------------------------------------------------------

    async def _open_loop(self, classes: tuple[tuple[RequestClass, float], ...], rate: float,
                         arrival: str, burst: float) -> None:
        p = self.cfg.profile
        fraction = p.burst_fraction if burst * p.burst_fraction <= 1 else 0.5 / burst
        process = make_arrivals(arrival, rate, random.Random(self.rng.getrandbits(64)), burst,
                                fraction, p.burst_mean_s)
        next_t = time.perf_counter()
        while True:
            next_t += process.next_gap()
            if not await self._sleep(next_t - time.perf_counter()):
                return
            if self.stats.in_flight >= self.cfg.max_in_flight:
                self.stats.dropped += 1  # open loop: never slow down to the server's pace
                continue
            if not self._take():
                return
            self._spawn(self._spec(weighted_choice(self.rng, classes)))

    async def _worker(self) -> None:
        while self._take():
            await self._execute(self._spec(weighted_choice(self.rng, self.weighted)))

    async def _sample_metrics(self) -> None:
        async with httpx.AsyncClient(base_url=self.cfg.base_url, timeout=2.0) as http:
            while not self.stop.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    r = await http.get("/metrics")
                    if r.status_code == 200:
                        t = self.elapsed()
                        kv, lag = parse_metrics(r.text)
                        self.kv_samples.extend((t, rep, model, v) for rep, model, v in kv)
                        self.billing_lag = lag
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), self.cfg.metrics_interval_s)

    # --- the run ----------------------------------------------------------------------------

    async def run(self) -> None:
        cfg, p = self.cfg, self.cfg.profile
        self.install_signal_handlers()
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + cfg.duration_s
        burst = cfg.burst if cfg.burst is not None else p.burst
        arrival = "bursty" if (p.arrival == "bursty" or (cfg.burst or 1) > 1) and burst > 1 \
            else "poisson"
        work: list[asyncio.Task[Any]] = []
        if cfg.concurrency:
            work += [asyncio.create_task(self._worker()) for _ in range(cfg.concurrency)]
        else:
            rate = cfg.rate or p.default_rate
            work.append(asyncio.create_task(self._open_loop(self.weighted, rate, arrival, burst)))
        for cls in p.side_streams:  # e.g. the noisy neighbour's own 20 req/min, in both modes
            work.append(asyncio.create_task(self._open_loop(
                ((cls, 1.0),), (cls.rate_per_min or 0) / 60, "poisson", 1.0)))
        sampler = asyncio.create_task(self._sample_metrics()) if cfg.sample_metrics else None
        stop_wait = asyncio.create_task(self.stop.wait())
        all_work = asyncio.ensure_future(asyncio.gather(*work, return_exceptions=True))
        try:
            await asyncio.wait({all_work, stop_wait}, timeout=cfg.duration_s + 0.05,
                               return_when=asyncio.FIRST_COMPLETED)
            self.stopping = True
            if not self.stop_reason:
                self.stop_reason = "duration" if time.perf_counter() >= self.deadline \
                    else "max-requests"
            # drain: let in-flight requests finish, bounded by --drain; Ctrl-C cuts it short
            drain_end = time.perf_counter() + cfg.drain_s
            pending = {t for t in (*work, *self.request_tasks) if not t.done()}
            while pending and not self.stop.is_set():
                left = drain_end - time.perf_counter()
                if left <= 0:
                    break
                await asyncio.wait(pending, timeout=min(left, 0.25))
                pending = {t for t in (*work, *self.request_tasks) if not t.done()}
            leftovers = {t for t in (*work, *self.request_tasks) if not t.done()}
            for t in leftovers:  # recorded as cancelled by the clients; billed what was made
                t.cancel()
            if leftovers:
                await asyncio.gather(*leftovers, return_exceptions=True)
                if self.stop_reason != "interrupted":
                    self.stop_reason += " (drain timeout: in-flight requests cancelled)"
        finally:
            self.stopping = True
            self.stop.set()
            all_work.cancel()
            stop_wait.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await all_work
            if sampler:
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
            await self.client.aclose()
            self.wall_s = self.elapsed()
