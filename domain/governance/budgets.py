"""What every level of a request's path holds (org → workspace → project → key,
`domain.governance`): its own requests/min, tokens/min and concurrent KV·s, its spend per
calendar period, and the agent run the request belongs to. The decision over it is
`domain.governance.path_admission.reserve`.

The view (`PathView`) runs the one reservation mechanism (`domain.reservations`, as the
organization's `domain.quota.QuotaView` does) with a hold per request at every level of its
path, and keeps beside it what only the hierarchy has: money and runs. It is a fold of request
events — `BudgetReserved` (what the admission reserved at each level), the terminal events,
`QuotaRefunded`, `UsageBilled` (the posted amount), `ToolCallsReturned`, a capacity
`RequestRejected` (void) — kept current by the edge's own decisions before they come back
through the log; applying an event twice is applying it once. Money moves as TigerBeetle's
two-phase transfers do: reserved at admission (the request's maximum cost), then posted (the
bill's amount, never more than was reserved) or voided, so the sum posted + reserved at a level
never passes its budget: there is no overshoot to apologise for, whatever the concurrency.

A request's spend belongs to the period it was admitted in (named in its `BudgetReserved`), so
its reservation and its bill are in the same period and a new period starts from zero at its
first instant.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime

from tollgate_llm.domain.backoff import BackoffPolicy
from tollgate_llm.domain.cost import GIB
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.governance.end_users import END_USER, EndUserRoster, end_user_level_id
from tollgate_llm.domain.governance.run_book import RunBook, RunUsage
from tollgate_llm.domain.governance.state import PathPlan, PathPolicy
from tollgate_llm.domain.requests.events import (
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
from tollgate_llm.domain.reservations import TOMBSTONE_TTL_S, Bucket, Hold, Reservations

__all__ = ["PathState", "PathView", "RatesFor", "RunUsage", "SpendEntry"]

# (tenant, level kind, level id, model) -> that level's (requests/min, tokens/min); None: unlimited.
RatesFor = Callable[[str, str, str, str], tuple[int | None, int | None]]

_LevelKey = tuple[str, str, str]  # (tenant, level kind, level id)
_RateKey = tuple[_LevelKey, str]  # (level, model): a level's buckets and KV·s are per model


class SpendEntry:
    """Micro-units reserved and posted at one level in one period."""

    __slots__ = ("reserved", "posted")

    def __init__(self) -> None:
        self.reserved = 0
        self.posted = 0


_Cells = tuple[SpendEntry, ...]


class _Req(Hold[_RateKey]):
    """A request's hold at every level of its path, and its money and run beside it."""

    __slots__ = ("periods", "cells", "run", "run_money", "reserved_micros", "posted", "tools")

    def __init__(
        self, event: BudgetReserved, rate_keys: tuple[_RateKey, ...],
        kv_keys: tuple[_RateKey, ...], periods: tuple[str, str], at_s: float,
    ) -> None:  # fmt: skip
        Hold.__init__(
            self, event.request_id, rate_keys, kv_keys, at_s, event.reserved_tokens,
            event.kv_byte_seconds, True,
        )  # fmt: skip
        self.periods = periods
        self.cells: tuple[SpendEntry, ...] = ()
        self.run = (event.tenant_id, event.run_id) if event.run_id else None
        self.run_money = False  # its money counted in its run (priced in the run's currency)
        self.reserved_micros = event.reserved_micros
        self.posted = False
        self.tools = False


def _levels_of(event: BudgetReserved) -> tuple[_LevelKey, ...]:
    """The levels of a reservation's path, org first, as its event names them."""
    tenant = event.tenant_id
    found: list[_LevelKey] = [(tenant, "org", tenant)]
    if event.workspace_id:
        found.append((tenant, "workspace", event.workspace_id))
    if event.project_id:
        found.append((tenant, "project", event.project_id))
    found.append((tenant, "key", event.key_id))
    if event.end_user and event.project_id:
        found.append((tenant, END_USER, end_user_level_id(event.project_id, event.end_user)))
    return tuple(found)


