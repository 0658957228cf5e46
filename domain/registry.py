"""The one registry of every stream's events: type name -> class, the upcasters that read old
versions, and the wire form (`to_payload`, `from_payload`, `dumps`) the stores write and read.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, TypeAlias, get_type_hints

from tollgate_llm.domain.audit.events import AuditedChange, ChangeAudited
from tollgate_llm.domain.batches.events import (
    BatchCancelRequested,
    BatchCreated,
    BatchEnded,
    BatchFailed,
    BatchFinalizing,
    BatchItemFinished,
    BatchStarted,
)
from tollgate_llm.domain.control_plane.adapters import AdapterRegistered, AdapterRevoked
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
from tollgate_llm.domain.errors import DomainError
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
from tollgate_llm.domain.requests.events import (
    BudgetReserved,
    FeedbackRecorded,
    FirstTokenStreamed,
    LeaseExpired,
    LeaseProgress,
    LeasesRenewed,
    PreemptionRequested,
    QuotaRefunded,
    RefusalsCounted,
    RequestAdmitted,
    RequestCancelled,
    RequestCompleted,
    RequestDowngraded,
    RequestEstimated,
    RequestFailed,
    RequestModelRouted,
    RequestPreempted,
    RequestRejected,
    RequestRouted,
    ToolCallsReturned,
    UsageBilled,
)
from tollgate_llm.domain.runs.events import RunBudgetExhausted, RunEnded, RunStarted

EVENT_CLASSES: dict[str, type[Event]] = {
    cls.EVENT_TYPE: cls
    for cls in (
        RequestAdmitted,
        RequestEstimated,
        RequestRejected,
        RefusalsCounted,
        RequestRouted,
        FirstTokenStreamed,
        LeasesRenewed,
        RequestCompleted,
        RequestCancelled,
        RequestFailed,
        LeaseExpired,
        RequestPreempted,
        PreemptionRequested,
        QuotaRefunded,
        UsageBilled,
        TenantRegistered,
        PlanChanged,
        LimitsSet,
        ApiKeyIssued,
        ApiKeyRevoked,
        ReplicaRegistered,
        PriceSet,
        FlexDiscountSet,
        ModelProfileRegistered,
        SloSet,
        FallbackAllowed,
        FallbackRevoked,
        RequestDowngraded,
        WorkspaceCreated,
        ProjectCreated,
        ProjectMoved,
        KeyAssigned,
        LevelLimitsSet,
        BudgetSet,
        TimeZoneSet,
        RunPolicySet,
        RunStarted,
        RunBudgetExhausted,
        RunEnded,
        BudgetReserved,
        ToolCallsReturned,
        BatchCreated,
        BatchStarted,
        BatchItemFinished,
        BatchCancelRequested,
        BatchFinalizing,
        BatchEnded,
        BatchFailed,
        RequestModelRouted,
        FeedbackRecorded,
        RoutingAllowed,
        RoutingRevoked,
        ResidencySet,
        ResidencyCleared,
        RetentionSet,
        ChangeAudited,
        AdapterRegistered,
        AdapterRevoked,
    )
}


Upcaster: TypeAlias = Callable[[dict[str, Any]], dict[str, Any]]
# (type, from_version) -> function giving the payload of version from_version + 1. Pure; stored
# rows are never rewritten, they are read through these.


def _estimated_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    # v1 reserved the whole output cap, with no predictor, and did not record the shape.
    return {
        **payload,
        "output_cap_tokens": payload["reserved_output_tokens"],
        "predictor_version": "",
        "message_count": 0,
        "system_prompt_bucket": -1,
    }


def _first_token_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    # v1 carried no engine counts: unknown, so nothing a lease expiry could bill.
    return {**payload, "prompt_tokens": 0, "cached_tokens": 0}


UPCASTERS: dict[tuple[str, int], Upcaster] = {
    ("RequestEstimated", 1): _estimated_v1_to_v2,
    ("FirstTokenStreamed", 1): _first_token_v1_to_v2,
}


def upcast(event_type: str, version: int, payload: Mapping[str, Any]) -> dict[str, Any]:
    cls = EVENT_CLASSES.get(event_type)
    if cls is None:
        raise DomainError("unknown_event_type", f"unknown event type {event_type!r}")
    if version > cls.EVENT_VERSION:
        raise DomainError(
            "event_version_too_new",
            f"{event_type} v{version} is newer than this code (v{cls.EVENT_VERSION})",
        )
    data = dict(payload)
    while version < cls.EVENT_VERSION:
        step = UPCASTERS.get((event_type, version))
        if step is None:
            raise DomainError("no_upcaster", f"no upcaster for {event_type} v{version}")
        data = step(data)
        version += 1
    return data


def to_payload(event: Event) -> dict[str, Any]:
    """The JSON-ready payload of an event: primitives only."""
    names = _FIELD_NAMES.get(type(event))
    if names is None:
        names = _FIELD_NAMES[type(event)] = tuple(f.name for f in dataclasses.fields(event))  # type: ignore[arg-type]
    payload = {}
    for name in names:
        value = getattr(event, name)
        kind = type(value)
        # Most values are already JSON primitives (every event is written once on the request
        # path, so this is hot); the rest, floats included (refused), go through _encode.
        plain = kind is str or kind is int or kind is bool or value is None
        payload[name] = value if plain else _encode(value)
    return payload


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def from_payload(event_type: str, version: int, payload: Mapping[str, Any]) -> Event:
    cls = EVENT_CLASSES.get(event_type)
    # The common case is the current version: no upcasting, no copy of the payload.
    if cls is None or version != cls.EVENT_VERSION:
        payload = upcast(event_type, version, payload)
        cls = EVENT_CLASSES[event_type]
    converters = _CONVERTERS.get(cls)
    if converters is None:
        converters = _converters(cls, _decoders(cls))
    if converters:
        converted = dict(payload)
        for name, convert in converters:
            value = converted.get(name)
            if value is not None:
                converted[name] = convert(value)
    else:  # most events: nothing to convert, and cls(**payload) copies nothing of it
        converted = payload  # type: ignore[assignment]
    make = _MAKERS.get(cls)
    if make is None:
        make = _MAKERS[cls] = _maker(cls)
    event = make(converted)
    if event is not None:
        return event
    try:
        # A payload of the current version has exactly the class's fields (to_payload wrote it).
        return cls(**converted)
    except TypeError:  # a key the class does not have: keep the fields only
        plan = _decoders(cls)
        return cls(**{name: value for name, value in converted.items() if name in plan})


_MAKERS: dict[type, Callable[[Mapping[str, Any]], Event | None]] = {}


def _maker(cls: type) -> Callable[[Mapping[str, Any]], Event | None]:
    """`cls`'s instance from a payload holding exactly its fields, its slots set one by one:
    a frozen dataclass's own __init__ sets each field through object.__setattr__, about three
    times the cost (3.4 against 1.3 us for a RequestAdmitted), and every fold decodes every
    event it reads. None for any other payload (a field missing or unknown: the caller's
    `cls(**payload)` then says so), and always None for a class this cannot build the same
    way (not a frozen slotted dataclass, or an __init__ that does more than set its fields)."""
    fields = dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ()
    params = getattr(cls, "__dataclass_params__", None)
    slots = getattr(cls, "__slots__", ())
    if (
        not fields
        or params is None
        or not params.frozen
        or hasattr(cls, "__post_init__")
        or any(not f.init for f in fields)
        or {f.name for f in fields} != set(slots)
    ):
        return lambda _payload: None
    setters = tuple((f.name, getattr(cls, f.name).__set__) for f in fields)
    names = frozenset(name for name, _ in setters)
    new = object.__new__

    def make(payload: Mapping[str, Any]) -> Event | None:
        if payload.keys() != names:
            return None
        event: Event = new(cls)
        for name, set_slot in setters:
            set_slot(event, payload[name])
        return event

    return make


def dumps(event: Event) -> str:
    return json.dumps(to_payload(event), separators=(",", ":"), sort_keys=True)


def _encode(value: Any) -> Any:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise DomainError("naive_datetime", "event datetimes must be timezone-aware UTC")
        return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, float):
        raise DomainError("float_in_event", "events carry no floats (money, tokens, time)")
    return value


_DECODERS: dict[type, dict[str, Callable[[Any], Any] | None]] = {}


def _decoders(cls: type) -> dict[str, Callable[[Any], Any] | None]:
    """Per event class, each field's converter from its JSON form (None: used as is). Built
    once per class: decoding is on every fold's path."""
    plan = _DECODERS.get(cls)
    if plan is None:
        plan = {}
        for f in dataclasses.fields(cls):
            hint = get_type_hints(cls)[f.name]
            if hint is datetime or hint == (datetime | None):
                plan[f.name] = parse_instant
            elif hint == tuple[LeaseProgress, ...]:
                plan[f.name] = _progress
            elif hint == tuple[str, ...]:  # JSON has lists only
                plan[f.name] = tuple
            elif hint == tuple[AuditedChange, ...]:
                plan[f.name] = _changes
            else:
                plan[f.name] = None
        _DECODERS[cls] = plan
    return plan


_CONVERTERS: dict[type, tuple[tuple[str, Callable[[Any], Any]], ...]] = {}


def _converters(
    cls: type, plan: dict[str, Callable[[Any], Any] | None]
) -> tuple[tuple[str, Callable[[Any], Any]], ...]:
    """The fields of `cls` whose JSON form needs converting (instants, nested records)."""
    found = _CONVERTERS.get(cls)
    if found is None:
        found = _CONVERTERS[cls] = tuple((n, fn) for n, fn in plan.items() if fn is not None)
    return found


def _progress(items: Any) -> tuple[LeaseProgress, ...]:
    return tuple(LeaseProgress(**item) for item in items)


def _changes(items: Any) -> tuple[AuditedChange, ...]:
    return tuple(AuditedChange(**item) for item in items)


def parse_instant(text: str) -> datetime:
    parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if parsed.tzinfo is None:
        raise DomainError("naive_datetime", f"instant {text!r} has no timezone")
    return parsed.astimezone(UTC)
