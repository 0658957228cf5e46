"""Count what the engine reports while one generation is relayed from a replica to the client.

The upstream is always streamed with cumulative usage on every chunk, so whatever ends the
request (completion, client disconnect, replica death) the last engine-reported counts are known.
Per-chunk work is one dict edit and one orjson.dumps: this is the hot path. Usage reports are
cumulative, so only the newest one a relay has seen is taken into the Progress, once, when the
relay ends (a mid-flight reader, the lease renewal or an abort, takes the exchange's
`last_usage` itself, which is never older).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class Progress:
    """Engine-reported counts so far; the lease renewal reads it, the terminal event bills it."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    engine_reported: bool = False
    started_ns: int = field(default_factory=time.perf_counter_ns)
    first_token_ns: int = 0
    last_token_ns: int = 0
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    # Tool calls the engine returned: OpenAI's stream names a call's id in its first delta only,
    # so each delta with an id is one call (what a run's max tool calls counts).
    tool_calls: int = 0

    def count_tool_calls(self, deltas: Any) -> None:
        for call in deltas:
            if isinstance(call, dict) and call.get("id"):
                self.tool_calls += 1

    def absorb_usage(self, usage: dict[str, Any]) -> None:
        """Take an engine usage report. The counts are cumulative, so they only grow: a report
        that arrives late (the drain after an abort) can never lower what was already seen."""
        self.engine_reported = True
        self.prompt_tokens = max(self.prompt_tokens, usage.get("prompt_tokens") or 0)
        self.completion_tokens = max(self.completion_tokens, usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details")
        if details:
            self.cached_tokens = max(self.cached_tokens, details.get("cached_tokens") or 0)

    @property
    def ttft_ms(self) -> int:
        if not self.first_token_ns:
            return 0
        return (self.first_token_ns - self.started_ns) // 1_000_000

    @property
    def tpot_us(self) -> int:
        if self.completion_tokens < 2 or not self.first_token_ns:
            return 0
        return (self.last_token_ns - self.first_token_ns) // 1000 // (self.completion_tokens - 1)


async def relay_stream(
    chunks: AsyncIterator[dict[str, Any]],
    progress: Progress,
    *,
    include_usage: bool,
    continuous_usage: bool,
    on_first_token: Any,
    service_tier: str | None = None,
) -> AsyncIterator[bytes]:
    """Yield the client's SSE frames, each naming the `service_tier` that serves it (as OpenAI's
    do) when given. Stops after an engine error object (which it yields)."""
    last_usage: dict[str, Any] | None = None
    try:
        async for chunk in chunks:
            if service_tier is not None:
                chunk["service_tier"] = service_tier
            if "error" in chunk:
                progress.error = chunk["error"]
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                return
            usage = chunk.get("usage")
            if usage is not None:
                last_usage = usage
            choices = chunk.get("choices")
            if not choices:
                if include_usage:
                    yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                continue
            now = time.perf_counter_ns()
            if not progress.first_token_ns:
                progress.first_token_ns = now
                on_first_token()
            progress.last_token_ns = now
            first = choices[0]
            finish = first.get("finish_reason")
            if finish:
                progress.finish_reason = finish
            delta = first.get("delta")
            if delta and "tool_calls" in delta:
                progress.count_tool_calls(delta["tool_calls"] or ())
            if not continuous_usage and usage is not None:
                del chunk["usage"]
            yield b"data: " + orjson.dumps(chunk) + b"\n\n"
    finally:
        if last_usage is not None:
            progress.absorb_usage(last_usage)


class Collector:
    """Assembles a non-streaming chat.completion. `feed` is the exchange's sink: it runs as each
    chunk arrives (no task wakes up per chunk); `completion()` takes the newest usage report into
    the Progress and builds the answer at the end."""

    __slots__ = (
        "progress", "_on_first_token", "_parts", "_tool_calls", "_head", "_logprobs", "_usage"
    )

    def __init__(self, progress: Progress, on_first_token: Any) -> None:
        self.progress = progress
        self._on_first_token = on_first_token
        self._parts: list[str] = []
        self._logprobs: list[Any] = []  # the streamed chunks' logprobs.content, in order
        self._tool_calls: dict[int, dict[str, Any]] = {}
        self._head: dict[str, Any] = {}
        self._usage: dict[str, Any] | None = None  # the newest report, absorbed at the end

    def feed(self, chunk: dict[str, Any]) -> None:
        progress = self.progress
        if progress.error is not None:
            return  # the engine failed: the rest is not part of an answer
        if "error" in chunk:
            progress.error = chunk["error"]
            return
        usage = chunk.get("usage")
        if usage is not None:
            self._usage = usage
        choices = chunk.get("choices")
        if not choices:
            return
        if not self._head:
            self._head = chunk
        now = time.perf_counter_ns()
        if not progress.first_token_ns:
            progress.first_token_ns = now
            self._on_first_token()
        progress.last_token_ns = now
        choice = choices[0]
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if text:
            self._parts.append(text)
        logprobs = choice.get("logprobs")
        if logprobs:
            self._logprobs.extend(logprobs.get("content") or ())
        calls = delta.get("tool_calls")
        if calls:
            progress.count_tool_calls(calls)
            for call in calls:
                _merge_tool_call(self._tool_calls, call)
        if choice.get("finish_reason"):
            progress.finish_reason = choice["finish_reason"]

    def completion(self) -> dict[str, Any]:
        progress, head, tool_calls = self.progress, self._head, self._tool_calls
        if self._usage is not None:
            progress.absorb_usage(self._usage)
        # OpenAI's schema requires `refusal` (null unless the model refused), as vLLM sends it.
        message: dict[str, Any] = {
            "role": "assistant", "content": "".join(self._parts), "refusal": None
        }
        if tool_calls:
            message["tool_calls"] = [tool_calls[i] for i in sorted(tool_calls)]
        prompt, completion = progress.prompt_tokens, progress.completion_tokens
        return {
            "id": head.get("id", ""),
            "object": "chat.completion",
            "created": head.get("created", int(time.time())),
            "model": head.get("model", ""),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": {"content": self._logprobs} if self._logprobs else None,
                    "finish_reason": progress.finish_reason,
                }
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": progress.cached_tokens},
            },
        }


def _merge_tool_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    index = delta.get("index", 0)
    call = calls.setdefault(
        index,
        {"id": delta.get("id"), "type": "function", "function": {"name": "", "arguments": ""}},
    )
    if delta.get("id"):
        call["id"] = delta["id"]
    function = delta.get("function") or {}
    if function.get("name"):
        call["function"]["name"] += function["name"]
    if function.get("arguments"):
        call["function"]["arguments"] += function["arguments"]
