"""Admission below and beside the organization's limits: every level of a request's path (org →
workspace → project → key, `domain.governance`) with its own requests/min, tokens/min and
concurrent KV·s, its spend budgets per calendar period, and the agent run the request belongs
to — decided at once (`reserve`), reserved at every level, and trued up at every level from the
same terminal event.

The view (`PathView`) is a fold of request events — `BudgetReserved` (what the admission
reserved at each level), the terminal events, `QuotaRefunded`, `UsageBilled` (the posted
amount), `ToolCallsReturned`, a capacity `RequestRejected` (void) — kept current by the edge's
own decisions before they come back through the log; applying an event twice is applying it
once. Money moves as TigerBeetle's two-phase transfers do: reserved at admission (the request's
maximum cost), then posted (the bill's amount, never more than was reserved) or voided, so the
sum posted + reserved at a level never passes its budget: there is no overshoot to apologise
for, whatever the concurrency.

A request's spend belongs to the period it was admitted in (named in its `BudgetReserved`), so
its reservation and its bill are in the same period and a new period starts from zero at its
first instant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final, Literal, NamedTuple

from domain.backoff import BackoffPolicy
from domain.control_plane.state import Limits
from domain.cost import GIB, TOKENS_PER_MTOK, Price
from domain.envelope import Event, Recorded
from domain.governance.state import LevelRule, PathPlan, PathPolicy, time_zone
from domain.quota import TOMBSTONE_TTL_S, Bucket
from domain.requests.events import (
    BudgetReserved,
    LeaseExpired,
    QuotaRefunded,
    RequestCancelled,
    RequestCompleted,
    RequestFailed,
    RequestPreempted,
    RequestRejected,
    ToolCallsReturned,
    UsageBilled,
)
from domain.runs.state import Run

PathReason = Literal["requests", "tokens", "concurrency", "budget", "run_budget", "invalid"]
_MINUTE_S: Final = 60.0
_MICROS_PER_UNIT: Final = 1_000_000
_PERIODLY: Final = {"day": "daily", "month": "monthly"}


def max_cost_micros(price: Price, prompt_tokens: int, output_tokens: int) -> int:
    """The most a request can be billed: its whole prompt at the prompt rate (a cache hit only
    lowers it) and every reserved output token, rounded up so a reservation is never short."""
    total = prompt_tokens * price.prompt_micros_per_mtok + (
        output_tokens * price.completion_micros_per_mtok
    )
    return -(-total // TOKENS_PER_MTOK)


def narrow(limits: Limits, path: PathPolicy) -> Limits:
    """The organization's limits with the path's tighter max_context / max_output, so that the
    one clamp (`domain.admission.decide`) applies the tightest level's."""
    context, output = path.max_context, path.max_output
    if (context is None or context >= limits.max_context) and (
        output is None or output >= limits.max_output
    ):
        return limits
    return Limits(
        limits.rpm, limits.tpm,
        limits.max_context if context is None else min(context, limits.max_context),
        limits.max_output if output is None else min(output, limits.max_output),
        limits.kv_gib_seconds, limits.reserved_kv_gib_seconds,
    )  # fmt: skip


# The tightest level's X-RateLimit-* figures after a decision: (limit, remaining, reset ms) for
# requests and for tokens; None where no level below the organization limits that dimension.
Rate = tuple[int, int, int]
# (tenant, level kind, level id, model) -> that level's (requests/min, tokens/min); None: unlimited.
RatesFor = Callable[[str, str, str, str], tuple[int | None, int | None]]


class PathAdmitted(NamedTuple):
    reserved: BudgetReserved
    requests: Rate | None
    tokens: Rate | None
    starts_run: bool  # the run is new: its RunStarted goes with this admission


class PathRefused(NamedTuple):
    reason: PathReason
    level: str  # the level that refused, as its tenant names it: 'project "search-bot"'
    dimension: str  # rpm | tpm | kv | day | month | calls | tool_calls | wall_clock | cost | ...
    retry_after_s: int
    detail: str
    requests: Rate | None
    tokens: Rate | None
    param: str | None = None


@dataclass(slots=True)
class RunUsage:
    """A run's consumption, folded from its calls' events."""

    calls: int = 0
    in_flight: int = 0
    reserved_micros: int = 0
    posted_micros: int = 0
    tool_calls: int = 0
    exhausted: str | None = None  # the first dimension a call was refused for

    @property
    def cost_micros(self) -> int:
        return self.reserved_micros + self.posted_micros


class _Spend:
    __slots__ = ("reserved", "posted")

    def __init__(self) -> None:
        self.reserved = 0
        self.posted = 0


