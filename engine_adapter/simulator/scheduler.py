"""The simulated engine's scheduler: which requests run in the next step and how many tokens each
computes (continuous batching, chunked prefill within the token budget, prefix-cache hits on
admission, preemption by recompute when the KV blocks run out)."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from tollgate_llm.engine_adapter.simulator.kv import BlockPool
from tollgate_llm.engine_adapter.simulator.metrics import SimMetrics
from tollgate_llm.engine_adapter.simulator.state import SimConfig, SimRequest


class WaitingQueue:
    """Requests not running: first come first served, or a heap on (priority, arrival)."""

    def __init__(self, *, priority: bool) -> None:
        self.priority = priority
        self.fcfs: deque[SimRequest] = deque()
        self.heap: list[SimRequest] = []

    def __len__(self) -> int:
        return len(self.heap) + len(self.fcfs)

    def __iter__(self) -> Iterator[SimRequest]:
        yield from list(self.fcfs)
        yield from list(self.heap)

    def push(self, r: SimRequest) -> None:
        if self.priority:
            heapq.heappush(self.heap, r)
        else:
            self.fcfs.append(r)

    def peek(self) -> SimRequest | None:
        if self.priority:
            return self.heap[0] if self.heap else None
        return self.fcfs[0] if self.fcfs else None

    def pop(self) -> None:
        if self.priority:
            heapq.heappop(self.heap)
        else:
            self.fcfs.popleft()

    def push_front(self, r: SimRequest) -> None:
        if self.priority:
            heapq.heappush(self.heap, r)
        else:
            self.fcfs.appendleft(r)

    def remove(self, r: SimRequest) -> None:
        """Raises ValueError when `r` is not waiting."""
        if self.priority:
            self.heap.remove(r)
            heapq.heapify(self.heap)
        else:
            self.fcfs.remove(r)


class Scheduler:
    """The running batch, the waiting queue and the KV blocks they hold."""

    def __init__(self, config: SimConfig, metrics: SimMetrics) -> None:
        self.cfg = config
        self.metrics = metrics
        self.pool = BlockPool(config.num_gpu_blocks)
        self.running: list[SimRequest] = []
        self.waiting = WaitingQueue(priority=config.scheduling_policy == "priority")

    def hashes_for(self, r: SimRequest, upto_tokens: int) -> list[int]:
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

    def schedule(self) -> tuple[list[tuple[SimRequest, int]], int]:
        """The next step's (request, tokens to compute) pairs and how many of those tokens are
        prefill (they set the step's time)."""
        scheduled, budget = self._continue_running(self.cfg.max_num_batched_tokens)
        self._admit_waiting(scheduled, budget)
        prefill_tokens = sum(n for _, n, is_prefill in scheduled if is_prefill)
        return [(r, n) for r, n, _ in scheduled], prefill_tokens

    def _continue_running(self, budget: int) -> tuple[list[tuple[SimRequest, int, bool]], int]:
        """Running requests in batch order: one decode token, or the next prefill chunk; a
        request that finds no free block preempts the latest (or least urgent) one."""
        scheduled: list[tuple[SimRequest, int, bool]] = []
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
        return scheduled, budget

    def _admit_waiting(self, scheduled: list[tuple[SimRequest, int, bool]], budget: int) -> None:
        """Waiting requests join while a sequence slot, the token budget and the blocks allow."""
        cfg = self.cfg
        while budget > 0 and len(self.running) < cfg.max_num_seqs:
            r = self.waiting.peek()
            if r is None:
                break
            total = r.prompt_len + r.generated
            hit: list[int] = []
            if cfg.enable_prefix_caching:
                # At least one token is always computed, so a full-cache hit stops a block short.
                hashes = self.hashes_for(r, total - 1)
                hit = self.pool.lookup(hashes)
                self.metrics.prefix_queries.inc(total)
                self.metrics.prefix_hits.inc(len(hit) * cfg.block_size)
            computed = len(hit) * cfg.block_size
            n = min(total - computed, budget)
            need_new = -(-(computed + n) // cfg.block_size) - len(hit)
            hit_free = sum(1 for b in hit if self.pool.ref[b] == 0)
            if need_new + hit_free > self.pool.num_free:
                break  # no preemption on behalf of a waiting request: it waits
            self.waiting.pop()
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

    def _blocks_needed(self, r: SimRequest, tokens: int) -> int:
        return -(-tokens // self.cfg.block_size) - len(r.blocks)

    def _preempt(self, victim: SimRequest) -> None:
        self.running.remove(victim)
        self.pool.release(victim.blocks)
        victim.blocks = []
        victim.num_computed = 0
        victim.record.preemptions += 1
        self.metrics.preemptions.inc()
        self.waiting.push_front(victim)

    def _pick_victim(self) -> SimRequest:
        if self.cfg.scheduling_policy == "priority":
            return max(self.running, key=SimRequest.sort_key)
        return max(self.running, key=lambda q: q.seq)
