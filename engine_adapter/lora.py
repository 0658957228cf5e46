"""LoRA adapters on the replicas: vLLM's runtime endpoints (`POST /v1/load_lora_adapter`,
`/v1/unload_lora_adapter`, `GET /v1/models` listing adapters with their `parent`), the adapters
each replica holds as one router keeps them (`ReplicaLoras`: its slots, what it holds and how
recently used, what runs on each), and `AdapterBound`, the replica a request for an adapter is
given: it loads the adapter where the router decided to (once, whatever the number of requests
waiting on it) and asks the engine for it by its engine name.

The policy (which replica, which slot, whom to evict) is pure, in `domain.capacity`; this only
keeps the state and talks HTTP. vLLM must run with `--enable-lora --max-loras N
--max-lora-rank R` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import aiohttp
import orjson

from tollgate_llm.domain.capacity import AdapterRef, AdapterSlots, SlotPlan
from tollgate_llm.engine_adapter.exchange import ChatExchange
from tollgate_llm.engine_adapter.vllm_http import ReplicaUnavailable, Served
from tollgate_llm.ledger import faults

log = logging.getLogger("tollgate.lora")

_TIMEOUT = aiohttp.ClientTimeout(total=30.0)  # a load reads the adapter's files from disk


class AdapterLoadFailed(ReplicaUnavailable):
    """The replica would not load the adapter (its path is not there, its rank is above the
    replica's `--max-lora-rank`, LoRA is off). The client gets the replica-unavailable answer;
    the engine's words, which may name the path, go to the log only."""


class LoraDisabled(AdapterLoadFailed):
    """The replica has no LoRA endpoints: vLLM started without `--enable-lora` (or without
    `VLLM_ALLOW_RUNTIME_LORA_UPDATING`) answers FastAPI's own 404, `{"detail": "Not Found"}`."""


@faults.seam("engine.lora", lambda: AdapterLoadFailed("loading an adapter: reset (fault)"))
async def load_adapter(session: aiohttp.ClientSession, url: str, name: str, path: str) -> None:
    """POST /v1/load_lora_adapter. One that is loaded already (vLLM's 400 "has already been
    loaded": another edge, or an earlier life of this one, loaded it) counts as loaded.

    The fault seam `engine.lora` (ledger/faults.py): a load that fails before its effect, or
    after it (the engine holds the adapter, this router was told it failed: it gives the slot
    back, and the next load is answered "already been loaded", or the scrape lists it), or
    hangs; the request waiting on it gets the replica-unavailable answer, ends failed and is
    billed nothing."""
    body = {"lora_name": name, "lora_path": path}
    status, text = await _post(session, url + "/v1/load_lora_adapter", body)
    if status == 200 or (status == 400 and "already been loaded" in text):
        return
    if status == 404 and text.startswith('{"detail":'):
        raise LoraDisabled(f"{url}: no LoRA endpoints (loading {name} answered 404)")
    raise AdapterLoadFailed(f"{url}: loading adapter {name} answered {status}: {text[:300]}")


async def unload_adapter(session: aiohttp.ClientSession, url: str, name: str) -> None:
    """POST /v1/unload_lora_adapter; one that is not there (404) is unloaded already."""
    status, text = await _post(session, url + "/v1/unload_lora_adapter", {"lora_name": name})
    if status not in (200, 404):
        raise ReplicaUnavailable(f"{url}: unloading adapter {name} answered {status}: {text[:300]}")


async def fetch_adapters(session: aiohttp.ClientSession, url: str, parent: str) -> set[str]:
    """The adapters a replica lists in /v1/models on `parent` (its served model name)."""
    try:
        async with session.get(url + "/v1/models", timeout=_TIMEOUT) as resp:
            if resp.status != 200:
                raise ReplicaUnavailable(f"{url}/v1/models answered {resp.status}")
            listing = orjson.loads(await resp.read())
    except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError) as e:
        raise ReplicaUnavailable(f"{url}/v1/models: {type(e).__name__}: {e}") from e
    return {
        str(card["id"])
        for card in listing.get("data") or ()
        if isinstance(card, dict) and card.get("id") and card.get("parent") == parent
    }


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, str]:
    try:
        async with session.post(url, data=orjson.dumps(body), timeout=_TIMEOUT,
                                headers={"Content-Type": "application/json"}) as resp:  # fmt: skip
            return resp.status, (await resp.read()).decode(errors="replace")
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        raise ReplicaUnavailable(f"{url}: {type(e).__name__}: {e}") from e


