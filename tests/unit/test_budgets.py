"""Hierarchical quotas, spend budgets and run budgets in the pure domain: the tree folded from
control events, one decision over every level of the path (`admission.decide_on_path`),
reservation and true-up at every level, calendar periods in the organization's zone, run
dimensions, folding from the log, and (Hypothesis) that no random tree, budget set or request
sequence is ever admitted past any level's budget."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import builders as b
from tollgate_llm.domain import admission
from tollgate_llm.domain.admission import Admitted, Rejected, ReserveQuota
from tollgate_llm.domain.control_plane.decide import ControlCommand, IssueApiKey, decide_control
from tollgate_llm.domain.control_plane.state import ControlView, tenant_stream
from tollgate_llm.domain.cost import Price, amount_micros
from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.errors import MAX_AMOUNT_MICROS, DomainError
from tollgate_llm.domain.governance.budgets import PathView
from tollgate_llm.domain.governance.decide import (
    AssignKey,
    CreateProject,
    CreateWorkspace,
    EndRun,
    MoveProject,
    SetBudget,
    SetLevelLimits,
    SetRunPolicy,
    SetTimeZone,
    StartRun,
)
from tollgate_llm.domain.governance.state import Budget
from tollgate_llm.domain.quota import QuotaView
from tollgate_llm.domain.requests.decide import decide
from tollgate_llm.domain.requests.events import BudgetReserved, ToolCallsReturned
from tollgate_llm.domain.requests.state import RequestState
from tollgate_llm.domain.runs.state import Run, RunLimits, run_stream

MODEL = b.MODEL
PRICE = Price(MODEL, 1_000_000, 2_000_000, 500_000)  # $1 / $2 / $0.50 per Mtok
KV = 131_072
LIMITS = b.limits(rpm=100_000, tpm=100_000_000, max_context=8_000, max_output=1_000)


class Org:
    """A tenant's control view, quota and path views, and a decision helper: what one edge holds."""

    def __init__(self, *events: Event, plan: str = "enterprise") -> None:
        self.view = ControlView()
        self._n = 0
        self.apply(b.tenant_registered(plan=plan), b.key_issued())
        self.apply(*events)
        self.quota = QuotaView(lambda tenant, model: LIMITS)
        self.paths = PathView()
        self._rid = 0

    def apply(self, *events: Event, seconds: float = 0) -> None:
        for event in events:
            self._n += 1
            stream = (
                run_stream(b.TENANT, event.run_id)  # type: ignore[attr-defined]
                if type(event).__name__.startswith("Run") and hasattr(event, "run_id")
                else tenant_stream(b.TENANT)
            )
            self.view.apply(
                b.record(event, version=self._n, seconds=seconds, stream_id=stream,
                         position=self._n)
            )  # fmt: skip

    def do(self, command: ControlCommand, seconds: float = 0) -> tuple[Event, ...]:
        events = decide_control(self.view, command)
        self.apply(*events, seconds=seconds)
        return events

    def ask(
        self, *, key: str = b.KEY, seconds: float = 0, now: datetime | None = None,
        run: Run | None = None, **kw: Any,
    ) -> Admitted | Rejected:  # fmt: skip
        self._rid += 1
        when = now or b.at(seconds)
        cmd = ReserveQuota(
            request_id=f"r{self._rid}", tenant_id=b.TENANT, key_id=key, model=MODEL,
            tier="enterprise", edge_id="edge-1", prompt_tokens=kw.pop("prompt", 100),
            max_tokens=kw.pop("max_tokens", 100), kv_bytes_per_token=KV, tpot_us=50_000,
            now=when, jitter=0.0,
        )  # fmt: skip
        path = self.view.hierarchy.policy(b.TENANT, key, MODEL, when, run)
        assert path is not None
        return admission.decide_on_path(self.quota, self.paths, cmd, LIMITS, path, PRICE)

    def finish(self, decision: Admitted | Rejected, rid: str | None = None, *, prompt: int = 100,
               completion: int = 100, tool_calls: int = 0, seconds: float = 1) -> int:  # fmt: skip
        assert isinstance(decision, Admitted) and decision.reserved is not None
        amount = amount_micros(PRICE, prompt, completion, 0)
        self.paths.finish(
            rid or decision.reserved.request_id,
            prompt + completion,
            amount,
            tool_calls,
            b.at(seconds),
        )
        self.quota.refund(decision.reserved.request_id, prompt + completion, b.at(seconds))
        return amount


