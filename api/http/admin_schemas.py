"""What the admin routes (api/http/admin_routes.py) and the audit route read and answer, as
pydantic models FastAPI validates the bodies with and describes in `/openapi.json`.

Bodies are strict (a number is not a string of digits, a flag not 0/1: what the published schema
says is all that is accepted) and closed (an unknown field is a 400 naming it). The rules that
span fields or need the control plane are the command handler's (api/services/admin_service.py),
the same as the CLI's."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from tollgate_llm.api.http.schemas import Usd
from tollgate_llm.domain.control_plane.adapters import (
    ADAPTER_NAME,
    MAX_PATH_CHARS,
    MAX_PROJECTS,
    MAX_RANK,
)
from tollgate_llm.domain.control_plane.data_policy import MAX_REGIONS, REGION, RETENTION_TIERS
from tollgate_llm.domain.control_plane.state import MAX_MODEL_CHARS, TENANT_NAME
from tollgate_llm.domain.governance.state import LEVEL_NAME, LevelKind
from tollgate_llm.domain.types import SCOPES, TIERS

# RFC 3339, as `format: date-time` means it (a date alone or an instant without its offset is not
# one): checked before pydantic's own, laxer parsing.
RFC3339 = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?"
                     r"([Zz]|[+-][0-9]{2}:[0-9]{2})")  # fmt: skip


def _rfc3339(value: Any) -> Any:
    if not isinstance(value, str) or not RFC3339.fullmatch(value):
        raise ValueError("must be an RFC 3339 instant, e.g. 2026-12-01T00:00:00Z")
    return value


Instant = Annotated[datetime, BeforeValidator(_rfc3339), Field(strict=False)]
Quantity = Annotated[int, Field(ge=0, le=10**12)]
Dimension = Annotated[int, Field(ge=1, le=1_000_000)]
Name = Annotated[str, Field(pattern=LEVEL_NAME.pattern, max_length=63)]
ModelName = Annotated[str, Field(min_length=1, max_length=MAX_MODEL_CHARS)]
Plan = Literal[TIERS]  # type: ignore[valid-type]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Level(_Body):
    """At most one level below the organization (none: the organization's own), or each end
    user of a project (`per_end_user` with `project`)."""

    workspace: Name | None = Field(None, description="a workspace of the tenant")
    project: Name | None = Field(None, description="a project of the tenant")
    key: Annotated[str, Field(max_length=64)] | None = Field(
        None, description="an API key id of the tenant"
    )
    per_end_user: bool = Field(
        False, description="with `project` (and no other level): what each end user of the "
        "project gets on its own (the request's `user`, `safety_identifier` or "
        "X-Tollgate-End-User), at level `end_user`; limits `rpm` and `tpm` only, a budget "
        "`period` `day` only",
    )  # fmt: skip


class TenantCreate(_Body):
    name: Annotated[str, Field(pattern=TENANT_NAME.pattern, max_length=63)] = Field(
        description="becomes the tenant's id"
    )
    plan: Plan = "standard"


class PlanChange(_Body):
    plan: Plan


class KeyCreate(_Body):
    scope: Literal[SCOPES] = "customer"  # type: ignore[valid-type]
    project: Name | None = Field(None, description="its project (default: the organization)")


class KeyProject(_Body):
    project: Name


class LimitsSet(_Level):
    """Unset limits keep what is in force (the plan's default, or an earlier value)."""

    model: ModelName = Field(description="a model name, version, or * for every model")
    rpm: Quantity | None = Field(None, description="requests per minute")
    tpm: Quantity | None = Field(None, description="tokens per minute")
    max_context: Quantity | None = Field(None, description="max prompt tokens")
    max_output: Quantity | None = Field(None, description="max completion tokens")
    kv_gib_seconds: Quantity | None = Field(
        None, description="cap on concurrent estimated KV GiB-seconds in flight"
    )
    reserved_kv_gib_seconds: Quantity | None = Field(
        None, description="enterprise reserved floor (the organization's only)"
    )


class WorkspaceCreate(_Body):
    name: Name


class ProjectCreate(_Body):
    name: Name
    workspace: Name


class BudgetSet(_Level):
    """Give `amount` (or its deprecated alias `usd`, not both)."""

    period: Literal["day", "month"]
    amount: Usd | None = Field(
        None, description='the budget in `currency`, e.g. "25.00"; null removes it'
    )
    usd: Usd | None = Field(
        None, description="deprecated: the old name of `amount` (it was always in `currency`, "
        "not necessarily dollars), still accepted; give one of the two",
        json_schema_extra={"deprecated": True},
    )  # fmt: skip
    currency: Annotated[str, Field(pattern="^[A-Z]{3}$")] | None = Field(
        None, description="ISO 4217; the budget counts only spend priced in it (default: the "
        "deployment's currency)",
    )

    def amount_given(self) -> dict[str, str | None]:
        """The amount under the name it was sent as (`amount`, or the deprecated `usd`): the
        command handler checks that exactly one was, and names it in any refusal."""
        return {name: getattr(self, name) for name in ("amount", "usd")
                if name in self.model_fields_set}  # fmt: skip


class TimeZoneSet(_Body):
    zone: Annotated[str, Field(min_length=1, max_length=64)] = Field(
        description="an IANA time zone, e.g. Europe/Paris: where budget days and months begin"
    )


class PriceSet(_Body):
    """Per million tokens, in the deployment's currency (the setting `currency`)."""

    model: ModelName
    prompt: Usd
    completion: Usd
    cached: Usd
    effective_at: Instant | None = Field(None, description="default: now")


class FlexDiscountSet(_Body):
    model: ModelName
    percent: Annotated[float, Field(ge=0, le=100)] = Field(
        description="the flex class's discount on the model's price, e.g. 50"
    )
    effective_at: Instant | None = Field(None, description="default: now")


class ModelRegister(_Body):
    """A model's KV shape: dense/GQA (layers, kv_heads, head_dim, dtype_bytes) or MLA (layers,
    mla_rank, rope_dim, dtype_bytes)."""

    model: ModelName
    layers: Dimension | None = None
    kv_heads: Dimension | None = None
    head_dim: Dimension | None = None
    dtype_bytes: Dimension | None = Field(None, description="bytes per KV element (bf16: 2)")
    mla_rank: Dimension | None = Field(None, description="MLA: kv_lora_rank (then rope_dim)")
    rope_dim: Dimension | None = None
    max_model_len: Dimension | None = None
    effective_at: Instant | None = Field(None, description="default: now")


class AdapterRegister(_Body):
    """What `tollgate adapters register` takes: the tenant is the path's."""

    name: Annotated[str, Field(pattern=ADAPTER_NAME.pattern)] = Field(
        description="what the tenant's requests ask for (`model`)"
    )
    base: ModelName = Field(description="the base model (name or version) it adapts")
    path: Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS)] = Field(
        description="its directory, absolute, as the replicas read it"
    )
    rank: Annotated[int, Field(ge=1, le=MAX_RANK)] | None = Field(
        None, description="default: `r` of PATH/adapter_config.json, read by this server"
    )
    projects: Annotated[list[Name], Field(max_length=MAX_PROJECTS)] = Field(
        default_factory=list, description="only these projects' keys (default: every key)"
    )


