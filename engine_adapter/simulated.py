"""A simulated vLLM 0.33 replica: the OpenAI-compatible HTTP surface of `vllm serve` over an
honest engine model (paged KV, continuous batching, chunked prefill, preemption, prefix cache).

It is the ground truth billing is checked against: every request leaves a `SimRecord` with the
tokens the engine produced and actually wrote to the client. Run one in-process with
`start_simulated_replica(SimConfig(...))` or as a process with `python -m engine_adapter.simulated`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import heapq
import math
import random
import re
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

VLLM_VERSION = "0.33.0"
BLOCK_SIZE = 16
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# --- tokenisation -------------------------------------------------------------------------------
# Deterministic and cheap, not a real BPE: a word piece is a run of word characters (one token per
# started four characters) or one punctuation character. The gateway estimates with the same
# function; billing never uses it, only the engine's own count.

_PIECE_RE = re.compile(r"\w+|[^\w\s]")
# Chat-template overhead: <|im_start|> role \n ... <|im_end|> per message, plus the generation
# prompt "<|im_start|>assistant\n" that add_generation_prompt appends.
TEMPLATE_TOKENS_PER_MESSAGE = 4
GENERATION_PROMPT_TOKENS = 3
VOCAB_SIZE = 151_000
_SPECIAL_BASE = 150_000  # ids of template tokens; text ids stay below this


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def count_text_tokens(text: str) -> int:
    n = 0
    for piece in _PIECE_RE.findall(text):
        n += (len(piece) + 3) // 4
    return n


def count_prompt_tokens(messages: Sequence[Any]) -> int:
    """Prompt tokens the simulator charges for `messages` (chat template included). Pure."""
    n = GENERATION_PROMPT_TOKENS
    for message in messages:
        n += TEMPLATE_TOKENS_PER_MESSAGE + count_text_tokens(_message_text(message))
    return n


def _text_token_ids(text: str, out: list[int]) -> None:
    for piece in _PIECE_RE.findall(text):
        raw = piece.encode()
        for i in range(0, len(piece), 4):
            out.append(zlib.crc32(raw[i : i + 4], i) % _SPECIAL_BASE)


def prompt_token_ids(messages: Sequence[Any]) -> list[int]:
    """The token ids behind `count_prompt_tokens` (same length), used for prefix-cache hashing."""
    ids: list[int] = []
    for message in messages:
        role = message.get("role", "") if isinstance(message, dict) else ""
        ids.append(_SPECIAL_BASE)
        ids.append(_SPECIAL_BASE + 10 + zlib.crc32(str(role).encode()) % 100)
        ids.append(_SPECIAL_BASE + 1)
        _text_token_ids(_message_text(message), ids)
        ids.append(_SPECIAL_BASE + 2)
    ids.extend((_SPECIAL_BASE, _SPECIAL_BASE + 11, _SPECIAL_BASE + 1))
    return ids


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


class _Req:
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

    def __lt__(self, other: _Req) -> bool:
        return self.sort_key() < other.sort_key()


class SimEngine:
    """The asyncio step loop. All state changes happen on the event loop thread, no locks."""

    def __init__(self, config: SimConfig) -> None:
        self.cfg = config
        self.pool = _BlockPool(config.num_gpu_blocks)
        self.running: list[_Req] = []
        self.waiting_fcfs: deque[_Req] = deque()
        self.waiting_heap: list[_Req] = []
        self.records: dict[str, SimRecord] = {}
        self.history: list[SimRecord] = []
        self._seq = 0
        self._id_rng = random.Random(config.seed)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.metrics = _SimMetrics(config)
        self.steps = 0

    # waiting queue helpers (priority mode keeps a heap on (priority, arrival))
    @property
    def num_waiting(self) -> int:
        return len(self.waiting_heap) + len(self.waiting_fcfs)

    def _waiting_peek(self) -> _Req | None:
        if self.cfg.scheduling_policy == "priority":
            return self.waiting_heap[0] if self.waiting_heap else None
        return self.waiting_fcfs[0] if self.waiting_fcfs else None

    def _waiting_pop(self) -> None:
        if self.cfg.scheduling_policy == "priority":
            heapq.heappop(self.waiting_heap)
        else:
            self.waiting_fcfs.popleft()

    def _waiting_push_front(self, r: _Req) -> None:
        if self.cfg.scheduling_policy == "priority":
            heapq.heappush(self.waiting_heap, r)
        else:
            self.waiting_fcfs.appendleft(r)

    def _waiting_remove(self, r: _Req) -> None:
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
    ) -> _Req:
        cfg = self.cfg
        if cfg.max_num_queued_reqs is not None and self.num_waiting >= cfg.max_num_queued_reqs:
            self.metrics.admission_rejections.labels(cfg.model, "max_num_queued_reqs").inc()
            raise QueueFull
        r = _Req()
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
        else:
            mu = math.log(max(1, cfg.mean_output_tokens)) - cfg.output_sigma**2 / 2
            r.eos_at = max(1, round(r.rng.lognormvariate(mu, cfg.output_sigma)))
        rec = SimRecord(request_id=rid, prompt_tokens=r.prompt_len, stream=stream)
        rec.arrival_s = time.time()
        r.record = rec
        self.records[rid] = rec
        self.history.append(rec)
        if cfg.scheduling_policy == "priority":
            heapq.heappush(self.waiting_heap, r)
        else:
            self.waiting_fcfs.append(r)
        self.metrics.set_gauges(self)
        self._wake.set()
        return r

    def abort(self, r: _Req) -> None:
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
        self.metrics.set_gauges(self)

    def _finish(self, r: _Req, reason: str) -> None:
        r.finished = True
        r.finish_reason = reason
        rec = r.record
        rec.generated_tokens = r.generated
        rec.finished_s = time.time()
        # completion_tokens is not touched here: the HTTP handler counts what it wrote, which for
        # an abort is less than what the engine generated.
        rec.finish_reason = reason
        self.metrics.on_finish(self, r, reason)
        r.event.set()

    # -- scheduling

    def _hashes_for(self, r: _Req, upto_tokens: int) -> list[int]:
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

    def _blocks_needed(self, r: _Req, tokens: int) -> int:
        return -(-tokens // self.cfg.block_size) - len(r.blocks)

    def _preempt(self, victim: _Req) -> None:
        self.running.remove(victim)
        self.pool.release(victim.blocks)
        victim.blocks = []
        victim.num_computed = 0
        victim.record.preemptions += 1
        self.metrics.preemptions.inc()
        self._waiting_push_front(victim)

    def _pick_victim(self) -> _Req:
        if self.cfg.scheduling_policy == "priority":
            return max(self.running, key=_Req.sort_key)
        return max(self.running, key=lambda q: q.seq)

    def _schedule(self) -> tuple[list[tuple[_Req, int]], int]:
        cfg = self.cfg
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[_Req, int, bool]] = []
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

    def _apply(self, scheduled: list[tuple[_Req, int]], now: float) -> None:
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

    def _end(self, r: _Req, reason: str) -> None:
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
            self.metrics.set_gauges(self)
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
            self.metrics.set_gauges(self)

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


# --- Prometheus metrics (vLLM 0.33 names) --------------------------------------------------------

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class _SimMetrics:
    def __init__(self, cfg: SimConfig) -> None:
        self.registry = reg = CollectorRegistry()
        ln = ["model_name", "engine"]
        lv = {"model_name": cfg.model, "engine": "0"}

        def g(name: str, doc: str) -> Any:
            return Gauge(name, doc, ln, registry=reg).labels(**lv)

        def c(name: str, doc: str) -> Any:
            return Counter(name, doc, ln, registry=reg).labels(**lv)

        def h(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, ln, buckets=buckets, registry=reg).labels(**lv)

        self.running = g(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = g("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = c(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prefix_queries = c(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_hits = c(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.prompt_tokens = c("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = c(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*ln, "finished_reason"],
            registry=reg,
        )
        self.success = {
            reason: success.labels(finished_reason=reason, **lv)
            for reason in ("stop", "length", "abort", "error", "repetition")
        }
        self.admission_rejections = Counter(
            "vllm:admission_rejections",
            "Requests rejected by admission control.",
            ["model_name", "reason"],
            registry=reg,
        )
        self.ttft = h(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = h(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.tpot = h(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = h(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.gen_per_req = h(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000],
        )
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "gpu_memory_utilization",
                "num_cpu_blocks",
                "num_gpu_blocks",
                "num_gpu_blocks_override",
                "prefix_caching_hash_algo",
                "engine",
            ],
            registry=reg,
        )
        info.labels(
            block_size=str(cfg.block_size),
            cache_dtype="auto",
            enable_prefix_caching=str(cfg.enable_prefix_caching),
            gpu_memory_utilization="0.9",
            num_cpu_blocks="None",
            num_gpu_blocks=str(cfg.num_gpu_blocks),
            num_gpu_blocks_override="None",
            prefix_caching_hash_algo="sha256",
            engine="0",
        ).set(1)

    def set_gauges(self, eng: SimEngine) -> None:
        self.running.set(len(eng.running))
        self.waiting.set(eng.num_waiting)
        self.kv_usage.set(eng.pool.usage())

    def on_finish(self, eng: SimEngine, r: _Req, reason: str) -> None:
        self.success[reason].inc()
        now = time.monotonic()
        self.e2e.observe(now - r.arrival)
        self.gen_per_req.observe(r.generated)
        if r.generated > 1 and r.first_token_at is not None and r.last_token_at is not None:
            self.tpot.observe((r.last_token_at - r.first_token_at) / (r.generated - 1))


# --- HTTP surface --------------------------------------------------------------------------------


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, err_type: str, param: str | None) -> None:
        super().__init__(message)
        self.status = status
        self.body = {
            "error": {"message": message, "type": err_type, "param": param, "code": status}
        }


def _bad(message: str, param: str | None) -> _HTTPError:
    # VLLMValidationError renders as str(exc), which appends the parameter name.
    suffix = f" (parameter={param})" if param else ""
    return _HTTPError(400, message + suffix, "BadRequestError", param)


def _schema(param: str, msg: str) -> _HTTPError:
    # pydantic schema errors take a different path in vLLM: type is the HTTP phrase.
    return _HTTPError(400, f"1 validation error:\n  {msg}", "Bad Request", f"body.{param}")


def _json_response(status: int, body: Any) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


_CACHE_SALT_FORBIDDEN = re.compile(r"[@/\\\x00]")
_DONE = b"data: [DONE]\n\n"
_ROLE_CHOICE = (
    b'[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'
)
_CONTENT_TAIL = b'},"logprobs":null,"finish_reason":null,"token_ids":null}]'


@dataclass
class _Parsed:
    messages: list[Any]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    max_tokens: int
    ignore_eos: bool
    priority: int
    salt: str | None
    seed: int | None
    fail_after: int | None
    drop_after: int | None
    prompt_ids: list[int] = field(default_factory=list)


class SimulatedReplica:
    """aiohttp application around one SimEngine."""

    def __init__(self, config: SimConfig) -> None:
        self.cfg = config
        self.engine = SimEngine(config)
        self.created = int(time.time())
        digest = hashlib.sha256(f"{config.model}:{config.seed}".encode()).hexdigest()[:8]
        self.fingerprint = f"vllm-{VLLM_VERSION}-{digest}"
        self.app = web.Application()
        self.app.add_routes(
            [
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/version", self.version),
                web.post("/tokenize", self.tokenize),
                web.get("/metrics", self.metrics),
                web.get("/sim/requests/{rid}", self.sim_request),
                web.get("/sim/stats", self.sim_stats),
            ]
        )

    # -- small endpoints

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return _json_response(200, {"version": VLLM_VERSION})

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.cfg.model,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": self.cfg.model,
            "parent": None,
            "max_model_len": self.cfg.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{self.engine.new_request_id()}",
                    "object": "model_permission",
                    "created": self.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        return _json_response(200, {"object": "list", "data": [card]})

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return _json_response(400, _schema("messages", "invalid JSON").body)
        if isinstance(body.get("messages"), list):
            ids = prompt_token_ids(body["messages"])
        elif isinstance(body.get("prompt"), str):
            ids = []
            _text_token_ids(body["prompt"], ids)
        else:
            return _json_response(400, _schema("messages", "Field required").body)
        return _json_response(
            200,
            {
                "count": len(ids),
                "max_model_len": self.cfg.max_model_len,
                "tokens": ids,
                "token_strs": None,
            },
        )

    async def metrics(self, request: web.Request) -> web.Response:
        self.engine.metrics.set_gauges(self.engine)
        body = generate_latest(self.engine.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def sim_request(self, request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        rec = self.engine.records.get(rid) or self.engine.records.get(rid.removeprefix("chatcmpl-"))
        if rec is None:
            return _json_response(404, {"error": {"message": "unknown request", "code": 404}})
        return _json_response(200, rec.to_json())

    async def sim_stats(self, request: web.Request) -> web.Response:
        return _json_response(200, self.engine.stats())

    # -- chat completions

    def _parse(self, request: web.Request, raw: bytes) -> _Parsed:
        cfg = self.cfg
        ctype = request.headers.get("Content-Type", "")
        if ctype.split(";")[0].strip().lower() != "application/json":
            raise _HTTPError(
                400,
                "Unsupported Media Type: Only 'application/json' is allowed",
                "Bad Request",
                None,
            )
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise _schema("", f"JSON decode error: {e}") from None
        if not isinstance(body, dict):
            raise _schema("", "Input should be a valid dictionary")
        model = body.get("model")
        if model is not None and model != cfg.model:
            raise _HTTPError(
                404,
                f"The model `{model}` does not exist. Valid aliases: {cfg.model}.",
                "NotFoundError",
                "model",
            )
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise _schema(
                "messages", "Field required" if messages is None else "Input should be a valid list"
            )
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _schema(f"messages.{i}", "Input should be a valid message with a role")
        stream = body.get("stream") or False
        if not isinstance(stream, bool):
            raise _schema("stream", "Input should be a valid boolean")
        stream_options = body.get("stream_options")
        if stream_options is not None and not stream:
            raise _bad("Stream options can only be defined when `stream=True`.", "stream_options")
        if stream_options is not None and not isinstance(stream_options, dict):
            raise _schema("stream_options", "Input should be a valid dictionary")
        if cfg.enable_force_include_usage:
            include_usage = continuous = True
        else:
            so = stream_options or {}
            include_usage = bool(so.get("include_usage"))
            continuous = include_usage and bool(so.get("continuous_usage_stats"))
        n = body.get("n")
        if n not in (None, 1):
            raise _bad("The simulated replica supports only n=1.", "n")
        salt = body.get("cache_salt")
        if salt is not None and (
            not isinstance(salt, str)
            or not salt
            or len(salt) > 128
            or _CACHE_SALT_FORBIDDEN.search(salt)
        ):
            raise _bad(
                "cache_salt must be a non-empty string of at most 128 characters without "
                "'@', '/', '\\' or NUL.",
                "cache_salt",
            )
        limit = None
        for name in ("max_completion_tokens", "max_tokens"):
            v = body.get(name)
            if v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool):
                raise _schema(name, "Input should be a valid integer")
            if v < 1:
                raise _bad(f"{name} must be at least 1, got {v}.", name)
            limit = v
            break
        ids = prompt_token_ids(messages)
        prompt = len(ids)
        if prompt >= cfg.max_model_len:
            raise _bad(
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, "
                f"your prompt contains {prompt} input tokens. Please reduce the length of the "
                "input messages.",
                "input_tokens",
            )
        room = cfg.max_model_len - prompt
        if limit is None:
            limit = room
        elif limit > room:
            raise _bad(
                f"'max_tokens' or 'max_completion_tokens' is too large: {limit}. This model's "
                f"maximum context length is {cfg.max_model_len} tokens and your request has "
                f"{prompt} input tokens ({limit} > {cfg.max_model_len} - {prompt}).",
                "max_tokens",
            )
        priority = body.get("priority", 0)
        header_prio = request.headers.get("X-Vllm-Priority")
        if header_prio is not None:
            with contextlib.suppress(ValueError):
                priority = int(header_prio)
        if not isinstance(priority, int):
            raise _schema("priority", "Input should be a valid integer")
        seed = body.get("seed")
        return _Parsed(
            messages=messages,
            stream=stream,
            include_usage=include_usage,
            continuous_usage=continuous,
            max_tokens=limit,
            ignore_eos=bool(body.get("ignore_eos")),
            priority=priority,
            salt=salt,
            seed=seed if isinstance(seed, int) else None,
            fail_after=_opt_int(body.get("sim_fail_after_tokens")),
            drop_after=_opt_int(body.get("sim_drop_after_tokens")),
            prompt_ids=ids,
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            p = self._parse(request, raw)
        except _HTTPError as e:
            return _json_response(e.status, e.body)
        base = request.headers.get("X-Request-Id") or self.engine.new_request_id()
        try:
            r = self.engine.submit(
                base,
                p.prompt_ids,
                p.max_tokens,
                ignore_eos=p.ignore_eos,
                priority=p.priority,
                salt=p.salt,
                seed=p.seed,
                stream=p.stream,
                fail_after=p.fail_after,
                drop_after=p.drop_after,
            )
        except QueueFull:
            e = _HTTPError(
                503,
                "The engine is currently busy and cannot accept new requests. Please try again "
                "later or on a different instance.",
                "Service Unavailable",
                None,
            )
            return _json_response(503, e.body)
        try:
            if p.stream:
                return await self._stream(request, r, p, f"chatcmpl-{base}")
            return await self._full(r, p, f"chatcmpl-{base}")
        except BaseException:
            # Client disconnect cancels this handler (handler_cancellation): abort at once.
            self.engine.abort(r)
            raise

    def _final_usage(self, r: _Req, completion: int, *, chunk: bool) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": r.prompt_len,
            "total_tokens": r.prompt_len + completion,
            "completion_tokens": completion,
        }
        if self.cfg.enable_prompt_tokens_details:
            cached = r.record.cached_tokens
            bs = self.cfg.block_size
            created = -(-r.prompt_len // bs) * bs - cached
            details: dict[str, Any] = {"cached_tokens": cached, "created_cache_tokens": created}
            if not chunk:
                details["multimodal_tokens"] = None
            usage["prompt_tokens_details"] = details
        elif not chunk:
            usage["prompt_tokens_details"] = None
        if not chunk:
            usage["completion_tokens_details"] = None
        return usage

    async def _full(self, r: _Req, p: _Parsed, response_id: str) -> web.Response:
        while not r.finished:
            r.event.clear()
            await r.event.wait()
        text = "".join(r.pending)
        r.pending.clear()
        rec = r.record
        if r.finish_reason == "error":
            rec.completion_tokens = r.generated
            e = _HTTPError(500, "Internal server error", "InternalServerError", None)
            return _json_response(500, e.body)
        body = {
            "id": response_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.cfg.model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": text,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "reasoning": None,
                    },
                    "logprobs": None,
                    "finish_reason": r.finish_reason,
                    "stop_reason": None,
                    "token_ids": None,
                    "routed_experts": None,
                    "weight_versions": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": self._final_usage(r, r.generated, chunk=False),
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
        payload = orjson.dumps(body)
        rec.completion_tokens = r.generated
        return web.Response(body=payload, content_type="application/json")

    async def _stream(
        self, request: web.Request, r: _Req, p: _Parsed, response_id: str
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        created = int(time.time())
        head = (
            b'{"id":'
            + orjson.dumps(response_id)
            + b',"object":"chat.completion.chunk","created":'
            + str(created).encode()
            + b',"model":'
            + orjson.dumps(self.cfg.model)
            + b',"choices":'
        )
        prompt = r.prompt_len
        rec = r.record
        written = 0
        first = True
        while True:
            if not r.pending and not r.finished:
                r.event.clear()
                await r.event.wait()
            texts = r.pending
            r.pending = []
            finished = r.finished
            reason = r.finish_reason
            out = bytearray()
            if first and (texts or finished) and reason != "error":
                first = False
                out += b"data: " + head + _ROLE_CHOICE
                if p.continuous_usage:
                    out += b',"usage":' + orjson.dumps(
                        {
                            "prompt_tokens": prompt,
                            "total_tokens": prompt,
                            "completion_tokens": 0,
                            "completion_tokens_details": None,
                        }
                    )
                out += b',"prompt_token_ids":null,"prompt_text":null}\n\n'
            n_new = len(texts)
            if reason == "error":
                if n_new:
                    out += self._content_frame(head, texts, written + n_new, None, prompt, p)
                out += (
                    b'data: {"error":{"message":"Internal server error",'
                    b'"type":"InternalServerError","param":null,"code":500}}\n\n' + _DONE
                )
                await resp.write(bytes(out))
                rec.completion_tokens = written + n_new
                await resp.write_eof()
                return resp
            if n_new or finished:
                fr = reason if finished else None
                out += self._content_frame(head, texts, written + n_new, fr, prompt, p)
            if finished:
                if p.include_usage:
                    usage = self._final_usage(r, written + n_new, chunk=True)
                    out += (
                        b"data: "
                        + head
                        + b'[],"usage":'
                        + orjson.dumps(usage)
                        + b',"system_fingerprint":'
                        + orjson.dumps(self.fingerprint)
                        + b"}\n\n"
                    )
                out += _DONE
            if out:
                await resp.write(bytes(out))
            written += n_new
            rec.completion_tokens = written
            if r.drop_after is not None and written >= r.drop_after and not finished:
                # Fault injection: the replica dies mid-stream, no error frame, no [DONE]. Like a
                # crashed process, what it already wrote still leaves (the kernel sends it, then
                # FIN); what it never wrote does not. close(), not abort(): abort() would also
                # drop bytes this record already counts as written.
                self.engine.abort(r)
                if request.transport is not None:
                    request.transport.close()
                return resp
            if finished:
                await resp.write_eof()
                return resp

    def _content_frame(
        self,
        head: bytes,
        texts: list[str],
        completion: int,
        finish_reason: str | None,
        prompt: int,
        p: _Parsed,
    ) -> bytes:
        content = orjson.dumps("".join(texts))
        if finish_reason is None:
            choice = b'[{"index":0,"delta":{"content":' + content + _CONTENT_TAIL
        else:
            choice = (
                b'[{"index":0,"delta":{"content":' + content + b'},"logprobs":null,'
                b'"finish_reason":' + orjson.dumps(finish_reason) + b',"stop_reason":null,'
                b'"token_ids":null,"weight_versions":null}]'
            )
        out = b"data: " + head + choice
        if p.continuous_usage:
            out += b',"usage":' + orjson.dumps(
                {
                    "prompt_tokens": prompt,
                    "total_tokens": prompt + completion,
                    "completion_tokens": completion,
                    "completion_tokens_details": None,
                }
            )
        if finish_reason is not None and not p.include_usage:
            out += b',"system_fingerprint":' + orjson.dumps(self.fingerprint)
        return out + b',"kv_transfer_params":null}\n\n'


def _opt_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


# --- entry points --------------------------------------------------------------------------------


class SimulatedReplicaHandle:
    def __init__(self, replica: SimulatedReplica, runner: web.AppRunner, host: str, port: int):
        self.replica = replica
        self._runner = runner
        self.host = host
        self.port = port
        self.url = f"http://{host}:{port}"

    @property
    def config(self) -> SimConfig:
        return self.replica.cfg

    @property
    def engine(self) -> SimEngine:
        return self.replica.engine

    @property
    def records(self) -> dict[str, SimRecord]:
        """Latest record per request id (a repeated X-Request-Id replaces the earlier entry;
        `engine.history` keeps all of them)."""
        return self.replica.engine.records

    def stats(self) -> dict[str, Any]:
        return self.replica.engine.stats()

    async def stop(self) -> None:
        await self.replica.engine.stop()
        await self._runner.cleanup()


async def start_simulated_replica(
    config: SimConfig | None = None, host: str = "127.0.0.1", port: int = 0
) -> SimulatedReplicaHandle:
    """Start a replica on the running loop; port 0 picks a free port (see `.port`)."""
    replica = SimulatedReplica(config or SimConfig())
    # handler_cancellation: a client disconnect cancels the handler at once, which is how the
    # engine hears about it (vLLM's Starlette stack does the same through listen_for_disconnect).
    runner = web.AppRunner(replica.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    replica.engine.start()
    sockets = site._server.sockets if site._server is not None else []  # type: ignore[union-attr]
    bound = sockets[0].getsockname()[1] if sockets else port
    return SimulatedReplicaHandle(replica, runner, host, bound)


def _arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m engine_adapter.simulated", description="Simulated vLLM 0.33 replica"
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    for f in dataclasses.fields(SimConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if isinstance(default, bool):
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif f.name == "max_num_queued_reqs":
            ap.add_argument(flag, type=int, default=None)
        else:
            ap.add_argument(flag, type=type(default), default=default)
    return ap


async def _serve(args: argparse.Namespace) -> None:
    cfg = SimConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SimConfig)})
    handle = await start_simulated_replica(cfg, args.host, args.port)
    print(f"simulated vLLM {VLLM_VERSION} replica {cfg.model!r} on {handle.url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await handle.stop()


def serve_forever(host: str = "127.0.0.1", port: int = 8000, **config: Any) -> None:
    """Run one replica in this process until interrupted; `config` holds SimConfig fields."""
    args = _arg_parser().parse_args(["--host", host, "--port", str(port)])
    for name, value in config.items():
        if not hasattr(args, name):
            raise TypeError(f"unknown SimConfig field {name!r}")
        setattr(args, name, value)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))


def main(argv: list[str] | None = None) -> None:
    args = _arg_parser().parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