# 100 prompt + 100 output at $1/$2 per Mtok: at most 300 micro-dollars per request.
MAX_COST = 300


def tree(**kw: Any) -> Org:
    """acme → workspace "research" → project "search-bot" → key-1."""
    org = Org(**kw)
    org.do(CreateWorkspace(b.TENANT, "research"))
    org.do(CreateProject(b.TENANT, "search-bot", "research"))
    org.do(AssignKey(b.TENANT, b.KEY, "search-bot"))
    return org


def admitted(decision: Admitted | Rejected) -> Admitted:
    assert isinstance(decision, Admitted), decision
    return decision


def refused(decision: Admitted | Rejected, reason: str) -> Rejected:
    assert isinstance(decision, Rejected), decision
    assert decision.reason == reason, decision
    return decision


# --- the tree -----------------------------------------------------------------------------------


def test_a_keys_path_runs_from_the_organization_to_the_key() -> None:
    org = tree()
    path = org.view.hierarchy.path(b.TENANT, b.KEY)
    assert [(lvl.kind, lvl.level_id) for lvl in path] == [
        ("org", b.TENANT), ("workspace", "research"), ("project", "search-bot"), ("key", b.KEY),
    ]  # fmt: skip
    assert path[2].label == 'project "search-bot"'


def test_a_key_without_a_project_belongs_to_the_organization() -> None:
    org = tree()
    org.apply(b.key_issued(key_id="key-2", key_hash="b" * 64))
    path = org.view.hierarchy.path(b.TENANT, "key-2")
    assert [lvl.kind for lvl in path] == ["org", "key"]


def test_a_tenant_with_nothing_set_is_not_decided_over_a_path() -> None:
    assert Org().view.hierarchy.policy(b.TENANT, b.KEY, MODEL, b.at()) is None


def test_issuing_a_key_into_a_project_records_its_place() -> None:
    org = tree()
    events = org.do(IssueApiKey(b.TENANT, "key-3", "c" * 64, project_id="search-bot"))
    assert [type(e).__name__ for e in events] == ["ApiKeyIssued", "KeyAssigned"]
    assert org.view.hierarchy.project_of_key(b.TENANT, "key-3") == "search-bot"


def test_moving_a_project_changes_the_path_of_its_keys() -> None:
    org = tree()
    org.do(CreateWorkspace(b.TENANT, "ops"))
    org.do(MoveProject(b.TENANT, "search-bot", "ops"))
    assert org.view.hierarchy.path(b.TENANT, b.KEY)[1].level_id == "ops"


@pytest.mark.parametrize(
    ("command", "rule"),
    [
        (CreateProject(b.TENANT, "p", "nowhere"), "unknown_workspace"),
        (CreateWorkspace(b.TENANT, "Bad Name"), "bad_name"),
        (SetBudget(b.TENANT, "project", "nope", "month", 1), "unknown_project"),
        (SetBudget(b.TENANT, "org", b.TENANT, "week", 1), "bad_period"),
        (SetBudget(b.TENANT, "org", b.TENANT, "month", -1), "negative_budget"),
        (SetBudget(b.TENANT, "org", b.TENANT, "month", MAX_AMOUNT_MICROS + 1), "too_large"),
        (SetLevelLimits(b.TENANT, "project", "search-bot", "*", tpm=10**13), "too_large"),
        (StartRun(b.TENANT, "r", None, RunLimits(max_calls=10**13)), "too_large"),
        (SetTimeZone(b.TENANT, "Mars/Olympus"), "bad_time_zone"),
        (SetLevelLimits(b.TENANT, "key", "key-9", "*", rpm=1), "unknown_key"),
        (SetLevelLimits(b.TENANT, "workspace", "research", "*"), "empty_limits"),
        (StartRun(b.TENANT, "bad id!", None, RunLimits()), "bad_run_id"),
        (EndRun(b.TENANT, "never"), "unknown_run"),
    ],
)
def test_malformed_hierarchy_commands_name_their_rule(command: ControlCommand, rule: str) -> None:
    org = tree()
    with pytest.raises(DomainError) as err:
        decide_control(org.view, command)
    assert err.value.rule == rule


