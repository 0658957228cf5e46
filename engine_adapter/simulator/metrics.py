"""The simulated replica's Prometheus metrics, under vLLM 0.33's names and buckets. The engine
hands them numbers: they know nothing of its classes."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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


class SimMetrics:
    def __init__(
        self, model: str, *, block_size: int, enable_prefix_caching: bool, num_gpu_blocks: int
    ) -> None:
        self.registry = CollectorRegistry()
        self._labels = ["model_name", "engine"]
        self._values = {"model_name": model, "engine": "0"}
        self._gauges()
        self._counters()
        self._histograms()
        _cache_config_info(self.registry, block_size, enable_prefix_caching, num_gpu_blocks)

    def _gauge(self, name: str, doc: str) -> Any:
        return Gauge(name, doc, self._labels, registry=self.registry).labels(**self._values)

    def _counter(self, name: str, doc: str) -> Any:
        return Counter(name, doc, self._labels, registry=self.registry).labels(**self._values)

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Any:
        return Histogram(name, doc, self._labels, buckets=buckets, registry=self.registry).labels(
            **self._values
        )

    def _gauges(self) -> None:
        g = self._gauge
        self.running = g(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = g("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")

    def _counters(self) -> None:
        c, reg, lv = self._counter, self.registry, self._values
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
        # What billing is reconciled against: the prompt tokens served from the prefix cache.
        self.prompt_tokens_cached = c(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.generation_tokens = c(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*self._labels, "finished_reason"],
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

    def _histograms(self) -> None:
        h = self._histogram
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

    def set_gauges(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)

    def on_finish(
        self, reason: str, arrival: float, generated: int,
        first_token_at: float | None, last_token_at: float | None,
    ) -> None:  # fmt: skip
        """One request ended (`arrival` and the token instants: `time.monotonic()` seconds)."""
        self.success[reason].inc()
        now = time.monotonic()
        self.e2e.observe(now - arrival)
        self.gen_per_req.observe(generated)
        if generated > 1 and first_token_at is not None and last_token_at is not None:
            self.tpot.observe((last_token_at - first_token_at) / (generated - 1))


def _cache_config_info(
    reg: CollectorRegistry, block_size: int, enable_prefix_caching: bool, num_gpu_blocks: int
) -> None:
    """vLLM's cache configuration as an info gauge: what the fleet reads the KV capacity from."""
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
        block_size=str(block_size),
        cache_dtype="auto",
        enable_prefix_caching=str(enable_prefix_caching),
        gpu_memory_utilization="0.9",
        num_cpu_blocks="None",
        num_gpu_blocks=str(num_gpu_blocks),
        num_gpu_blocks_override="None",
        prefix_caching_hash_algo="sha256",
        engine="0",
    ).set(1)
