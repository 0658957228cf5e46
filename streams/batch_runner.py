"""The batch runner: feeds open batches' items to the edge as flex requests while capacity is
idle, backs off while it is not, and ends each batch with its output and error files.

It runs in the fold worker's process (embedded mode), on a thread with its own event loop, and
speaks to the edge over HTTP like any client, so its items are routed, preempted and billed by
the same code as every flex request. It holds nothing that a restart would lose:

- an item is recorded once: its response is kept first (`batch_results`, first writer wins),
  then `BatchItemFinished` is appended, which `domain.batches.decide.decide` refuses to repeat;
  a result kept but not yet recorded is recorded on the next pass;
- an item is generated to completion once: every attempt carries the item's own
  Idempotency-Key, so an attempt that completed before a crash is replayed by the edge (no
  second generation, no second bill), and an attempt cut short (preempted, cancelled, the runner
  killed) is billed nothing (`domain.requests.decide.billed_counts`) and simply tried again;
- the output and error files have ids derived from the batch id, so writing them twice writes
  them once.

It reports a heartbeat in `worker_status` (name "batch-runner") every HEARTBEAT_S, and deletes it
when it stops: an edge of the distributed mode refuses to create a batch while no runner's
heartbeat is fresh (nothing would ever run it), and `tollgate status` lists the runner.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import quote

import httpx
import orjson
from sqlalchemy.engine import Engine

from tollgate_llm.domain.batches.decide import (
    BatchCommand,
    EndBatch,
    FailBatch,
    FinalizeBatch,
    RecordItem,
    StartBatch,
    decide,
)
from tollgate_llm.domain.batches.evolve import fold
from tollgate_llm.domain.batches.files import (
    INPUT_RETENTION_S,
    OUTPUT_RETENTION_S,
    InputLine,
    output_line,
    parse_input,
    unrun_line,
)
from tollgate_llm.domain.batches.state import BatchState, batch_stream
from tollgate_llm.domain.control_plane.data_policy import ZERO
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.ledger.batches import BatchStore, ItemResult, StoredFile
from tollgate_llm.ledger.commands import CommandHandler, batch_stream_loader
from tollgate_llm.ledger.idempotency import IdempotencyStore
from tollgate_llm.ledger.ids import Clock, utcnow
from tollgate_llm.ledger.store import EventStore
from tollgate_llm.streams.status import BATCH_RUNNER_NAME
from tollgate_llm.streams.worker_rows import delete_status_row, process_row, write_status_row

log = logging.getLogger("tollgate.batch")

# Back-off after a refusal (no idle capacity, preempted, quota): doubled per refusal up to the
# maximum, reset by a success. Short, because idle capacity comes and goes within seconds and a
# refused flex request costs nothing.
BACKOFF_MIN_S = 0.25
BACKOFF_MAX_S = 5.0
PURGE_EVERY_S = 60.0
# Statuses after which an attempt is tried again later (not the item's outcome).
RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})
# A repeated failure of one batch is logged once per this many seconds, with the count since.
LOG_EVERY_S = 60.0
HEARTBEAT_S = 1.0


@dataclass(slots=True)
class _Backoff:
    """One tenant's back-off: a refusal of its items pauses its items only."""

    backoff_s: float = 0.0
    pause_until: float = 0.0


@dataclass(slots=True)
class _Ready:
    """An open batch's items that may be sent this pass."""

    state: BatchState
    lines: list[InputLine]
    kept: dict[str, ItemResult]
    tasks: dict[str, asyncio.Task[None]]
    pending: Iterator[InputLine] = field(init=False)

    def __post_init__(self) -> None:
        finished, kept, tasks = self.state.finished, self.kept, self.tasks
        self.pending = (
            line for line in self.lines
            if line.custom_id not in finished and line.custom_id not in kept
            and line.custom_id not in tasks
        )  # fmt: skip