class PathState:
    """What a path's checks read in one view, for one model, currency and day: each check of
    its plan with its own buckets, the KV·s key and the spend entries of its budgets in that
    currency (the period's; a budget in another currency does not count this request), and
    the keys and spend entries a charge updates. Looked up once per decision
    instead of one dict lookup (and key tuple) per level, dimension and budget."""

    __slots__ = ("plan", "model", "currency", "day", "month", "periods", "checks", "rate_keys",
                 "kv_keys", "cells", "rpms", "tpms", "buckets_seen", "rated", "kv_caps", "spends",
                 "amount_min")  # fmt: skip

    def __init__(
        self, view: PathView, plan: PathPlan, path: PathPolicy, model: str, currency: str,
        now_s: float,
    ) -> None:  # fmt: skip
        self.plan = plan
        self.model = model
        self.currency = currency
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
                    (budget.amount_micros,
                     view._spend_entry(rule.key, day if daily else month, currency),
                     day if daily else month, budget)
                    for budget, daily in budgets
                    if budget.currency == currency
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
            (key, kv_limit * GIB)
            for _, _, _, kv_limit, _, _, key, _ in self.checks
            if kv_limit is not None
        )
        self.spends = tuple(
            (amount, spent) for *_, budgets in self.checks for amount, spent, _, _ in budgets
        )
        self.amount_min = min((amount for amount, _ in self.spends), default=None)
        self.rate_keys = tuple((level, model) for level in path.level_keys)
        self.kv_keys = tuple((level, model) for level in path.kv_keys)
        self.cells = view._path_cells(path.level_keys, self.periods, currency)
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


