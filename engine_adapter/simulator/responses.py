"""What the simulated replica answers a chat with, byte for byte as vLLM 0.33 writes it: the
non-streamed `chat.completion` body and the streamed chunks (`StreamFrames`)."""

from __future__ import annotations

import hashlib
import time
import zlib
from typing import Any

import orjson
from aiohttp import web

from tollgate_llm.engine_adapter.simulator.chat_body import HTTPError, Parsed
from tollgate_llm.engine_adapter.simulator.state import (
    VOCAB_SIZE,
    SimConfig,
    SimRequest,
    token_text,
)

DONE = b"data: [DONE]\n\n"
_ROLE_CHOICE = (
    b'[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'
)
_ERROR_FRAME = (
    b'data: {"error":{"message":"Internal server error",'
    b'"type":"InternalServerError","param":null,"code":500}}\n\n'
)


def json_response(status: int, body: Any) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def error_response(error: HTTPError) -> web.Response:
    return json_response(error.status, error.body)


def final_usage(cfg: SimConfig, r: SimRequest, completion: int, *, chunk: bool) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": r.prompt_len,
        "total_tokens": r.prompt_len + completion,
        "completion_tokens": completion,
    }
    if cfg.enable_prompt_tokens_details:
        cached = r.record.cached_tokens
        bs = cfg.block_size
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


def full_body(
    cfg: SimConfig, fingerprint: str, r: SimRequest, p: Parsed, text: str, response_id: str
) -> dict[str, Any]:
    """The non-streamed answer of a request that ended without an engine error."""
    body = {
        "id": response_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": p.adapter or cfg.model,
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
                "logprobs": _logprobs(r, 0, r.generated, p.top_logprobs) if p.logprobs else None,
                "finish_reason": r.finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": None,
                "weight_versions": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": final_usage(cfg, r, r.generated, chunk=False),
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }
    if p.tool is not None and r.finish_reason == "stop":
        choice = body["choices"][0]  # type: ignore[index]
        choice["message"]["content"] = None
        choice["message"]["tool_calls"] = [_tool_call(r, p.tool, text)]
        choice["finish_reason"] = "tool_calls"
    return body


class StreamFrames:
    """The SSE frames of one streamed answer; every chunk starts with the same `head`."""

    def __init__(
        self, cfg: SimConfig, fingerprint: str, r: SimRequest, p: Parsed, response_id: str
    ) -> None:
        self.cfg = cfg
        self.fingerprint = fingerprint
        self.r = r
        self.p = p
        self.head = (
            b'{"id":'
            + orjson.dumps(response_id)
            + b',"object":"chat.completion.chunk","created":'
            + str(int(time.time())).encode()
            + b',"model":'
            + orjson.dumps(p.adapter or cfg.model)
            + b',"choices":'
        )

    def role(self) -> bytes:
        """The first chunk: the assistant's role, no content yet."""
        out = b"data: " + self.head + _ROLE_CHOICE
        if self.p.continuous_usage:
            prompt = self.r.prompt_len
            out += b',"usage":' + orjson.dumps(
                {
                    "prompt_tokens": prompt,
                    "total_tokens": prompt,
                    "completion_tokens": 0,
                    "completion_tokens_details": None,
                }
            )
        return out + b',"prompt_token_ids":null,"prompt_text":null}\n\n'

    def error(self) -> bytes:
        """The in-stream error frame of an engine error, and the `[DONE]` vLLM still sends."""
        return _ERROR_FRAME + DONE

    def tool_calls(self, text: str) -> bytes:
        """The last chunk of a natural stop when the request offered tools."""
        call = {"index": 0, **_tool_call(self.r, self.p.tool or "", text)}
        return (
            b"data: " + self.head + b'[{"index":0,"delta":{"tool_calls":'
            + orjson.dumps([call]) + b'},"logprobs":null,"finish_reason":"tool_calls"'
            b',"stop_reason":null,"token_ids":null}]}\n\n'
        )  # fmt: skip

    def usage(self, completion: int) -> bytes:
        """The include_usage chunk: no choices, the final usage."""
        usage = final_usage(self.cfg, self.r, completion, chunk=True)
        return (
            b"data: "
            + self.head
            + b'[],"usage":'
            + orjson.dumps(usage)
            + b',"system_fingerprint":'
            + orjson.dumps(self.fingerprint)
            + b"}\n\n"
        )

    def content(self, texts: list[str], completion: int, finish_reason: str | None) -> bytes:
        """One content chunk carrying `texts`, `completion` tokens written with them."""
        p = self.p
        content = orjson.dumps("".join(texts))
        logprobs = (
            orjson.dumps(_logprobs(self.r, completion - len(texts), completion, p.top_logprobs))
            if p.logprobs
            else b"null"
        )
        if finish_reason is None:
            choice = (
                b'[{"index":0,"delta":{"content":'
                + content
                + b'},"logprobs":'
                + logprobs
                + b',"finish_reason":null,"token_ids":null}]'
            )
        else:
            choice = (
                b'[{"index":0,"delta":{"content":' + content + b'},"logprobs":' + logprobs
                + b',"finish_reason":' + orjson.dumps(finish_reason) + b',"stop_reason":null,'
                b'"token_ids":null,"weight_versions":null}]'
            )  # fmt: skip
        out = b"data: " + self.head + choice
        if p.continuous_usage:
            prompt = self.r.prompt_len
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


def _tool_call(r: SimRequest, name: str, text: str) -> dict[str, Any]:
    """One OpenAI-shaped tool call whose arguments carry the generated text (vLLM's ids are
    "chatcmpl-tool-" and 32 hex digits)."""
    digest = hashlib.sha256(f"{r.record.request_id}:{name}".encode()).hexdigest()[:32]
    return {
        "id": f"chatcmpl-tool-{digest}",
        "type": "function",
        "function": {"name": name, "arguments": orjson.dumps({"text": text}).decode()},
    }


def _logprobs(r: SimRequest, start: int, end: int, top: int) -> dict[str, Any]:
    """vLLM's chat `logprobs` for generated tokens [start, end): each token's log probability and
    the `top` most likely tokens at its position, the sampled one first. The simulator has no
    model to ask: the values are made up, but fixed per request and position, and ordered."""
    content = []
    for i in range(start, end):
        token_id = r.token_ids[r.prompt_len + i]
        text = token_text(token_id)
        logprob = -(zlib.crc32(f"{r.rid}:{i}".encode()) % 4000) / 1000
        entry = {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        alternatives = [entry]
        for j in range(1, top):
            other = token_text((token_id + 37 * j) % VOCAB_SIZE)
            alternatives.append(
                {
                    "token": other,
                    "logprob": round(logprob - 0.75 * j, 3),
                    "bytes": list(other.encode()),
                }
            )
        content.append({**entry, "top_logprobs": alternatives[:top]})
    return {"content": content}
