"""The simulated engine model: paged KV blocks with a prefix cache, continuous batching with
chunked prefill, preemption by recompute, and the asyncio step loop that paces it all.

Every request leaves a `SimRecord`, the ground truth billing is checked against.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import heapq
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine_adapter.simulator.metrics import SimMetrics

BLOCK_SIZE = 16

# What the model samples from: each generated token is one of these words.
_WORDS = (
    " the of and to in is that for it as was with be by on not he this are or his from at which"
    " but have an they you were her she there been one all we their has would when if will more"
    " no out so said what up its about into than them can only other new some time could these"
    " two may then do first any my now such like our over man me even most made after also did"
    " many before must through back years where much your way well down should because each just"
    " those people how too little state good very make world still own see men work long get"
    " here between both life being under never day same another know while last might us great"
    " old year off come since against go came right used take three ."
)
_VOCAB = [" " + w if w != "." else "." for w in _WORDS.split()]
VOCAB_SIZE = len(_VOCAB)


def token_text(token_id: int) -> str:
    """The text of a generated token id."""
    return _VOCAB[token_id % VOCAB_SIZE]


# --- configuration and records -------------------------------------------------------------------


@dataclass
class SimConfig:
    """Knobs of one simulated replica. Times are milliseconds of simulated engine work."""

    model: str = "sim-model"
    seed: int = 0
    max_model_len: int = 8192
    block_size: int = BLOCK_SIZE
    num_gpu_blocks: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_num_queued_reqs: int | None = None
    scheduling_policy: str = "fcfs"  # fcfs | priority
    enable_prefix_caching: bool = True
    enable_prompt_tokens_details: bool = True
    enable_force_include_usage: bool = False
    step_base_ms: float = 15.0
    per_seq_ms: float = 0.3
    prefill_ms_per_1k_tokens: float = 30.0
    speed: float = 1.0
    mean_output_tokens: int = 128
    output_sigma: float = 1.0  # lognormal sigma of the EOS position: the heavy tail
    # A prompt that asks for an answer "in about N words" ends near N tokens (lognormal around
    # N with this sigma), as an instruction-following model roughly does: traffic generators
    # (`tollgate predictor generate`) give each tenant's answers their own length that way.
    length_follow_sigma: float = 0.15

    def __post_init__(self) -> None:
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("scheduling_policy must be fcfs or priority")
        if self.max_model_len > self.num_gpu_blocks * self.block_size:
            # vLLM refuses to start when one max-length sequence does not fit in the KV cache;
            # without this check a long request could wait forever.
            raise ValueError(
                f"max_model_len {self.max_model_len} does not fit in "
                f"{self.num_gpu_blocks} blocks of {self.block_size}"
            )
        if self.speed <= 0:
            raise ValueError("speed must be positive")


@dataclass
class SimRecord:
    """Ground truth for one request. `completion_tokens` counts tokens written to the client."""

    request_id: str
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None  # stop | length | abort | error; None while in flight
    preemptions: int = 0
    generated_tokens: int = 0  # produced by the engine; > completion_tokens only after an abort
    stream: bool = False
    arrival_s: float = 0.0
    first_token_s: float | None = None
    finished_s: float | None = None
    priority: int = 0  # the scheduling priority it ran at (0 under fcfs, which ignores it)
    traceparent: str = ""  # the W3C traceparent it was sent with (vLLM continues that trace)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["finished"] = self.finish_reason is not None
        return d


# --- KV block manager ----------------------------------------------------------------------------


class _BlockPool:
    """Paged KV blocks with a prefix cache: free blocks keep their hash in an LRU until reused."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def lookup(self, hashes: Iterable[int]) -> list[int]:
        hit: list[int] = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def touch(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)  # least recently freed goes first
            h = self.hash_of[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.hash_of[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        # Tail blocks go to the LRU first so a shared prefix outlives the suffixes built on it.
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None

    def register(self, block: int, h: int) -> None:
        if self.hash_of[block] is None and h not in self.cached:
            self.hash_of[block] = h
            self.cached[h] = block


# --- engine --------------------------------------------------------------------------------------


class QueueFull(Exception):
    pass


class SimRequest:
    __slots__ = (
        "rid",
        "record",
        "token_ids",
        "prompt_len",
        "max_tokens",
        "eos_at",
        "priority",
        "seq",
        "salt",
        "num_computed",
        "blocks",
        "block_hashes",
        "generated",
        "cached_set",
        "finished",
        "finish_reason",
        "pending",
        "event",
        "rng",
        "fail_after",
        "drop_after",
        "arrival",
        "first_token_at",
        "last_token_at",
        "prompt_counted",
    )

    def __init__(self) -> None:
        self.num_computed = 0
        self.blocks: list[int] = []
        self.block_hashes: list[int] = []
        self.generated = 0
        self.cached_set = False
        self.finished = False
        self.finish_reason: str | None = None
        self.pending: list[str] = []  # texts produced but not yet taken by the HTTP handler
        self.event = asyncio.Event()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.prompt_counted = False

    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.seq)

    def __lt__(self, other: SimRequest) -> bool:
        return self.sort_key() < other.sort_key()


class SimEngine:
    """The asyncio step loop. All state changes happen on the event loop thread, no locks."""

    def __init__(self, config: SimConfig) -> None:
        self.cfg = config
        self.pool = _BlockPool(config.num_gpu_blocks)
        self.running: list[SimRequest] = []
        self.waiting_fcfs: deque[SimRequest] = deque()
        self.waiting_heap: list[SimRequest] = []
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
        self.steps = 0

    def publish_gauges(self) -> None:
        """The running, waiting and KV-usage gauges, as of now (each step, and each scrape)."""
        self.metrics.set_gauges(len(self.running), self.num_waiting, self.pool.usage())

    # waiting queue helpers (priority mode keeps a heap on (priority, arrival))
    @property
    def num_waiting(self) -> int:
        return len(self.waiting_heap) + len(self.waiting_fcfs)

    def _waiting_peek(self) -> SimRequest | None:
        if self.cfg.scheduling_policy == "priority":
            return self.waiting_heap[0] if self.waiting_heap else None
        return self.waiting_fcfs[0] if self.waiting_fcfs else None

    def _waiting_pop(self) -> None:
        if self.cfg.scheduling_policy == "priority":
            heapq.heappop(self.waiting_heap)
        else:
            self.waiting_fcfs.popleft()

    def _waiting_push_front(self, r: SimRequest) -> None:
        if self.cfg.scheduling_policy == "priority":
            heapq.heappush(self.waiting_heap, r)
        else:
            self.waiting_fcfs.appendleft(r)

    def _waiting_remove(self, r: SimRequest) -> None:
        if self.cfg.scheduling_policy == "priority":
            self.waiting_heap.remove(r)
            heapq.heapify(self.waiting_heap)
        else:
            self.waiting_fcfs.remove(r)

    def new_request_id(self) -> str:
        return f"{self._id_rng.getrandbits(64):016x}"

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="sim-engine")

    async def stop(self) -> None:
        for r in list(self.running) + list(self.waiting_fcfs) + list(self.waiting_heap):
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
        if cfg.scheduling_policy == "priority":
            heapq.heappush(self.waiting_heap, r)
        else:
            self.waiting_fcfs.append(r)
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
                self._waiting_remove(r)
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

    # -- scheduling

    def _hashes_for(self, r: SimRequest, upto_tokens: int) -> list[int]:
        """Chained block hashes of the full blocks in r.token_ids[:upto_tokens]. The salt is mixed
        into the first block only; the chain carries it into every later hash."""
        bs = self.cfg.block_size
        hashes = r.block_hashes
        n_full = upto_tokens // bs
        while len(hashes) < n_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else 0
            extra = r.salt if (i == 0 and r.salt) else None
            hashes.append(hash((parent, tuple(r.token_ids[i * bs : (i + 1) * bs]), extra)))
        return hashes[:n_full]

    def _blocks_needed(self, r: SimRequest, tokens: int) -> int:
        return -(-tokens // self.cfg.block_size) - len(r.blocks)

    def _preempt(self, victim: SimRequest) -> None:
        self.running.remove(victim)
        self.pool.release(victim.blocks)
        victim.blocks = []
        victim.num_computed = 0
        victim.record.preemptions += 1
        self.metrics.preemptions.inc()
        self._waiting_push_front(victim)

    def _pick_victim(self) -> SimRequest:
        if self.cfg.scheduling_policy == "priority":
            return max(self.running, key=SimRequest.sort_key)
        return max(self.running, key=lambda q: q.seq)

    def _schedule(self) -> tuple[list[tuple[SimRequest, int]], int]:
        cfg = self.cfg
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int, bool]] = []
        # 1. running requests in batch order: one decode token, or the next prefill chunk
        for r in list(self.running):
            if budget <= 0:
                break
            if r not in self.running:
                continue  # preempted for an earlier request of this same step
            total = r.prompt_len + r.generated
            n = min(total - r.num_computed, budget)
            if n <= 0:
                continue
            need = self._blocks_needed(r, r.num_computed + n)
            while need > 0:
                got = self.pool.allocate(need)
                if got is not None:
                    r.blocks.extend(got)
                    break
                victim = self._pick_victim()
                self._preempt(victim)
                for q, k, _ in scheduled:
                    if q is victim:
                        budget += k
                scheduled = [e for e in scheduled if e[0] is not victim]
                if victim is r:
                    break
            if r not in self.running:
                continue
            scheduled.append((r, n, not (n == 1 and r.num_computed == total - 1)))
            budget -= n
        # 2. admit waiting requests while a sequence slot, the token budget and the blocks allow
        while budget > 0 and len(self.running) < cfg.max_num_seqs:
            r = self._waiting_peek()
            if r is None:
                break
            total = r.prompt_len + r.generated
            hit: list[int] = []
            if cfg.enable_prefix_caching:
                # At least one token is always computed, so a full-cache hit stops a block short.
                hashes = self._hashes_for(r, total - 1)
                hit = self.pool.lookup(hashes)
                self.metrics.prefix_queries.inc(total)
                self.metrics.prefix_hits.inc(len(hit) * cfg.block_size)
            computed = len(hit) * cfg.block_size
            n = min(total - computed, budget)
            need_new = -(-(computed + n) // cfg.block_size) - len(hit)
            hit_free = sum(1 for b in hit if self.pool.ref[b] == 0)
            if need_new + hit_free > self.pool.num_free:
                break  # no preemption on behalf of a waiting request: it waits
            self._waiting_pop()
            self.pool.touch(hit)
            got = self.pool.allocate(need_new)
            assert got is not None
            r.blocks = hit + got
            r.num_computed = computed
            if not r.cached_set:
                # vLLM reports the cache hit of the first scheduling only, never a re-prefill's.
                r.cached_set = True
                r.record.cached_tokens = computed
            self.running.append(r)
            scheduled.append((r, n, True))
            budget -= n
        prefill_tokens = sum(n for _, n, is_prefill in scheduled if is_prefill)
        return [(r, n) for r, n, _ in scheduled], prefill_tokens

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
                hashes = self._hashes_for(r, full * bs)
                for k in range(start, full):
                    self.pool.register(r.blocks[k], hashes[k])
            if r.num_computed < total:
                continue  # still prefilling (chunked)
            # caught up: the model samples one token
            r.generated += 1
            produced += 1
            tok = r.rng.randrange(len(_VOCAB))
            r.token_ids.append(tok)
            r.pending.append(_VOCAB[tok])
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
            scheduled, prefill_tokens = self._schedule()
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