_LevelKey = tuple[str, str, str]  # (tenant, level kind, level id)


class _PathState:
    """What a path's checks read in one view, for one model and one day: each check of its
    plan with its own buckets, the KV·s key and the spend entries of its budgets (the
    period's), and the keys and spend entries a charge updates. Looked up once per decision
    instead of one dict lookup (and key tuple) per level, dimension and budget."""

    __slots__ = ("plan", "model", "day", "month", "periods", "checks", "levels", "kv_levels",
                 "rate_keys", "kv_keys", "cells", "rpms", "tpms", "buckets_seen", "rated",
                 "kv_caps", "spends", "amount_min")  # fmt: skip

    def __init__(
        self, view: PathView, plan: PathPlan, path: PathPolicy, model: str, now_s: float
    ) -> None:
        self.plan = plan
        self.model = model
        self.day, self.month = day, month = path.day, path.month
        self.periods = (day, month)
        # Buckets and spend entries made now rather than at their first check are the same:
        # a new bucket is full (refilling it changes nothing) and a new entry holds zero. An
        # existing bucket is left as it is: it is refilled when checked, as before.
        checks = []
        for rule, rpm, tpm, kv, budgets in plan.checks:
            key = (rule.key, model)
            checks.append((
                rule, rpm, tpm, kv,
                None if rpm is None else view._found_bucket(view._rpm, key, rpm, now_s),
                None if tpm is None else view._found_bucket(view._tpm, key, tpm, now_s),
                key,
                tuple(
                    (budget.amount_micros, view._spend_entry(rule.key, day if daily else month),
                     day if daily else month, budget)
                    for budget, daily in budgets
                ),
            ))  # fmt: skip
        self.checks = tuple(checks)
        # The same checks by kind, flat, for the decision that passes them all (`_fits`).
        self.rated = tuple(
            (rpm_limit, tpm_limit, rpm, tpm)
            for _, rpm_limit, tpm_limit, _, rpm, tpm, _, _ in self.checks
            if rpm is not None or tpm is not None
        )
        self.kv_caps = tuple(
            (key, kv_limit * GIB) for _, _, _, kv_limit, _, _, key, _ in self.checks
            if kv_limit is not None
        )
        self.spends = tuple(
            (amount, spent) for *_, budgets in self.checks for amount, spent, _, _ in budgets
        )
        self.amount_min = min((amount for amount, _ in self.spends), default=None)
        self.levels = path.level_keys
        self.kv_levels = path.kv_keys
        self.rate_keys = tuple((level, model) for level in path.level_keys)
        self.kv_keys = tuple((level, model) for level in path.kv_keys)
        self.cells = view._path_cells(path.level_keys, self.periods)
        self.rpms: tuple[Bucket, ...] = ()
        self.tpms: tuple[Bucket, ...] = ()
        self.buckets_seen = -1
        self.find_buckets(view)

    def find_buckets(self, view: PathView) -> None:
        """The rate buckets a charge takes from: every bucket there is at the path's levels
        for the model (not only those its own rules check), found again whenever the view
        has made a bucket since."""
        rpms, tpms = view._rpm, view._tpm
        self.rpms = tuple(rpms[key] for key in self.rate_keys if key in rpms)
        self.tpms = tuple(tpms[key] for key in self.rate_keys if key in tpms)
        self.buckets_seen = view._buckets_made


class _Req:
    __slots__ = (
        "request_id", "tenant_id", "model", "levels", "kv_levels", "periods", "cells", "run",
        "reserved_micros",
        "reserved_tokens", "kv", "in_flight", "posted", "voided", "refunded", "tools",
        "admitted_s", "finished_s",
    )  # fmt: skip

    def __init__(
        self, event: BudgetReserved, levels: tuple[_LevelKey, ...], periods: tuple[str, str],
        at_s: float,
    ) -> None:  # fmt: skip
        self.request_id = event.request_id
        self.tenant_id = event.tenant_id
        self.model = event.model
        self.levels = levels
        self.kv_levels = levels
        self.periods = periods
        self.cells: tuple[_Spend, ...] = ()
        self.run = (event.tenant_id, event.run_id) if event.run_id else None
        self.reserved_micros = event.reserved_micros
        self.reserved_tokens = event.reserved_tokens
        self.kv = event.kv_byte_seconds
        self.in_flight = True
        self.posted = False
        self.voided = False
        self.refunded = False
        self.tools = False
        self.admitted_s = at_s
        self.finished_s: float | None = None


