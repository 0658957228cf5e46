"""The edge's quota decision (DESIGN §5, seed 000 §6 and R4/R6): requests/min, tokens/min and
concurrent KV·seconds per tenant and model, read from the `QuotaView` (folded from events plus the
edge's own admissions that have not come back through the log yet) and charged to it on admission.

Quota is the tenant's contract (429); capacity is the fleet's (503, decided by the router in
`domain.capacity`). The retry budget is the one 503 decided here: it protects the fleet from a
retry storm, which no single tenant caused.

Exact rules, written down:
- Only an admission is charged (1 request, the reserved tokens, the estimated KV·s); a refusal is
  free. A request refused later by capacity is `void`ed: its charges are undone.
- tokens/min is charged `prompt + min(max_tokens, max_output)` and refunded by QuotaRefunded.
  With an output-length prediction (`predicted_output_tokens`, from the `OutputPredictor` port)
  the output part is `min(max_tokens, max_output, max(predicted, min_tokens, 1))` instead, for
  tokens/min and KV·s alike; the request may still produce up to its cap
  (`Estimate.output_cap_tokens`), and what it uses beyond the reservation is charged when it
  ends (`QuotaView.refund`: the bucket may go below zero and refills from there). The estimate
  never reaches a bill either way. Whether to predict at all (a tenant's realised coverage, too
  little history) is `domain.prediction`'s, not this module's.
  `max_tokens` above `max_output` is clamped to `max_output` (not refused): the client asked for
  "up to" that many, and the clamp is visible as `Admitted.clamped_output`. A prompt above
  `max_context`, or a request that needs more tokens than the per-minute limit can ever hold, is
  invalid (400): retrying it can never succeed, so a 429 would be a lie.
- KV·s: admitted while in_flight + estimate ≤ cap, or while the tenant has nothing in flight for
  the model (a lone request is never refused for concurrency: max_context and max_output are what
  bound a single request). Enterprise (the reserved class, R2) uses max(cap, reserved floor).
- Stale view (the caller says so, e.g. the log is lagging): tokens/min fails OPEN (checked never,
  still charged), KV·s fails CLOSED to min(cap, policy.stale_kv_gib_seconds), except that the
  reserved class still gets its floor: that capacity is held back for it in reserve-only replicas.
- Retry-After and the retry budget: `domain.backoff.BackoffPolicy`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import NamedTuple

from tollgate_llm.domain.backoff import BackoffPolicy
from tollgate_llm.domain.control_plane.state import Limits
from tollgate_llm.domain.cost import GIB, Estimate, Price, est_kv_byte_seconds
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.governance.budgets import PathView
from tollgate_llm.domain.governance.path_admission import (
    PathRefused,
    Rate,
    max_cost_micros,
    narrow,
    reserve,
)
from tollgate_llm.domain.governance.state import PathPolicy
from tollgate_llm.domain.quota import QuotaView
from tollgate_llm.domain.requests.events import BudgetReserved
from tollgate_llm.domain.reservations import Bucket
from tollgate_llm.domain.types import RESERVED_TIER, RejectReason

__all__ = [
    "AdmissionPolicy", "Admitted", "RateLimitInfo", "Rejected", "ReserveQuota", "decide",
    "decide_on_path", "output_cap",
]  # fmt: skip


# What a named tuple's constructor does, without the Python frame it adds (RateLimitInfo is
# built on every decision).
_new_tuple = tuple.__new__


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    stale_kv_gib_seconds: int = 256  # the conservative KV·s cap when the view is stale
    backoff: BackoffPolicy = field(default_factory=BackoffPolicy)


DEFAULT_POLICY = AdmissionPolicy()


@dataclass(frozen=True, slots=True)
class ReserveQuota:
    """One admission question from an edge. `now` and the jitter draw arrive with it."""

    request_id: str
    tenant_id: str
    key_id: str
    model: str
    tier: str
    edge_id: str
    prompt_tokens: int
    max_tokens: int | None  # None: the tenant's max_output
    kv_bytes_per_token: int
    tpot_us: int  # from cost.tpot_estimate_us
    now: datetime
    jitter: float  # a uniform draw in [0, 1), made by the caller
    is_retry: bool = False
    # An output-length prediction: the output reserved (tokens/min and KV·s), floored at
    # min_tokens and capped at min(max_tokens, max_output). None: reserve the cap.
    predicted_output_tokens: int | None = None
    min_tokens: int | None = None  # the client's floor on the output (vLLM's `min_tokens`)
    predictor_version: str = ""  # the model behind `predicted_output_tokens`, for the record
    # The model's context (max_model_len; None: unknown): a prompt that fills it is invalid,
    # refused here rather than admitted and failed by the engine.
    context_tokens: int | None = None


class RateLimitInfo(NamedTuple):
    """The X-RateLimit-* figures of one decision: remaining after it; reset = ms until full.
    A named tuple: one is built per decision (a frozen dataclass costs several times more)."""

    limit_requests: int
    remaining_requests: int
    reset_requests_ms: int
    limit_tokens: int
    remaining_tokens: int
    reset_tokens_ms: int


class Admitted(NamedTuple):
    """A named tuple, as RateLimitInfo: one is built per admission, and a frozen dataclass
    costs several times more to build (0.64 against 0.13 µs here)."""

    estimate: Estimate
    rate_limits: RateLimitInfo
    clamped_output: bool = False
    # Decided over a path (`decide_on_path`): what was reserved at every level, and whether the
    # request's run starts with it.
    reserved: BudgetReserved | None = None
    starts_run: bool = False


@dataclass(frozen=True, slots=True)
class Rejected:
    reason: RejectReason  # requests | tokens | concurrency | invalid | retry_budget
    retry_after_s: int  # 0 for invalid: retrying cannot help
    detail: str
    rate_limits: RateLimitInfo
    param: str | None = None  # for invalid: the request field at fault
    level: str | None = None  # decided over a path: the level (or run) that refused
    dimension: str | None = None  # ... and what ran out there (rpm, month, calls, cost, ...)


def decide(
    view: QuotaView,
    cmd: ReserveQuota,
    limits: Limits,
    *,
    stale: bool = False,
    policy: AdmissionPolicy = DEFAULT_POLICY,
) -> Admitted | Rejected:
    """Admit `cmd` under `limits` and charge `view` at once, or refuse it (charging nothing).
    `stale` says the folded view is behind: tokens/min then fails open and KV·s fails closed."""
    granted = _admit(view, cmd, limits, stale, policy, cmd.now.timestamp())
    if isinstance(granted, Rejected):
        return granted
    estimate, rpm, tpm, clamped = granted
    return Admitted(estimate, _info(rpm, tpm), clamped)


# What `_admit` answers for an admission (charged already): the estimate, the requests/min
# and tokens/min buckets after the charge, and whether max_tokens was clamped. A plain tuple:
# the caller builds the one Admitted (a frozen dataclass costs more to build than a tuple).
_Granted = tuple[Estimate, Bucket, Bucket, bool]


def _admit(
    view: QuotaView, cmd: ReserveQuota, limits: Limits, stale: bool, policy: AdmissionPolicy,
    now_s: float,
) -> _Granted | Rejected:  # fmt: skip
    """`decide`'s rules, answering what its Admitted would be built from (`now_s`: `cmd.now` as
    epoch seconds)."""
    if not 0.0 <= cmd.jitter < 1.0:
        raise DomainError("bad_jitter", "jitter is a uniform draw in [0, 1)", field="jitter")
    rid = cmd.request_id
    if view.knows(rid):
        raise DomainError("duplicate_request", f"request {rid} was already admitted")
    key = (cmd.tenant_id, cmd.model)
    windows = view.windows(key, limits, now_s)
    rpm, tpm = windows

    prompt = cmd.prompt_tokens
    max_tokens = cmd.max_tokens
    out = output_cap(max_tokens, limits)
    invalid = _invalid(cmd, limits, out)
    if invalid is not None:
        return Rejected("invalid", 0, invalid[0], _info(rpm, tpm), invalid[1])
    reserved_out = out
    predicted = cmd.predicted_output_tokens
    if predicted is not None:
        floor = max(predicted, cmd.min_tokens or 0, 1)
        if floor < out:
            reserved_out = floor
    reserved = prompt + reserved_out

    view.see(rid, cmd.is_retry, now_s)
    refused = _rate_refusal(view, cmd, limits, policy, stale, windows, reserved, reserved_out < out)
    if refused is not None:
        return refused
    kv = est_kv_byte_seconds(prompt, reserved_out, cmd.kv_bytes_per_token, cmd.tpot_us)
    refused = _kv_refusal(view, cmd, limits, policy, stale, windows, kv)
    if refused is not None:
        return refused

    view.charge(rid, key, now_s, windows, reserved, kv)
    return (
        Estimate(
            prompt, reserved_out, kv, cmd.tpot_us, out,
            cmd.predictor_version if predicted is not None else "",
        ),
        rpm,
        tpm,
        max_tokens is not None and max_tokens > limits.max_output,
    )  # fmt: skip


def _invalid(cmd: ReserveQuota, limits: Limits, out: int) -> tuple[str, str] | None:
    """(message, param) of a request that can never be admitted as asked, else None."""
    prompt = cmd.prompt_tokens
    max_tokens = cmd.max_tokens
    if prompt < 0:
        return "prompt_tokens is negative", "messages"
    if max_tokens is not None and max_tokens < 1:
        return "max_tokens must be at least 1", "max_tokens"
    if prompt > limits.max_context:
        return f"prompt of {prompt} tokens exceeds max_context {limits.max_context}", "messages"
    if cmd.context_tokens is not None and prompt >= cmd.context_tokens:
        return (
            f"prompt of {prompt} tokens leaves no room in the model's context of "
            f"{cmd.context_tokens} tokens"
        ), "messages"
    if cmd.min_tokens is not None and cmd.min_tokens > out:
        # The engine would refuse it after admission; it can never succeed as asked.
        return (
            f"min_tokens {cmd.min_tokens} exceeds the {out} output tokens this request may "
            f"produce (max_tokens, capped at the {limits.max_output} of the tenant's max_output)"
        ), "min_tokens"
    reserved = prompt + out
    if reserved > limits.tpm:
        return (
            f"request needs {reserved} tokens, above the {limits.tpm} tokens/min limit",
            "max_tokens",
        )
    return None


def _rate_refusal(
    view: QuotaView, cmd: ReserveQuota, limits: Limits, policy: AdmissionPolicy, stale: bool,
    windows: tuple[Bucket, Bucket], reserved: int, predicted: bool,
) -> Rejected | None:  # fmt: skip
    """The retry budget, then requests/min, then tokens/min (`reserved`: the tokens charged,
    on a `predicted` output or the whole cap)."""
    backoff = policy.backoff
    jitter = cmd.jitter
    rpm, tpm = windows
    if cmd.is_retry and cmd.tier != RESERVED_TIER:
        requests, retries = view.retry_window()
        if backoff.over_budget(requests, retries):
            return Rejected(
                "retry_budget",
                backoff.shed_after_s(jitter),
                f"retries are {retries} of {requests} requests in the last "
                f"{backoff.retry_window_s} s; shedding retries",
                _info(rpm, tpm),
            )
    if rpm.level < 1.0:
        return Rejected(
            "requests",
            backoff.retry_after_s(jitter, rpm.refill_s(1)),
            f"{limits.rpm} requests/min for {cmd.model}",
            _info(rpm, tpm),
        )
    if not stale and tpm.level < reserved:
        return Rejected(
            "tokens",
            backoff.retry_after_s(jitter, tpm.refill_s(reserved)),
            f"{reserved} tokens reserved (prompt + "
            f"{'predicted' if predicted else 'max'} output) exceed the "
            f"{max(0, int(tpm.level))} left of {limits.tpm} tokens/min for {cmd.model}",
            _info(rpm, tpm),
        )
    return None


def _kv_refusal(
    view: QuotaView, cmd: ReserveQuota, limits: Limits, policy: AdmissionPolicy, stale: bool,
    windows: tuple[Bucket, Bucket], kv: int,
) -> Rejected | None:  # fmt: skip
    """The concurrent KV·s limit: what the tenant has in flight plus this request's `kv`."""
    in_flight = view.kv_in_flight(cmd.tenant_id, cmd.model)
    if not in_flight:
        return None
    cap_gib_s = limits.kv_gib_seconds
    if stale and policy.stale_kv_gib_seconds < cap_gib_s:
        cap_gib_s = policy.stale_kv_gib_seconds
    if cmd.tier == RESERVED_TIER and limits.reserved_kv_gib_seconds > cap_gib_s:
        cap_gib_s = limits.reserved_kv_gib_seconds
    if in_flight + kv <= cap_gib_s * GIB:
        return None
    return Rejected(
        "concurrency",
        policy.backoff.retry_after_s(cmd.jitter),
        f"{_gib(in_flight)} GiB·s in flight + {_gib(kv)} GiB·s for this request "
        f"exceed the {cap_gib_s} GiB·s concurrent KV limit for {cmd.model}"
        + (" (stale view: conservative cap)" if stale else ""),
        _info(*windows),
    )


