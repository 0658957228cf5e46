"""Client of one `vllm serve` replica (or the simulator): streamed chat, /metrics, /health.

Chats go over `http1.Http1Pool` (a protocol-level HTTP/1.1 client: one wake-up per generation
instead of one per chunk); /metrics and /health over aiohttp. Both chosen by measurement, see
bench/upstream_client.py and engine_adapter/README.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import orjson

from tollgate_llm.engine_adapter.exchange import ChatExchange
from tollgate_llm.engine_adapter.http1 import Connection, Http1Pool
from tollgate_llm.ledger import faults

_STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


class PromptCounter(Protocol):
    """What the replica asks to fit `max_tokens` to the context (engine_adapter/tokenizers.py)."""

    def prompt_tokens(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> int: ...


class ReplicaError(Exception):
    """Base of everything a replica call raises."""


class ReplicaUnavailable(ReplicaError):
    """The replica could not be reached (connect refused, DNS, timeout before any answer)."""


class ReplicaSlow(ReplicaUnavailable):
    """The replica took the connection but did not answer a probe in time: busy or frozen, not
    (yet) known dead. A refused or reset connection is plain `ReplicaUnavailable`."""


@dataclass(frozen=True, slots=True)
class Served:
    """A chat served through a LoRA adapter the replica holds (`engine_adapter.lora`): the
    engine's name for it, the name the answer says, and what to call when the engine answers
    that it does not have it (restarted, or another router unloaded it): the request then fails
    as a replica that is unavailable (a 503 to retry), never with the engine's 404, which would
    name the adapter's engine name to the client."""

    engine_name: str
    answer_as: str
    gone: Callable[[], None]


class AdapterNotLoaded(ReplicaUnavailable):
    """The engine did not have the adapter asked for (see `Served`)."""


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
    """The fleet's session for /metrics and /health (chats go over `Http1Pool`). 0 means
    unbounded: the fleet's own admission is the limit, and a connector cap would turn into a
    hidden queue."""
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


