"""A non-streamed answer: the engine's generation collected into one completion, given to the
client only once its terminal event is durable, and kept for a replay when it has an
Idempotency-Key. The streamed counterpart is `api.services.relay`; the request's ends are
`api.services.flights.Flights`'."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson

from tollgate_llm.api.ports import Idempotency
from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.api.services.flights import (
    NOT_RECORDED,
    Flights,
    complete_command,
    durable,
    engine_error_text,
    fail_command,
)
from tollgate_llm.api.services.recorder import Flight
from tollgate_llm.engine_adapter.exchange import ChatExchange
from tollgate_llm.engine_adapter.usage import Collector

__all__ = ["JsonCompletion", "JsonOutcome"]


@dataclass(slots=True)
class JsonOutcome:
    status: int
    body: bytes
    headers: dict[str, str]


class JsonCompletion:
    def __init__(self, flights: Flights, idempotency: Idempotency) -> None:
        self.flights = flights
        self.idempotency = idempotency

    async def complete(
        self, flight: Flight, caller: Caller, body: dict[str, Any], headers: dict[str, str]
    ) -> JsonOutcome:
        key = flight.idempotency_key
        exchange: ChatExchange | None = None
        try:
            exchange = await self.flights.open(flight, caller, body)
            collector = Collector(flight.progress, lambda: self.flights.first_token(flight))
            await exchange.run(collector.feed)
            completion = collector.completion()
        except BaseException as exc:
            await self.flights.fail(flight, caller, exchange, exc)
            refusal = self.flights.engine_failure(flight, exc, headers)
            if refusal is not None:
                raise refusal from None
            raise
        error = flight.progress.error
        if error is not None:
            self.flights.end(flight, fail_command(flight.progress, engine_error_text(error)))
            if key is not None:
                await self.idempotency.abandon(caller.tenant_id, key)
            raise ApiError(
                502,
                "the model replica failed while generating",
                type="server_error",
                code="replica_failed",
                headers=headers,
            )
        ended = self.flights.end(flight, complete_command(flight.progress))
        completion["service_tier"] = flight.service_tier
        answer = self._answer(flight, caller, ended, completion, headers)
        if flight.idempotency_key is None:
            return await answer
        # Shielded: the request is completed and billed, so its replay must be kept even if the
        # client leaves now (a record left in flight would answer every retry 409 for 24 h; the
        # batch runner, killed at this instant, met exactly that).
        return await asyncio.shield(answer)

    async def _answer(
        self, flight: Flight, caller: Caller, ended: asyncio.Future[bool] | None,
        completion: dict[str, Any], headers: dict[str, str],
    ) -> JsonOutcome:  # fmt: skip
        """A non-streamed answer, once its terminal event has committed: a client never holds
        an answer the ledger does not know (if it cannot commit, the lease expiry bills what was
        renewed, and the client gets a 503 instead)."""
        key = flight.idempotency_key
        if not await durable(ended):
            if key is not None:
                await self.idempotency.abandon(caller.tenant_id, key)
            raise ApiError(
                503, NOT_RECORDED, type="server_error", code="not_recorded", headers=headers
            )
        payload = orjson.dumps(completion)
        if key is not None:
            await self.idempotency.complete(
                caller.tenant_id, key, 200, payload, "application/json", headers
            )
        return JsonOutcome(200, payload, headers)