def test_a_second_workspace_of_the_same_name_is_refused() -> None:
    org = tree()
    with pytest.raises(DomainError) as err:
        org.do(CreateWorkspace(b.TENANT, "research"))
    assert err.value.rule == "duplicate_workspace"


# --- spend budgets ------------------------------------------------------------------------------


def test_a_project_budget_admits_until_its_next_request_could_pass_it() -> None:
    org = tree()
    org.do(SetBudget(b.TENANT, "project", "search-bot", "month", 10 * MAX_COST))
    for _ in range(10):
        admitted(org.ask())
    no = refused(org.ask(), "budget")
    assert no.level == 'project "search-bot"' and no.dimension == "month"
    assert "3000" not in no.detail and "0.003 USD" in no.detail
    assert no.retry_after_s >= 5  # in-flight requests hold the room: it may come back soon


def test_a_refusal_below_the_organization_gives_the_organizations_charge_back() -> None:
    org = tree()
    org.do(SetBudget(b.TENANT, "project", "search-bot", "month", MAX_COST))
    admitted(org.ask())
    refused(org.ask(), "budget")
    assert len(org.quota.in_flight(b.TENANT)) == 1  # the refused one holds nothing


def test_the_bill_trues_the_reservation_up_at_every_level() -> None:
    org = tree()
    org.do(SetBudget(b.TENANT, "workspace", "research", "day", 750))
    first = admitted(org.ask())
    admitted(org.ask())
    refused(org.ask(), "budget")  # 300 + 300 reserved + 300 > 750
    posted = org.finish(first, completion=10)  # 100 + 20 micro-dollars, not 300
    assert posted == 120
    admitted(org.ask())  # 120 posted + 300 reserved + 300 = 720 <= 750
    for kind, level_id in (("org", b.TENANT), ("workspace", "research"),
                           ("project", "search-bot"), ("key", b.KEY)):  # fmt: skip
        reserved, spent = org.paths.spend(b.TENANT, kind, level_id, b.at().date().isoformat())
        assert (reserved, spent) == (2 * MAX_COST, 120)


def test_an_ancestor_is_named_before_a_descendant() -> None:
    org = tree()
    org.do(SetBudget(b.TENANT, "org", b.TENANT, "month", MAX_COST))
    org.do(SetBudget(b.TENANT, "key", b.KEY, "month", MAX_COST))
    admitted(org.ask())
    assert refused(org.ask(), "budget").level == "organization"


def test_a_request_that_costs_more_than_the_whole_budget_is_invalid() -> None:
    org = tree()
    org.do(SetBudget(b.TENANT, "project", "search-bot", "day", MAX_COST - 1))
    no = refused(org.ask(), "invalid")
    assert no.param == "max_tokens" and no.retry_after_s == 0


def test_a_spent_budget_says_when_the_next_period_begins() -> None:
    org = tree()
    org.do(SetBudget(b.TENANT, "project", "search-bot", "day", MAX_COST))
    org.finish(admitted(org.ask()), completion=100)  # 300 posted: nothing will come back today
    no = refused(org.ask(), "budget")
    # T0 is 12:00 UTC: the next day begins in 12 h (plus the jitter's 0 s).
    assert no.retry_after_s == 12 * 3600