class PathView:
    def __init__(
        self, *, backoff: BackoffPolicy | None = None, tombstone_ttl_s: int = TOMBSTONE_TTL_S,
        rates_for: RatesFor | None = None,
    ) -> None:
        self.backoff = backoff or BackoffPolicy()
        # (tenant, level kind, level id, model) -> that level's (requests/min, tokens/min), e.g.
        # Hierarchy.level_rates: sizes the buckets of levels this view has not decided on yet
        # when it folds another edge's admission there. Without it, only buckets this view
        # already has are charged from the log.
        self._rates_for = rates_for
        self.tombstone_ttl_s = tombstone_ttl_s
        self._rpm: dict[tuple[_LevelKey, str], Bucket] = {}
        self._tpm: dict[tuple[_LevelKey, str], Bucket] = {}
        self._kv: dict[tuple[_LevelKey, str], int] = {}
        self._spend: dict[tuple[_LevelKey, str], _Spend] = {}
        self._cells: dict[tuple[tuple[_LevelKey, ...], tuple[str, str]], tuple[_Spend, ...]] = {}
        # plan -> its state for the model and day last decided (`_state`): rebuilt on demand.
        self._states: dict[PathPlan, _PathState] = {}
        self._buckets_made = 0  # how many rate buckets exist: a state's lists are current
        self._runs: dict[tuple[str, str], RunUsage] = {}
        self._run_defs: dict[tuple[str, str], Run] = {}  # runs this edge started itself
        self._requests: dict[str, _Req] = {}
        self._handlers: dict[type[Event], Callable[[Recorded], None]] = {
            BudgetReserved: self._on_reserved,
            RequestCompleted: self._on_terminal,
            RequestCancelled: self._on_terminal,
            RequestFailed: self._on_terminal,
            LeaseExpired: self._on_terminal,
            RequestPreempted: self._on_terminal,
            QuotaRefunded: self._on_refunded,
            UsageBilled: self._on_billed,
            ToolCallsReturned: self._on_tools,
            RequestRejected: self._on_rejected,
        }

    # --- what a decision reads ----------------------------------------------------------------

    def knows(self, request_id: str) -> bool:
        return request_id in self._requests

    def spend(self, tenant_id: str, kind: str, level_id: str, period_key: str) -> tuple[int, int]:
        """(reserved, posted) micro-units at one level in one period."""
        found = self._spend.get(((tenant_id, kind, level_id), period_key))
        return (0, 0) if found is None else (found.reserved, found.posted)

    def run_usage(self, tenant_id: str, run_id: str) -> RunUsage:
        return self._runs.get((tenant_id, run_id)) or RunUsage()

    def started_run(self, tenant_id: str, run_id: str) -> Run | None:
        """A run this view started (its RunStarted may not be folded into the control view
        yet)."""
        return self._run_defs.get((tenant_id, run_id))

    def mark_exhausted(self, tenant_id: str, run_id: str, dimension: str) -> bool:
        """True the first time a run's call is refused (so it is recorded once per run)."""
        run = self._runs.get((tenant_id, run_id))
        if run is None:
            run = self._runs[(tenant_id, run_id)] = RunUsage()
        if run.exhausted is not None:
            return False
        run.exhausted = dimension
        return True

    def note_run(self, run: Run) -> None:
        self._run_defs.setdefault((run.tenant_id, run.run_id), run)

    # --- the edge's own decisions -------------------------------------------------------------

    def charge(
        self, event: BudgetReserved, at_s: float, levels: tuple[_LevelKey, ...] | None = None,
        kv_levels: tuple[_LevelKey, ...] | None = None,
    ) -> None:  # fmt: skip
        """Take an admission's reservation at every level (`levels`: the path's keys, else
        read from the event), its run included. KV·s in flight is kept at `kv_levels` only
        (default: every level), the levels with a KV·s limit: it is a concurrency lease, so a
        limit set later counts the requests admitted from then on (they last seconds), while
        money is kept at every level, since a budget set mid-period counts the whole period."""
        if event.request_id in self._requests:
            return
        self._take(event, at_s, rate=True, levels=levels, kv_levels=kv_levels)

    def void(self, request_id: str) -> None:
        """Undo an admission that did not go through (capacity refused it): everything back."""
        req = self._requests.get(request_id)
        if req is None or req.voided:
            return
        for level in req.levels:
            key = (level, req.model)
            rpm = self._rpm.get(key)
            if rpm is not None:
                rpm.give_back(1.0)
            tpm = self._tpm.get(key)
            if tpm is not None and not req.refunded:
                tpm.give_back(req.reserved_tokens)
        if not req.posted:
            self._unreserve(req)
        run = self._runs.get(req.run) if req.run else None
        if run is not None:
            run.calls -= 1
        req.voided = req.refunded = True
        self._release(req, req.admitted_s)

    def withdraw(self, request_id: str) -> None:
        """Void and forget, so the same request may be decided again (for another model)."""
        self.void(request_id)
        self._requests.pop(request_id, None)

    def finish(
        self, request_id: str, used_tokens: int, amount_micros: int, tool_calls: int, at: datetime
    ) -> None:
        """The edge's true-up at a request's terminal event, before its facts come back through
        the log (which are then skipped): KV released, tokens/min refunded, the reservation
        replaced by the bill's amount, the run's tool calls counted."""
        req = self._requests.get(request_id)
        if req is None:
            return
        at_s = at.timestamp()
        self._refund(req, max(0, req.reserved_tokens - used_tokens), at_s)
        self._post(req, amount_micros)
        self._count_tools(req, tool_calls)
        self._release(req, at_s)

    # --- folding ------------------------------------------------------------------------------

    def folded_types(self) -> frozenset[str]:
        """The event types `apply` folds (a reader of the log may skip every other)."""
        return frozenset(kind.EVENT_TYPE for kind in self._handlers)

    def apply(self, recorded: Recorded) -> None:
        handler = self._handlers.get(type(recorded.event))
        if handler is not None:
            handler(recorded)

    def _on_reserved(self, recorded: Recorded) -> None:
        event = recorded.event
        assert isinstance(event, BudgetReserved)
        if event.request_id not in self._requests:
            at_s = recorded.occurred_at.timestamp()
            self._take(event, at_s, rate=False)
            self._charge_from_log(self._requests[event.request_id], event, at_s)

    def _charge_from_log(self, req: _Req, event: BudgetReserved, at_s: float) -> None:
        """Another edge's admission at its levels' requests/min and tokens/min buckets, so the
        edges share a level's rates as they share the organization's (domain.quota; its own
        bucket is not here). A bucket is made, full at the admission's instant, where the level
        has a limit and this view has none yet; a charge a minute old would have refilled."""
        rates_for = self._rates_for
        rpms, tpms = self._rpm, self._tpm
        for level in req.levels:
            if level[1] == "org":
                continue
            key = (level, req.model)
            rpm, tpm = rpms.get(key), tpms.get(key)
            if (rpm is None or tpm is None) and rates_for is not None:
                rpm_limit, tpm_limit = rates_for(level[0], level[1], level[2], req.model)
                if rpm is None and rpm_limit is not None:
                    rpm = self._found_bucket(rpms, key, rpm_limit, at_s)
                if tpm is None and tpm_limit is not None:
                    tpm = self._found_bucket(tpms, key, tpm_limit, at_s)
            if rpm is not None and at_s + _MINUTE_S > rpm.at:
                rpm.level -= 1.0
            if tpm is not None and at_s + _MINUTE_S > tpm.at:
                tpm.level -= event.reserved_tokens

    def _on_terminal(self, recorded: Recorded) -> None:
        req = self._requests.get(recorded.stream_id)
        if req is not None:
            self._release(req, recorded.occurred_at.timestamp())

    def _on_refunded(self, recorded: Recorded) -> None:
        event = recorded.event
        assert isinstance(event, QuotaRefunded)
        req = self._requests.get(event.request_id)
        if req is not None:
            self._refund(req, event.refunded_tokens, recorded.occurred_at.timestamp())

    def _on_billed(self, recorded: Recorded) -> None:
        event = recorded.event
        assert isinstance(event, UsageBilled)
        req = self._requests.get(event.request_id)
        if req is not None:
            self._post(req, event.amount_micros)

    def _on_tools(self, recorded: Recorded) -> None:
        event = recorded.event
        assert isinstance(event, ToolCallsReturned)
        req = self._requests.get(event.request_id)
        if req is not None:
            self._count_tools(req, event.tool_calls)

    def _on_rejected(self, recorded: Recorded) -> None:
        event = recorded.event
        assert isinstance(event, RequestRejected)
        self.void(event.request_id)

    def prune(self, now: datetime) -> int:
        """Forget finished requests older than the tombstone TTL (their money stays counted)."""
        horizon = now.timestamp() - self.tombstone_ttl_s
        stale = []
        for rid, req in self._requests.items():
            if req.admitted_s >= horizon:
                break
            if not req.in_flight and (req.posted or req.voided):
                stale.append(rid)
        for rid in stale:
            del self._requests[rid]
        # Caches of the spend entries paths use (so yesterday's go): rebuilt on demand.
        self._cells.clear()
        self._states.clear()
        return len(stale)

    # --- helpers ------------------------------------------------------------------------------

    def _take(
        self, event: BudgetReserved, at_s: float, *, rate: bool,
        levels: tuple[_LevelKey, ...] | None = None,
        kv_levels: tuple[_LevelKey, ...] | None = None,
    ) -> None:  # fmt: skip
        if levels is None:
            tenant = event.tenant_id
            found: list[_LevelKey] = [(tenant, "org", tenant)]
            if event.workspace_id:
                found.append((tenant, "workspace", event.workspace_id))
            if event.project_id:
                found.append((tenant, "project", event.project_id))
            found.append((tenant, "key", event.key_id))
            levels = tuple(found)
        req = _Req(event, levels, (event.day, event.month), at_s)
        req.kv_levels = levels if kv_levels is None else kv_levels
        self._requests[event.request_id] = req
        model = event.model
        kv = self._kv
        kv_bytes = event.kv_byte_seconds
        for level in req.kv_levels:
            key = (level, model)
            kv[key] = kv.get(key, 0) + kv_bytes
        if rate and (self._rpm or self._tpm):  # (a level may limit tokens/min alone)
            for level in req.levels:
                key = (level, model)
                rpm = self._rpm.get(key)
                if rpm is not None:
                    rpm.level -= 1.0
                tpm = self._tpm.get(key)
                if tpm is not None:
                    tpm.level -= event.reserved_tokens
        self._hold(event, req, self._path_cells(levels, req.periods))

    def _take_on_path(self, event: BudgetReserved, at_s: float, state: _PathState) -> None:
        """`charge` of an admission decided over a path, with the keys and spend entries its
        state holds (the same updates as `_take`, without building them again)."""
        if event.request_id in self._requests:
            return
        # The state's periods tuple, shared: one object fewer kept per admission (objects
        # kept are what sets off the garbage collector, mid-decision).
        req = _Req(event, state.levels, state.periods, at_s)
        req.kv_levels = state.kv_levels
        self._requests[event.request_id] = req
        kv = self._kv
        kv_bytes = event.kv_byte_seconds
        for key in state.kv_keys:
            kv[key] = kv.get(key, 0) + kv_bytes
        if self._rpm or self._tpm:  # (as `_take`: no rate charge while the view has no bucket)
            if state.buckets_seen != self._buckets_made:
                state.find_buckets(self)
            for rpm in state.rpms:
                rpm.level -= 1.0
            tokens = event.reserved_tokens
            for tpm in state.tpms:
                tpm.level -= tokens
        self._hold(event, req, state.cells)

    def _hold(self, event: BudgetReserved, req: _Req, cells: tuple[_Spend, ...]) -> None:
        """Reserve an admission's money in its spend entries and count it in its run."""
        req.cells = cells
        micros = event.reserved_micros
        for entry in cells:
            entry.reserved += micros
        if req.run is not None:
            run = self._runs.get(req.run)
            if run is None:
                run = self._runs[req.run] = RunUsage()
            run.calls += 1
            run.in_flight += 1
            run.reserved_micros += micros

    def _path_cells(
        self, levels: tuple[_LevelKey, ...], periods: tuple[str, str]
    ) -> tuple[_Spend, ...]:
        """The spend entries of a path and period pair, found once: every request of the path
        that day updates the same few objects."""
        cells_key = (levels, periods)
        cells = self._cells.get(cells_key)
        if cells is None:
            cells = self._cells[cells_key] = tuple(
                self._spend_entry(level, period) for level in levels for period in periods
            )
        return cells

    def _spend_entry(self, level: _LevelKey, period: str) -> _Spend:
        entry = self._spend.get((level, period))
        if entry is None:
            entry = self._spend[(level, period)] = _Spend()
        return entry

    def _state(self, path: PathPolicy, model: str, now_s: float) -> _PathState:
        """The state of a path's checks for this model and day (kept while it holds)."""
        plan = path.plan
        if plan is None:  # a policy not built by `Hierarchy.policy`: worked out, not kept
            return _PathState(self, PathPlan(path.levels), path, model, now_s)
        state = self._states.get(plan)
        if state is None or not (
            state.day == path.day and state.month == path.month and state.model == model
        ):
            state = self._states[plan] = _PathState(self, plan, path, model, now_s)
        return state

    def _unreserve(self, req: _Req) -> None:
        micros = req.reserved_micros
        for entry in req.cells:
            entry.reserved -= micros
        run = self._runs.get(req.run) if req.run else None
        if run is not None:
            run.reserved_micros -= req.reserved_micros

    def _post(self, req: _Req, amount_micros: int) -> None:
        if req.posted or req.voided:
            return
        req.posted = True
        self._unreserve(req)
        for entry in req.cells:
            entry.posted += amount_micros
        run = self._runs.get(req.run) if req.run else None
        if run is not None:
            run.posted_micros += amount_micros

    def _refund(self, req: _Req, tokens: int, at_s: float) -> None:
        if req.refunded or req.voided:
            return
        req.refunded = True
        for level in req.levels:
            tpm = self._tpm.get((level, req.model))
            if tpm is not None:
                tpm.refill(at_s, tpm.capacity)
                tpm.give_back(tokens)

    def _count_tools(self, req: _Req, tool_calls: int) -> None:
        if req.tools or req.run is None or tool_calls <= 0:
            return
        req.tools = True
        self._runs[req.run].tool_calls += tool_calls

    def _release(self, req: _Req, at_s: float) -> None:
        if req.finished_s is None:
            req.finished_s = at_s
        if not req.in_flight:
            return
        req.in_flight = False
        for level in req.kv_levels:
            key = (level, req.model)
            left = self._kv[key] - req.kv
            if left:
                self._kv[key] = left
            else:
                del self._kv[key]
        run = self._runs.get(req.run) if req.run else None
        if run is not None:
            run.in_flight -= 1

    def _found_bucket(
        self, buckets: dict[tuple[_LevelKey, str], Bucket], key: tuple[_LevelKey, str],
        capacity: int, now_s: float,
    ) -> Bucket:  # fmt: skip
        """A level's bucket, made (full) if it is new; not refilled."""
        bucket = buckets.get(key)
        if bucket is None:
            bucket = buckets[key] = Bucket(capacity, now_s)
            self._buckets_made += 1
        return bucket


