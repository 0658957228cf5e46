"""The simulated replica's HTTP surface: `vllm serve`'s OpenAI-compatible routes, `/metrics`
and the `/sim/*` extras, in aiohttp around one `SimEngine`.

Start one on the running loop with `start_simulated_replica(SimConfig(...))`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import generate_latest

from engine_adapter.simulator.engine import (
    VOCAB_SIZE,
    QueueFull,
    SimConfig,
    SimEngine,
    SimRecord,
    SimRequest,
    token_text,
)
from engine_adapter.simulator.tokenizer import prompt_token_ids, text_token_ids

log = logging.getLogger("tollgate.simulator")

VLLM_VERSION = "0.33.0"
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


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
# vLLM's --max-logprobs default: more top_logprobs than this is a 400.
MAX_LOGPROBS = 20


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
    asked_length: int | None = None
    prompt_ids: list[int] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    tool: str | None = None  # the function a natural stop calls (the request offered tools)


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
            text_token_ids(body["prompt"], ids)
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
        self.engine.publish_gauges()
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
        # As vLLM 0.32 (checked against the CPU build): a limit above the whole context is
        # refused; one above what the prompt leaves is generated up to the context's end.
        if limit is not None and limit > cfg.max_model_len:
            raise _bad(
                f"max_tokens={limit} cannot be greater than max_model_len={cfg.max_model_len}. "
                "Please request fewer output tokens.",
                "max_tokens",
            )
        limit = room if limit is None else min(limit, room)
        priority = body.get("priority", 0)
        header_prio = request.headers.get("X-Vllm-Priority")
        if header_prio is not None:
            with contextlib.suppress(ValueError):
                priority = int(header_prio)
        if not isinstance(priority, int):
            raise _schema("priority", "Input should be a valid integer")
        seed = body.get("seed")
        logprobs, top_logprobs = _parse_logprobs(body)
        tool = _offered_tool(body)
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
            asked_length=_asked_length(messages),
            prompt_ids=ids,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            tool=tool,
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
                asked_length=p.asked_length,
            )
            r.record.traceparent = request.headers.get("traceparent", "")
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
            if not p.stream:
                return await self._full(r, p, f"chatcmpl-{base}")
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
            try:
                return await self._stream(request, resp, r, p, f"chatcmpl-{base}")
            except ConnectionResetError:
                # A write found the connection closing before the disconnect cancelled this
                # handler. Raised, aiohttp would log it as an error with two tracebacks.
                self._client_gone(r, base)
                return resp
        except asyncio.CancelledError:
            # Client disconnect cancels this handler (handler_cancellation): abort at once.
            self._client_gone(r, base)
            raise
        except BaseException:
            self.engine.abort(r)
            raise

    def _client_gone(self, r: SimRequest, request_id: str) -> None:
        """A client that leaves is expected, not an error: its request is aborted (its KV freed
        at once) with one INFO line, as vLLM logs its aborts."""
        if not r.finished:
            log.info("Aborted request %s: the client disconnected.", request_id,
                     extra={"request_id": request_id})  # fmt: skip
        self.engine.abort(r)

    def _final_usage(self, r: SimRequest, completion: int, *, chunk: bool) -> dict[str, Any]:
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

    async def _full(self, r: SimRequest, p: _Parsed, response_id: str) -> web.Response:
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
                    "logprobs": _logprobs(r, 0, r.generated, p.top_logprobs)
                    if p.logprobs
                    else None,
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
        if p.tool is not None and r.finish_reason == "stop":
            choice = body["choices"][0]  # type: ignore[index]
            choice["message"]["content"] = None
            choice["message"]["tool_calls"] = [_tool_call(r, p.tool, text)]
            choice["finish_reason"] = "tool_calls"
        payload = orjson.dumps(body)
        rec.completion_tokens = r.generated
        return web.Response(body=payload, content_type="application/json")

    async def _stream(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        r: SimRequest,
        p: _Parsed,
        response_id: str,
    ) -> web.StreamResponse:
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
        sent: list[str] = []  # the text so far, for a tool call's arguments
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
            if p.tool is not None:
                sent.extend(texts)
            if reason == "error":
                if n_new:
                    out += self._content_frame(r, head, texts, written + n_new, None, prompt, p)
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
                calls = finished and p.tool is not None and reason == "stop"
                out += self._content_frame(
                    r, head, texts, written + n_new, None if calls else fr, prompt, p
                )
                if calls:
                    call = {"index": 0, **_tool_call(r, p.tool or "", "".join(sent))}
                    out += (
                        b"data: " + head + b'[{"index":0,"delta":{"tool_calls":'
                        + orjson.dumps([call]) + b'},"logprobs":null,"finish_reason":"tool_calls"'
                        b',"stop_reason":null,"token_ids":null}]}\n\n'
                    )  # fmt: skip
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
        r: SimRequest,
        head: bytes,
        texts: list[str],
        completion: int,
        finish_reason: str | None,
        prompt: int,
        p: _Parsed,
    ) -> bytes:
        content = orjson.dumps("".join(texts))
        logprobs = (
            orjson.dumps(_logprobs(r, completion - len(texts), completion, p.top_logprobs))
            if p.logprobs
            else b"null"
        )
        if finish_reason is None:
            choice = (
                b'[{"index":0,"delta":{"content":' + content + b'},"logprobs":' + logprobs
                + b',"finish_reason":null,"token_ids":null}]'
            )
        else:
            choice = (
                b'[{"index":0,"delta":{"content":' + content + b'},"logprobs":' + logprobs
                + b',"finish_reason":' + orjson.dumps(finish_reason) + b',"stop_reason":null,'
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


def _offered_tool(body: dict[str, Any]) -> str | None:
    """The function a generation that stops on its own calls, as a model served with vLLM's
    tool parser does when it is offered tools (`tool_choice` not "none"): the first one's."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools or body.get("tool_choice") == "none":
        return None
    first = tools[0]
    function = first.get("function") if isinstance(first, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) and name else None