def test_a_new_month_starts_from_zero_at_exactly_its_first_instant() -> None:
    org = tree()
    org.do(SetBudget(b.TENANT, "project", "search-bot", "month", MAX_COST))
    end = datetime(2026, 5, 31, 23, 59, 59, 999_999, tzinfo=UTC)
    last = admitted(org.ask(now=end))
    refused(org.ask(now=end), "budget")
    new = admitted(org.ask(now=end + timedelta(microseconds=1)))
    assert (last.reserved and last.reserved.month, new.reserved and new.reserved.month) == (
        "2026-05", "2026-06",
    )  # fmt: skip


def test_periods_are_the_organizations_local_days() -> None:
    org = tree()
    org.do(SetTimeZone(b.TENANT, "America/New_York"))
    org.do(SetBudget(b.TENANT, "org", b.TENANT, "day", MAX_COST))
    # 03:00 UTC on 1 June is 23:00 on 31 May in New York (EDT, UTC-4): still 31 May there.
    may = admitted(org.ask(now=datetime(2026, 6, 1, 3, 0, tzinfo=UTC)))
    refused(org.ask(now=datetime(2026, 6, 1, 3, 59, tzinfo=UTC)), "budget")
    june = admitted(org.ask(now=datetime(2026, 6, 1, 4, 0, tzinfo=UTC)))
    assert may.reserved is not None and may.reserved.day == "2026-05-31"
    assert june.reserved is not None and june.reserved.day == "2026-06-01"


def test_lowering_a_budget_takes_effect_on_the_next_decision() -> None:
    org = tree()
    org.do(SetBudget(b.TENANT, "workspace", "research", "month", 100 * MAX_COST))
    admitted(org.ask())
    org.do(SetBudget(b.TENANT, "workspace", "research", "month", MAX_COST))
    assert refused(org.ask(), "budget").level == 'workspace "research"'
    org.do(SetBudget(b.TENANT, "workspace", "research", "month", None))
    admitted(org.ask())


# --- limits at every level ----------------------------------------------------------------------


def test_a_project_rpm_bounds_every_key_of_the_project_together() -> None:
    org = tree()
    org.do(IssueApiKey(b.TENANT, "key-2", "d" * 64, project_id="search-bot"))
    org.do(SetLevelLimits(b.TENANT, "project", "search-bot", "*", rpm=3))
    admitted(org.ask(key=b.KEY))
    admitted(org.ask(key="key-2"))
    ok = admitted(org.ask(key=b.KEY))
    assert ok.rate_limits.limit_requests == 3 and ok.rate_limits.remaining_requests == 0
    no = refused(org.ask(key="key-2"), "requests")
    assert no.level == 'project "search-bot"' and no.dimension == "rpm"


def test_a_level_limit_set_between_decisions_bounds_the_next_ones() -> None:
    # The path's state (its buckets and spend entries) is kept between decisions: a limit set
    # since must still be checked and charged from the next decision on.
    org = tree()
    admitted(org.ask())
    org.do(SetLevelLimits(b.TENANT, "project", "search-bot", "*", rpm=2))
    admitted(org.ask())
    admitted(org.ask())
    assert refused(org.ask(), "requests").level == 'project "search-bot"'


def test_a_keys_policy_is_built_once_a_day_and_again_after_a_change() -> None:
    org = tree()
    tree_view = org.view.hierarchy
    first = tree_view.policy(b.TENANT, b.KEY, MODEL, b.at(0))
    assert first is not None
    assert tree_view.policy(b.TENANT, b.KEY, MODEL, b.at(60)) is first
    next_day = tree_view.policy(b.TENANT, b.KEY, MODEL, b.at(24 * 3600))
    assert next_day is not first and next_day is not None and next_day.day != first.day
    org.do(SetBudget(b.TENANT, "key", b.KEY, "day", MAX_COST))
    changed = tree_view.policy(b.TENANT, b.KEY, MODEL, b.at(24 * 3600))
    assert changed is not next_day and changed is not None
    assert changed.levels[-1].budgets == (Budget("day", MAX_COST),)