def output_cap(max_tokens: int | None, limits: Limits) -> int:
    """What a request may produce: its `max_tokens`, clamped to the tenant's `max_output`
    (which is also the default)."""
    max_output = limits.max_output
    return max_output if max_tokens is None or max_tokens > max_output else max_tokens


def decide_on_path(
    view: QuotaView,
    paths: PathView,
    cmd: ReserveQuota,
    limits: Limits,
    path: PathPolicy,
    price: Price,
    *,
    stale: bool = False,
    policy: AdmissionPolicy = DEFAULT_POLICY,
) -> Admitted | Rejected:
    """The one admission decision of a request whose key sits in a hierarchy (or whose call
    belongs to a run): the organization's limits (`decide`, with the path's tightest
    max_context / max_output), then every level below it and the run
    (`path_admission.reserve`). It is charged everywhere or nowhere: a refusal below the
    organization gives the organization's charge back. X-RateLimit-* figures are the tightest
    level's. Money is reserved on the output cap (the engine's max_tokens), never on a
    predicted output: a prediction narrows the tokens/min and KV·s charges, but a budget must
    hold whatever the engine produces."""
    narrowed = narrow(limits, path)
    now_s = cmd.now.timestamp()
    granted = _admit(view, cmd, narrowed, stale, policy, now_s)
    if isinstance(granted, Rejected):
        return replace(granted, level="organization") if granted.reason != "invalid" else granted
    est, rpm, tpm, clamped = granted
    # What the organization has left after this decision's charge, as `decide` answers it
    # (read before a refusal's void gives the charge back): a level's figures are worked out
    # only where it has less.
    level = rpm.level
    requests_left = int(level) if level > 0 else 0  # max(0, int(level)), without two calls
    level = tpm.level
    tokens_left = int(level) if level > 0 else 0
    outcome = reserve(
        paths, path, cmd.request_id, cmd.model, est.reserved_tokens, est.kv_byte_seconds,
        max_cost_micros(price, est.prompt_tokens, est.max_output_tokens), cmd.now,
        cmd.jitter, now_s=now_s, requests_left=requests_left, tokens_left=tokens_left,
        currency=price.currency,
    )  # fmt: skip
    rate_limits = _tightest(rpm, tpm, requests_left, tokens_left, outcome.requests, outcome.tokens)
    if isinstance(outcome, PathRefused):
        view.void(cmd.request_id)
        return Rejected(
            outcome.reason, outcome.retry_after_s, outcome.detail, rate_limits, outcome.param,
            outcome.level, outcome.dimension,
        )  # fmt: skip
    # The one Admitted, with what `decide` would have answered and what the path decided.
    return Admitted(est, rate_limits, clamped, outcome.reserved, outcome.starts_run)


def _tightest(
    rpm: Bucket, tpm: Bucket, org_requests: int, org_tokens: int, requests: Rate | None,
    tokens: Rate | None,
) -> RateLimitInfo:  # fmt: skip
    """Requests and tokens each from the level with the least remaining (the organization's,
    from its buckets as `_info` reads them, unless a level below it has less). Built once,
    from whichever level wins, rather than the organization's first and then again."""
    req = requests if requests is not None and requests[1] < org_requests else (
        rpm.capacity, org_requests, rpm.reset_ms()
    )
    tok = tokens if tokens is not None and tokens[1] < org_tokens else (
        tpm.capacity, org_tokens, tpm.reset_ms()
    )
    return _new_tuple(RateLimitInfo, req + tok)


def _info(rpm: Bucket, tpm: Bucket) -> RateLimitInfo:
    return RateLimitInfo(
        rpm.capacity,
        max(0, int(rpm.level)),
        rpm.reset_ms(),
        tpm.capacity,
        max(0, int(tpm.level)),
        tpm.reset_ms(),
    )


def _gib(byte_seconds: int) -> str:
    return f"{byte_seconds / GIB:.1f}"