def _tool_call(r: SimRequest, name: str, text: str) -> dict[str, Any]:
    """One OpenAI-shaped tool call whose arguments carry the generated text (vLLM's ids are
    "chatcmpl-tool-" and 32 hex digits)."""
    digest = hashlib.sha256(f"{r.record.request_id}:{name}".encode()).hexdigest()[:32]
    return {
        "id": f"chatcmpl-tool-{digest}",
        "type": "function",
        "function": {"name": name, "arguments": orjson.dumps({"text": text}).decode()},
    }


def _parse_logprobs(body: dict[str, Any]) -> tuple[bool, int]:
    """`logprobs` and `top_logprobs` as vLLM 0.33 checks them (`check_logprobs`, and the engine's
    --max-logprobs)."""
    logprobs = body.get("logprobs")
    if logprobs is None:
        logprobs = False
    if not isinstance(logprobs, bool):
        raise _schema("logprobs", "Input should be a valid boolean")
    top = body.get("top_logprobs")
    if top is None:
        return logprobs, 0
    if not isinstance(top, int) or isinstance(top, bool):
        raise _schema("top_logprobs", "Input should be a valid integer")
    if top < 0 and top != -1:
        raise _bad("`top_logprobs` must be a positive value or -1.", "top_logprobs")
    if (top == -1 or top > 0) and not logprobs:
        raise _bad("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    if top > MAX_LOGPROBS or top == -1:
        # -1 asks for the whole vocabulary, which the default --max-logprobs refuses too.
        raise _bad(
            f"Requested sample logprobs of {top}, which is greater than max allowed: "
            f"{MAX_LOGPROBS}",
            "top_logprobs",
        )
    return logprobs, top


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
                {"token": other, "logprob": round(logprob - 0.75 * j, 3),
                 "bytes": list(other.encode())}
            )
        content.append({**entry, "top_logprobs": alternatives[:top]})
    return {"content": content}


def _opt_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


_ASKED_LENGTH = re.compile(r"\bin about (\d{1,6}) words\b")


def _asked_length(messages: list[Any]) -> int | None:
    """The answer length the last user message asks for ("... in about 120 words"), if any:
    the simulated model follows it roughly (SimConfig.length_follow_sigma)."""
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            found = _ASKED_LENGTH.search(content) if isinstance(content, str) else None
            return int(found.group(1)) if found else None
    return None


# --- starting a replica on the running loop ----------------------------------------------------


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