class _QuietLog:
    """Warnings keyed by what failed (a batch and a kind of failure): the first at once, then
    at most one per `LOG_EVERY_S` with the count since. A batch whose items keep failing wrote
    375 lines a minute, its clients' custom_ids in them."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def warn(self, key: tuple[str, str], message: str, *args: object) -> None:
        now = time.monotonic()
        last, suppressed = self._last.get(key, (0.0, 0))
        if now - last < LOG_EVERY_S:
            self._last[key] = (last, suppressed + 1)
            return
        self._last[key] = (now, 0)
        if suppressed:
            message += " (%d more since the last report)"
            args = (*args, suppressed)
        log.warning(message, *args)


class BatchRunner:
    def __init__(
        self,
        engine: Engine,
        events: EventStore,
        *,
        edge_url: str,
        token: str,
        concurrency: int = 8,
        clock: Clock = utcnow,
        poll_s: float = 0.2,
        idle_poll_s: float = 1.0,
    ) -> None:
        self.engine = engine
        self.files = BatchStore(engine)
        self.idempotency = IdempotencyStore(engine)
        self.events = events
        self.commands = CommandHandler(events, clock=clock)
        self.edge_url = edge_url
        self.token = token
        self.concurrency = concurrency
        self.clock = clock
        self.poll_s = poll_s
        self.idle_poll_s = idle_poll_s
        self._inflight: dict[str, dict[str, asyncio.Task[None]]] = {}
        self._inputs: dict[str, list[InputLine]] = {}
        # Each open batch as last folded: a pass reads only its stream's version when nothing
        # changed, and what this runner appends is folded on, not read back (a batch of n items
        # would otherwise be read n times over).
        self._states: dict[str, BatchState] = {}
        self._wake: asyncio.Event | None = None  # set when an item ends: feed the next at once
        self._loop: asyncio.AbstractEventLoop | None = None
        # Per tenant: one tenant's refused or failing items never pause another's.
        self._backoffs: dict[str, _Backoff] = {}
        self._turn = 0  # rotates which tenant goes first among equals
        self._log = _QuietLog()
        self._purged_at = 0.0
        self.attempts = 0  # items sent to the edge (a retry counts again)
        self.refusals = 0  # attempts the edge refused or stopped (tried again later)

    # --- the loop -------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        try:
            asyncio.run(self._run(stop))
        finally:
            delete_status_row(self.engine, BATCH_RUNNER_NAME)

    async def _run(self, stop: threading.Event) -> None:
        timeout = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None)
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        beat_at = 0.0
        async with httpx.AsyncClient(base_url=self.edge_url, timeout=timeout) as client:
            while not stop.is_set():
                if time.monotonic() - beat_at >= HEARTBEAT_S:
                    beat_at = time.monotonic()
                    await asyncio.to_thread(self.heartbeat)
                open_batches = 0
                try:
                    open_batches = await self.tick(client)
                except Exception:  # the next pass tries again; the error is said, not hidden
                    log.exception("batch runner pass failed")
                    await asyncio.sleep(1.0)
                # The next pass after `poll_s` (`idle_poll_s` with no batch open), or as soon
                # as an item ends (its slot is free) or a batch is created (`nudge`).
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._wake.wait(), self.poll_s if open_batches else self.idle_poll_s
                    )
            for tasks in self._inflight.values():
                for task in tasks.values():
                    task.cancel()  # the edge cancels them; they are billed nothing, tried later
            await asyncio.gather(
                *(t for tasks in self._inflight.values() for t in tasks.values()),
                return_exceptions=True,
            )

    def heartbeat(self) -> None:
        """Upsert this runner's `worker_status` row (a failure is logged: the next beat tries
        again, and meanwhile the edges may refuse new batches, which is the truth)."""
        row = {
            **process_row(BATCH_RUNNER_NAME), "position": None, "billing_lag": 0,
            "error": None, "dead_letters": 0,
        }  # fmt: skip
        try:
            write_status_row(self.engine, row)
        except Exception:
            log.exception("could not write the batch runner's heartbeat")

    def nudge(self) -> None:
        """From any thread: a batch was created, pass now instead of at the idle poll."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop has just closed
                loop.call_soon_threadsafe(wake.set)

    async def tick(self, client: httpx.AsyncClient) -> int:
        """One pass over the open batches; returns how many are open."""
        now = self.clock()
        if time.monotonic() - self._purged_at > PURGE_EVERY_S:
            self._purged_at = time.monotonic()
            purged = await asyncio.to_thread(self.files.purge_expired, now)
            if purged:
                log.info("deleted %d expired batch file(s)", purged)
        open_batches = await asyncio.to_thread(self.files.open_batches)
        ready: list[_Ready] = []
        for batch_id in open_batches:
            found = await self._step(batch_id, now)
            if found is not None:
                ready.append(found)
        self._feed(ready, client)
        return len(open_batches)

    # --- one batch ------------------------------------------------------------------------------

    async def _step(self, batch_id: str, now: datetime) -> _Ready | None:
        """Move one batch on; its items that may be sent, if it has any."""
        state = await self._state(batch_id)
        if state.status == "new":
            return None  # registered, its BatchCreated not committed yet (or never)
        if state.ended:
            await asyncio.to_thread(self._close, state, now)
            return None
        if state.status == "validating":
            state = await self._decide(state, StartBatch(), now)
        lines = await self._lines(state, now)
        if lines is None:
            return None
        tasks = self._inflight.setdefault(batch_id, {})
        for custom_id in [c for c, t in tasks.items() if t.done()]:
            del tasks[custom_id]
        kept = await asyncio.to_thread(self.files.result_outcomes, batch_id)
        for result in kept.values():  # kept before a crash, never recorded: record it now
            if result.custom_id not in state.finished:
                state = await self._record(state, result, now)
        stopping = state.status == "cancelling" or (
            state.status == "in_progress" and state.expires_at is not None
            and now >= state.expires_at
        )
        if stopping or state.status == "finalizing":
            for task in tasks.values():
                task.cancel()  # expiry and cancel stop what runs: billed nothing, not retried
            if any(not t.done() for t in tasks.values()):
                return None  # the next pass ends it, once they have stopped
            state = await self._harvest(state, lines, kept, now)
            if state.status == "in_progress":
                state = await self._decide(state, FinalizeBatch("expired"), now)
            await asyncio.to_thread(self._end, state, lines, now)
            return None
        if state.all_finished:
            state = await self._decide(state, FinalizeBatch("completed"), now)
            await asyncio.to_thread(self._end, state, lines, now)
            return None
        return _Ready(state, lines, kept, tasks)

    async def _harvest(
        self, state: BatchState, lines: list[InputLine], kept: dict[str, ItemResult],
        now: datetime,
    ) -> BatchState:
        """Items whose attempt the edge finished although this runner stopped waiting for it (a
        cancel or an expiry cut its task as the answer came): the edge's replay record of the
        answer, which was billed, is the item's result, never an error line saying it did not
        run."""
        done = await asyncio.to_thread(
            self.idempotency.done_with_prefix, state.tenant_id, batch_keys(state.batch_id)
        )
        for line in lines:
            cid = line.custom_id
            answer = done.get(item_key(state.batch_id, cid))
            if answer is None or cid in state.finished or cid in kept:
                continue
            body = answer.body or _not_kept(answer.request_id)  # zero retention kept none
            result = ItemResult(cid, answer.request_id, answer.status, body)
            result = await asyncio.to_thread(self.files.put_result, state.batch_id, result, now)
            state = await self._record(state, result, now)
        return state

    def _feed(self, ready: list[_Ready], client: httpx.AsyncClient) -> None:
        """Fill the free slots fairly between tenants: each slot goes to the tenant with the
        fewest items in flight among those with items to send and not backing off (ties in
        turn), and a tenant's own batches go oldest first. One tenant's batch of a million
        items, or one whose items keep failing, takes no slot another tenant could use."""
        now = time.monotonic()
        by_tenant: dict[str, list[_Ready]] = {}
        for r in ready:
            backoff = self._backoffs.get(r.state.tenant_id)
            if backoff is None or now >= backoff.pause_until:
                by_tenant.setdefault(r.state.tenant_id, []).append(r)
        running: dict[str, int] = {}
        for batch_id, tasks in self._inflight.items():
            live = sum(not t.done() for t in tasks.values())
            cached = self._states.get(batch_id)
            if live and cached is not None:
                running[cached.tenant_id] = running.get(cached.tenant_id, 0) + live
        total = sum(running.values())
        order = sorted(by_tenant)
        if order:
            self._turn = (self._turn + 1) % len(order)
            order = order[self._turn :] + order[: self._turn]
        rank = {tenant: i for i, tenant in enumerate(order)}
        loop = asyncio.get_running_loop()
        while total < self.concurrency and by_tenant:
            tenant = min(by_tenant, key=lambda t: (running.get(t, 0), rank[t]))
            batches = by_tenant[tenant]
            line = next(batches[0].pending, None)
            if line is None:
                batches.pop(0)
                if not batches:
                    del by_tenant[tenant]
                continue
            r = batches[0]
            r.tasks[line.custom_id] = loop.create_task(
                self._run_item(r.state, line, client),
                name=f"batch-item-{r.state.batch_id}-{line.line}",
            )
            running[tenant] = running.get(tenant, 0) + 1
            total += 1

    async def _run_item(
        self, state: BatchState, line: InputLine, client: httpx.AsyncClient
    ) -> None:
        """One attempt. Whatever goes wrong stays with this item: a body or a header that cannot
        be sent ends the item as failed (it never could be), a refusal or a lost connection
        backs off its tenant only, and nothing escapes the task unseen."""
        self.attempts += 1
        tenant = state.tenant_id
        where = f"batch {state.batch_id} line {line.line}"  # ids only: never the client's text
        try:
            request = self._request(state, line, client)
        except (TypeError, ValueError) as exc:
            await self._keep_or_back_off(state, line, "", 400, _unsendable(exc))
            return
        try:
            r = await client.send(request)
        except httpx.HTTPError as exc:
            self._log.warn(
                (state.batch_id, "no_answer"), "%s: the edge did not answer (%s)", where,
                type(exc).__name__,
            )  # fmt: skip
            self._refused(tenant)
            return
        except Exception:
            log.exception("%s: sending failed", where, extra={"tenant_id": tenant})
            self._refused(tenant)
            return
        if r.status_code in RETRY_STATUSES:
            self._refused(tenant)  # no idle capacity, preempted, quota, the edge busy: later
            return
        request_id = r.headers.get("x-request-id", "")
        if await self._keep_or_back_off(state, line, request_id, r.status_code, r.content):
            self._backoffs.pop(tenant, None)

    async def _keep_or_back_off(
        self, state: BatchState, line: InputLine, request_id: str, status: int, body: bytes
    ) -> bool:
        """Keep and record the item's outcome; a store that fails backs the tenant off (a
        result kept but not recorded is recorded by a later pass)."""
        try:
            await self._keep(state, line, request_id, status, body)
        except Exception:
            log.exception(
                "batch %s line %d: keeping its result failed", state.batch_id, line.line,
                extra={"request_id": request_id, "tenant_id": state.tenant_id},
            )  # fmt: skip
            self._refused(state.tenant_id)
            return False
        return True

    def _request(
        self, state: BatchState, line: InputLine, client: httpx.AsyncClient
    ) -> httpx.Request:
        """The attempt as sent. The custom_id is percent-encoded in the header (a client's
        newline or non-ASCII id cannot break the request line); a body orjson cannot encode
        (an integer beyond 64 bits) raises TypeError here, before anything is sent."""
        headers = {
            "Authorization": f"Bearer {self.token}",
            "X-Tollgate-Batch-Item": f"{state.batch_id}/{quote(line.custom_id, safe='')}",
            "X-Tollgate-On-Behalf-Of": state.key_id,
            # The item's identity: an attempt that completed is replayed, never run again.
            "Idempotency-Key": item_key(state.batch_id, line.custom_id),
            "Content-Type": "application/json",
        }
        return client.build_request(
            "POST", "/v1/chat/completions", content=orjson.dumps(line.body), headers=headers
        )

    async def _keep(
        self, state: BatchState, line: InputLine, request_id: str, status: int, body: bytes
    ) -> None:
        now = self.clock()
        result = ItemResult(line.custom_id, request_id, status, body)
        result = await asyncio.to_thread(self.files.put_result, state.batch_id, result, now)
        fresh = await self._state(state.batch_id)
        await self._record(fresh, result, now)
        if self._wake is not None:
            self._wake.set()

    def _refused(self, tenant_id: str) -> None:
        self.refusals += 1
        backoff = self._backoffs.setdefault(tenant_id, _Backoff())
        backoff.backoff_s = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, backoff.backoff_s * 2))
        backoff.pause_until = time.monotonic() + backoff.backoff_s

    # --- its facts ------------------------------------------------------------------------------

    async def _state(self, batch_id: str) -> BatchState:
        state, _ = await asyncio.to_thread(self._load, batch_id)
        return state

    def _load(self, batch_id: str) -> tuple[BatchState, int]:
        cached = self._states.get(batch_id)
        stream = batch_stream(batch_id)
        if cached is not None and self.events.stream_version(stream) == cached.version:
            return cached, cached.version
        state, version = batch_stream_loader(self.events, batch_id)()
        self._states[batch_id] = state
        return state, version

    async def _decide(
        self, state: BatchState, command: BatchCommand, now: datetime
    ) -> BatchState:
        return await asyncio.to_thread(self._decide_sync, state, command, now)

    def _decide_sync(
        self, state: BatchState, command: BatchCommand, now: datetime
    ) -> BatchState:
        batch_id = state.batch_id
        loaded: list[BatchState] = []

        def load() -> tuple[BatchState, int]:
            found = self._load(batch_id)
            loaded.append(found[0])
            return found

        handled = self.commands.handle(
            batch_stream(batch_id), lambda s: decide(s, command), load,
            tenant_id=state.tenant_id, at=now,
        )
        after = fold(handled.records, loaded[-1])  # what it decided on, plus what it appended
        self._states[batch_id] = after
        return after

    async def _record(
        self, state: BatchState, result: ItemResult, now: datetime
    ) -> BatchState:
        outcome = "completed" if result.status_code == 200 else "failed"
        command = RecordItem(result.custom_id, result.request_id, outcome, result.status_code)
        return await self._decide(state, command, now)

    async def _lines(self, state: BatchState, now: datetime) -> list[InputLine] | None:
        lines = self._inputs.get(state.batch_id)
        if lines is not None:
            return lines
        content = await asyncio.to_thread(
            self.files.content, state.tenant_id, state.input_file_id, now
        )
        try:
            if content is None and state.retention == ZERO:
                raise DomainError(
                    "input_file_deleted", "under zero retention the input file is deleted once "
                    "read, and the batch runner restarted before the batch ended",
                )  # fmt: skip
            if content is None:
                raise DomainError("input_file_deleted", "the input file was deleted")
            lines = parse_input(bytes(content))
        except DomainError as exc:
            await self._decide(state, FailBatch(exc.rule, exc.message), now)
            return None
        self._inputs[state.batch_id] = lines
        if state.retention == ZERO:
            # Read: its items are in this runner's memory now, and the file is not kept.
            await asyncio.to_thread(self.files.delete_file, state.tenant_id, state.input_file_id)
        return lines

    def _end(self, state: BatchState, lines: list[InputLine], now: datetime) -> None:
        """Write the output and error files (ids derived from the batch: a repeat writes
        nothing new), end the batch, then let go of what it kept."""
        outcome = "cancelled" if state.status == "cancelling" else state.finalizing_as
        results = self.files.results(state.batch_id)
        out: list[bytes] = []
        err: list[bytes] = []
        for line in lines:
            r = results.get(line.custom_id)
            if r is not None:
                entry = output_line(r.custom_id, r.request_id, r.status_code, _json(r.body))
                (out if r.status_code == 200 else err).append(orjson.dumps(entry))
            elif outcome in ("expired", "cancelled"):
                err.append(orjson.dumps(unrun_line(line.custom_id, outcome)))
        output_id = self._write(state, "output", out, now)
        error_id = self._write(state, "error", err, now)
        self._decide_sync(state, EndBatch(output_id, error_id), now)
        self._close(state, now)

    def _write(
        self, state: BatchState, kind: str, lines: list[bytes], now: datetime
    ) -> str | None:
        if not lines:
            return None
        file_id = "file-" + hashlib.sha256(f"{state.batch_id}/{kind}".encode()).hexdigest()[:24]
        content = b"\n".join(lines) + b"\n"
        self.files.put_file(
            StoredFile(
                file_id, state.tenant_id, "batch_output", f"{state.batch_id}_{kind}.jsonl",
                len(content), now, now + timedelta(seconds=OUTPUT_RETENTION_S),
            ),
            content,
            read_once=state.retention == ZERO,  # zero retention: deleted as it is downloaded
        )
        return file_id

    def _close(self, state: BatchState, now: datetime) -> None:
        """An ended batch: its input file kept for the retention, then nothing of it runs."""
        self.files.set_expiry(state.input_file_id, now + timedelta(seconds=INPUT_RETENTION_S))
        self.files.delete_results(state.batch_id)
        self.idempotency.delete_prefixed(state.tenant_id, batch_keys(state.batch_id))
        self.files.mark_ended(state.batch_id, now)
        self._inflight.pop(state.batch_id, None)
        self._inputs.pop(state.batch_id, None)
        self._states.pop(state.batch_id, None)