def reserve(
    view: PathView, path: PathPolicy, request_id: str, model: str, reserved_tokens: int,
    kv_byte_seconds: int, micros: int, now: datetime, jitter: float, *,
    now_s: float | None = None, requests_left: int | None = None, tokens_left: int | None = None,
) -> PathAdmitted | PathRefused:  # fmt: skip
    """Admit a request (already admitted by the organization's limits, with `reserved_tokens`
    and `kv_byte_seconds` charged there and `micros` its maximum cost) at every level of its
    path and in its run, charging all of them at once, or refuse it naming the first level
    (from the organization down) or run dimension without room, charging nothing. Levels are
    checked top-down: when an ancestor is exhausted, raising a descendant's limit would not
    help, so the ancestor is the one to name.

    Positional arguments and named tuples, not a command dataclass: this runs on every
    governed request, and a frozen dataclass costs more to build than a level's checks.
    `now_s` is `now` as epoch seconds, when the caller has it already. `requests_left` and
    `tokens_left`, the organization's remaining after its charge: a level's figures are then
    answered only where that level has less (else None), as the caller would discard them."""
    tenant = path.tenant_id
    if now_s is None:
        now_s = now.timestamp()
    backoff = view.backoff
    state = view._state(path, model, now_s)
    least = (requests_left, tokens_left)
    figures = _fits(view, state, reserved_tokens, kv_byte_seconds, micros, now_s, least)
    if figures is None:
        # Some check has no room: walk them in order, to name the first.
        walked = _walk(view, path, state, model, reserved_tokens, kv_byte_seconds, micros, now,
                       now_s, jitter, least)  # fmt: skip
        if isinstance(walked, PathRefused):
            return walked
        figures = walked
    requests, tokens = figures
    run = path.run
    starts_run = False
    if run is not None:
        refusal = _run_refusal(view, run, now, micros)
        if refusal is not None:
            dimension, detail = refusal
            # Room comes back only while calls are in flight (in_flight, cost); the rest never.
            retry_after = (
                backoff.retry_after_s(jitter) if dimension in ("in_flight", "cost") else 0
            )
            return PathRefused(
                "run_budget", f"run {run.run_id!r}", dimension, retry_after, detail, requests,
                tokens,
            )  # fmt: skip
        starts_run = (tenant, run.run_id) not in view._runs
    event = BudgetReserved(
        request_id, tenant, path.key_id, path.workspace_id, path.project_id,
        run.run_id if run else None, model, path.day, path.month, micros, reserved_tokens,
        kv_byte_seconds,
    )  # fmt: skip
    view._take_on_path(event, now_s, state)
    if run is not None:
        view.note_run(run)
    return PathAdmitted(event, requests, tokens, starts_run)


