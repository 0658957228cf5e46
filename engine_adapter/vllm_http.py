"""Thin aiohttp client for one `vllm serve` replica (or the simulator): streamed chat, /metrics.

aiohttp rather than httpx by measurement: see bench/upstream_client.py and engine_adapter/README.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

_STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}
_JSON_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}


class ReplicaError(Exception):
    """Base of everything a replica call raises."""


class ReplicaUnavailable(ReplicaError):
    """The replica could not be reached (connect refused, DNS, timeout before any answer)."""


class ReplicaHTTPError(ReplicaError):
    """The replica answered with a non-200 status before the stream started."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        err = body.get("error") if isinstance(body.get("error"), dict) else None
        message = err.get("message") if err else body.get("message")
        super().__init__(f"replica answered {status}: {message}")
        self.status = status
        self.body = body


class ReplicaStreamBroken(ReplicaError):
    """The stream ended (or the connection died) without `data: [DONE]`.

    `last_usage` is the last cumulative usage the replica reported: with continuous usage stats
    that is the engine's own count of what was delivered before the break.
    """

    def __init__(self, last_usage: dict[str, Any] | None, reason: str) -> None:
        super().__init__(f"stream broken before [DONE]: {reason}")
        self.last_usage = last_usage
        self.reason = reason


def make_session(
    *, limit: int = 0, limit_per_host: int = 0, keepalive_timeout_s: float = 30.0
) -> aiohttp.ClientSession:
    """The one shared session for a fleet. 0 means unbounded: the fleet's own admission is the
    limit, and a connector cap would turn into a hidden queue."""
    connector = aiohttp.TCPConnector(
        limit=limit,
        limit_per_host=limit_per_host,
        keepalive_timeout=keepalive_timeout_s,
        ttl_dns_cache=300,
    )
    return aiohttp.ClientSession(
        connector=connector,
        json_serialize=lambda o: orjson.dumps(o).decode(),
        auto_decompress=False,
    )


class VLLMReplica:
    """One replica behind an OpenAI-compatible vLLM 0.33 HTTP server."""

    __slots__ = ("replica_id", "url", "model", "_session", "_chat_url", "_timeout")

    def __init__(
        self,
        replica_id: str,
        url: str,
        model: str,
        session: aiohttp.ClientSession,
        *,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 120.0,
    ) -> None:
        self.replica_id = replica_id
        self.url = url.rstrip("/")
        self.model = model
        self._session = session
        self._chat_url = self.url + "/v1/chat/completions"
        # No total timeout: a long generation is legitimate. sock_read bounds the silence between
        # two chunks (a queued request is silent until its first token).
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )

    def __repr__(self) -> str:
        return f"VLLMReplica({self.replica_id!r}, {self.url!r}, {self.model!r})"

    async def stream_chat(
        self,
        body: dict[str, Any],
        *,
        request_id: str,
        cache_salt: str,
        on_abort_usage: Callable[[dict[str, Any]], None] | None = None,
        drain_s: float = 1.0,
    ) -> AsyncIterator[dict[str, Any]]:
        """POST the chat request streamed and yield every parsed chunk up to `[DONE]`.

        Always streams with continuous usage, whatever the client asked, so that a cancelled
        request still has an engine-reported count. The tenant's `cache_salt` replaces any
        client value. Closing the generator early aborts the request in vLLM: it half-closes the
        connection (the server sees the disconnect and stops), reads for at most `drain_s` what
        the engine had already sent, hands the last usage found to `on_abort_usage` — so a
        cancelled request is billed every token the engine produced, not only those read — and
        then drops the connection.
        """
        payload = dict(body)
        payload["model"] = self.model
        payload["stream"] = True
        payload["stream_options"] = _STREAM_OPTIONS
        payload["cache_salt"] = cache_salt
        headers = {**_JSON_HEADERS, "X-Request-Id": request_id}
        try:
            resp = await self._session.post(
                self._chat_url, data=orjson.dumps(payload), headers=headers, timeout=self._timeout
            )
        except (aiohttp.ClientConnectionError, TimeoutError, OSError) as e:
            raise ReplicaUnavailable(f"{self.replica_id}: {type(e).__name__}: {e}") from e
        done = early = False
        last_usage: dict[str, Any] | None = None
        buf = b""
        try:
            if resp.status != 200:
                raw = await resp.read()
                try:
                    err = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    err = {"error": {"message": raw[:500].decode(errors="replace")}}
                raise ReplicaHTTPError(resp.status, err if isinstance(err, dict) else {})
            content = resp.content
            try:
                while True:
                    data = await content.readany()
                    if not data:
                        break
                    frames = (buf + data).split(b"\n\n") if buf else data.split(b"\n\n")
                    buf = frames.pop()
                    for frame in frames:
                        if not frame.startswith(b"data: "):
                            continue  # SSE comment (": keep-alive") or blank
                        if frame == b"data: [DONE]":
                            done = True
                            return
                        chunk = orjson.loads(frame[6:])
                        usage = chunk.get("usage")
                        if usage is not None:
                            last_usage = usage
                        yield chunk
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, OSError) as e:
                raise ReplicaStreamBroken(last_usage, f"{type(e).__name__}: {e}") from e
            except TimeoutError as e:
                raise ReplicaStreamBroken(last_usage, "read timeout") from e
            except (GeneratorExit, asyncio.CancelledError):
                early = True  # the consumer stopped: abort, but count what the engine sent
                raise
            raise ReplicaStreamBroken(last_usage, "connection closed")
        finally:
            if early and on_abort_usage is not None and not resp.content.at_eof():
                usage = await _drain_after_half_close(resp, buf, drain_s)
                if usage is not None:
                    on_abort_usage(usage)
            if done and not resp.content.at_eof():
                # The chunked-encoding terminator follows [DONE]; reading it lets the connection
                # go back to the pool instead of being closed.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(resp.content.read(), 0.5)
            if resp.content.at_eof():
                resp.release()
            else:
                # Not finished cleanly (aclose, cancellation, error): drop the connection. vLLM
                # sees the disconnect and aborts the request at once.
                resp.close()