def item_key(batch_id: str, custom_id: str) -> str:
    """The Idempotency-Key of a batch item's every attempt. It starts with the batch's own
    prefix, so the records it leaves (the item's completion, kept for a replay after a crash)
    are deleted when the batch ends: the customer never asked for them to be kept."""
    digest = hashlib.sha256(f"{batch_id}/{custom_id}".encode()).hexdigest()[:40]
    return f"{batch_keys(batch_id)}{digest}"


def batch_keys(batch_id: str) -> str:
    return f"batch-{batch_id}-"


def _unsendable(exc: Exception) -> bytes:
    """The error body of an item whose request cannot be encoded (it fails alone, at once)."""
    return orjson.dumps(
        {"error": {
            "message": f"this request could not be sent: {type(exc).__name__}",
            "type": "invalid_request_error", "param": "body", "code": "unsendable_request",
        }}
    )  # fmt: skip


def _not_kept(request_id: str) -> bytes:
    """The result of an item whose answer the edge completed under zero retention while this
    runner was not waiting for it: billed, but its response was not kept to be read back."""
    return orjson.dumps(
        {"error": {
            "message": f"request {request_id} completed, but under zero retention its response "
            "was not kept", "type": "server_error", "param": None, "code": "response_not_kept",
        }}
    )  # fmt: skip


def _json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return {"error": {"message": "the response was not JSON", "type": "server_error"}}


def run_batch_runner(database_url: str, *, edge_url: str, token: str, concurrency: int) -> None:
    """`tollgate batch-runner`: the batch runner as a process of its own (distributed mode),
    feeding batch items to the edge at `edge_url` until SIGTERM/SIGINT. Run one per cluster:
    a second would only duplicate attempts, which each item's Idempotency-Key turns into
    replays, never into a second generation or bill."""
    import signal

    from tollgate_llm.ledger.engine import create_engine_from_url
    from tollgate_llm.ledger.store import SqlEventStore

    engine = create_engine_from_url(database_url)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    runner = BatchRunner(
        engine, SqlEventStore(engine), edge_url=edge_url, token=token, concurrency=concurrency
    )
    log.info("batch runner feeding %s, %d items in flight at most", edge_url, concurrency)
    try:
        runner.run(stop)
    finally:
        engine.dispose()