def _fits(
    view: PathView, state: _PathState, reserved_tokens: int, kv_byte_seconds: int, micros: int,
    now_s: float, least: tuple[int | None, int | None],
) -> tuple[Rate | None, Rate | None] | None:  # fmt: skip
    """The tightest level's figures (requests, tokens) when every check of the path has room,
    else None (`_walk` then names the check that has not). When all pass, the order they are
    checked in does not matter, so each kind is one flat loop over what the state found: the
    decision that admits, the common one, walks no level that has nothing of that kind."""
    amount_min = state.amount_min
    if amount_min is not None and micros > amount_min:
        return None
    for amount, spent in state.spends:
        if spent.reserved + spent.posted + micros > amount:
            return None
    kv_of = view._kv
    for key, cap in state.kv_caps:
        in_flight = kv_of.get(key, 0)
        if in_flight and in_flight + kv_byte_seconds > cap:
            return None
    requests: Rate | None = None
    tokens: Rate | None = None
    requests_least, tokens_least = least
    # A refill at an instant is idempotent: `_walk` refilling these again changes nothing.
    for rpm_limit, tpm_limit, rpm, tpm in state.rated:
        if rpm is not None and rpm_limit is not None:
            rpm.refill(now_s, rpm_limit)
            if rpm.level < 1.0:
                return None
            left = max(0, int(rpm.level) - 1)
            if requests_least is None or left < requests_least:
                requests = (rpm.capacity, left, rpm.reset_ms())
                requests_least = left
        if tpm is not None and tpm_limit is not None:
            tpm.refill(now_s, tpm_limit)
            if reserved_tokens > tpm.capacity or tpm.level < reserved_tokens:
                return None
            left = max(0, int(tpm.level) - reserved_tokens)
            if tokens_least is None or left < tokens_least:
                tokens = (tpm.capacity, left, tpm.reset_ms())
                tokens_least = left
    return requests, tokens


