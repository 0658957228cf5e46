"""The control plane's commands and `decide_control`: the control events a command produces
against the current `ControlView`, or a DomainError.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from tollgate_llm.domain.control_plane.adapters import (
    ADAPTER_COMMANDS,
    AdapterCommand,
    RegisterAdapter,
    decide_adapter,
)
from tollgate_llm.domain.control_plane.data_policy import (
    DATA_POLICY_COMMANDS,
    DataPolicyCommand,
    decide_data_policy,
)
from tollgate_llm.domain.control_plane.events import (
    ApiKeyIssued,
    ApiKeyRevoked,
    FallbackAllowed,
    FallbackRevoked,
    FlexDiscountSet,
    LimitsSet,
    ModelProfileRegistered,
    PlanChanged,
    PriceSet,
    ReplicaRegistered,
    RoutingAllowed,
    RoutingRevoked,
    SloSet,
    TenantRegistered,
)
from tollgate_llm.domain.control_plane.state import (
    KEY_HASH,
    LIMIT_FIELDS,
    MAX_MODEL_CHARS,
    PLAN_LIMITS,
    SCOPES,
    TENANT_NAME,
    ControlView,
    _profile_of,
)
from tollgate_llm.domain.cost import CURRENCY_CODE, PROFILES, base_model, check_profile
from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.errors import DomainError, check_quantity
from tollgate_llm.domain.governance.decide import (
    HIERARCHY_COMMANDS,
    AssignKey,
    HierarchyCommand,
    SetBudget,
    SetRunPolicy,
    StartRun,
)
from tollgate_llm.domain.governance.decide import decide as hierarchy_decide
from tollgate_llm.domain.routing import (
    AUTO,
    DEFAULT_EXPLORATION_PPM,
    EXPLORATION_PPM_MAX,
    ON_CAPACITY,
)
from tollgate_llm.domain.text import check_text
from tollgate_llm.domain.types import TIERS


@dataclass(frozen=True, slots=True)
class RegisterTenant:
    name: str  # becomes the tenant id
    plan: str
    cache_salt: str  # generated outside the domain (random), sent to the engine per request


@dataclass(frozen=True, slots=True)
class ChangePlan:
    tenant_id: str
    plan: str


@dataclass(frozen=True, slots=True)
class SetLimits:
    tenant_id: str
    model: str  # "*", a base name or a pinned version
    rpm: int | None = None
    tpm: int | None = None
    max_context: int | None = None
    max_output: int | None = None
    kv_gib_seconds: int | None = None
    reserved_kv_gib_seconds: int | None = None


@dataclass(frozen=True, slots=True)
class IssueApiKey:
    tenant_id: str
    key_id: str
    key_hash: str  # sha256 hex of the secret, computed outside the domain
    scope: str = "customer"
    project_id: str | None = None  # None: the key belongs to the organization directly


@dataclass(frozen=True, slots=True)
class RevokeApiKey:
    tenant_id: str
    key_id: str


@dataclass(frozen=True, slots=True)
class SetPrice:
    model: str
    prompt_micros_per_mtok: int
    completion_micros_per_mtok: int
    cached_micros_per_mtok: int
    effective_at: datetime
    now: datetime
    currency: str = "USD"  # ISO 4217: the deployment's setting, passed in by the control service


@dataclass(frozen=True, slots=True)
class SetFlexDiscount:
    """The flex class's discount on a model's price, in ppm of it (500,000 = half price)."""

    model: str
    discount_ppm: int
    effective_at: datetime
    now: datetime


@dataclass(frozen=True, slots=True)
class RegisterReplica:
    replica_id: str
    model: str
    url: str
    reserved_only: bool = False


@dataclass(frozen=True, slots=True)
class RegisterModelProfile:
    """The KV shape of a model name or version, in force from `effective_at`."""

    model: str
    layers: int
    dtype_bytes: int
    kv_heads: int = 0
    head_dim: int = 0
    attention: str = "gqa"
    kv_lora_rank: int = 0
    rope_dim: int = 0
    max_model_len: int | None = None
    effective_at: datetime | None = None  # None: now
    now: datetime | None = None


@dataclass(frozen=True, slots=True)
class SetSlo:
    tier: str
    ttft_ms: int
    tpot_us: int
    effective_at: datetime
    now: datetime


@dataclass(frozen=True, slots=True)
class AllowFallback:
    tenant_id: str
    from_model: str
    to_model: str


@dataclass(frozen=True, slots=True)
class RevokeFallback:
    tenant_id: str
    from_model: str
    to_model: str


@dataclass(frozen=True, slots=True)
class AllowRouting:
    """Consent to the router for a tenant (or one of its projects): see RoutingAllowed."""

    tenant_id: str
    models: tuple[str, ...]
    quality_bar_ppm: int
    exploration_ppm: int = DEFAULT_EXPLORATION_PPM
    on_capacity: str = "asked"
    project_id: str = ""
    reset_drift: bool = False  # record it even unchanged: forget the latched classes
    route_reference: bool = False  # route requests naming the most expensive model too


@dataclass(frozen=True, slots=True)
class RevokeRouting:
    tenant_id: str
    project_id: str = ""


# A policy names a handful of models (it is a price ladder, not a catalogue).
MAX_ROUTING_MODELS = 8


ControlCommand = (
    RegisterTenant
    | ChangePlan
    | SetLimits
    | IssueApiKey
    | RevokeApiKey
    | SetPrice
    | SetFlexDiscount
    | RegisterReplica
    | RegisterModelProfile
    | SetSlo
    | AllowFallback
    | RevokeFallback
    | AllowRouting
    | RevokeRouting
    | HierarchyCommand
    | DataPolicyCommand
    | AdapterCommand
)


def decide_control(view: ControlView, command: ControlCommand) -> tuple[Event, ...]:
    """The control events a command produces against the current view, or a DomainError.
    A repeat that changes nothing (same plan, key already revoked) answers ()."""
    match command:
        case RegisterTenant():
            if not TENANT_NAME.fullmatch(command.name):
                raise DomainError(
                    "bad_name",
                    f"tenant name {command.name!r} must match {TENANT_NAME.pattern}",
                    field="name",
                )
            _check_plan(command.plan)
            if view.tenant(command.name) is not None:
                raise DomainError(
                    "duplicate_tenant", f"tenant {command.name!r} exists", field="name"
                )
            if not command.cache_salt:
                raise DomainError("bad_cache_salt", "cache_salt is empty", field="cache_salt")
            return (TenantRegistered(command.name, command.name, command.plan, command.cache_salt),)
        case ChangePlan():
            _check_plan(command.plan)
            tenant = view._tenant_or_error(command.tenant_id)
            if tenant.plan == command.plan:
                return ()
            return (PlanChanged(command.tenant_id, command.plan),)
        case SetLimits():
            view._tenant_or_error(command.tenant_id)
            _check_model(command.model)
            if command.model.strip() != command.model:
                raise DomainError("bad_model", f"model {command.model!r}", field="model")
            values = {name: getattr(command, name) for name in LIMIT_FIELDS}
            for name, value in values.items():
                check_quantity(name, value)
            if all(value is None for value in values.values()):
                raise DomainError("empty_limits", "SetLimits sets no limit")
            return (LimitsSet(command.tenant_id, command.model, **values),)
        case IssueApiKey():
            view._tenant_or_error(command.tenant_id)
            if not KEY_HASH.fullmatch(command.key_hash):
                raise DomainError(
                    "bad_key_hash", "key_hash must be 64 lowercase hex", field="key_hash"
                )
            if command.scope not in SCOPES:
                raise DomainError("bad_scope", f"scope not in {SCOPES}", field="scope")
            existing = view.key(command.key_id)
            if existing is not None:
                same = (existing.tenant_id, existing.key_hash, existing.scope) == (
                    command.tenant_id,
                    command.key_hash,
                    command.scope,
                )
                if same:
                    return ()
                raise DomainError("duplicate_key", f"key {command.key_id} exists", field="key_id")
            if command.key_hash in view._key_ids_by_hash:
                raise DomainError("duplicate_key_hash", "this key hash is in use", field="key_hash")
            issued = ApiKeyIssued(
                command.tenant_id, command.key_id, command.key_hash, command.scope
            )
            if command.project_id is None:
                return (issued,)
            if command.scope != "customer":
                raise DomainError(
                    "bad_scope", "only a customer key belongs to a project", field="project"
                )
            assigned = hierarchy_decide(
                view.hierarchy,
                AssignKey(command.tenant_id, command.key_id, command.project_id),
                key_tenant=command.tenant_id,
            )
            return (issued, *assigned)
        case RevokeApiKey():
            key = view.key(command.key_id)
            if key is None or key.tenant_id != command.tenant_id:
                raise DomainError("unknown_key", f"no key {command.key_id}", field="key_id")
            if key.revoked:
                return ()
            return (ApiKeyRevoked(command.tenant_id, command.key_id),)
        case SetPrice():
            _check_model(command.model)
            for name in (
                "prompt_micros_per_mtok",
                "completion_micros_per_mtok",
                "cached_micros_per_mtok",
            ):
                check_quantity(name, getattr(command, name), negative="negative_price")
            if not CURRENCY_CODE.fullmatch(command.currency):
                raise DomainError(
                    "bad_currency",
                    f"currency {command.currency!r} is not an ISO 4217 code "
                    f"({CURRENCY_CODE.pattern})",
                    field="currency",
                )
            if command.effective_at < command.now:
                raise DomainError(
                    "price_backdated",
                    "a price cannot take effect before it is set",
                    field="effective_at",
                )
            return (
                PriceSet(
                    command.model,
                    command.prompt_micros_per_mtok,
                    command.completion_micros_per_mtok,
                    command.cached_micros_per_mtok,
                    command.effective_at,
                    command.currency,
                ),
            )
        case SetFlexDiscount():
            _check_model(command.model)
            if not 0 <= command.discount_ppm <= 1_000_000:
                raise DomainError(
                    "bad_discount", "the flex discount is within [0, 100] %", field="discount_ppm"
                )
            if command.effective_at < command.now:
                raise DomainError(
                    "price_backdated",
                    "a price cannot take effect before it is set",
                    field="effective_at",
                )
            return (FlexDiscountSet(command.model, command.discount_ppm, command.effective_at),)
        case RegisterReplica():
            if not command.replica_id or not command.model or not command.url:
                raise DomainError("bad_replica", "replica_id, model and url are required")
            # replica_id: request_log's replica column is 100 wide.
            check_text(command.replica_id, "replica_id", max_chars=100)
            _check_model(command.model)
            check_text(command.url, "url", max_chars=2_048)
            view.model_profile(command.model)  # a replica nobody could admit traffic for
            known = view._replicas.get(command.replica_id)
            if known is not None:
                if (known.model, known.url, known.reserved_only) == (
                    command.model,
                    command.url,
                    command.reserved_only,
                ):
                    return ()
                raise DomainError("duplicate_replica", f"replica {command.replica_id} exists")
            return (
                ReplicaRegistered(
                    command.replica_id, command.model, command.url, command.reserved_only
                ),
            )
        case RegisterModelProfile():
            return (_decide_model_profile(command),)
        case SetSlo():
            if command.tier not in TIERS:
                raise DomainError("bad_tier", f"tier {command.tier!r} is not one of {TIERS}",
                                  field="tier")
            if command.ttft_ms <= 0 or command.tpot_us <= 0:
                raise DomainError("bad_slo", "SLO targets must be positive", field="ttft_ms")
            if command.effective_at < command.now:
                raise DomainError(
                    "slo_backdated", "an SLO cannot take effect before it is set",
                    field="effective_at",
                )
            return (SloSet(command.tier, command.ttft_ms, command.tpot_us, command.effective_at),)
        case AllowFallback():
            view._tenant_or_error(command.tenant_id)
            if not command.from_model or not command.to_model:
                raise DomainError("bad_model", "both models are required", field="from_model")
            _check_model(command.from_model, "from_model")
            _check_model(command.to_model, "to_model")
            if base_model(command.from_model) == base_model(command.to_model):
                raise DomainError(
                    "same_model", "a fallback is to another model", field="to_model"
                )
            if command.to_model in view.fallback_book.given(command.tenant_id, command.from_model):
                return ()
            return (FallbackAllowed(command.tenant_id, command.from_model, command.to_model),)
        case RevokeFallback():
            view._tenant_or_error(command.tenant_id)
            if command.to_model not in view.fallback_book.given(
                command.tenant_id, command.from_model
            ):
                return ()
            return (FallbackRevoked(command.tenant_id, command.from_model, command.to_model),)
    if isinstance(command, AllowRouting):
        return _decide_routing(view, command)
    if isinstance(command, RevokeRouting):
        view._tenant_or_error(command.tenant_id)
        if view.routing_book.own(command.tenant_id, command.project_id) is None:
            return ()
        return (RoutingRevoked(command.tenant_id, command.project_id),)
    if isinstance(command, DATA_POLICY_COMMANDS):
        view._tenant_or_error(command.tenant_id)
        project = command.project_id
        exists = project is not None and view.hierarchy.project(command.tenant_id, project)
        return decide_data_policy(view.data_policy, command, project_exists=bool(exists))
    if isinstance(command, ADAPTER_COMMANDS):
        return _decide_adapter(view, command)
    if isinstance(command, HIERARCHY_COMMANDS):
        view._tenant_or_error(command.tenant_id)
        _check_priced_currency(view, command)
        key_id = getattr(command, "key_id", None) or (
            getattr(command, "level_id", None) if getattr(command, "level", "") == "key" else None
        )
        key = view.key(key_id) if key_id else None
        return hierarchy_decide(
            view.hierarchy, command, key_tenant=key.tenant_id if key is not None else None
        )
    raise DomainError("unknown_command", f"unknown command {type(command).__name__}")


def _decide_adapter(view: ControlView, command: AdapterCommand) -> tuple[Event, ...]:
    """An adapter command, after what only the whole view knows: the tenant, the base model's
    KV profile (what admission charges an adapter's requests by), that the name is no catalogue
    model's (a tenant's adapter never hides a model) and the projects named."""
    view._tenant_or_error(command.tenant_id)
    if not isinstance(command, RegisterAdapter):
        return decide_adapter(view.adapters, command)
    _check_model(command.base_model, "base")
    try:
        view.model_profile(command.base_model)
    except DomainError as exc:
        raise DomainError(exc.rule, exc.message, field="base") from None
    names = (command.name, base_model(command.name))
    if any(n in view._profiles or view.prices.ever_priced(n) or n in PROFILES for n in names):
        raise DomainError(
            "name_taken", f"{command.name!r} is a model's name; give the adapter its own",
            field="name",
        )
    unknown = tuple(
        p for p in command.projects if view.hierarchy.project(command.tenant_id, p) is None
    )
    return decide_adapter(view.adapters, command, unknown_projects=unknown)


def _decide_routing(view: ControlView, command: AllowRouting) -> tuple[Event, ...]:
    view._tenant_or_error(command.tenant_id)
    if command.project_id and view.hierarchy.project(command.tenant_id, command.project_id) is None:
        raise DomainError("unknown_project", f"no project {command.project_id!r}",
                          field="project")  # fmt: skip
    models = command.models
    if not 2 <= len(models) <= MAX_ROUTING_MODELS:
        raise DomainError(
            "bad_models", f"a routing policy names 2 to {MAX_ROUTING_MODELS} models",
            field="models",
        )  # fmt: skip
    for model in models:
        _check_model(model, "models")
        if model == AUTO:
            raise DomainError("bad_models", f"{AUTO!r} is what asks the router", field="models")
    if len({base_model(m) for m in models}) != len(models):
        raise DomainError("bad_models", "each model once", field="models")
    if not 0 < command.quality_bar_ppm <= 1_000_000:
        raise DomainError("bad_quality_bar", "the quality bar is within (0, 1]",
                          field="quality_bar")  # fmt: skip
    if not 0 <= command.exploration_ppm <= EXPLORATION_PPM_MAX:
        raise DomainError(
            "bad_exploration",
            f"exploration is within [0, {EXPLORATION_PPM_MAX / 1e6:g}] of a class's requests",
            field="exploration",
        )  # fmt: skip
    if command.on_capacity not in ON_CAPACITY:
        raise DomainError("bad_on_capacity", f"on_capacity is one of {ON_CAPACITY}",
                          field="on_capacity")  # fmt: skip
    event = RoutingAllowed(
        command.tenant_id, command.project_id, tuple(models), command.quality_bar_ppm,
        command.exploration_ppm, command.on_capacity, command.route_reference,
    )  # fmt: skip
    current = view.routing_book.own(command.tenant_id, command.project_id)
    same = current is not None and (
        current.models, current.quality_bar_ppm, current.exploration_ppm, current.on_capacity,
        current.route_reference,
    ) == (
        event.models, event.quality_bar_ppm, event.exploration_ppm, event.on_capacity,
        event.route_reference,
    )  # fmt: skip
    if same and not command.reset_drift:
        return ()
    return (event,)


def _check_priced_currency(view: ControlView, command: HierarchyCommand) -> None:
    """A budget or a run's cost limit counts only spend priced in its currency, so one in a
    currency no price was ever set in could never count anything (a mistaken currency): it is
    refused, while any price exists (before the first, every currency is allowed)."""
    match command:
        case SetBudget(amount_micros=int()):
            currency = command.currency
        case SetRunPolicy() | StartRun() if command.limits.max_cost_micros is not None:
            currency = command.limits.currency
        case _:
            return
    priced = view.prices.currencies()
    if priced and currency not in priced:
        raise DomainError(
            "unpriced_currency",
            f"no price is in currency {currency} (prices are in {', '.join(sorted(priced))}): "
            f"an amount in {currency} would never count any spend",
            field="currency",
        )


def _decide_model_profile(command: RegisterModelProfile) -> ModelProfileRegistered:
    _check_model(command.model)
    if not command.model or command.model.strip() != command.model or command.model == "*":
        raise DomainError("bad_model", f"model {command.model!r}", field="model")
    if command.now is None:
        raise DomainError("no_instant", "RegisterModelProfile needs `now`", field="now")
    effective_at = command.effective_at or command.now
    if effective_at < command.now:
        raise DomainError(
            "profile_backdated",
            "a model profile cannot take effect before it is registered",
            field="effective_at",
        )
    if command.max_model_len is not None and command.max_model_len <= 0:
        raise DomainError("bad_profile", "max_model_len must be positive", field="max_model_len")
    if command.attention not in ("gqa", "mla"):
        raise DomainError("bad_profile", f"attention {command.attention!r} is not gqa or mla")
    event = ModelProfileRegistered(
        command.model, command.attention, command.layers, command.kv_heads, command.head_dim,
        command.dtype_bytes, command.kv_lora_rank, command.rope_dim, command.max_model_len,
        effective_at,
    )  # fmt: skip
    check_profile(_profile_of(event))
    return event


def _check_model(model: str, field: str = "model") -> None:
    """A model name an operator gives: storable (domain.text), and short enough for the stream
    ids it names (`prices-<model>`, `models-<model>`) to fit their 200-character column."""
    try:
        check_text(model, field, max_chars=MAX_MODEL_CHARS)
    except DomainError as exc:
        raise DomainError("bad_model", exc.message, field=field) from None


def _check_plan(plan: str) -> None:
    if plan not in PLAN_LIMITS:
        raise DomainError("bad_plan", f"plan {plan!r} is not one of {TIERS}", field="plan")
