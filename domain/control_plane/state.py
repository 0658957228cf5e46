"""The control plane folded: tenants, plans and their limits, API keys, prices and replicas
(`ControlView`, whose `apply` is the evolve of every control stream).

History is kept, so every question can be asked as of a past instant: "what was this tenant's
limit when that request was rejected?", "what did this model cost when that request ran?".
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Final

from tollgate_llm.domain.audit.events import ChangeAudited
from tollgate_llm.domain.control_plane.adapters import ADAPTER_EVENTS, Adapter, AdapterBook
from tollgate_llm.domain.control_plane.consents import (
    CONSENT_EVENTS,
    FALLBACK_EVENTS,
    ROUTING_EVENTS,
    FallbackBook,
    RoutingBook,
)
from tollgate_llm.domain.control_plane.data_policy import DATA_POLICY_EVENTS, DataPolicy
from tollgate_llm.domain.control_plane.events import (
    ApiKeyIssued,
    ApiKeyRevoked,
    LimitsSet,
    ModelProfileRegistered,
    PlanChanged,
    ReplicaRegistered,
    SloSet,
    TenantRegistered,
)
from tollgate_llm.domain.control_plane.prices import PRICE_EVENTS, PriceBook, insort
from tollgate_llm.domain.cost import PROFILES, ModelProfile, Price, base_model
from tollgate_llm.domain.envelope import Event, Recorded
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.goodput import DEFAULT_SLOS, Slo
from tollgate_llm.domain.governance.state import HIERARCHY_EVENTS, Hierarchy
from tollgate_llm.domain.types import TIERS


@dataclass(frozen=True, slots=True)
class Limits:
    """A tenant's limits for one model. KV caps are GiB·s of estimated KV occupancy integral in
    flight at once (× 2^30 for byte-seconds)."""

    rpm: int
    tpm: int
    max_context: int
    max_output: int
    kv_gib_seconds: int
    reserved_kv_gib_seconds: int = 0


LIMIT_FIELDS: Final = (
    "rpm",
    "tpm",
    "max_context",
    "max_output",
    "kv_gib_seconds",
    "reserved_kv_gib_seconds",
)

# Plan defaults. Reference costs (domain.cost, llama-3.1-70b at 320 KiB/token): a typical chat
# (800 prompt, 300 out) at the 50 ms TPOT target is ~4.4 GiB·s, ~8.7 GiB·s at the stale 2×.
# - free: enough for a person trying the API (20 rpm, 40k tpm), contexts and outputs short
#   (8k/1k) because they are the only knobs that bound a single request's KV (seed 000 §4);
#   256 GiB·s ≈ 30 typical chats in flight, or one maximal 8k/1k request at 2× TPOT (~272).
# - standard: a production app (600 rpm, 400k tpm ≈ 10 req/s of 700 tokens); 32k/4k;
#   4,096 GiB·s ≈ 470 typical chats in flight at 2× TPOT.
# - enterprise: 3,000 rpm, 2M tpm, the full 128k context, 8k out; 32,768 GiB·s cap and a
#   reserved floor of 8,192 GiB·s that admission honours even when the limits view is stale
#   (it is capacity held back in reserve-only replicas, R2).
# A single request is never refused for concurrency while its tenant has nothing else in flight
# (domain.admission), so a maximal request above the cap stays possible.
PLAN_LIMITS: Final[dict[str, Limits]] = {
    "free": Limits(20, 40_000, 8_192, 1_024, 256, 0),
    "standard": Limits(600, 400_000, 32_768, 4_096, 4_096, 0),
    "enterprise": Limits(3_000, 2_000_000, 131_072, 8_192, 32_768, 8_192),
}
assert tuple(PLAN_LIMITS) == TIERS

SCOPES: Final = ("customer", "finance", "support", "admin")
# Matched whole (`fullmatch`): with `match`, `$` also matches before a final newline.
TENANT_NAME: Final = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
KEY_HASH: Final = re.compile(r"^[0-9a-f]{64}$")
FLEET_STREAM: Final = "fleet"
# 200 (the events' stream_id column) - len("prices-").
MAX_MODEL_CHARS: Final = 193
# Every control-plane stream starts with one of these (tenants with their keys and limits, prices,
# the fleet, model profiles, SLOs): what a control-plane follower reads.
CONTROL_PREFIXES: Final = ("tenant-", "prices-", "slo-", FLEET_STREAM, "models-", "run-")


def tenant_stream(tenant_id: str) -> str:
    return f"tenant-{tenant_id}"


def price_stream(model: str) -> str:
    return f"prices-{model}"


def model_stream(model: str) -> str:
    return f"models-{model}"


def slo_stream(tier: str) -> str:
    return f"slo-{tier}"


@dataclass(frozen=True, slots=True)
class Tenant:
    tenant_id: str
    name: str
    plan: str
    cache_salt: str
    registered_at: datetime


@dataclass(frozen=True, slots=True)
class ApiKey:
    key_id: str
    tenant_id: str
    key_hash: str
    scope: str
    issued_at: datetime
    revoked: bool = False
    revoked_at: datetime | None = None


@dataclass(slots=True)
class _Dated:
    """One dated entry of a history; `seq` orders entries recorded at the same instant."""

    at: datetime
    seq: int
    values: dict[str, int] = field(default_factory=dict)


# What `ControlView.apply` folds (its cases below). Anything else is passed over before the
# match: a fold worker hands this view every record of the log, and a request's event went
# through every case first (a test holds this set equal to the cases).
CONTROL_EVENTS: Final[frozenset[type[Event]]] = frozenset({
    TenantRegistered, PlanChanged, LimitsSet, ApiKeyIssued, ApiKeyRevoked, *PRICE_EVENTS,
    ReplicaRegistered, ModelProfileRegistered, SloSet, ChangeAudited,
    *HIERARCHY_EVENTS, *DATA_POLICY_EVENTS, *ADAPTER_EVENTS, *CONSENT_EVENTS,
})  # fmt: skip


class ControlView:
    """Control-plane state folded incrementally from control records (`apply`)."""

    def __init__(self) -> None:
        self._tenants: dict[str, Tenant] = {}
        self._plans: dict[str, list[tuple[datetime, int, str]]] = {}
        self._overrides: dict[tuple[str, str], list[_Dated]] = {}
        self._keys: dict[str, ApiKey] = {}
        self._key_ids_by_hash: dict[str, str] = {}
        # Prices and flex discounts (domain/control_plane/prices.py).
        self.prices = PriceBook()
        self._replicas: dict[str, ReplicaRegistered] = {}
        self._profiles: dict[str, list[tuple[datetime, int, ModelProfile]]] = {}
        self._slos: dict[str, list[tuple[datetime, int, Slo]]] = {}
        self._current: dict[tuple[str, str], Limits] = {}
        # Workspaces, projects, the keys' places, level limits, budgets and runs.
        self.hierarchy = Hierarchy()
        # Residency pins and retention tiers (domain/control_plane/data_policy.py).
        self.data_policy = DataPolicy()
        # The tenants' LoRA adapters (domain/control_plane/adapters.py).
        self.adapters = AdapterBook()
        # The tenants' consents to fallbacks and to the router (domain/control_plane/consents.py).
        self.fallback_book = FallbackBook()
        self.routing_book = RoutingBook()
        self._seen: set[str] = set()
        self._versions: dict[str, int] = {}
        self._seq = 0
        self.position = 0
        # How many records have changed the view, counted once each is folded: what a reader
        # keeps of it (the router's policy per key) holds while this stays the same.
        self.changes = 0

    # --- folding ------------------------------------------------------------------------------

    def apply(self, recorded: Recorded) -> None:
        """Fold one control record. A redelivered event (same event_id) changes nothing; events
        that are not control-plane facts are ignored, so the view can read a mixed log."""
        event = recorded.event
        if type(event) not in CONTROL_EVENTS or recorded.event_id in self._seen:
            return
        at = recorded.occurred_at
        self._seq += 1
        seq = self._seq
        folded = (
            self._fold_tenancy(event, at, seq)
            or self._fold_catalogue(event, at, seq)
            or self._fold_policies(event, at)
        )
        if not folded:
            if not isinstance(event, HIERARCHY_EVENTS):
                return
            self.hierarchy.apply(event, at)
        self._seen.add(recorded.event_id)
        self._current.clear()
        self.changes += 1
        self.position = max(self.position, recorded.position)
        stream = recorded.stream_id
        if recorded.stream_version > self._versions.get(stream, 0):
            self._versions[stream] = recorded.stream_version

    def _fold_tenancy(self, event: Event, at: datetime, seq: int) -> bool:
        """Tenants, their plans, limits and keys; False: not one of these."""
        match event:
            case TenantRegistered():
                self._tenants[event.tenant_id] = Tenant(
                    event.tenant_id, event.name, event.plan, event.cache_salt, at
                )
                self._plans[event.tenant_id] = [(at, seq, event.plan)]
            case PlanChanged():
                tenant = self._tenant_or_error(event.tenant_id)
                self._tenants[event.tenant_id] = Tenant(
                    tenant.tenant_id,
                    tenant.name,
                    event.plan,
                    tenant.cache_salt,
                    tenant.registered_at,
                )
                insort(self._plans[event.tenant_id], (at, seq, event.plan))
            case LimitsSet():
                values = {
                    name: value
                    for name in LIMIT_FIELDS
                    if (value := getattr(event, name)) is not None
                }
                history = self._overrides.setdefault((event.tenant_id, event.model), [])
                entry = _Dated(at, seq, values)
                bisect.insort(history, entry, key=lambda d: (d.at, d.seq))
            case ApiKeyIssued():
                key = ApiKey(event.key_id, event.tenant_id, event.key_hash, event.scope, at)
                self._keys[event.key_id] = key
                self._key_ids_by_hash[event.key_hash] = event.key_id
            case ApiKeyRevoked():
                old = self._keys.get(event.key_id)
                if old is not None and not old.revoked:
                    self._keys[event.key_id] = ApiKey(
                        old.key_id,
                        old.tenant_id,
                        old.key_hash,
                        old.scope,
                        old.issued_at,
                        revoked=True,
                        revoked_at=at,
                    )
            case _:
                return False
        return True

    def _fold_policies(self, event: Event, at: datetime) -> bool:
        """The tenants' consents, pins and adapters (fallbacks, the router's, residency,
        retention, LoRA adapters) and the audit trail's records; False: none of these."""
        match event:
            case _ if isinstance(event, FALLBACK_EVENTS):
                self.fallback_book.apply(event)
            case _ if isinstance(event, ROUTING_EVENTS):
                self.routing_book.apply(event, at)
            case _ if isinstance(event, DATA_POLICY_EVENTS):
                self.data_policy.apply(event)
            case ChangeAudited():
                pass  # the audit trail's (domain/audit/): counted in the stream's version only
            case _ if isinstance(event, ADAPTER_EVENTS):
                self.adapters.apply(event, at)
            case _:
                return False
        return True

    def _fold_catalogue(self, event: Event, at: datetime, seq: int) -> bool:
        """Prices, flex discounts, replicas, model profiles, objectives; False: none of these."""
        match event:
            case _ if isinstance(event, PRICE_EVENTS):
                self.prices.apply(event, at, seq)
            case ReplicaRegistered():
                self._replicas[event.replica_id] = event
            case ModelProfileRegistered():
                profile = _profile_of(event)
                # Like a price, never in force before it was recorded.
                effective = max(event.effective_at, at)
                insort(self._profiles.setdefault(event.model, []), (effective, seq, profile))
            case SloSet():
                slo = Slo(event.ttft_ms, event.tpot_us)
                effective = max(event.effective_at, at)
                insort(self._slos.setdefault(event.tier, []), (effective, seq, slo))
            case _:
                return False
        return True

    # --- questions ----------------------------------------------------------------------------

    def stream_version(self, stream_id: str) -> int:
        """The version of a control stream as folded here (0: nothing of it seen): what a
        command decided on this view must append at."""
        return self._versions.get(stream_id, 0)

    def tenant(self, tenant_id: str) -> Tenant | None:
        return self._tenants.get(tenant_id)

    def tenants(self) -> list[Tenant]:
        return list(self._tenants.values())

    def key_by_hash(self, key_hash: str) -> ApiKey | None:
        """The live key with this sha256 hex hash. A revoked key answers None, exactly like an
        unknown one, so a caller that forgets to check `revoked` cannot let it in; `key(key_id)`
        still shows revoked keys to support and admins."""
        key_id = self._key_ids_by_hash.get(key_hash)
        if key_id is None:
            return None
        key = self._keys[key_id]
        return None if key.revoked else key

    def key(self, key_id: str) -> ApiKey | None:
        return self._keys.get(key_id)

    def keys(self, tenant_id: str) -> list[ApiKey]:
        return [k for k in self._keys.values() if k.tenant_id == tenant_id]

    def cache_salt(self, tenant_id: str) -> str:
        return self._tenant_or_error(tenant_id).cache_salt

    def plan(self, tenant_id: str, at: datetime | None = None) -> str:
        history = self._plans.get(tenant_id)
        if history is None:
            raise DomainError("unknown_tenant", f"no tenant {tenant_id!r}", field="tenant_id")
        if at is None:
            return history[-1][2]
        index = bisect.bisect_right(history, at, key=lambda entry: entry[0])
        if index == 0:
            raise DomainError("unknown_tenant", f"tenant {tenant_id!r} did not exist at {at}")
        return history[index - 1][2]

    def limits(self, tenant_id: str, model: str, at: datetime | None = None) -> Limits:
        """The limits in force for a tenant and model (now, or at `at`): the plan's defaults,
        overridden by the "*" override, then the model's base name, then its exact version.
        Each override only replaces the fields it set."""
        if at is None:
            cached = self._current.get((tenant_id, model))
            if cached is not None:
                return cached
        defaults = PLAN_LIMITS[self.plan(tenant_id, at)]
        values = {name: getattr(defaults, name) for name in LIMIT_FIELDS}
        base = base_model(model)
        scopes = ("*", base) if base == model else ("*", base, model)
        for scope in scopes:
            for entry in self._overrides.get((tenant_id, scope), ()):
                if at is not None and entry.at > at:
                    break
                values.update(entry.values)
        resolved = Limits(**values)
        if at is None:
            self._current[(tenant_id, model)] = resolved
        return resolved

    def price(
        self, model: str, at: datetime, service_tier: str = "default", adapter: str = ""
    ) -> Price:
        """The price in force (`PriceBook.price`)."""
        return self.prices.price(model, at, service_tier, adapter)

    def has_price(self, model: str, at: datetime) -> bool:
        try:
            self.price(model, at)
        except DomainError:
            return False
        return True

    def model_profile(self, model: str, at: datetime | None = None) -> ModelProfile:
        """The KV profile in force for a model version (now, or at `at`): a registered profile of
        the exact version, else of its base name, else the built-in default. None of them is a
        DomainError that says what to register."""
        for name in (model, base_model(model)):
            history = self._profiles.get(name)
            if history:
                if at is None:
                    return history[-1][2]
                index = bisect.bisect_right(history, at, key=lambda entry: entry[0])
                if index:
                    return history[index - 1][2]
        default = PROFILES.get(model) or PROFILES.get(base_model(model))
        if default is not None:
            return default
        raise DomainError(
            "no_model_profile",
            f"no model profile for {model!r} (its KV-cache size per token is unknown): register "
            f"one with `tollgate models register --model {model} --hf-config PATH/config.json` "
            "or --layers/--kv-heads/--head-dim/--dtype-bytes",
            field="model",
        )

    def model_profiles(self, model: str) -> list[tuple[datetime, ModelProfile]]:
        """Every registered profile of a model name or version, by effective instant."""
        return [(at, profile) for at, _, profile in self._profiles.get(model, ())]

    def slo(self, tier: str, at: datetime) -> Slo:
        """The objective of a tier in force at `at` (seed 000's interactive default before any
        was set)."""
        history = self._slos.get(tier)
        if history:
            index = bisect.bisect_right(history, at, key=lambda entry: entry[0])
            if index:
                return history[index - 1][2]
        return DEFAULT_SLOS.get(tier, DEFAULT_SLOS["standard"])

    def regions(self, tenant_id: str, key_id: str) -> frozenset[str] | None:
        """The regions a key's requests may be served in (its tenant's pin narrowed by its
        project's); None: anywhere."""
        project = self.hierarchy.project_of_key(tenant_id, key_id)
        return self.data_policy.regions(tenant_id, project)

    def retention(self, tenant_id: str, key_id: str) -> str:
        """The retention tier of a key's requests: `zero` when its tenant or project says so."""
        project = self.hierarchy.project_of_key(tenant_id, key_id)
        return self.data_policy.retention(tenant_id, project)

    def adapter(self, tenant_id: str, key_id: str, name: str) -> Adapter | None:
        """The LoRA adapter a key asks for by `name`: its tenant's, live, and open to the key's
        project; None otherwise, exactly as for a name never registered."""
        project = self.hierarchy.project_of_key(tenant_id, key_id)
        return self.adapters.visible(tenant_id, name, project)

    def replicas(self, model: str | None = None) -> list[ReplicaRegistered]:
        return [r for r in self._replicas.values() if model is None or r.model == model]

    def _tenant_or_error(self, tenant_id: str) -> Tenant:
        tenant = self._tenants.get(tenant_id)
        if tenant is None:
            raise DomainError("unknown_tenant", f"no tenant {tenant_id!r}", field="tenant_id")
        return tenant


def _profile_of(event: ModelProfileRegistered) -> ModelProfile:
    # The view keeps a profile's own max_model_len default when the event leaves it to the
    # replica: the replica's /v1/models, when it reports one, is what limits a request.
    return ModelProfile(
        event.model,
        layers=event.layers,
        kv_heads=event.kv_heads,
        head_dim=event.head_dim,
        dtype_bytes=event.dtype_bytes,
        attention="mla" if event.attention == "mla" else "gqa",
        kv_lora_rank=event.kv_lora_rank,
        rope_dim=event.rope_dim,
        **({} if event.max_model_len is None else {"max_model_len": event.max_model_len}),
    )