def _walk(
    view: PathView, path: PathPolicy, state: _PathState, model: str, reserved_tokens: int,
    kv_byte_seconds: int, micros: int, now: datetime, now_s: float, jitter: float,
    least: tuple[int | None, int | None],
) -> PathRefused | tuple[Rate | None, Rate | None]:  # fmt: skip
    """The path's checks in order, from the organization down (at a level: requests/min,
    tokens/min, KV·s, its budgets): the first without room, as a refusal, else the figures
    (`_fits`')."""
    backoff = view.backoff
    requests: Rate | None = None
    tokens: Rate | None = None
    requests_least, tokens_least = least
    kv_of = view._kv
    for rule, rpm_limit, tpm_limit, kv_limit, rpm, tpm, key, budgets in state.checks:
        if rpm is not None and rpm_limit is not None:  # (a bucket only where a limit is)
            rpm.refill(now_s, rpm_limit)
            if rpm.level < 1.0:
                return _refused(
                    "requests", rule, "rpm", backoff.retry_after_s(jitter, rpm.refill_s(1)),
                    f"{rpm_limit} requests/min for {model} at {rule.level.label}", requests,
                    tokens,
                )  # fmt: skip
            requests, requests_least = _least(
                requests, requests_least, rpm, max(0, int(rpm.level) - 1)
            )
        if tpm is not None and tpm_limit is not None:
            tpm.refill(now_s, tpm_limit)
            if reserved_tokens > tpm.capacity:
                return _refused(
                    "invalid", rule, "tpm", 0,
                    f"request needs {reserved_tokens} tokens, above the {tpm.capacity} "
                    f"tokens/min limit of {rule.level.label}", requests, tokens,
                    "max_tokens",
                )  # fmt: skip
            if tpm.level < reserved_tokens:
                return _refused(
                    "tokens", rule, "tpm",
                    backoff.retry_after_s(jitter, tpm.refill_s(reserved_tokens)),
                    f"{reserved_tokens} tokens reserved exceed the "
                    f"{max(0, int(tpm.level))} left of {tpm_limit} tokens/min for {model} at "
                    f"{rule.level.label}", requests, tokens,
                )  # fmt: skip
            tokens, tokens_least = _least(
                tokens, tokens_least, tpm, max(0, int(tpm.level) - reserved_tokens)
            )
        if kv_limit is not None:
            in_flight = kv_of.get(key, 0)
            if in_flight and in_flight + kv_byte_seconds > kv_limit * GIB:
                return _refused(
                    "concurrency", rule, "kv", backoff.retry_after_s(jitter),
                    f"{in_flight / GIB:.1f} GiB·s in flight + "
                    f"{kv_byte_seconds / GIB:.1f} GiB·s exceed the "
                    f"{kv_limit} GiB·s concurrent KV limit of {rule.level.label}",
                    requests, tokens,
                )  # fmt: skip
        for amount, spent, period_key, budget in budgets:
            if micros > amount:
                return _refused(
                    "invalid", rule, budget.period, 0,
                    f"this request may cost up to {_usd(micros)} USD, more than the whole "
                    f"{_PERIODLY[budget.period]} budget of {rule.level.label} "
                    f"({_usd(amount)} USD); lower max_tokens", requests, tokens, "max_tokens",
                )  # fmt: skip
            if spent.reserved + spent.posted + micros > amount:
                reserved, posted = spent.reserved, spent.posted
                if posted + micros <= amount:
                    # In-flight requests hold the room; their bills will give some of it back.
                    retry_after = backoff.retry_after_s(jitter)
                else:
                    retry_after = backoff.retry_after_s(
                        jitter, _until_next(now, budget.period, path.zone_name)
                    )
                return _refused(
                    "budget", rule, budget.period, retry_after,
                    f"{rule.level.label} has spent {_usd(posted)} USD and reserved "
                    f"{_usd(reserved)} USD of its {_usd(amount)} USD "
                    f"{_PERIODLY[budget.period]} budget ({period_key}); this request may cost "
                    f"up to {_usd(micros)} USD", requests, tokens,
                )  # fmt: skip
    return requests, tokens