class AdapterPriceSet(_Body):
    """Per million tokens, in the deployment's currency: the adapter's own price (without one
    it is billed at its base model's)."""

    prompt: Usd
    completion: Usd
    cached: Usd
    effective_at: Instant | None = Field(None, description="default: now")


Region = Annotated[str, Field(pattern=REGION.pattern)]


class ResidencySet(_Body):
    regions: Annotated[list[Region], Field(min_length=1, max_length=MAX_REGIONS)] = Field(
        description="e.g. [\"eu-west\", \"eu-central\"]: only replicas there serve it"
    )
    project: Name | None = Field(
        None, description="pin one project (within the tenant's regions); default: the tenant"
    )


class ResidencyClear(_Body):
    project: Name | None = Field(None, description="default: the tenant's own pin")


class RetentionSet(_Body):
    tier: Literal[RETENTION_TIERS] = Field(  # type: ignore[valid-type]
        description="zero: no response kept for an Idempotency-Key replay, batch files deleted "
        "once used"
    )
    project: Name | None = Field(None, description="default: the tenant")


# --- answers -----------------------------------------------------------------------------------


class AdminTenant(BaseModel):
    object: Literal["tenant"]
    id: str
    plan: str
    registered_at: str


class AdminTenantList(BaseModel):
    object: Literal["list"]
    data: list[AdminTenant]


class AdminKey(BaseModel):
    object: Literal["api_key"]
    id: str
    tenant: str
    scope: str
    project: str | None
    revoked: bool


class IssuedKey(AdminKey):
    secret: str = Field(description="the key: shown in this answer only, never stored")


class LimitsRecorded(BaseModel):
    object: Literal["limits"]
    tenant: str
    level: LevelKind = Field(description="`end_user`: each end user of the project `level_id`")
    level_id: str
    model: str
    recorded: dict[str, int]