def test_a_level_max_output_clamps_the_reservation() -> None:
    org = tree()
    org.do(SetLevelLimits(b.TENANT, "key", b.KEY, MODEL, max_output=10))
    ok = admitted(org.ask(max_tokens=100))
    assert ok.estimate.reserved_output_tokens == 10 and ok.clamped_output


def test_a_level_limiting_tokens_per_minute_alone_binds() -> None:
    # No requests/min limit anywhere: the tokens/min bucket must still be charged.
    org = tree()
    org.do(SetLevelLimits(b.TENANT, "project", "search-bot", "*", tpm=450))
    first = admitted(org.ask())
    reserved = first.estimate.reserved_tokens
    assert 450 // reserved >= 1
    for _ in range(450 // reserved - 1):
        admitted(org.ask())
    no = refused(org.ask(), "tokens")
    assert no.level == 'project "search-bot"' and no.dimension == "tpm"


def test_a_level_tpm_too_small_for_the_request_is_invalid() -> None:
    org = tree()
    org.do(SetLevelLimits(b.TENANT, "workspace", "research", "*", tpm=150))
    assert refused(org.ask(), "invalid").param == "max_tokens"


# --- runs ---------------------------------------------------------------------------------------


def run_of(org: Org, run_id: str = "run-1", **limits: int) -> Run:
    org.do(StartRun(b.TENANT, run_id, "search-bot", RunLimits(**limits)))
    run = org.view.hierarchy.run(b.TENANT, run_id)
    assert run is not None
    return run


def test_a_run_stops_at_its_max_calls() -> None:
    org = tree()
    run = run_of(org, max_calls=2)
    first = admitted(org.ask(run=run))
    assert first.starts_run and first.reserved and first.reserved.run_id == "run-1"
    second = admitted(org.ask(run=run))
    assert not second.starts_run
    no = refused(org.ask(run=run), "run_budget")
    assert (no.level, no.dimension, no.retry_after_s) == ("run 'run-1'", "calls", 0)


def test_a_run_bounds_its_calls_in_flight_and_gives_room_back() -> None:
    org = tree()
    run = run_of(org, max_in_flight=1)
    first = admitted(org.ask(run=run))
    assert refused(org.ask(run=run), "run_budget").dimension == "in_flight"
    org.finish(first)
    admitted(org.ask(run=run))


def test_a_run_bounds_its_cost_with_the_reservation_then_the_bill() -> None:
    org = tree()
    run = run_of(org, max_cost_micros=2 * MAX_COST)
    first = admitted(org.ask(run=run))
    admitted(org.ask(run=run))
    assert refused(org.ask(run=run), "run_budget").dimension == "cost"
    org.finish(first, completion=0)  # 100 posted of the 300 reserved: 100 + 300 + 300 > 600
    assert refused(org.ask(run=run), "run_budget").dimension == "cost"
    assert org.paths.runs.usage(b.TENANT, "run-1").cost_micros == 400


def test_a_run_stops_once_the_engine_returned_its_max_tool_calls() -> None:
    org = tree()
    run = run_of(org, max_tool_calls=2)
    org.finish(admitted(org.ask(run=run)), tool_calls=2)
    assert refused(org.ask(run=run), "run_budget").dimension == "tool_calls"


def test_a_run_stops_after_its_wall_clock() -> None:
    org = tree()
    run = run_of(org, max_wall_ms=30_000)
    admitted(org.ask(run=run, seconds=30))
    assert refused(org.ask(run=run, seconds=30.001), "run_budget").dimension == "wall_clock"


def test_an_ended_run_takes_no_more_calls() -> None:
    org = tree()
    run_of(org)
    org.do(EndRun(b.TENANT, "run-1"))
    ended = org.view.hierarchy.run(b.TENANT, "run-1")
    assert refused(org.ask(run=ended), "run_budget").dimension == "ended"


def test_a_run_takes_its_projects_policy_where_it_gives_no_limit() -> None:
    org = tree()
    org.do(SetRunPolicy(b.TENANT, "search-bot", RunLimits(max_calls=5, max_cost_micros=9)))
    run = run_of(org, max_calls=2)
    assert run.limits == RunLimits(max_calls=2, max_cost_micros=9)


def test_a_run_its_first_call_started_takes_the_policy_in_force_at_its_start() -> None:
    """The edge that started the run had not heard of the policy set a moment before (its
    RunStarted carries no limit): the run is bound by it all the same once the view learns it.
    A policy set after the run started does not reach back."""
    from tollgate_llm.domain.governance.events import RunPolicySet
    from tollgate_llm.domain.runs.events import RunStarted

    org = tree()
    org.apply(RunPolicySet(b.TENANT, "search-bot", max_calls=1), seconds=10)
    org.apply(RunStarted(b.TENANT, "agent-1", "search-bot", implicit=True), seconds=11)
    org.apply(RunStarted(b.TENANT, "agent-0", "search-bot", implicit=True), seconds=9)
    org.apply(RunPolicySet(b.TENANT, "search-bot", max_calls=7), seconds=12)
    tree_view = org.view.hierarchy
    run = tree_view.run(b.TENANT, "agent-1")
    assert run is not None and run.limits == RunLimits(max_calls=1)
    early = tree_view.run(b.TENANT, "agent-0")  # started before any policy: none binds it
    assert early is not None and early.limits == RunLimits()
    admitted(org.ask(run=run, seconds=13))
    assert refused(org.ask(run=run, seconds=13), "run_budget").dimension == "calls"
    # An explicit run keeps what it was created with.
    org.apply(RunStarted(b.TENANT, "posted", "search-bot", max_calls=3), seconds=11)
    posted = tree_view.run(b.TENANT, "posted")
    assert posted is not None and posted.limits == RunLimits(max_calls=3)


# --- the request stream and the fold -------------------------------------------------------------


def test_the_admission_records_the_reservation_and_the_end_the_tool_calls() -> None:
    org = tree()
    run = run_of(org)
    ok = admitted(org.ask(run=run))
    assert ok.reserved is not None
    admit = b.admit(request_id=ok.reserved.request_id, estimate=ok.estimate, reserved=ok.reserved)
    events = b.decided(admit, b.route(), at=b.at())
    assert isinstance(events[2], BudgetReserved)
    state = b.folded(events)
    assert (state.project_id, state.workspace_id, state.run_id) == (
        "search-bot", "research", "run-1",
    )  # fmt: skip
    ended = decide(state, b.complete(tool_calls=3))
    assert ended[-1] == ToolCallsReturned(ok.reserved.request_id, "run-1", 3)


def test_a_reservation_for_another_request_is_refused() -> None:
    org = tree()
    ok = admitted(org.ask())
    assert ok.reserved is not None
    with pytest.raises(DomainError) as err:
        decide(RequestState(), b.admit(estimate=ok.estimate, reserved=ok.reserved))
    assert err.value.rule == "reservation_mismatch"


def test_a_view_folded_from_the_log_holds_what_the_deciding_edge_holds() -> None:
    org = tree()
    org.do(SetBudget(b.TENANT, "project", "search-bot", "month", 10 * MAX_COST))
    log: list[Any] = []
    for i in range(4):
        ok = admitted(org.ask())
        assert ok.reserved is not None
        rid = ok.reserved.request_id
        log.append(b.record(ok.reserved, version=3))
        if i % 2:
            amount = org.finish(ok)
            log.append(b.record(b.completed(request_id=rid), version=5, seconds=1))
            log.append(b.record(b.billed(request_id=rid, amount_micros=amount), version=7,
                                seconds=1))  # fmt: skip
    other = PathView()
    for record in log + log:  # twice: a redelivery changes nothing
        other.apply(record)
    month = b.at().strftime("%Y-%m")
    for kind, level_id in (("org", b.TENANT), ("project", "search-bot")):
        assert other.spend(b.TENANT, kind, level_id, month) == org.paths.spend(
            b.TENANT, kind, level_id, month
        )


def _edge(*, rates: bool = True, rpm: int = 3, tpm: int = 1_000) -> Org:
    """Another edge of the same organization: the same tree, its own views."""
    org = tree()
    org.do(SetLevelLimits(b.TENANT, "project", "search-bot", "*", rpm=rpm, tpm=tpm))
    if rates:
        org.paths = PathView(rates_for=org.view.hierarchy.level_rates)
    return org


def _two_edges(*, rates: bool = True, rpm: int = 3) -> tuple[Org, Org]:
    one, two = _edge(rpm=rpm), _edge(rates=rates, rpm=rpm)
    two._rid = 1_000  # its request ids are its own
    return one, two


def test_edges_share_a_levels_requests_per_minute_through_the_log() -> None:
    one, two = _two_edges()
    for _ in range(2):
        ok = admitted(one.ask())
        assert ok.reserved is not None
        two.paths.apply(b.record(ok.reserved, version=3))
    admitted(two.ask())  # the third of the project's minute, wherever it is asked
    no = refused(two.ask(), "requests")
    assert no.level == 'project "search-bot"' and no.dimension == "rpm"


def test_edges_share_a_levels_tokens_per_minute_and_its_refunds() -> None:
    # 200 tokens reserved per request (100 prompt + 100 output) against 1,000 a minute.
    one, two = _two_edges(rpm=100)
    reserved = []
    for _ in range(4):
        ok = admitted(one.ask())
        assert ok.reserved is not None
        reserved.append(ok.reserved)
        two.paths.apply(b.record(ok.reserved, version=3))
    admitted(two.ask())
    assert refused(two.ask(), "tokens").dimension == "tpm"
    # One of the first edge's requests used 50 of its 200: the 150 back make room again.
    rid = reserved[0].request_id
    two.paths.apply(b.record(b.refunded(request_id=rid, refunded_tokens=150), version=5))
    admitted(two.ask(prompt=50, max_tokens=50))


def test_without_the_levels_rates_only_buckets_it_has_are_charged_from_the_log() -> None:
    # (the view as it was before: each edge gave a level its whole minute)
    one, two = _two_edges(rates=False)
    for _ in range(3):
        ok = admitted(one.ask())
        assert ok.reserved is not None
        two.paths.apply(b.record(ok.reserved, version=3))
    admitted(two.ask())


def test_a_capacity_refusal_after_the_reservation_voids_it_everywhere() -> None:
    org = tree()
    org.do(SetBudget(b.TENANT, "project", "search-bot", "month", MAX_COST))
    ok = admitted(org.ask())
    assert ok.reserved is not None
    org.paths.void(ok.reserved.request_id)
    org.quota.void(ok.reserved.request_id)
    admitted(org.ask())


# --- property: no level is ever admitted past -----------------------------------------------------

PERIOD = st.sampled_from(["day", "month"])


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Org, list[str], list[tuple[str, str, int]], list[Any]]:
    org = Org()
    workspaces = [f"w{i}" for i in range(draw(st.integers(1, 3)))]
    for w in workspaces:
        org.do(CreateWorkspace(b.TENANT, w))
    projects = []
    for i in range(draw(st.integers(1, 4))):
        projects.append(f"p{i}")
        org.do(CreateProject(b.TENANT, f"p{i}", draw(st.sampled_from(workspaces))))
    keys = []
    for i in range(draw(st.integers(1, 5))):
        key_id = f"k{i}"
        project = draw(st.none() | st.sampled_from(projects))
        org.do(IssueApiKey(b.TENANT, key_id, f"{i:064x}", project_id=project))
        keys.append(key_id)
    levels = [("org", b.TENANT)] + [("workspace", w) for w in workspaces]
    levels += [("project", p) for p in projects] + [("key", k) for k in keys]
    set_budgets = []
    for kind, level_id in draw(st.lists(st.sampled_from(levels), min_size=1, max_size=6)):
        period = draw(PERIOD)
        amount = draw(st.integers(MAX_COST, 8 * MAX_COST))
        org.do(SetBudget(b.TENANT, kind, level_id, period, amount))
        set_budgets.append((kind, level_id, period))
    steps = draw(
        st.lists(
            st.tuples(
                st.sampled_from(keys),
                st.integers(0, 3 * 3600),  # seconds after T0 (crosses no month, some hours)
                st.integers(1, 100),  # max_tokens
                st.floats(0, 1),  # fraction of the reservation the bill posts
                st.booleans(),  # finished before the next request
            ),
            max_size=60,
        )
    )
    return org, keys, set_budgets, steps


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_random_trees_never_admit_past_any_ancestors_budget(
    scenario: tuple[Org, list[str], list[tuple[str, str, int]], list[Any]],
) -> None:
    org, _, set_budgets, steps = scenario
    pending: list[tuple[Admitted, int]] = []
    for key, offset, max_tokens, fraction, finish_now in sorted(steps, key=lambda s: s[1]):
        decision = org.ask(key=key, seconds=offset, max_tokens=max_tokens)
        if isinstance(decision, Admitted):
            pending.append((decision, max_tokens))
        if finish_now and pending:
            done, reserved_out = pending.pop(0)
            completion = int(reserved_out * fraction)
            org.finish(done, completion=completion, seconds=offset)
        for kind, level_id, period in set_budgets:
            amount = org.view.hierarchy.budgets(b.TENANT, kind, level_id)[period]
            key_at = b.at(offset).date().isoformat()
            key_at = key_at if period == "day" else key_at[:7]
            reserved, posted = org.paths.spend(b.TENANT, kind, level_id, key_at)
            assert reserved >= 0 and posted + reserved <= amount, (kind, level_id, period)
    for done, _ in pending:
        org.finish(done, completion=0)
    for kind, level_id, period in set_budgets:
        amount = org.view.hierarchy.budgets(b.TENANT, kind, level_id)[period]
        key_at = b.at().date().isoformat()
        reserved, posted = org.paths.spend(b.TENANT, kind, level_id, key_at if period == "day"
                                           else key_at[:7])  # fmt: skip
        assert reserved == 0 and posted <= amount