def _least(
    figure: Rate | None, least: int | None, bucket: Bucket, left: int
) -> tuple[Rate | None, int | None]:
    """A level's figures and what it leaves, when it leaves less than `least` (None: nothing
    yet), else those it is compared with (`_fits` does the same inline)."""
    if least is None or left < least:
        return (bucket.capacity, left, bucket.reset_ms()), left
    return figure, least


def _run_refusal(view: PathView, run: Run, now: datetime, micros: int) -> tuple[str, str] | None:
    """The run dimension a call would pass, with what to say of it, or None."""
    usage = view._runs.get((run.tenant_id, run.run_id)) or RunUsage()
    limits = run.limits
    name = repr(run.run_id)
    if run.ended_at is not None:
        return ("ended", f"run {name} has ended")
    if limits.max_wall_ms is not None and now - run.started_at > timedelta(
        milliseconds=limits.max_wall_ms
    ):
        return ("wall_clock", f"run {name} started more than {limits.max_wall_ms} ms ago")
    if limits.max_calls is not None and usage.calls + 1 > limits.max_calls:
        return ("calls", f"run {name} made its {limits.max_calls} model calls")
    if limits.max_in_flight is not None and usage.in_flight + 1 > limits.max_in_flight:
        return (
            "in_flight",
            f"run {name} has {usage.in_flight} of {limits.max_in_flight} calls in flight",
        )
    if limits.max_tool_calls is not None and usage.tool_calls >= limits.max_tool_calls:
        return ("tool_calls", f"run {name} received its {limits.max_tool_calls} tool calls")
    if limits.max_cost_micros is not None and usage.cost_micros + micros > limits.max_cost_micros:
        return (
            "cost",
            f"run {name} has spent or reserved {_usd(usage.cost_micros)} USD of its "
            f"{_usd(limits.max_cost_micros)} USD; this call may cost up to {_usd(micros)} USD",
        )
    return None


def _refused(
    reason: PathReason, rule: LevelRule, dimension: str, retry_after_s: int, detail: str,
    requests: Rate | None, tokens: Rate | None, param: str | None = None,
) -> PathRefused:  # fmt: skip
    return PathRefused(
        reason, rule.level.label, dimension, retry_after_s, detail, requests, tokens, param
    )


def _until_next(now: datetime, period: str, zone_name: str) -> int:
    """Whole seconds until the next period begins in the organization's zone."""
    local = now.astimezone(time_zone(zone_name))
    if period == "day":
        start = (local + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    else:
        year, month = (local.year + 1, 1) if local.month == 12 else (local.year, local.month + 1)
        start = local.replace(year=year, month=month, day=1, hour=0, minute=0, second=0,
                              microsecond=0)  # fmt: skip
    return max(1, -int(-(start.timestamp() - now.timestamp()) // 1))


def _usd(micros: int) -> str:
    return f"{micros / _MICROS_PER_UNIT:.6f}".rstrip("0").rstrip(".") if micros else "0"
