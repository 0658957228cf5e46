"""The edge over fakes with a project budget and a controllable clock: a run of traffic that
crosses a month boundary (the new month starts from zero at its first instant; a request
admitted in the old month is posted there even when it ends in the new one), what the edge
records with a governed admission, the true-up at the end, and a capacity refusal voiding every
level."""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime, timedelta

import orjson
import pytest

from tests import builders as b
from tests.fakes import (
    FakeClock,
    FakeFleet,
    FakeIdempotency,
    FakeReplica,
    FakeSink,
    FixedTokens,
    Script,
)
from tollgate_llm.api.metrics import Metrics
from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.edge import Edge, JsonOutcome
from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.domain.control_plane.decide import decide_control
from tollgate_llm.domain.control_plane.events import PriceSet
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.governance.decide import (
    AssignKey,
    CreateProject,
    CreateWorkspace,
    SetBudget,
    SetTimeZone,
)
from tollgate_llm.domain.quota import QuotaView
from tollgate_llm.domain.requests.events import BudgetReserved, ToolCallsReturned
from tollgate_llm.domain.runs.events import RunStarted
from tollgate_llm.domain.runs.state import run_stream
from tollgate_llm.ledger.commands import CommandHandler

MODEL = b.MODEL
CALLER = Caller(b.KEY, b.TENANT, "customer", "standard", "salt-acme")
# "two words" is 2 prompt tokens and the replica answers 3: at $10 / $30 per Mtok, 110 micros.
COST = 2 * 10 + 3 * 30
MAY_END = datetime(2026, 5, 31, 23, 59, 58, tzinfo=UTC)


class Org:
    def __init__(self, budget_micros: int) -> None:
        self.control = ControlView()
        self._n = 0
        self.record(
            b.tenant_registered(), b.key_issued(),
            b.price_set(prompt_micros_per_mtok=10_000_000, completion_micros_per_mtok=30_000_000,
                        effective_at=b.at(-60)),
        )  # fmt: skip
        for command in (
            CreateWorkspace(b.TENANT, "research"),
            CreateProject(b.TENANT, "search-bot", "research"),
            AssignKey(b.TENANT, b.KEY, "search-bot"),
            SetBudget(b.TENANT, "project", "search-bot", "month", budget_micros),
        ):
            self.record(*decide_control(self.control, command))
        self.clock = FakeClock(MAY_END)
        self.script = Script(tokens=3, prompt_tokens=2)
        self.fleet = FakeFleet(FakeReplica("replica-1", MODEL, self.script))
        self.sink = FakeSink()
        self.edge = Edge(
            control=self.control, quota=QuotaView(self.control.limits), fleet=self.fleet,
            events=self.sink, idempotency=FakeIdempotency(), metrics=Metrics(),
            tokens=lambda model: FixedTokens(), edge_id="edge-1", rng=random.Random(7),
            clock=self.clock, commands=CommandHandler(self.sink.store, clock=self.clock),
        )  # fmt: skip
        self._rid = 0

    def record(self, *events: Event) -> None:
        for event in events:
            self._n += 1
            stream = "prices-x" if isinstance(event, PriceSet) else "tenant-acme"
            self.control.apply(b.record(event, version=self._n, seconds=-60, stream_id=stream))

    async def chat(self, run_id: str | None = None, **body: object) -> JsonOutcome:
        self._rid += 1
        raw = orjson.dumps({"model": MODEL, "max_tokens": 3,
                            "messages": [{"role": "user", "content": "two words"}], **body})
        out = await self.edge.chat(CALLER, raw, request_id=f"req_{self._rid:032x}",
                                   idempotency_key=None, retry_count=0, run_id=run_id)
        assert isinstance(out, JsonOutcome)
        return out

    def stored(self, n: int) -> list[Event]:
        return [r.event for r in self.sink.store.read_stream(f"req_{n:032x}")]

    def spend(self, period: str) -> tuple[int, int]:
        return self.edge.paths.spend(b.TENANT, "project", "search-bot", period)


def test_a_month_boundary_during_traffic_starts_the_new_month_from_zero() -> None:
    async def t(org: Org) -> None:
        await org.chat()
        await org.chat()
        hold = asyncio.Event()
        org.script.hold = hold
        straddling = asyncio.create_task(org.chat())  # admitted in May, ends in June
        while not org.edge.in_flight:
            await asyncio.sleep(0)
        org.script.hold = None
        with pytest.raises(ApiError) as refused:
            await org.chat()
        assert refused.value.status == 429 and refused.value.code == "budget_exceeded"
        assert org.spend("2026-05") == (COST, 2 * COST)
        org.clock.advance(2)  # 2026-06-01T00:00:00Z: the first instant of June
        await org.chat()
        hold.set()
        await straddling
        assert org.spend("2026-05") == (0, 3 * COST)  # its bill stays in May
        assert org.spend("2026-06") == (0, COST)
        reserved = [e for e in org.stored(5) if isinstance(e, BudgetReserved)]
        assert [r.month for r in reserved] == ["2026-06"]
        assert [e.month for e in org.stored(3) if isinstance(e, BudgetReserved)] == ["2026-05"]

    asyncio.run(t(Org(3 * COST)))


def test_a_governed_admission_records_its_reservation_and_the_end_trues_it_up() -> None:
    async def t(org: Org) -> None:
        org.script.tokens = 1  # ends after 1 of the 3 reserved output tokens
        await org.chat()
        (reserved,) = [e for e in org.stored(1) if isinstance(e, BudgetReserved)]
        assert (reserved.workspace_id, reserved.project_id, reserved.run_id) == (
            "research", "search-bot", None,
        )  # fmt: skip
        assert reserved.reserved_micros == COST
        assert org.spend("2026-05") == (0, 2 * 10 + 1 * 30)

    asyncio.run(t(Org(100 * COST)))


def test_a_capacity_refusal_gives_every_levels_reservation_back() -> None:
    async def t(org: Org) -> None:
        org.fleet.full = True
        with pytest.raises(ApiError) as refused:
            await org.chat()
        assert refused.value.status == 503
        assert org.spend("2026-05") == (0, 0)
        org.fleet.full = False
        await org.chat()
        assert org.spend("2026-05") == (0, COST)

    asyncio.run(t(Org(COST)))


def test_a_call_with_a_new_run_id_starts_the_run_and_counts_its_tool_calls() -> None:
    async def t(org: Org) -> None:
        await org.chat(run_id="task-1")
        starts = [r.event for r in org.sink.store.read_stream(run_stream(b.TENANT, "task-1"))]
        assert len(starts) == 1 and isinstance(starts[0], RunStarted) and starts[0].implicit
        usage = org.edge.paths.runs.usage(b.TENANT, "task-1")
        assert (usage.calls, usage.in_flight, usage.posted_micros) == (1, 0, COST)
        assert not any(isinstance(e, ToolCallsReturned) for e in org.stored(1))

    asyncio.run(t(Org(100 * COST)))


def test_periods_follow_the_organizations_zone() -> None:
    async def t(org: Org) -> None:
        # 23:59:58 UTC on 31 May is 01:59:58 on 1 June in Paris (CEST, UTC+2).
        await org.chat()
        (reserved,) = [e for e in org.stored(1) if isinstance(e, BudgetReserved)]
        assert (reserved.day, reserved.month) == ("2026-06-01", "2026-06")
        org.clock.advance(timedelta(hours=1).total_seconds())
        assert org.spend("2026-06") == (0, COST)

    org = Org(100 * COST)
    org.record(*decide_control(org.control, SetTimeZone(b.TENANT, "Europe/Paris")))
    asyncio.run(t(org))