def test_tightest_rate_limits_come_from_the_level_with_least_left() -> None:
    org = tree()
    org.do(SetLevelLimits(b.TENANT, "workspace", "research", "*", rpm=10, tpm=10_000))
    ok = admitted(org.ask())
    assert (ok.rate_limits.limit_requests, ok.rate_limits.remaining_requests) == (10, 9)
    assert (ok.rate_limits.limit_tokens, ok.rate_limits.remaining_tokens) == (10_000, 9_800)


def test_prune_forgets_only_what_is_finished_and_old() -> None:
    org = tree()
    org.do(SetBudget(b.TENANT, "org", b.TENANT, "month", 100 * MAX_COST))
    org.finish(admitted(org.ask()))
    admitted(org.ask())
    assert org.paths.prune(b.at(10_000)) == 1
    month = b.at().strftime("%Y-%m")
    assert org.paths.spend(b.TENANT, "org", b.TENANT, month) == (MAX_COST, 300)


def test_a_project_kv_limit_bounds_its_keys_in_flight_together() -> None:
    org = tree()
    org.do(IssueApiKey(b.TENANT, "key-2", "e" * 64, project_id="search-bot"))
    org.do(SetLevelLimits(b.TENANT, "project", "search-bot", "*", kv_gib_seconds=0))
    first = admitted(org.ask(key=b.KEY))  # a lone request is never refused for concurrency
    no = refused(org.ask(key="key-2"), "concurrency")
    assert no.level == 'project "search-bot"' and no.dimension == "kv"
    org.finish(first)
    admitted(org.ask(key="key-2"))
