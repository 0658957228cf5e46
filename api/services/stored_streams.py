"""What the edge decides on a request's stored stream rather than on the state it holds: the
preemption of a flex request another edge serves, and the commands whose append lost the version
race to another writer (the lease sweeper, another edge's PreemptionRequested). Both go through
the one command handler (`ledger.commands`), in a thread, off the event loop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from tollgate_llm.api.metrics import Metrics
from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.requests.decide import AskToPreempt, Command
from tollgate_llm.domain.requests.decide import decide as request_decide
from tollgate_llm.domain.requests.evolve import evolve_event
from tollgate_llm.domain.requests.state import RequestState
from tollgate_llm.ledger.commands import CommandHandler, request_stream
from tollgate_llm.ledger.errors import WrongExpectedVersion
from tollgate_llm.ledger.ids import Clock

log = logging.getLogger("tollgate.edge")


class StoredStreams:
    def __init__(self, commands: CommandHandler, metrics: Metrics, *, clock: Clock) -> None:
        self.commands = commands
        self.metrics = metrics
        self.clock = clock
        self._tasks: set[asyncio.Task[Any]] = set()

    def ask(self, request_id: str, tenant_id: str, command: AskToPreempt) -> None:
        """Ask for the preemption of a flex request another edge serves: decided on its stored
        stream (this edge does not hold it), appended at the version folded, in the background.
        An ask that finds it ended, or already asked for, records nothing."""
        self._background(self._ask(request_id, tenant_id, command))

    def decide_again(
        self, request_id: str, tenant_id: str, commands: Sequence[Command],
        conflict: WrongExpectedVersion, durable: asyncio.Future[bool],
    ) -> None:  # fmt: skip
        """Decide `commands` again on the stored stream, in the background; `durable` says
        whether they were appended."""
        self._background(self._decide_again(request_id, tenant_id, commands, conflict, durable))

    async def _ask(self, request_id: str, tenant_id: str, command: AskToPreempt) -> None:
        try:
            handled = await asyncio.to_thread(
                self.commands.handle,
                request_id,
                lambda state: request_decide(state, command),
                request_stream(self.commands.store, request_id),
                tenant_id=tenant_id,
                at=self.clock(),
            )
        except DomainError as exc:
            log.warning(
                "preemption of %s not asked for: %s", request_id, exc.message,
                extra={"request_id": request_id, "tenant_id": tenant_id},
            )  # fmt: skip
            return
        except Exception:
            self.metrics.append_failures.inc()
            log.exception(
                "asking for the preemption of %s failed", request_id,
                extra={"request_id": request_id, "tenant_id": tenant_id},
            )  # fmt: skip
            return
        for record in handled.records:
            self.metrics.events_of(record.type).inc()

    async def _decide_again(
        self, request_id: str, tenant_id: str, commands: Sequence[Command],
        conflict: WrongExpectedVersion, durable: asyncio.Future[bool],
    ) -> None:  # fmt: skip
        at = self.clock()
        durable_now = False
        try:
            durable_now = await self._handle_again(request_id, tenant_id, commands, conflict, at)
        finally:
            settle(durable, durable_now)

    async def _handle_again(
        self, request_id: str, tenant_id: str, commands: Sequence[Command],
        conflict: WrongExpectedVersion, at: datetime,
    ) -> bool:  # fmt: skip
        """Decide `commands` again on the stored stream and append them; whether they were."""
        try:
            handled = await asyncio.to_thread(
                self.commands.handle,
                request_id,
                _deciding(commands, at),
                request_stream(self.commands.store, request_id),
                tenant_id=tenant_id,
                at=at,
            )
        except DomainError as exc:
            # Typically `second_terminal`: the sweeper expired the request while this edge was
            # silent, and billed the progress it had renewed. What the engine reported after
            # that renewal is not billed: the bound is one renewal interval of tokens.
            log.warning(
                "request %s was changed by another writer (%s); %s not recorded: %s",
                request_id, conflict, ", ".join(type(c).__name__ for c in commands),
                exc.message, extra={"request_id": request_id, "tenant_id": tenant_id},
            )  # fmt: skip
            return False
        except Exception:
            self.metrics.append_failures.inc()
            log.exception(
                "deciding again for %s failed", request_id,
                extra={"request_id": request_id, "tenant_id": tenant_id},
            )  # fmt: skip
            return False
        for record in handled.records:
            self.metrics.events_of(record.type).inc()
        return True

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def settle(durable: asyncio.Future[bool], committed: bool) -> None:
    if not durable.done():
        durable.set_result(committed)


def _deciding(commands: Sequence[Command], at: datetime) -> Callable[[RequestState], list[Event]]:
    def decide(state: RequestState) -> list[Event]:
        events: list[Event] = []
        for command in commands:
            for event in request_decide(state, command):
                events.append(event)
                state = evolve_event(state, event, at)
        return events

    return decide