async def _drain_after_half_close(
    resp: aiohttp.ClientResponse, buf: bytes, drain_s: float
) -> dict[str, Any] | None:
    """Send our FIN (the server reads EOF, takes it as the client leaving and aborts), then read
    what the engine had already written until the server closes or `drain_s` runs out. Returns
    the last cumulative usage in it."""
    connection = resp.connection
    transport = connection.transport if connection is not None else None
    if transport is None or not transport.can_write_eof():
        return None
    last: dict[str, Any] | None = None
    try:
        transport.write_eof()
        async with asyncio.timeout(drain_s):
            while data := await resp.content.readany():
                frames = (buf + data).split(b"\n\n")
                buf = frames.pop()
                for frame in frames:
                    if frame.startswith(b"data: {"):
                        usage = orjson.loads(frame[6:]).get("usage")
                        if usage is not None:
                            last = usage
    except (TimeoutError, aiohttp.ClientError, OSError, orjson.JSONDecodeError):
        pass  # whatever was read before the cut still counts
    return last


# --- /metrics ------------------------------------------------------------------------------------


@dataclass(slots=True)
class ReplicaMetrics:
    """What the router reads from one replica's /metrics (floats are fine here; events convert)."""

    kv_cache_usage: float = 0.0  # 0..1
    running: int = 0
    waiting: int = 0
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    preemptions: int = 0
    # vllm:request_time_per_output_token_seconds: cumulative bucket counts by upper bound
    tpot_buckets: tuple[tuple[float, int], ...] = ()
    tpot_count: int = 0
    tpot_sum_s: float = 0.0
    engines: int = 0

    @property
    def kv_capacity_tokens(self) -> int | None:
        if self.num_gpu_blocks is None or self.block_size is None:
            return None
        return self.num_gpu_blocks * self.block_size


def _labels(s: bytes) -> dict[bytes, bytes]:
    out: dict[bytes, bytes] = {}
    for part in s.split(b'",'):
        k, _, v = part.partition(b'="')
        out[k.strip()] = v.rstrip(b'"')
    return out


