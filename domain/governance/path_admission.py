"""Admission over a request's path (`reserve`): every level below the organization's limits
(org → workspace → project → key) and the agent run, decided at once over what
`domain.governance.budgets.PathView` holds, charged at every level or refused naming the first
level (or run dimension) without room, charging nothing.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Final, Literal, NamedTuple

from tollgate_llm.domain.backoff import BackoffPolicy
from tollgate_llm.domain.control_plane.state import Limits
from tollgate_llm.domain.cost import GIB, TOKENS_PER_MTOK, Price
from tollgate_llm.domain.governance.budgets import PathState, PathView, SpendEntry
from tollgate_llm.domain.governance.state import Budget, LevelRule, PathPolicy, time_zone
from tollgate_llm.domain.requests.events import BudgetReserved
from tollgate_llm.domain.reservations import Bucket
from tollgate_llm.domain.runs.state import Run

__all__ = [
    "PathAdmitted", "PathReason", "PathRefused", "Rate", "max_cost_micros", "narrow", "reserve",
]  # fmt: skip

PathReason = Literal["requests", "tokens", "concurrency", "budget", "run_budget", "invalid"]
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


def reserve(
    view: PathView, path: PathPolicy, request_id: str, model: str, reserved_tokens: int,
    kv_byte_seconds: int, micros: int, now: datetime, jitter: float, *,
    now_s: float | None = None, requests_left: int | None = None, tokens_left: int | None = None,
    currency: str = "USD",
) -> PathAdmitted | PathRefused:  # fmt: skip
    """Admit a request (already admitted by the organization's limits, with `reserved_tokens`
    and `kv_byte_seconds` charged there and `micros` its maximum cost, in micro-units of
    `currency`, its price's: only the budgets in that currency count it) at every level of its
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
    state = view.state(path, model, currency, now_s)
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
        refusal = _run_refusal(view, run, now, micros, currency)
        if refusal is not None:
            dimension, detail = refusal
            # Room comes back only while calls are in flight (in_flight, cost); the rest never.
            retry_after = backoff.retry_after_s(jitter) if dimension in ("in_flight", "cost") else 0
            return PathRefused(
                "run_budget", f"run {run.run_id!r}", dimension, retry_after, detail, requests,
                tokens,
            )  # fmt: skip
        starts_run = not view.runs.has(tenant, run.run_id)
    event = BudgetReserved(
        request_id, tenant, path.key_id, path.workspace_id, path.project_id,
        run.run_id if run else None, model, path.day, path.month, micros, reserved_tokens,
        kv_byte_seconds, currency, path.end_user or "",
    )  # fmt: skip
    view.take_on_path(event, now_s, state)
    if run is not None:
        view.runs.note(run)
    return PathAdmitted(event, requests, tokens, starts_run)


def _fits(
    view: PathView, state: PathState, reserved_tokens: int, kv_byte_seconds: int, micros: int,
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
    kv_of = view.kv
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
    view: PathView, path: PathPolicy, state: PathState, model: str, reserved_tokens: int,
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
            in_flight = view.kv.get(key, 0)
            if in_flight and in_flight + kv_byte_seconds > kv_limit * GIB:
                return _refused(
                    "concurrency", rule, "kv", backoff.retry_after_s(jitter),
                    f"{in_flight / GIB:.1f} GiB·s in flight + "
                    f"{kv_byte_seconds / GIB:.1f} GiB·s exceed the "
                    f"{kv_limit} GiB·s concurrent KV limit of {rule.level.label}",
                    requests, tokens,
                )  # fmt: skip
        refused = _budget_refusal(
            rule, budgets, micros, now, path.zone_name, backoff, jitter, requests, tokens
        )
        if refused is not None:
            return refused
    return requests, tokens


def _budget_refusal(
    rule: LevelRule, budgets: tuple[tuple[int, SpendEntry, str, Budget], ...], micros: int,
    now: datetime, zone_name: str, backoff: BackoffPolicy, jitter: float,
    requests: Rate | None, tokens: Rate | None,
) -> PathRefused | None:  # fmt: skip
    """The first of a level's budgets (`PathState.checks`: amount, its spend entry, period key,
    budget) without room for `micros` more, as a refusal."""
    for amount, spent, period_key, budget in budgets:
        unit = budget.currency
        if micros > amount:
            return _refused(
                "invalid", rule, budget.period, 0,
                f"this request may cost up to {_amount(micros, unit)}, more than the whole "
                f"{_PERIODLY[budget.period]} budget of {rule.level.label} "
                f"({_amount(amount, unit)}); lower max_tokens", requests, tokens, "max_tokens",
            )  # fmt: skip
        if spent.reserved + spent.posted + micros > amount:
            reserved, posted = spent.reserved, spent.posted
            if posted + micros <= amount:
                # In-flight requests hold the room; their bills will give some of it back.
                retry_after = backoff.retry_after_s(jitter)
            else:
                retry_after = backoff.retry_after_s(
                    jitter, _until_next(now, budget.period, zone_name)
                )
            return _refused(
                "budget", rule, budget.period, retry_after,
                f"{rule.level.label} has spent {_amount(posted, unit)} and reserved "
                f"{_amount(reserved, unit)} of its {_amount(amount, unit)} "
                f"{_PERIODLY[budget.period]} budget ({period_key}); this request may cost "
                f"up to {_amount(micros, unit)}", requests, tokens,
            )  # fmt: skip
    return None


def _least(
    figure: Rate | None, least: int | None, bucket: Bucket, left: int
) -> tuple[Rate | None, int | None]:
    """A level's figures and what it leaves, when it leaves less than `least` (None: nothing
    yet), else those it is compared with (`_fits` does the same inline)."""
    if least is None or left < least:
        return (bucket.capacity, left, bucket.reset_ms()), left
    return figure, least


def _run_refusal(
    view: PathView, run: Run, now: datetime, micros: int, currency: str
) -> tuple[str, str] | None:
    """The run dimension a call would pass, with what to say of it, or None. A run is billed in
    one currency — its cost limit's, else its first call's — so that its cost is one sum: a
    call priced in another (the deployment's currency changed mid-run) is refused, for good."""
    usage = view.runs.usage(run.tenant_id, run.run_id)
    limits = run.limits
    name = repr(run.run_id)
    if run.ended_at is not None:
        return ("ended", f"run {name} has ended")
    billed_in = limits.currency if limits.max_cost_micros is not None else usage.currency
    if billed_in is not None and currency != billed_in:
        return ("currency", f"run {name} is billed in {billed_in}; this call is priced in "
                            f"{currency}: start a new run")  # fmt: skip
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
            f"run {name} has spent or reserved {_amount(usage.cost_micros, currency)} of its "
            f"{_amount(limits.max_cost_micros, currency)}; this call may cost up to "
            f"{_amount(micros, currency)}",
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


def _amount(micros: int, currency: str) -> str:
    """Micro-units as a refusal says them: "0.0003 EUR"."""
    shown = f"{micros / _MICROS_PER_UNIT:.6f}".rstrip("0").rstrip(".") if micros else "0"
    return f"{shown} {currency}"