class LimitsInForce(BaseModel):
    object: Literal["limits_in_force"]
    tenant: str
    model: str
    at: str | None
    plan: str
    rpm: int
    tpm: int
    max_context: int
    max_output: int
    kv_gib_seconds: int
    reserved_kv_gib_seconds: int


class AdminWorkspace(BaseModel):
    object: Literal["workspace"]
    id: str
    tenant: str


class AdminProject(BaseModel):
    object: Literal["project"]
    id: str
    tenant: str
    workspace: str


class AdminBudget(BaseModel):
    object: Literal["budget"]
    tenant: str
    level: LevelKind = Field(description="`end_user`: each end user of the project `level_id`")
    level_id: str
    period: Literal["day", "month"]
    amount_micros: int | None
    amount: str | None = Field(description="the budget, in `currency`")
    usd: str | None = Field(
        description="deprecated: the same as `amount` (in `currency`)",
        json_schema_extra={"deprecated": True},
    )
    currency: str
    changed: bool = Field(description="false: it was already so (nothing recorded)")


class AdminTimeZone(BaseModel):
    object: Literal["time_zone"]
    tenant: str
    zone: str
    changed: bool


class AdminPrice(BaseModel):
    object: Literal["price"]
    model: str
    currency: str
    prompt_micros_per_mtok: int
    completion_micros_per_mtok: int
    cached_micros_per_mtok: int
    effective_at: str


class AdminFlexDiscount(BaseModel):
    object: Literal["flex_discount"]
    model: str
    discount_ppm: int
    effective_at: str


class ProfileShape(BaseModel):
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    attention: Literal["gqa", "mla"]
    kv_lora_rank: int
    rope_dim: int
    max_model_len: int


class ProfileVersion(ProfileShape):
    effective_at: str


class AdminModelProfile(ProfileShape):
    object: Literal["model_profile"]
    model: str
    kv_bytes_per_token: int
    history: list[ProfileVersion]


class AdminAdapter(BaseModel):
    object: Literal["adapter"]
    tenant: str
    name: str
    base: str
    path: str
    rank: int
    projects: list[str]
    version: int = Field(description="1, then one more each re-registration")
    engine_name: str = Field(description="what the replicas load and serve it as")
    registered_at: str
    revoked_at: str | None
    priced: Literal["own", "base", "none"]
    changed: bool | None = Field(
        None, description="revoke only: false when it was revoked already"
    )


class AdminAdapterList(BaseModel):
    object: Literal["list"]
    data: list[AdminAdapter]


class AdminAdapterPrice(BaseModel):
    object: Literal["adapter_price"]
    tenant: str
    adapter: str
    currency: str
    prompt_micros_per_mtok: int
    completion_micros_per_mtok: int
    cached_micros_per_mtok: int
    effective_at: str


class AdminResidency(BaseModel):
    object: Literal["residency"]
    tenant: str
    project: str | None
    regions: list[str] | None = Field(description="null: not pinned at this level")
    changed: bool


class AdminRetention(BaseModel):
    object: Literal["retention"]
    tenant: str
    project: str | None
    tier: Literal["standard", "zero"]
    changed: bool


class ProjectPolicy(BaseModel):
    project: str
    regions: list[str] | None
    retention: str
    regions_in_force: list[str] | None
    retention_in_force: str


class AdminDataPolicy(BaseModel):
    object: Literal["data_policy"]
    tenant: str
    regions: list[str] | None
    retention: str
    projects: list[ProjectPolicy]


# --- the audit trail ---------------------------------------------------------------------------


class AuditChange(BaseModel):
    subject: str = Field(description="what was changed, e.g. `limits model=*`, `key key_1`")
    field: str
    old: str | None = Field(description="null: none before (a new thing, or the default)")
    new: str | None


class AuditRecord(BaseModel):
    id: str
    position: int
    stream: str
    stream_version: int
    tenant: str | None = Field(description="null: a change of no one tenant (prices, models)")
    at: str
    actor: str | None = Field(description="an admin key's id, or the CLI's --actor / user@host")
    actor_kind: Literal["key", "operator", "system"] | None
    command: str | None
    changes: list[AuditChange]


class AuditPage(BaseModel):
    object: Literal["list"]
    data: list[AuditRecord]
    has_more: bool
    last_id: int | None = Field(None, description="pass as `after` for the next page, older")


class AuditProblem(BaseModel):
    stream: str
    problem: str


class AuditHead(BaseModel):
    stream: str
    sealed_through: int
    seal: str


class AuditReport(BaseModel):
    ok: bool
    streams: int
    events: int
    problems: list[AuditProblem]
    heads: list[AuditHead] = Field(
        description="each stream's last seal: a copy kept elsewhere pins the history up to it"
    )
