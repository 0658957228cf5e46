"""What the edge needs of the world, as `typing.Protocol`s: the implementations live in
`engine_adapter/` (fleet, replicas, token estimators), `predictor/` (the output predictor) and
`ledger/` (the event sink, idempotency records), and are built and injected in one place,
`api/runtime.py`. Unit tests replace them with fakes (`tests/fakes.py`), which
`tests/unit/port_checks.py` holds to these contracts under mypy.

The router's answers (`Choice`, `Refusal`, `UnknownModel`, `TpotEstimate`) are pure values in
`domain.capacity`, over any replica with an id; here a `Choice` carries a `Replica`. The clock
and the id source are the `Clock` and `IdSource` protocols of `ledger.ids` (the ledger's own
writers take them too, and the ledger cannot import this module).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tollgate_llm.domain.capacity import AdapterRef, Choice, Refusal, TpotEstimate, UnknownModel
from tollgate_llm.domain.prediction import Prediction, RequestShape, Skip
from tollgate_llm.engine_adapter.exchange import ChatExchange
from tollgate_llm.ledger.idempotency import StoredResponse
from tollgate_llm.ledger.ids import Clock, IdSource
from tollgate_llm.ledger.store import AppendBatch, AppendResult

__all__ = [
    "Clock", "EventSink", "Fleet", "IdSource", "Idempotency", "OutputPredictor", "Replica",
    "TokenEstimator",
]


class TokenEstimator(Protocol):
    """Counts the prompt tokens the engine will count for a chat, before it is sent.

    Contract: deterministic for the same input; the count includes what the model's chat
    template adds (roles, separators, the tools block). It is an admission estimate only —
    billing always uses the engine's own counts — so an estimator may be approximate, and says
    how far in its docstring."""

    def prompt_tokens(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> int: ...


class OutputPredictor(Protocol):
    """Predicts a high quantile of a request's output tokens before it runs, so that admission
    reserves that instead of the whole `max_tokens` (`domain.admission`: capped at the output
    cap, floored at `min_tokens`). Beside the `TokenEstimator`, and like it an estimate only:
    what a request used is charged when it ends, and billing reads the engine's counts.

    Contract: `predict` is on the admission path: in memory, no I/O, no torch, tens of
    microseconds at most; it answers a `Prediction` (tokens and the model version, recorded on
    RequestEstimated) or why it will not predict (the request then reserves its cap).
    `observe` is told every completed request's engine output count (and the output it
    reserved when a prediction did), which is the tenant's history and realised coverage; it
    never reads another tenant's data for a prediction. `predictor.runtime.LoadedPredictor`
    implements it."""

    def predict(self, shape: RequestShape) -> Prediction | Skip: ...

    def observe(
        self, shape: RequestShape, reserved_output_tokens: int | None, output_tokens: int
    ) -> None: ...


class Replica(Protocol):
    """One engine replica (`engine_adapter.vllm_http.VLLMReplica`, in front of vLLM or the
    simulator). `open_chat` starts a generation that the exchange then streams; the request is
    always sent with cumulative usage on every chunk (so every way a request ends has an
    engine-reported count) and with the tenant's `cache_salt`. The contract over HTTP is
    `tests/contracts/test_replica.py`."""

    @property
    def replica_id(self) -> str: ...

    async def open_chat(
        self, body: dict[str, Any], *, request_id: str, cache_salt: str,
        traceparent: str | None = None,
    ) -> ChatExchange: ...  # fmt: skip


class Fleet(Protocol):
    """The replicas the edge routes to and the router's view of them (the last scrapes):
    `engine_adapter.fleet.Fleet`, given its replicas by the composition root."""

    @property
    def serves(self) -> Mapping[str, object]:
        """The model versions some replica serves."""
        ...

    def models(self) -> list[str]: ...

    def choose(
        self, model: str, tier: str, est_kv_tokens: int, rng: random.Random, *,
        service_tier: str = "default", request_id: str = "",
        regions: frozenset[str] | None = None, adapter: AdapterRef | None = None,
    ) -> Choice[Replica] | Refusal | UnknownModel:
        """A replica for the request (its estimate is counted against it until `release`), or
        why none may take it. A flex request is placed only into idle capacity; an interactive
        one may be placed by preempting flex requests, named in `Choice.preempt`, which the
        caller must then abort. `regions` (None: anywhere): only a replica in one of them may
        be chosen, by any step, and `Choice.region` says which. `adapter` (a LoRA adapter of
        `model`): only a replica with a slot for it, and the chosen one's `open_chat` loads it
        there first where it is not held yet, then serves it."""
        ...

    def release(self, choice: Choice[Replica]) -> None: ...

    def tpot_p95(self, model: str) -> TpotEstimate | None: ...

    def context_tokens(self, model: str) -> int | None:
        """The model's context (vLLM's max_model_len), the smallest among its replicas; None
        while unknown. A prompt that fills it can never be served."""
        ...


class EventSink(Protocol):
    """Where the edge's decided facts go: group commits on the event loop
    (`ledger.commits.LoopCommits` in production). Each batch is one stream's append at the
    version its events were decided on; the future answers the store's result."""

    def commit(self, batch: AppendBatch) -> asyncio.Future[AppendResult]:
        """Commit with this loop iteration's group: for what the caller awaits (admissions)."""
        ...

    def later(self, batch: AppendBatch) -> asyncio.Future[AppendResult]:
        """Commit with the next group, soon: for what nobody waits for (ends, refusals)."""
        ...


class Idempotency(Protocol):
    """Idempotency-Key records (`api.services.idempotency_service.AsyncIdempotency`): 409
    while a key is in flight, 422 for a different body, the stored response for a replay."""

    def seen_recently(self, tenant_id: str, key: str | None) -> bool: ...

    async def lookup(
        self, tenant_id: str, key: str, body_sha256: str
    ) -> StoredResponse | None: ...

    async def begin(
        self, tenant_id: str, key: str, request_id: str, body_sha256: str
    ) -> None: ...

    async def complete(
        self,
        tenant_id: str,
        key: str,
        status: int,
        body: bytes,
        content_type: str,
        headers: dict[str, str],
    ) -> None: ...

    async def abandon(self, tenant_id: str, key: str) -> None: ...