_KV = b"vllm:kv_cache_usage_perc{"
_RUN = b"vllm:num_requests_running{"
_WAIT = b"vllm:num_requests_waiting{"
_PRE = b"vllm:num_preemptions_total{"
_INFO = b"vllm:cache_config_info{"
_TPOT = b"vllm:request_time_per_output_token_seconds_"


def parse_metrics(text: bytes) -> ReplicaMetrics:
    """A small exact-match parser for the few series the router needs.

    prometheus_client's parser handles all of the format but costs ~28x more per scrape (6.5 ms
    vs 0.24 ms, bench/upstream_metrics.py); at 4 scrapes/s per replica that decides the fleet size
    one router can watch.
    Label values we read never contain '",' so the split is safe for vLLM's output. Several
    engines (data parallel) are combined: counts summed, KV usage averaged.
    """
    m = ReplicaMetrics()
    kv_sum = 0.0
    kv_n = 0
    buckets: dict[float, int] = {}
    blocks_total = 0
    for line in text.split(b"\n"):
        if not line.startswith(b"vllm:"):
            continue
        if line.startswith(_KV):
            kv_sum += float(line.rsplit(b" ", 1)[1])
            kv_n += 1
        elif line.startswith(_RUN):
            m.running += int(float(line.rsplit(b" ", 1)[1]))
        elif line.startswith(_WAIT):
            m.waiting += int(float(line.rsplit(b" ", 1)[1]))
        elif line.startswith(_PRE):
            m.preemptions += int(float(line.rsplit(b" ", 1)[1]))
        elif line.startswith(_TPOT):
            head, _, value = line.rpartition(b" ")
            if head.startswith(b"bucket{", len(_TPOT)):
                lb = _labels(head[len(_TPOT) + 7 : -1])
                le = lb.get(b"le", b"+Inf")
                bound = math.inf if le == b"+Inf" else float(le)
                buckets[bound] = buckets.get(bound, 0) + int(float(value))
            elif head.startswith(b"count{", len(_TPOT)):
                m.tpot_count += int(float(value))
            elif head.startswith(b"sum{", len(_TPOT)):
                m.tpot_sum_s += float(value)
        elif line.startswith(_INFO):
            head = line.rpartition(b" ")[0]
            lb = _labels(head[len(_INFO) : -1])
            try:
                blocks_total += int(lb[b"num_gpu_blocks"])
                m.block_size = int(lb[b"block_size"])
                m.engines += 1
            except (KeyError, ValueError):
                pass
    if kv_n:
        m.kv_cache_usage = kv_sum / kv_n
    if m.engines:
        m.num_gpu_blocks = blocks_total
    m.tpot_buckets = tuple(sorted(buckets.items()))
    return m


_METRICS_TIMEOUT = aiohttp.ClientTimeout(total=1.0)


async def fetch_metrics(
    session: aiohttp.ClientSession, url: str, *, timeout_s: float | None = None
) -> ReplicaMetrics:
    """GET {url}/metrics and parse it. Raises ReplicaUnavailable on any failure."""
    timeout = _METRICS_TIMEOUT if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(url.rstrip("/") + "/metrics", timeout=timeout) as resp:
            if resp.status != 200:
                raise ReplicaUnavailable(f"{url}/metrics answered {resp.status}")
            text = await resp.read()
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        raise ReplicaUnavailable(f"{url}/metrics: {type(e).__name__}: {e}") from e
    return parse_metrics(text)


async def check_health(session: aiohttp.ClientSession, url: str, *, timeout_s: float = 1.0) -> bool:
    """True when GET {url}/health answers 200."""
    try:
        async with session.get(
            url.rstrip("/") + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            await resp.read()
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False


__all__ = [
    "ReplicaError",
    "ReplicaHTTPError",
    "ReplicaMetrics",
    "ReplicaStreamBroken",
    "ReplicaUnavailable",
    "VLLMReplica",
    "check_health",
    "fetch_metrics",
    "make_session",
    "parse_metrics",
]