class PathView(Reservations[_RateKey, _Req]):
    def __init__(
        self, *, backoff: BackoffPolicy | None = None, tombstone_ttl_s: int = TOMBSTONE_TTL_S,
        rates_for: RatesFor | None = None,
    ) -> None:  # fmt: skip
        super().__init__(tombstone_ttl_s)
        self.backoff = backoff or BackoffPolicy()
        # (tenant, level kind, level id, model) -> that level's (requests/min, tokens/min), e.g.
        # Hierarchy.level_rates: sizes the buckets of levels this view has not decided on yet
        # when it folds another edge's admission there. Without it, only buckets this view
        # already has are charged from the log.
        self._rates_for = rates_for
        # KV byte-seconds in flight per (level, model), for the decision to read: the same dict,
        # an attribute rather than a property (read on every decision).
        self.kv: Mapping[_RateKey, int] = self._kv
        self._spend: dict[tuple[_LevelKey, str, str], SpendEntry] = {}  # level, period, currency
        # (path's level keys, periods, currency) -> their spend entries (`_path_cells`)
        self._cells: dict[tuple[tuple[_LevelKey, ...], tuple[str, str], str], _Cells] = {}
        # plan -> its state for the model and day last decided (`state`): rebuilt on demand.
        self._states: dict[PathPlan, PathState] = {}
        # The runs' calls, cost and tool calls (domain/governance/run_book.py).
        self.runs = RunBook()
        # Who has an end-user level of their own, per project and day (bounded: end_users.py).
        self.end_users = EndUserRoster()
        self._handlers = {
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

    def state(self, path: PathPolicy, model: str, currency: str, now_s: float) -> PathState:
        """The state of a path's checks for this model, currency and day (kept while it
        holds)."""
        plan = path.plan
        if plan is None:  # a policy not built by `Hierarchy.policy`: worked out, not kept
            return PathState(self, PathPlan(path.levels), path, model, currency, now_s)
        state = self._states.get(plan)
        if state is None or not (
            state.day == path.day and state.month == path.month and state.model == model
            and state.currency == currency
        ):  # fmt: skip
            state = self._states[plan] = PathState(self, plan, path, model, currency, now_s)
        return state

    def spend(
        self, tenant_id: str, kind: str, level_id: str, period_key: str, currency: str = "USD"
    ) -> tuple[int, int]:
        """(reserved, posted) micro-units of `currency` at one level in one period."""
        found = self._spend.get(((tenant_id, kind, level_id), period_key, currency))
        return (0, 0) if found is None else (found.reserved, found.posted)

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
        self._take_levels(event, at_s, rate=True, levels=levels, kv_levels=kv_levels)

    def take_on_path(self, event: BudgetReserved, at_s: float, state: PathState) -> None:
        """`charge` of an admission decided over a path, with the keys and spend entries its
        state holds (the same updates as `charge`, without building them again)."""
        if event.request_id in self._requests:
            return
        # The state's keys and periods tuples, shared: fewer objects kept per admission
        # (objects kept are what sets off the garbage collector, mid-decision).
        req = _Req(event, state.rate_keys, state.kv_keys, state.periods, at_s)
        self._take(req)
        if event.end_user and event.project_id:
            self.end_users.note(event.tenant_id, event.project_id, event.day, event.end_user)
        if self._rpm or self._tpm:  # (no rate charge while the view has no bucket)
            if state.buckets_seen != self._buckets_made:
                state.find_buckets(self)
            for rpm in state.rpms:
                rpm.level -= 1.0
            tokens = event.reserved_tokens
            for tpm in state.tpms:
                tpm.level -= tokens
        self._hold_money(req, state.cells, state.currency)

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
        self._refund_tokens(req, max(0, req.reserved_tokens - used_tokens), at_s)
        self._post(req, amount_micros)
        self._count_tools(req, tool_calls)
        self._release(req, at_s)

    def prune(self, now: datetime) -> int:
        """Forget settled requests older than the tombstone TTL (their money stays counted)."""
        pruned = super().prune(now)
        if self.end_users.rolled:
            self._forget_end_users()
        # Caches of the spend entries paths use (so yesterday's go): rebuilt on demand.
        self._cells.clear()
        self._states.clear()
        return pruned

    def _forget_end_users(self) -> None:
        """Drop the buckets and spend entries of end users not tracked on their project's
        current day: what keeps the view bounded by `MAX_END_USERS_PER_PROJECT` a day rather
        than by every end user ever seen. A request of theirs still in flight keeps its own
        references (its bill posts to an entry no longer read)."""
        self.end_users.rolled = False
        roster = self.end_users
        for buckets in (self._rpm, self._tpm):  # (KV·s in flight goes when its requests end)
            stale = [
                key for key in buckets
                if key[0][1] == END_USER and not roster.tracks(key[0][0], key[0][2])
            ]  # fmt: skip
            for key in stale:
                del buckets[key]
        spent = [
            entry for entry in self._spend
            if entry[0][1] == END_USER and not roster.tracks(entry[0][0], entry[0][2])
        ]  # fmt: skip
        for entry in spent:
            del self._spend[entry]

    # --- folding ------------------------------------------------------------------------------

    def _on_reserved(self, recorded: Recorded) -> None:
        event = recorded.event
        assert isinstance(event, BudgetReserved)
        if event.request_id not in self._requests:
            at_s = recorded.occurred_at.timestamp()
            self._take_levels(event, at_s, rate=False)
            self._charge_from_log(self._requests[event.request_id], at_s)

    def _charge_from_log(self, req: _Req, at_s: float) -> None:
        """Another edge's admission at its levels' requests/min and tokens/min buckets, so the
        edges share a level's rates as they share the organization's (domain.quota; its own
        bucket is not here). A bucket is made, full at the admission's instant, where the level
        has a limit and this view has none yet; a charge a minute old would have refilled."""
        rates_for = self._rates_for
        rpms, tpms = self._rpm, self._tpm
        for key in req.rate_keys:
            level, model = key
            if level[1] == "org":
                continue
            rpm, tpm = rpms.get(key), tpms.get(key)
            if (rpm is None or tpm is None) and rates_for is not None:
                rpm_limit, tpm_limit = rates_for(level[0], level[1], level[2], model)
                if rpm is None and rpm_limit is not None:
                    rpm = self._found_bucket(rpms, key, rpm_limit, at_s)
                if tpm is None and tpm_limit is not None:
                    tpm = self._found_bucket(tpms, key, tpm_limit, at_s)
            if rpm is not None:
                rpm.take_logged(1.0, at_s)
            if tpm is not None:
                tpm.take_logged(req.reserved_tokens, at_s)

    def _on_terminal(self, recorded: Recorded) -> None:
        req = self._requests.get(recorded.stream_id)
        if req is not None:
            self._release(req, recorded.occurred_at.timestamp())

    def _on_refunded(self, recorded: Recorded) -> None:
        event = recorded.event
        assert isinstance(event, QuotaRefunded)
        req = self._requests.get(event.request_id)
        if req is not None:
            self._refund_tokens(req, event.refunded_tokens, recorded.occurred_at.timestamp())

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

    # --- helpers ------------------------------------------------------------------------------

    def _take_levels(
        self, event: BudgetReserved, at_s: float, *, rate: bool,
        levels: tuple[_LevelKey, ...] | None = None,
        kv_levels: tuple[_LevelKey, ...] | None = None,
    ) -> None:  # fmt: skip
        if levels is None:
            levels = _levels_of(event)
        model = event.model
        rate_keys = tuple((level, model) for level in levels)
        kv_keys = rate_keys if kv_levels is None else tuple((lv, model) for lv in kv_levels)
        periods = (event.day, event.month)
        req = _Req(event, rate_keys, kv_keys, periods, at_s)
        self._take(req)
        if event.end_user and event.project_id:
            self.end_users.note(event.tenant_id, event.project_id, event.day, event.end_user)
        if rate:
            self._take_rates(req)
        cells = self._path_cells(levels, periods, event.currency)
        self._hold_money(req, cells, event.currency)

    def _hold_money(self, req: _Req, cells: _Cells, currency: str) -> None:
        """Reserve an admission's money in its spend entries (its currency's) and count it in
        its run (its money only in the run's currency, the first call's)."""
        req.cells = cells
        micros = req.reserved_micros
        for entry in cells:
            entry.reserved += micros
        if req.run is not None:
            req.run_money = self.runs.called(req.run, currency, micros)

    def _path_cells(
        self, levels: tuple[_LevelKey, ...], periods: tuple[str, str], currency: str
    ) -> _Cells:
        """The spend entries of a path, period pair and currency, found once: every request of
        the path that day updates the same few objects."""
        cells_key = (levels, periods, currency)
        cells = self._cells.get(cells_key)
        if cells is None:
            cells = self._cells[cells_key] = tuple(
                self._spend_entry(level, period, currency)
                for level in levels for period in periods
            )  # fmt: skip
        return cells

    def _spend_entry(self, level: _LevelKey, period: str, currency: str) -> SpendEntry:
        entry = self._spend.get((level, period, currency))
        if entry is None:
            entry = self._spend[(level, period, currency)] = SpendEntry()
        return entry

    def _unreserve(self, req: _Req) -> None:
        micros = req.reserved_micros
        for entry in req.cells:
            entry.reserved -= micros
        if req.run_money and req.run is not None:
            self.runs.unreserve(req.run, micros)

    def _post(self, req: _Req, amount_micros: int) -> None:
        if req.posted or req.voided:
            return
        req.posted = True
        self._unreserve(req)
        for entry in req.cells:
            entry.posted += amount_micros
        if req.run_money and req.run is not None:
            self.runs.post(req.run, amount_micros)

    def _count_tools(self, req: _Req, tool_calls: int) -> None:
        if req.tools or req.run is None or tool_calls <= 0:
            return
        req.tools = True
        self.runs.tools(req.run, tool_calls)

    # --- the reservation mechanism's hooks: money and runs ------------------------------------

    def _voided(self, hold: _Req) -> None:
        if not hold.posted:
            self._unreserve(hold)
        if hold.run is not None:
            self.runs.voided(hold.run)

    def _released(self, hold: _Req) -> None:
        if hold.run is not None:
            self.runs.released(hold.run)

    def _settled(self, hold: _Req, horizon: float) -> bool:
        # Kept until its money is posted (or voided), however old: the bill may come late.
        return hold.posted or hold.voided
