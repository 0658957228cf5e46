"""Two ways to send a chat completion: the official `openai` SDK (AsyncOpenAI, what customers
run) and raw httpx (the floor of client CPU cost). Both return one `Attempt` per HTTP request.

Streaming requests always ask for `stream_options.include_usage`, so the final chunk carries the
engine's usage; a client that drops mid-stream (the `disconnect` profile) records only the content
chunks it saw, and its request id, by which finance reconciles it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import orjson

from tollgate_llm.loadgen.profiles import RequestSpec


@dataclass
class Attempt:
    seq: int
    attempt: int  # 0 for the first send, n for the n-th retry or replay
    tenant: str
    tier: str
    model: str
    cls: str
    stream: bool
    t_start: float  # seconds since the run started
    latency: float = 0.0
    ttft: float | None = None
    tpot: float | None = None
    status: int = 0  # HTTP status; 0 when no response arrived
    kind: str = "error"  # ok | cancelled | 429 | 503 | 4xx | 5xx | error
    reason: str = ""  # error type / code, or why the client cancelled
    request_id: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    usage_seen: bool = False
    chunks: int = 0  # content chunks seen
    replayed: bool = False  # the server replayed a stored response (Idempotent-Replayed)
    retry_after: float | None = None
    target_prompt_tokens: int = 0
    max_tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def classify(status: int) -> str:
    if 200 <= status < 300:
        return "ok"
    if status in (429, 503):
        return str(status)
    if 400 <= status < 500:
        return "4xx"
    if status >= 500:
        return "5xx"
    return "error"


@dataclass
class Prepared:
    spec: RequestSpec
    key: str
    body: dict[str, Any]
    raw: bytes  # the exact bytes, resent unchanged on retries (Idempotency-Key body hash)
    headers: dict[str, str] = field(default_factory=dict)


def prepare(spec: RequestSpec, key: str, messages: list[dict[str, Any]]) -> Prepared:
    body: dict[str, Any] = {"model": spec.model, "messages": messages,
                            "max_tokens": spec.max_tokens}
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if spec.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return Prepared(spec, key, body, orjson.dumps(body))


class _Stream:
    """Per-attempt streaming bookkeeping shared by both clients."""

    def __init__(self, attempt: Attempt, t0: float) -> None:
        self.a = attempt
        self.t0 = t0
        self.first: float | None = None
        self.last: float | None = None

    def chunk(self, data: dict[str, Any]) -> None:
        for choice in data.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
                now = time.perf_counter()
                if self.first is None:
                    self.first = now
                    self.a.ttft = now - self.t0
                self.last = now
                self.a.chunks += 1
        usage = data.get("usage")
        if usage:
            _usage(self.a, usage)

    def finish(self) -> None:
        n = self.a.completion_tokens if self.a.usage_seen else self.a.chunks
        if self.first is not None and self.last is not None and n > 1:
            self.a.tpot = (self.last - self.first) / (n - 1)


def _usage(a: Attempt, usage: dict[str, Any]) -> None:
    a.usage_seen = True
    a.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    a.completion_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    a.cached_tokens = int(details.get("cached_tokens") or 0)


def _error_reason(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("code") or err.get("type") or "")[:80]
    return ""


def _retry_after(headers: Any) -> float | None:
    value = headers.get("retry-after") if headers is not None else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


class HttpxClient:
    name = "httpx"

    def __init__(self, base_url: str, timeout_s: float, max_connections: int) -> None:
        self.http = httpx.AsyncClient(
            base_url=base_url.rstrip("/") + "/v1",
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=max_connections,
                                max_keepalive_connections=max_connections),
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    async def send(self, p: Prepared, a: Attempt, extra_headers: dict[str, str]) -> None:
        headers = {"Authorization": f"Bearer {p.key}", "Content-Type": "application/json",
                   **extra_headers}
        t0 = time.perf_counter()
        try:
            if not p.spec.stream:
                r = await self.http.post("/chat/completions", content=p.raw, headers=headers)
                a.latency = time.perf_counter() - t0
                self._head(a, r)
                body = orjson.loads(r.content) if r.content else {}
                if a.kind == "ok":
                    _usage(a, body.get("usage") or {})
                    a.ttft = None
                else:
                    a.reason = _error_reason(body)
                return
            st = _Stream(a, t0)
            async with self.http.stream("POST", "/chat/completions", content=p.raw,
                                        headers=headers) as r:
                self._head(a, r)
                if a.kind != "ok":
                    await r.aread()
                    a.reason = _error_reason(orjson.loads(r.content) if r.content else {})
                    a.latency = time.perf_counter() - t0
                    return
                try:
                    async for line in r.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == "[DONE]":
                            break
                        data = orjson.loads(payload)
                        if "error" in data and not data.get("choices"):
                            a.kind, a.reason = "5xx", _error_reason(data) or "stream_error"
                            break
                        st.chunk(data)
                        if p.spec.disconnect_after is not None and \
                                a.chunks >= p.spec.disconnect_after:
                            a.kind, a.reason = "cancelled", "client_disconnect"
                            break  # leaving the block closes the connection mid-stream
                finally:
                    st.finish()
                    a.latency = time.perf_counter() - t0
        except asyncio.CancelledError:
            _cancelled(a, t0)
            raise
        except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
            a.latency = time.perf_counter() - t0
            if a.kind == "ok" and a.status:
                a.kind = "error"  # broken mid-stream after 200
            elif a.kind != "cancelled":
                a.kind = "error"
            a.reason = type(exc).__name__

    @staticmethod
    def _head(a: Attempt, r: httpx.Response) -> None:
        a.status = r.status_code
        a.kind = classify(r.status_code)
        a.request_id = r.headers.get("x-request-id")
        a.replayed = r.headers.get("idempotent-replayed") == "true"
        a.retry_after = _retry_after(r.headers)


def _cancelled(a: Attempt, t0: float) -> None:
    a.latency = time.perf_counter() - t0
    if a.kind != "cancelled":
        a.kind, a.reason = "cancelled", "interrupted"


class OpenAIClient:
    name = "openai"

    def __init__(self, base_url: str, timeout_s: float, max_connections: int) -> None:
        import openai

        self.openai = openai
        # The SDK brings its own HTTP stack (and pool); retries are ours, so max_retries=0.
        self.root = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="unset",
                                       max_retries=0, timeout=timeout_s)
        self.clients: dict[str, Any] = {}

    def _client(self, key: str) -> Any:
        client = self.clients.get(key)
        if client is None:  # one AsyncOpenAI per key (like one per customer app), shared pool
            client = self.root.with_options(api_key=key)
            self.clients[key] = client
        return client

    async def aclose(self) -> None:
        await self.root.close()

    async def send(self, p: Prepared, a: Attempt, extra_headers: dict[str, str]) -> None:
        oa = self.openai
        body = dict(p.body)
        kwargs: dict[str, Any] = {
            "model": body.pop("model"), "messages": body.pop("messages"),
            "max_tokens": body.pop("max_tokens"), "extra_headers": extra_headers,
        }
        if body.pop("stream", False):
            kwargs["stream"] = True
            kwargs["stream_options"] = body.pop("stream_options")
        if body:
            kwargs["extra_body"] = body
        t0 = time.perf_counter()
        try:
            raw = await self._client(p.key).chat.completions.with_raw_response.create(**kwargs)
            a.status = raw.status_code
            a.kind = classify(raw.status_code)
            a.request_id = raw.headers.get("x-request-id")
            a.replayed = raw.headers.get("idempotent-replayed") == "true"
            if not p.spec.stream:
                completion = raw.parse()
                a.latency = time.perf_counter() - t0
                if completion.usage is not None:
                    _usage(a, completion.usage.model_dump())
                return
            stream = raw.parse()
            st = _Stream(a, t0)
            try:
                async for chunk in stream:
                    st.chunk(chunk.model_dump(exclude_none=True))
                    if p.spec.disconnect_after is not None and \
                            a.chunks >= p.spec.disconnect_after:
                        a.kind, a.reason = "cancelled", "client_disconnect"
                        break
            finally:
                await stream.close()
                st.finish()
                a.latency = time.perf_counter() - t0
        except asyncio.CancelledError:
            _cancelled(a, t0)
            raise
        except oa.APIStatusError as exc:
            a.latency = time.perf_counter() - t0
            a.status = exc.status_code
            a.kind = classify(exc.status_code)
            a.request_id = exc.response.headers.get("x-request-id")
            a.retry_after = _retry_after(exc.response.headers)
            a.reason = _error_reason(exc.body if isinstance(exc.body, dict) else
                                     {"error": exc.body})
            if a.status == 200 or not a.status:  # an error event inside a 200 stream
                a.kind, a.reason = "5xx", a.reason or "stream_error"
        except (oa.APIConnectionError, oa.APIError, httpx.HTTPError) as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # the SDK wrapped our cancellation
                _cancelled(a, t0)
                raise asyncio.CancelledError from exc
            a.latency = time.perf_counter() - t0
            a.kind = "error"
            a.reason = type(exc).__name__


def make_client(kind: str, base_url: str, timeout_s: float,
                max_connections: int) -> HttpxClient | OpenAIClient:
    if kind == "httpx":
        return HttpxClient(base_url, timeout_s, max_connections)
    if kind == "openai":
        return OpenAIClient(base_url, timeout_s, max_connections)
    raise ValueError(f"unknown client {kind!r}")
