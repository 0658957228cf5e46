"""The simulated engine: the asyncio step loop that paces the scheduler (`scheduler.py`) over
the paged KV blocks (`kv.py`), and each request's life from submission to its end.

Every request leaves a `SimRecord`, the ground truth billing is checked against. `SimConfig` and
`SimRecord` (`state.py`) are importable from here too, as they were before the split.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import random
import time
from typing import Any

from tollgate_llm.engine_adapter.simulator.kv import BlockPool
from tollgate_llm.engine_adapter.simulator.metrics import SimMetrics
from tollgate_llm.engine_adapter.simulator.scheduler import Scheduler
from tollgate_llm.engine_adapter.simulator.state import (
    VOCAB_SIZE,
    SimConfig,
    SimRecord,
    SimRequest,
    token_text,
)

__all__ = ["QueueFull", "SimConfig", "SimEngine", "SimRecord", "SimRequest"]


class QueueFull(Exception):
    pass


class SimEngine:
    """The asyncio step loop. All state changes happen on the event loop thread, no locks."""

    def __init__(self, config: SimConfig) -> None:
        self.cfg = config
        self.records: dict[str, SimRecord] = {}
        self.history: list[SimRecord] = []
        self._seq = 0
        self._id_rng = random.Random(config.seed)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.metrics = SimMetrics(
            config.model, block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            num_gpu_blocks=config.num_gpu_blocks,
        )  # fmt: skip
        self.scheduler = Scheduler(config, self.metrics)
        self.steps = 0

    @property
    def running(self) -> list[SimRequest]:
        return self.scheduler.running

    @property
    def pool(self) -> BlockPool:
        return self.scheduler.pool

    def publish_gauges(self) -> None:
        """The running, waiting and KV-usage gauges, as of now (each step, and each scrape)."""
        self.metrics.set_gauges(len(self.running), self.num_waiting, self.pool.usage())

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def new_request_id(self) -> str:
        return f"{self._id_rng.getrandbits(64):016x}"

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="sim-engine")

    async def stop(self) -> None:
        for r in list(self.running) + list(self.scheduler.waiting):
            self.abort(r)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def submit(
        self,
        rid: str,
        token_ids: list[int],
        max_tokens: int,
        *,
        ignore_eos: bool,
        priority: int,
        salt: str | None,
        seed: int | None,
        stream: bool,
        fail_after: int | None = None,
        drop_after: int | None = None,
        asked_length: int | None = None,
    ) -> SimRequest:
        cfg = self.cfg
        if cfg.max_num_queued_reqs is not None and self.num_waiting >= cfg.max_num_queued_reqs:
            self.metrics.admission_rejections.labels(cfg.model, "max_num_queued_reqs").inc()
            raise QueueFull
        r = SimRequest()
        r.rid = rid
        r.token_ids = token_ids
        r.prompt_len = len(token_ids)
        r.max_tokens = max_tokens
        r.priority = priority if cfg.scheduling_policy == "priority" else 0
        self._seq += 1
        r.seq = self._seq
        r.salt = salt
        r.fail_after = fail_after
        r.drop_after = drop_after
        r.arrival = time.monotonic()
        # Per-request RNG from (replica seed, request seed or id): the text and the EOS position
        # of a request do not depend on what else is running.
        key = f"{cfg.seed}:{seed if seed is not None else rid}".encode()
        r.rng = random.Random(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest()))
        if ignore_eos:
            r.eos_at = None
        elif asked_length is not None:
            mu = math.log(max(1, asked_length))
            r.eos_at = max(1, round(r.rng.lognormvariate(mu, cfg.length_follow_sigma)))
        else:
            mu = math.log(max(1, cfg.mean_output_tokens)) - cfg.output_sigma**2 / 2
            r.eos_at = max(1, round(r.rng.lognormvariate(mu, cfg.output_sigma)))
        rec = SimRecord(
            request_id=rid, prompt_tokens=r.prompt_len, stream=stream, priority=r.priority
        )
        rec.arrival_s = time.time()
        r.record = rec
        self.records[rid] = rec
        self.history.append(rec)
        self.scheduler.waiting.push(r)
        self.publish_gauges()
        self._wake.set()
        return r

    def abort(self, r: SimRequest) -> None:
        """Client went away: free the request's KV now and count it as aborted."""
        if r.finished:
            return
        if r in self.running:
            self.running.remove(r)
            self.pool.release(r.blocks)
            r.blocks = []
        else:
            with contextlib.suppress(ValueError):
                self.scheduler.waiting.remove(r)
        self._finish(r, "abort")
        self.publish_gauges()

    def _finish(self, r: SimRequest, reason: str) -> None:
        r.finished = True
        r.finish_reason = reason
        rec = r.record
        rec.generated_tokens = r.generated
        rec.finished_s = time.time()
        # completion_tokens is not touched here: the HTTP handler counts what it wrote, which for
        # an abort is less than what the engine generated.
        rec.finish_reason = reason
        self.metrics.on_finish(reason, r.arrival, r.generated, r.first_token_at, r.last_token_at)
        r.event.set()

    def _apply(self, scheduled: list[tuple[SimRequest, int]], now: float) -> None:
        cfg = self.cfg
        bs = cfg.block_size
        produced = 0
        for r, n in scheduled:
            if r.finished or r not in self.running:
                continue  # aborted or preempted while the step ran
            start = r.num_computed // bs
            r.num_computed += n
            total = r.prompt_len + r.generated
            if cfg.enable_prefix_caching:
                full = r.num_computed // bs
                hashes = self.scheduler.hashes_for(r, full * bs)
                for k in range(start, full):
                    self.pool.register(r.blocks[k], hashes[k])
            if r.num_computed < total:
                continue  # still prefilling (chunked)
            # caught up: the model samples one token
            r.generated += 1
            produced += 1
            tok = r.rng.randrange(VOCAB_SIZE)
            r.token_ids.append(tok)
            r.pending.append(token_text(tok))
            if r.first_token_at is None:
                r.first_token_at = now
                r.record.first_token_s = time.time()
                self.metrics.ttft.observe(now - r.arrival)
                if not r.prompt_counted:
                    r.prompt_counted = True
                    self.metrics.prompt_tokens.inc(r.prompt_len)
                    self.metrics.prompt_tokens_cached.inc(r.record.cached_tokens)
            else:
                self.metrics.itl.observe(now - r.last_token_at)  # type: ignore[operator]
            r.last_token_at = now
            if r.fail_after is not None and r.generated >= r.fail_after:
                self._end(r, "error")
            elif r.eos_at is not None and r.generated >= r.eos_at and r.generated < r.max_tokens:
                self._end(r, "stop")
            elif r.generated >= r.max_tokens:
                self._end(r, "length")
            else:
                r.event.set()
        self.metrics.generation_tokens.inc(produced)

    def _end(self, r: SimRequest, reason: str) -> None:
        self.running.remove(r)
        self.pool.release(r.blocks)
        r.blocks = []
        self._finish(r, reason)

    async def _loop(self) -> None:
        cfg = self.cfg
        next_at = time.monotonic()
        while True:
            if not self.running and not self.num_waiting:
                self._wake.clear()
                await self._wake.wait()
                next_at = time.monotonic()
            scheduled, prefill_tokens = self.scheduler.schedule()
            self.publish_gauges()
            step_ms = (
                cfg.step_base_ms
                + cfg.per_seq_ms * len(scheduled)
                + cfg.prefill_ms_per_1k_tokens * prefill_tokens / 1000
            ) / cfg.speed
            next_at += step_ms / 1000
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                next_at = time.monotonic()  # fell behind: do not try to catch up in a burst
                await asyncio.sleep(0)
            self.steps += 1
            self._apply(scheduled, time.monotonic())
            self.publish_gauges()

    def stats(self) -> dict[str, Any]:
        by_reason: dict[str, int] = {}
        totals = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        generated = preemptions = 0
        for rec in self.history:
            if rec.finish_reason is not None:
                by_reason[rec.finish_reason] = by_reason.get(rec.finish_reason, 0) + 1
            totals["prompt_tokens"] += rec.prompt_tokens
            totals["completion_tokens"] += rec.completion_tokens
            totals["cached_tokens"] += rec.cached_tokens
            generated += rec.generated_tokens
            preemptions += rec.preemptions
        return {
            "requests": len(self.history),
            "finished": by_reason,
            **totals,
            "generated_tokens": generated,
            "preemptions": preemptions,
            "running": len(self.running),
            "waiting": self.num_waiting,
            "free_blocks": self.pool.num_free,
            "num_gpu_blocks": self.pool.num_blocks,
            "kv_cache_usage": self.pool.usage(),
            "steps": self.steps,
        }
