"""The simulated replica's HTTP surface: `vllm serve`'s OpenAI-compatible routes, `/metrics`
and the `/sim/*` extras, in aiohttp around one `SimEngine`.

Start one on the running loop with `start_simulated_replica(SimConfig(...))`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import generate_latest

from tollgate_llm.engine_adapter.simulator.chat_body import (
    HTTPError,
    Parsed,
    parse_chat,
    schema_error,
)
from tollgate_llm.engine_adapter.simulator.engine import QueueFull, SimEngine
from tollgate_llm.engine_adapter.simulator.lora import SimLoras
from tollgate_llm.engine_adapter.simulator.responses import (
    DONE,
    StreamFrames,
    error_response,
    full_body,
    json_response,
)
from tollgate_llm.engine_adapter.simulator.state import SimConfig, SimRecord, SimRequest
from tollgate_llm.engine_adapter.simulator.tokenizer import prompt_token_ids, text_token_ids

log = logging.getLogger("tollgate.simulator")

VLLM_VERSION = "0.33.0"
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SimulatedReplica:
    """aiohttp application around one SimEngine."""

    def __init__(self, config: SimConfig) -> None:
        self.cfg = config
        self.engine = SimEngine(config)
        self.loras = SimLoras(config)
        self.created = int(time.time())
        digest = hashlib.sha256(f"{config.model}:{config.seed}".encode()).hexdigest()[:8]
        self.fingerprint = f"vllm-{VLLM_VERSION}-{digest}"
        self.app = web.Application()
        self.app.add_routes(
            [
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models),
                web.post("/v1/load_lora_adapter", self.loras.load),
                web.post("/v1/unload_lora_adapter", self.loras.unload),
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
        return json_response(200, {"version": VLLM_VERSION})

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
        cards = [card, *self.loras.cards(card)]
        return json_response(200, {"object": "list", "data": cards})

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return json_response(400, schema_error("messages", "invalid JSON").body)
        if isinstance(body.get("messages"), list):
            ids = prompt_token_ids(body["messages"])
        elif isinstance(body.get("prompt"), str):
            ids = []
            text_token_ids(body["prompt"], ids)
        else:
            return json_response(400, schema_error("messages", "Field required").body)
        return json_response(
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
        running = {r.record.adapter for r in self.engine.running if r.record.adapter}
        body = generate_latest(self.engine.metrics.registry)
        body += self.loras.metrics_text(sorted(running))
        return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def sim_request(self, request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        rec = self.engine.records.get(rid) or self.engine.records.get(rid.removeprefix("chatcmpl-"))
        if rec is None:
            return json_response(404, {"error": {"message": "unknown request", "code": 404}})
        return json_response(200, rec.to_json())

    async def sim_stats(self, request: web.Request) -> web.Response:
        return json_response(200, self.engine.stats())

    # -- chat completions

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            p = parse_chat(
                self.cfg,
                request.headers.get("Content-Type", ""),
                request.headers.get("X-Vllm-Priority"),
                raw,
                self.loras.adapters,
            )
        except HTTPError as e:
            return error_response(e)
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
            r.record.adapter = p.adapter
            self.loras.stepped = True
        except QueueFull:
            e = HTTPError(
                503,
                "The engine is currently busy and cannot accept new requests. Please try again "
                "later or on a different instance.",
                "Service Unavailable",
                None,
            )
            return error_response(e)
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

    def _die_mid_stream(self, request: web.Request, r: SimRequest) -> None:
        """Fault injection: the replica dies mid-stream, no error frame, no [DONE]. Like a
        crashed process, what it already wrote still leaves (the kernel sends it, then FIN);
        what it never wrote does not. close(), not abort(): abort() would also drop bytes this
        record already counts as written."""
        self.engine.abort(r)
        if request.transport is not None:
            request.transport.close()

    async def _full(self, r: SimRequest, p: Parsed, response_id: str) -> web.Response:
        while not r.finished:
            r.event.clear()
            await r.event.wait()
        text = "".join(r.pending)
        r.pending.clear()
        rec = r.record
        if r.finish_reason == "error":
            rec.completion_tokens = r.generated
            e = HTTPError(500, "Internal server error", "InternalServerError", None)
            return error_response(e)
        payload = orjson.dumps(full_body(self.cfg, self.fingerprint, r, p, text, response_id))
        rec.completion_tokens = r.generated
        return web.Response(body=payload, content_type="application/json")

    async def _stream(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        r: SimRequest,
        p: Parsed,
        response_id: str,
    ) -> web.StreamResponse:
        await resp.prepare(request)
        frames = StreamFrames(self.cfg, self.fingerprint, r, p, response_id)
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
                out += frames.role()
            n_new = len(texts)
            if p.tool is not None:
                sent.extend(texts)
            if reason == "error":
                if n_new:
                    out += frames.content(texts, written + n_new, None)
                out += frames.error()
                await resp.write(bytes(out))
                rec.completion_tokens = written + n_new
                await resp.write_eof()
                return resp
            if n_new or finished:
                calls = finished and p.tool is not None and reason == "stop"
                fr = reason if finished and not calls else None
                out += frames.content(texts, written + n_new, fr)
                if calls:
                    out += frames.tool_calls("".join(sent))
            if finished:
                if p.include_usage:
                    out += frames.usage(written + n_new)
                out += DONE
            if out:
                await resp.write(bytes(out))
            written += n_new
            rec.completion_tokens = written
            if r.drop_after is not None and written >= r.drop_after and not finished:
                self._die_mid_stream(request, r)
                return resp
            if finished:
                await resp.write_eof()
                return resp


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
