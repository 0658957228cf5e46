"""What a command changed, old -> new: `describe(history, new)` over the facts of one control
stream, pure.

Each fact names a subject (the thing it sets: `limits model=*`, `key key_1`, `price llama-…`)
and values for it; the old value of a field is the one the stream's earlier facts left for that
subject. A fact without a rule here is still described (its type as the subject, its fields as
values), so a control event added later is audited before anyone writes its rule.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final

from tollgate_llm.domain.audit.events import MAX_VALUE_CHARS, AuditedChange, ChangeAudited
from tollgate_llm.domain.control_plane.data_policy import (
    ResidencyCleared,
    ResidencySet,
    RetentionSet,
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
from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.governance.events import (
    BudgetSet,
    KeyAssigned,
    LevelLimitsSet,
    ProjectCreated,
    ProjectMoved,
    RunPolicySet,
    TimeZoneSet,
    WorkspaceCreated,
)

Values = dict[str, Any]
Rule = Callable[[Any], tuple[str, Values]]

_LIMITS: Final = ("rpm", "tpm", "max_context", "max_output", "kv_gib_seconds")


def _fields(event: Event, names: Iterable[str]) -> Values:
    return {name: getattr(event, name) for name in names}


def _fallback(e: FallbackAllowed | FallbackRevoked) -> str:
    return f"fallback {e.from_model} -> {e.to_model}"


# Per fact: its subject and the values it sets. Never a secret, nor a hash of one: a key's hash
# and a tenant's cache salt are left out.
RULES: Final[Mapping[type[Event], Rule]] = {
    TenantRegistered: lambda e: ("tenant", {"plan": e.plan}),
    PlanChanged: lambda e: ("tenant", {"plan": e.plan}),
    LimitsSet: lambda e: (
        f"limits model={e.model}",
        _fields(e, (*_LIMITS, "reserved_kv_gib_seconds")),
    ),
    ApiKeyIssued: lambda e: (f"key {e.key_id}", {"scope": e.scope, "revoked": False}),
    ApiKeyRevoked: lambda e: (f"key {e.key_id}", {"revoked": True}),
    KeyAssigned: lambda e: (f"key {e.key_id}", {"project": e.project_id}),
    WorkspaceCreated: lambda e: (f"workspace {e.workspace_id}", {"name": e.name}),
    ProjectCreated: lambda e: (
        f"project {e.project_id}",
        {"name": e.name, "workspace": e.workspace_id},
    ),
    ProjectMoved: lambda e: (f"project {e.project_id}", {"workspace": e.workspace_id}),
    LevelLimitsSet: lambda e: (
        f"limits {e.level} {e.level_id} model={e.model}",
        _fields(e, _LIMITS),
    ),
    BudgetSet: lambda e: (
        f"budget {e.level} {e.level_id} {e.period}",
        {"amount_micros": e.amount_micros},
    ),
    TimeZoneSet: lambda e: ("time zone", {"time_zone": e.time_zone}),
    RunPolicySet: lambda e: (
        f"run policy {e.project_id}",
        _fields(
            e, ("max_calls", "max_tool_calls", "max_wall_ms", "max_cost_micros", "max_in_flight")
        ),
    ),  # fmt: skip
    PriceSet: lambda e: (
        f"price {e.model}",
        _fields(
            e,
            (
                "prompt_micros_per_mtok",
                "completion_micros_per_mtok",
                "cached_micros_per_mtok",
                "currency",
                "effective_at",
            ),
        ),
    ),  # fmt: skip
    FlexDiscountSet: lambda e: (
        f"flex discount {e.model}",
        _fields(e, ("discount_ppm", "effective_at")),
    ),
    ModelProfileRegistered: lambda e: (
        f"model profile {e.model}",
        _fields(
            e,
            (
                "attention",
                "layers",
                "kv_heads",
                "head_dim",
                "dtype_bytes",
                "kv_lora_rank",
                "rope_dim",
                "max_model_len",
                "effective_at",
            ),
        ),
    ),  # fmt: skip
    SloSet: lambda e: (f"slo {e.tier}", _fields(e, ("ttft_ms", "tpot_us", "effective_at"))),
    FallbackAllowed: lambda e: (_fallback(e), {"allowed": True}),
    FallbackRevoked: lambda e: (_fallback(e), {"allowed": False}),
    ReplicaRegistered: lambda e: (
        f"replica {e.replica_id}",
        _fields(e, ("model", "url", "reserved_only")),
    ),
    RoutingAllowed: lambda e: (
        f"routing {e.project_id or '*'}",
        {
            "models": ",".join(e.models),
            **_fields(e, ("quality_bar_ppm", "exploration_ppm", "on_capacity")),
            "allowed": True,
        },
    ),
    RoutingRevoked: lambda e: (f"routing {e.project_id or '*'}", {"allowed": False}),
    ResidencySet: lambda e: (f"residency {e.project_id or '*'}", {"regions": e.regions}),
    ResidencyCleared: lambda e: (f"residency {e.project_id or '*'}", {"regions": None}),
    RetentionSet: lambda e: (f"retention {e.project_id or '*'}", {"tier": e.tier}),
}
# Facts whose None means "leave the earlier value in force", not "none".
OVERLAID: Final[frozenset[type[Event]]] = frozenset({LimitsSet, LevelLimitsSet})


def subject_values(event: Event) -> tuple[str, Values]:
    """The subject a fact sets and its values (a fact without a rule: every field but the
    tenant, under its type's name)."""
    rule = RULES.get(type(event))
    if rule is not None:
        subject, values = rule(event)
    else:
        names = [f.name for f in dataclasses.fields(event)]  # type: ignore[arg-type]
        subject, values = event.EVENT_TYPE, _fields(event, (n for n in names if n != "tenant_id"))
    if type(event) in OVERLAID:
        values = {name: value for name, value in values.items() if value is not None}
    return subject, values


def render(value: Any) -> str | None:
    """A value as the audit trail shows it: text as it is, numbers and flags as JSON, instants
    in ISO 8601 UTC, bounded to MAX_VALUE_CHARS."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value
    elif isinstance(value, datetime):
        text = value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    else:
        text = json.dumps(value, default=str, separators=(",", ":"))
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 1] + "…"


def describe(history: Sequence[Event], new: Sequence[Event]) -> tuple[AuditedChange, ...]:
    """The changes `new` makes to a stream whose earlier facts are `history` (audit records are
    passed over). A fact that sets only what was already so is listed with old == new, so an
    audit record is never silent about what its command did."""
    state: dict[str, Values] = {}
    for event in history:
        if not isinstance(event, ChangeAudited):
            subject, values = subject_values(event)
            state.setdefault(subject, {}).update(values)
    changes: list[AuditedChange] = []
    for event in new:
        subject, values = subject_values(event)
        before = state.setdefault(subject, {})
        moved = [
            AuditedChange(subject, name, render(before.get(name)), render(value))
            for name, value in values.items()
            if name not in before or before[name] != value
        ]
        changes.extend(moved or (
            AuditedChange(subject, name, render(value), render(value))
            for name, value in values.items()
        ))  # fmt: skip
        before.update(values)
    return tuple(changes)