class ReplicaLoras:
    """One replica's adapters as this router keeps them."""

    def __init__(self) -> None:
        # vLLM's --max-loras from /metrics (vllm:lora_requests_info); None until reported.
        self.reported: int | None = None
        self.disabled = False  # a load found no LoRA endpoints there
        # engine name -> requests in flight on it here, least recently used first
        self.held: OrderedDict[str, int] = OrderedDict()
        # Decided by the router, not loaded yet: engine name -> (path, adapter to unload first)
        self._pending: dict[str, tuple[str, str | None]] = {}
        self._loading: dict[str, asyncio.Task[None]] = {}
        self._by_dispatch: dict[int, str] = {}

    @property
    def max_loras(self) -> int:
        """The slots the router counts. vLLM reports them only once it has run a step, so a
        replica that has served nothing yet is taken to have vLLM's default, one, until it
        reports its own or a load finds LoRA off (then none, for good: a restart with LoRA on
        reports it)."""
        if self.reported is not None:
            return self.reported
        return 0 if self.disabled else 1

    def slots(self) -> AdapterSlots:
        busy = frozenset(name for name, n in self.held.items() if n > 0 or name in self._loading)
        return AdapterSlots(self.max_loras, tuple(self.held), busy)

    def take(self, ref: AdapterRef, plan: SlotPlan, dispatch_id: int) -> None:
        """A request was placed here for `ref` by `plan`: hold the adapter (its slot is taken
        from now, though the load happens when the request is opened) and count the request."""
        name = ref.engine_name
        if plan.evict is not None:
            self.held.pop(plan.evict, None)
        if plan.load and name not in self.held:
            self._pending[name] = (ref.path, plan.evict)
        self.held[name] = self.held.get(name, 0) + 1
        self.held.move_to_end(name)
        self._by_dispatch[dispatch_id] = name

    def release(self, dispatch_id: int) -> None:
        name = self._by_dispatch.pop(dispatch_id, None)
        if name is None or self.held.get(name, 0) <= 0:
            return
        self.held[name] -= 1
        if self.held[name] == 0 and self._pending.pop(name, None) is not None:
            # Placed but never opened (its admission was not recorded, or it was preempted
            # first): never loaded, so its slot is free again.
            del self.held[name]

    def gone(self, name: str) -> None:
        """The engine answered that it does not have `name` (restarted, or unloaded by another
        router): not held any more, so the next request for it loads it again."""
        if name not in self._loading:
            self.held.pop(name, None)
            self._pending.pop(name, None)

    def sync(self, listed: set[str]) -> None:
        """What the engine lists: adapters another router loaded take slots here too; those
        unloaded elsewhere are gone (unless a request of this router runs on one, or it is
        being loaded). Order is kept for those known, the new ones counted as least recent."""
        for name in [n for n, busy in self.held.items() if n not in listed and busy == 0]:
            if name not in self._pending and name not in self._loading:
                del self.held[name]
        for name in listed - set(self.held):
            self.held[name] = 0
            self.held.move_to_end(name, last=False)

    async def ready(self, name: str, session: aiohttp.ClientSession, url: str) -> None:
        """The adapter is loaded on the replica: loaded now if the router decided so (one load
        however many requests wait on it). A failed load gives its slot back."""
        task = self._loading.get(name)
        if task is None:
            pending = self._pending.pop(name, None)
            if pending is None:
                return
            path, evict = pending
            task = asyncio.ensure_future(self._load(name, path, evict, session, url))
            self._loading[name] = task
            task.add_done_callback(lambda _: self._loading.pop(name, None))
        try:
            await asyncio.shield(task)
        except ReplicaUnavailable as exc:
            self.held.pop(name, None)
            self.disabled = self.disabled or isinstance(exc, LoraDisabled)
            raise

    async def _load(
        self, name: str, path: str, evict: str | None, session: aiohttp.ClientSession, url: str
    ) -> None:
        if evict is not None and evict not in self.held:  # not taken back meanwhile
            try:
                await unload_adapter(session, url, evict)
            except ReplicaUnavailable as exc:
                log.warning("%s", exc)  # the load below may still find room
        try:
            await load_adapter(session, url, name, path)
        except ReplicaUnavailable as exc:
            log.warning("%s", exc)
            raise


class ScrapedReplica(Protocol):
    """A replica as the fleet keeps it: the edge's `Replica` port (an id, `open_chat`) and what
    the scraper and the registry read (`engine_adapter.vllm_http.VLLMReplica`; the composition
    root builds them and hands them to `Fleet.add`, which wraps them in `AdapterBound`)."""

    replica_id: str
    url: str
    model: str
    max_model_len: int | None

    def close(self) -> None: ...

    async def open_chat(
        self, body: dict[str, Any], *, request_id: str, cache_salt: str,
        traceparent: str | None = None, adapter: Served | None = None,
    ) -> ChatExchange: ...  # fmt: skip


class AdapterBound:
    """The replica a request for an adapter was placed on: its chats wait for the adapter to
    be loaded there (`ready`), then ask the engine for it by its engine name, and answer with
    the name the client asked for."""

    __slots__ = ("inner", "ref", "_ready", "_served")

    def __init__(
        self, inner: ScrapedReplica, ref: AdapterRef, ready: Callable[[], Awaitable[None]],
        gone: Callable[[], None],
    ) -> None:  # fmt: skip
        self.inner = inner
        self.ref = ref
        self._ready = ready
        self._served = Served(ref.engine_name, ref.answer_as, gone)

    @property
    def replica_id(self) -> str:
        return self.inner.replica_id

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def model(self) -> str:
        return self.inner.model

    @property
    def max_model_len(self) -> int | None:
        return self.inner.max_model_len

    def close(self) -> None:
        """The fleet closes the replica itself, never a request's view of it."""

    async def open_chat(
        self, body: dict[str, Any], *, request_id: str, cache_salt: str,
        traceparent: str | None = None, adapter: Served | None = None,
    ) -> ChatExchange:  # fmt: skip
        await self._ready()
        return await self.inner.open_chat(
            body, request_id=request_id, cache_salt=cache_salt, traceparent=traceparent,
            adapter=self._served,
        )  # fmt: skip