class _HttpExchange(ChatExchange):
    """One streamed chat request on one kept-alive connection: the connection's listener."""

    __slots__ = ("replica_id", "_pool", "_request", "_conn", "_buf", "_status", "_error_body",
                 "_done", "_last_read", "_read_timeout_s", "_timer", "_resend",
                 "_model", "_adapter_gone")  # fmt: skip

    def __init__(
        self,
        replica_id: str,
        pool: Http1Pool,
        request: bytes,
        read_timeout_s: float,
        model: str | None = None,
        adapter_gone: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._adapter_gone = adapter_gone
        self.replica_id = replica_id
        # The model version the gateway serves, written over the engine's served name in every
        # chunk when the two differ (None: they are the same, nothing to do per chunk).
        self._model = model
        self._pool = pool
        self._request = request
        self._conn: Connection | None = None
        self._buf = b""
        self._status = 0
        self._error_body: list[bytes] | None = None
        self._done = False  # `data: [DONE]` seen
        self._resend: asyncio.Task[None] | None = None
        self._read_timeout_s = read_timeout_s
        loop = asyncio.get_running_loop()
        self._last_read = loop.time()
        # One timer per request, moved only when it fires: re-arming it on every read would
        # cost more than the read.
        self._timer: asyncio.TimerHandle | None = loop.call_at(
            self._last_read + read_timeout_s, self._check_silence
        )

    def send_on(self, conn: Connection) -> None:
        self._conn = conn
        conn.send(self._request, self)

    # --- Listener ----------------------------------------------------------------------------

    def on_status(self, status: int) -> None:
        self._status = status
        if status != 200:
            self._error_body = []

    def on_body(self, data: bytes) -> None:
        self._last_read = asyncio.get_running_loop().time()
        if self._error_body is not None:
            self._error_body.append(data)
            return
        buf = self._buf
        frames = (buf + data).split(b"\n\n") if buf else data.split(b"\n\n")
        self._buf = frames.pop()
        delivered = False
        for frame in frames:
            if not frame.startswith(b"data: "):
                continue  # SSE comment (": keep-alive") or blank
            if frame == b"data: [DONE]":
                self._done = True
                continue
            try:
                chunk = orjson.loads(frame[6:])
            except orjson.JSONDecodeError as exc:
                self._finish(ReplicaStreamBroken(self.last_usage, f"bad chunk: {exc}"))
                self._stop_now()
                return
            if self._model is not None and "model" in chunk:
                chunk["model"] = self._model
            self._deliver(chunk)
            delivered = True
        if delivered:
            self._arrived()

    def on_complete(self) -> None:
        if self._error_body is not None:
            raw = b"".join(self._error_body)
            try:
                err = orjson.loads(raw)
            except orjson.JSONDecodeError:
                err = {"error": {"message": raw[:500].decode(errors="replace")}}
            if self._status == 404 and self._adapter_gone is not None:
                self._adapter_gone()
                self._finish(AdapterNotLoaded(f"{self.replica_id}: the adapter is not loaded"))
                return
            self._finish(ReplicaHTTPError(self._status, err if isinstance(err, dict) else {}))
        elif self._done:
            self._finish(None)
        else:
            self._finish(ReplicaStreamBroken(self.last_usage, "stream ended without [DONE]"))

    def on_lost(self, reason: str, answered: bool) -> None:
        if answered:
            self._finish(ReplicaStreamBroken(self.last_usage, reason))
            return
        conn = self._conn
        if conn is not None and conn.requests > 1 and self._resend is None and not self._aborted:
            # A kept-alive connection the server closed as we sent on it (its idle timeout):
            # the request never reached a handler, or one whose client was already gone. Once
            # more, on a new connection.
            self._resend = asyncio.get_running_loop().create_task(self._send_again())
            return
        self._finish(ReplicaUnavailable(f"{self.replica_id}: lost before answering: {reason}"))

    async def _send_again(self) -> None:
        try:
            conn = await self._pool.connect()
        except (TimeoutError, OSError) as e:
            self._finish(ReplicaUnavailable(f"{self.replica_id}: {type(e).__name__}: {e}"))
            return
        if self._ended or self._aborted:
            conn.close()
            return
        self.send_on(conn)

    # --- ChatExchange ------------------------------------------------------------------------

    def _finish(self, error: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super()._finish(error)

    def _check_silence(self) -> None:
        loop = asyncio.get_running_loop()
        if self._paused:  # not read because the client is slow: the engine is not silent
            self._last_read = loop.time()
        due = self._last_read + self._read_timeout_s
        if loop.time() < due:
            self._timer = loop.call_at(due, self._check_silence)
            return
        self._timer = None
        self._finish(ReplicaStreamBroken(self.last_usage, "read timeout"))
        self._stop_now()

    def _pause_reading(self) -> None:
        if self._conn is not None:
            self._conn.pause_reading()

    def _resume_reading(self) -> None:
        if self._conn is not None:
            self._conn.resume_reading()

    def _stop_now(self) -> None:
        if self._conn is not None:
            self._conn.forget(self)

    async def _stop(self, drain_s: float) -> None:
        # Our FIN tells the server the client left (vLLM aborts the request); what it had
        # already written still arrives and moves last_usage, until it closes or drain_s ends.
        if self._conn is None:
            return
        self._conn.half_close()
        if not self._ended:
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(drain_s):
                        while not self._ended:
                            await self._wait()
            finally:
                self._stop_now()
                self._finish(ReplicaStreamBroken(self.last_usage, "aborted"))


class VLLMReplica:
    """One replica behind an OpenAI-compatible vLLM 0.33 HTTP server.

    `model` is the version the gateway serves; `served_model` the name the engine knows it by
    (its `--served-model-name`, or the path it loaded), `max_model_len` its context and
    `estimator` the prompt counter that fits `max_tokens` into what the context has left: both
    from the replica's /v1/models at start-up (see `configure`).
    """

    __slots__ = ("replica_id", "url", "model", "served_model", "max_model_len", "estimator",
                 "_pool", "_read_timeout_s")  # fmt: skip

    def __init__(
        self,
        replica_id: str,
        url: str,
        model: str,
        *,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 120.0,
    ) -> None:
        self.replica_id = replica_id
        self.url = url.rstrip("/")
        self.model = model
        self.served_model = model
        self.max_model_len: int | None = None
        self.estimator: PromptCounter | None = None
        self._pool = Http1Pool(self.url, connect_timeout_s=connect_timeout_s)
        # No total timeout: a long generation is legitimate. read_timeout_s bounds the silence
        # between two chunks (a queued request is silent until its first token).
        self._read_timeout_s = read_timeout_s

    def __repr__(self) -> str:
        return f"VLLMReplica({self.replica_id!r}, {self.url!r}, {self.model!r})"

    def configure(
        self,
        *,
        served_model: str | None = None,
        max_model_len: int | None = None,
        estimator: PromptCounter | None = None,
    ) -> None:
        if served_model is not None:
            self.served_model = served_model
        if max_model_len is not None:
            self.max_model_len = max_model_len
        if estimator is not None:
            self.estimator = estimator

    def fit_output_limit(self, payload: dict[str, Any]) -> None:
        """Never ask for more output than the context has left after the prompt: a request
        without a limit, or with one above it, gets max_model_len − prompt (the engine's own
        default). Without an estimator only the context itself is the cap (vLLM refuses a
        max_tokens above max_model_len). A prompt that fills the context is left for the engine
        to refuse, with its own message."""
        if self.max_model_len is None:
            return
        room = self.max_model_len
        if self.estimator is not None:
            room -= self.estimator.prompt_tokens(
                payload.get("messages") or (), payload.get("tools")
            )
        if room < 1:
            return
        limit = payload.get("max_completion_tokens") or payload.get("max_tokens")
        if limit is None or limit > room:
            payload.pop("max_completion_tokens", None)
            payload["max_tokens"] = room

    @property
    def idle_connections(self) -> int:
        return self._pool.idle_connections

    def close(self) -> None:
        """Close the kept-alive connections (requests in flight keep theirs)."""
        self._pool.close()

    @faults.seam("engine.send", lambda: ReplicaUnavailable("connection reset (fault)"))
    async def open_chat(
        self, body: dict[str, Any], *, request_id: str, cache_salt: str,
        traceparent: str | None = None, adapter: Served | None = None,
    ) -> ChatExchange:  # fmt: skip
        """POST the chat request, streamed, and return its exchange (chunks up to `[DONE]`).

        Always streams with continuous usage, whatever the client asked, so that a cancelled
        request still has an engine-reported count. The tenant's `cache_salt` replaces any
        client value. `exchange.abort()` half-closes the connection (the server sees the
        disconnect and stops), reads for a moment what the engine had already sent — so a
        cancelled request is billed every token the engine produced, not only those read — and
        drops the connection. Raises ReplicaUnavailable when the replica can not be reached;
        a status other than 200 ends the exchange with ReplicaHTTPError. A W3C `traceparent`
        (the gateway's engine span) is sent as the header of that name: vLLM started with
        `--otlp-traces-endpoint` continues the trace. `adapter`: ask the engine for that LoRA
        adapter of the model instead (`engine_adapter.lora`).
        """
        payload = dict(body)
        payload["model"] = adapter.engine_name if adapter else self.served_model
        self.fit_output_limit(payload)
        payload["stream"] = True
        payload["stream_options"] = _STREAM_OPTIONS
        payload["cache_salt"] = cache_salt
        headers = _CHAT_HEADERS + b"X-Request-Id: " + _header_value(request_id) + b"\r\n"
        if traceparent is not None:
            headers += b"traceparent: " + _header_value(traceparent) + b"\r\n"
        request = self._pool.request(b"POST", _CHAT_PATH, headers, orjson.dumps(payload))
        try:
            conn = await self._pool.acquire()
        except (TimeoutError, OSError) as e:
            raise ReplicaUnavailable(f"{self.replica_id}: {type(e).__name__}: {e}") from e
        rename = adapter.answer_as if adapter else (
            self.model if self.served_model != self.model else None
        )  # fmt: skip
        exchange = _HttpExchange(
            self.replica_id, self._pool, request, self._read_timeout_s, rename,
            adapter.gone if adapter else None,
        )  # fmt: skip
        exchange.send_on(conn)
        return exchange

    async def stream_chat(
        self,
        body: dict[str, Any],
        *,
        request_id: str,
        cache_salt: str,
        drain_s: float = 1.0,
    ) -> AsyncIterator[dict[str, Any]]:
        """`open_chat` as an async generator of chunks. Closing it early aborts the request."""
        exchange = await self.open_chat(body, request_id=request_id, cache_salt=cache_salt)
        try:
            async for chunk in exchange:
                yield chunk
        finally:
            await exchange.abort(drain_s)  # a no-op once it ended


_CHAT_PATH = b"/v1/chat/completions"
_CHAT_HEADERS = b"Content-Type: application/json\r\nAccept: text/event-stream\r\n"


def _header_value(value: str) -> bytes:
    """A header value as bytes; a CR or LF in it would split the request."""
    raw = value.encode("latin-1", "replace")
    if b"\r" in raw or b"\n" in raw:
        raise ValueError("header value with a line break")
    return raw


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
    # vLLM's --max-loras (vllm:lora_requests_info's max_lora label). None: not reported, which
    # is both a replica without LoRA and one with LoRA that has not run a step since it started
    # (vLLM sets the series on its first step).
    max_loras: int | None = None

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
_LORA = b"vllm:lora_requests_info{"


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
        elif line.startswith(_LORA):
            lb = _labels(line.rpartition(b" ")[0][len(_LORA) : -1])
            with contextlib.suppress(KeyError, ValueError):
                m.max_loras = max(m.max_loras or 0, int(lb[b"max_lora"]))
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
    except TimeoutError as e:  # aiohttp's own timeouts are TimeoutErrors too
        raise ReplicaSlow(f"{url}/metrics: no answer in {timeout.total} s") from e
    except (aiohttp.ClientError, OSError) as e:
        raise ReplicaUnavailable(f"{url}/metrics: {type(e).__name__}: {e}") from e
    return parse_metrics(text)


@dataclass(frozen=True, slots=True)
class ModelCard:
    """One entry of a replica's /v1/models."""

    id: str
    max_model_len: int | None
    root: str | None


async def fetch_models(
    session: aiohttp.ClientSession, url: str, *, timeout_s: float = 5.0
) -> list[ModelCard]:
    """GET {url}/v1/models (base models only: LoRA adapters have a parent). Raises
    ReplicaUnavailable when it cannot be read."""
    try:
        async with session.get(
            url.rstrip("/") + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                raise ReplicaUnavailable(f"{url}/v1/models answered {resp.status}")
            listing = orjson.loads(await resp.read())
    except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError) as e:
        raise ReplicaUnavailable(f"{url}/v1/models: {type(e).__name__}: {e}") from e
    cards = []
    for card in listing.get("data") or ():
        if not isinstance(card, dict) or card.get("parent") or not card.get("id"):
            continue
        length = card.get("max_model_len")
        root = card.get("root")
        cards.append(
            ModelCard(
                str(card["id"]),
                length if isinstance(length, int) and length > 0 else None,
                root if isinstance(root, str) else None,
            )
        )
    return cards


async def check_health(session: aiohttp.ClientSession, url: str, *, timeout_s: float = 1.0) -> bool:
    """True when GET {url}/health answers 200, False when it answers otherwise or the connection
    fails; raises ReplicaSlow when it does not answer within `timeout_s`."""
    try:
        async with session.get(
            url.rstrip("/") + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            await resp.read()
            return resp.status == 200
    except TimeoutError as e:
        raise ReplicaSlow(f"{url}/health: no answer in {timeout_s} s") from e
    except (aiohttp.ClientError, OSError):
        return False


__all__ = [
    "ModelCard",
    "PromptCounter",
    "ReplicaError",
    "ReplicaHTTPError",
    "ReplicaMetrics",
    "ReplicaSlow",
    "ReplicaStreamBroken",
    "ReplicaUnavailable",
    "VLLMReplica",
    "check_health",
    "fetch_metrics",
    "fetch_models",
    "make_session",
    "parse_metrics",
]
