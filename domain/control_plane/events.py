"""The control plane's facts: tenants, plans, limits and keys (stream "tenant-<tenant_id>", so
one optimistic-concurrency check covers a tenant's whole configuration), prices and the flex
discount ("prices-<model>"), model profiles ("models-<model>"), SLOs ("slo-<tier>"), replicas
("fleet") and fallbacks.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import ClassVar

from tollgate_llm.domain.envelope import Event


@dataclass(frozen=True, slots=True)
class TenantRegistered(Event):
    EVENT_TYPE: ClassVar[str] = "TenantRegistered"
    tenant_id: str
    name: str
    plan: str
    cache_salt: str  # per-tenant prefix-cache salt sent to the engine


@dataclass(frozen=True, slots=True)
class PlanChanged(Event):
    EVENT_TYPE: ClassVar[str] = "PlanChanged"
    tenant_id: str
    plan: str


@dataclass(frozen=True, slots=True)
class LimitsSet(Event):
    """Per tenant and model; None leaves the plan's default (or the earlier override) in force."""

    EVENT_TYPE: ClassVar[str] = "LimitsSet"
    tenant_id: str
    model: str  # a model name or version, or "*" for every model
    rpm: int | None = None
    tpm: int | None = None
    max_context: int | None = None
    max_output: int | None = None
    kv_gib_seconds: int | None = None  # cap on concurrent estimated KV GiB·s in flight
    reserved_kv_gib_seconds: int | None = None  # enterprise floor


@dataclass(frozen=True, slots=True)
class ApiKeyIssued(Event):
    EVENT_TYPE: ClassVar[str] = "ApiKeyIssued"
    tenant_id: str
    key_id: str
    key_hash: str  # sha256 hex of the secret; the secret itself is never stored
    scope: str  # customer | finance | support | admin


@dataclass(frozen=True, slots=True)
class ApiKeyRevoked(Event):
    EVENT_TYPE: ClassVar[str] = "ApiKeyRevoked"
    tenant_id: str
    key_id: str


@dataclass(frozen=True, slots=True)
class ReplicaRegistered(Event):
    """Stream "fleet"."""

    EVENT_TYPE: ClassVar[str] = "ReplicaRegistered"
    replica_id: str
    model: str
    url: str
    reserved_only: bool = False


@dataclass(frozen=True, slots=True)
class PriceSet(Event):
    """Stream "prices-<model>". Prices are per million tokens in micro-units of the currency."""

    EVENT_TYPE: ClassVar[str] = "PriceSet"
    model: str
    prompt_micros_per_mtok: int
    completion_micros_per_mtok: int
    cached_micros_per_mtok: int
    effective_at: datetime
    # ISO 4217 code the micro-units are of: the deployment's setting when the price was set, so
    # a past bill keeps the currency it was priced in. A default, so a PriceSet recorded before
    # it existed reads as USD (the only currency there was) and EVENT_VERSION stays 1.
    currency: str = "USD"


@dataclass(frozen=True, slots=True)
class FlexDiscountSet(Event):
    """Stream "prices-<model>": the flex class's discount on the model's price in force, in parts
    per million of it, from `effective_at` (never before it was recorded, like a price)."""

    EVENT_TYPE: ClassVar[str] = "FlexDiscountSet"
    model: str
    discount_ppm: int
    effective_at: datetime


@dataclass(frozen=True, slots=True)
class ModelProfileRegistered(Event):
    """Stream "models-<model>": the KV shape of a model name or pinned version, in force from
    `effective_at` (a later registration supersedes it from its own instant; history is kept).
    `max_model_len` None: the replica's own /v1/models (or the built-in default) decides."""

    EVENT_TYPE: ClassVar[str] = "ModelProfileRegistered"
    model: str
    attention: str  # "gqa" (dense / grouped-query) | "mla"
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    kv_lora_rank: int
    rope_dim: int
    max_model_len: int | None
    effective_at: datetime


@dataclass(frozen=True, slots=True)
class SloSet(Event):
    """Stream "slo-<tier>". A tier's objective from `effective_at` on (never before it was
    recorded, like prices, so a change cannot re-judge requests that already ran)."""

    EVENT_TYPE: ClassVar[str] = "SloSet"
    tier: str
    ttft_ms: int
    tpot_us: int
    effective_at: datetime


@dataclass(frozen=True, slots=True)
class FallbackAllowed(Event):
    """A tenant's consent to be served `to_model` when `from_model` has no capacity (its own
    stream, like its keys and limits). Without it no other model is ever served."""

    EVENT_TYPE: ClassVar[str] = "FallbackAllowed"
    tenant_id: str
    from_model: str
    to_model: str


@dataclass(frozen=True, slots=True)
class FallbackRevoked(Event):
    EVENT_TYPE: ClassVar[str] = "FallbackRevoked"
    tenant_id: str
    from_model: str
    to_model: str


@dataclass(frozen=True, slots=True)
class RoutingAllowed(Event):
    """A tenant's (or one of its projects') consent to the router (domain.routing): its requests
    for `auto` may be served by any of `models`, the cheapest whose quality for the request's
    task class meets `quality_bar_ppm` by a lower confidence bound on the tenant's own feedback.
    Recorded again (even unchanged, with `tollgate routing allow --reset-drift`) it forgets the
    classes the drift monitor had latched: the router's "retrain". Without it nothing is routed.
    `route_reference`: requests that name the reference model (the policy's most expensive) are
    routed too, as `auto` is (recorded before it existed: False, nothing changes)."""

    EVENT_TYPE: ClassVar[str] = "RoutingAllowed"
    tenant_id: str
    project_id: str  # "" for the whole organization
    models: tuple[str, ...]
    quality_bar_ppm: int
    exploration_ppm: int
    on_capacity: str  # asked: shed to the reference model | refuse: 503
    route_reference: bool = False


@dataclass(frozen=True, slots=True)
class RoutingRevoked(Event):
    EVENT_TYPE: ClassVar[str] = "RoutingRevoked"
    tenant_id: str
    project_id: str
