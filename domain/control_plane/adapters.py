"""A tenant's LoRA adapters: fine-tunes of a base model that share its replicas (vLLM's
multi-LoRA), registered and revoked as facts on the tenant's stream, decided here and folded by
`AdapterBook` (`ControlView.adapters`).

An adapter is the tenant's own: only its keys (or, when it names projects, the keys of those
projects) may ask for `model: <name>`; to everyone else the name does not exist. It is served
by the base model's replicas under an engine name unique to this registration
(`<tenant>/<name>@<version>`), so two tenants' adapters of the same name never meet on a
replica, and a re-registration (new weights) is loaded afresh instead of reusing the old ones.

What an adapter costs admission (`adapter_tpot_us`): the base model's KV profile unchanged (a
LoRA adapter changes projection weights, not the shape of the cache), held for longer, because
each decode step also runs the adapter's low-rank matrices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import ClassVar, Final

from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.text import check_text

# Lower case, so an adapter name never reads like a catalogue model's `Org/Model-7B`; no "/" or
# "@", which the engine name uses as separators.
ADAPTER_NAME: Final = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
# vLLM's `--max-lora-rank` choices go up to 512; a rank past 1024 is no low-rank adapter.
MAX_RANK: Final = 1024
MAX_PATH_CHARS: Final = 1024
# An operator registers a tenant's fine-tunes one by one: the bound keeps the tenant's stream
# and every edge's fold of it small whatever is sent.
MAX_ADAPTERS_PER_TENANT: Final = 100
MAX_PROJECTS: Final = 16
# The price book's key for an adapter's own price (`tollgate adapters price`): ":" appears in no
# catalogue model id, so the key can never be a model's.
PRICE_PREFIX: Final = "adapter:"

# The adapter's own cost, in parts per million of the base model's time per output token, per
# unit of rank. Decode is bound by reading weights: a rank-r adapter on a projection of d_in x
# d_out reads r(d_in + d_out) more values than its d_in·d_out, which for a 7-8B Llama with every
# projection adapted comes to ~400 ppm of a layer's weights per unit of rank; vLLM's LoRA kernels
# run as extra launches per layer, so the estimate takes 2.5 times that. Rank 16 is +1.6 %, rank
# 64 +6.4 %: the KV the request holds is held that much longer, which is what admission reserves
# (KV GiB·s). The adapter's weights themselves take no KV: vLLM sizes its LoRA slots
# (`--max-loras` x `--max-lora-rank`) at start-up, outside the cache.
LORA_TPOT_PPM_PER_RANK: Final = 1_000


def adapter_tpot_us(tpot_us: int, rank: int) -> int:
    """The time per output token admission assumes for a request served through an adapter of
    `rank`: the base model's, stretched by the adapter's low-rank matrices."""
    return tpot_us * (1_000_000 + rank * LORA_TPOT_PPM_PER_RANK) // 1_000_000


def price_key(tenant_id: str, name: str) -> str:
    """The price book's model name for an adapter's own price (default: its base model's)."""
    return f"{PRICE_PREFIX}{tenant_id}/{name}"


def price_key_of(tenant_id: str, adapter: str) -> str:
    """The price key a request's bill looks up first: its adapter's, "" for none."""
    return price_key(tenant_id, adapter) if adapter else ""


def engine_name(tenant_id: str, name: str, version: int) -> str:
    """What the replicas know a registration by (vLLM's `lora_name`)."""
    return f"{tenant_id}/{name}@{version}"


# --- events ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AdapterRegistered(Event):
    """Tenant stream. `projects`: sorted, comma-separated ("" for the whole tenant), a string so
    the payload round-trips exactly. `version` counts the registrations of this name."""

    EVENT_TYPE: ClassVar[str] = "AdapterRegistered"
    tenant_id: str
    name: str
    base_model: str
    path: str  # the adapter's directory, as every replica of the base model can read it
    rank: int
    projects: str
    version: int


@dataclass(frozen=True, slots=True)
class AdapterRevoked(Event):
    EVENT_TYPE: ClassVar[str] = "AdapterRevoked"
    tenant_id: str
    name: str


ADAPTER_EVENTS: Final = (AdapterRegistered, AdapterRevoked)


# --- commands ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RegisterAdapter:
    tenant_id: str
    name: str
    base_model: str
    path: str
    rank: int
    projects: tuple[str, ...] = ()  # () : every key of the tenant


@dataclass(frozen=True, slots=True)
class RevokeAdapter:
    tenant_id: str
    name: str


AdapterCommand = RegisterAdapter | RevokeAdapter
ADAPTER_COMMANDS: Final = (RegisterAdapter, RevokeAdapter)


# --- the fold ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Adapter:
    tenant_id: str
    name: str
    base_model: str
    path: str
    rank: int
    projects: frozenset[str]
    version: int
    registered_at: datetime
    revoked_at: datetime | None = None

    @property
    def engine_name(self) -> str:
        return engine_name(self.tenant_id, self.name, self.version)

    @property
    def price_key(self) -> str:
        return price_key(self.tenant_id, self.name)

    def visible_to(self, project_id: str | None) -> bool:
        """Whether a key of `project_id` (None: an organization key) may ask for it."""
        return not self.projects or (project_id is not None and project_id in self.projects)


class AdapterBook:
    """The adapters by (tenant, name): the latest registration of each, revoked or not."""

    def __init__(self) -> None:
        self._adapters: dict[tuple[str, str], Adapter] = {}

    def apply(self, event: Event, at: datetime) -> None:
        match event:
            case AdapterRegistered():
                projects = frozenset(p for p in event.projects.split(",") if p)
                self._adapters[(event.tenant_id, event.name)] = Adapter(
                    event.tenant_id, event.name, event.base_model, event.path, event.rank,
                    projects, event.version, at,
                )  # fmt: skip
            case AdapterRevoked():
                old = self._adapters.get((event.tenant_id, event.name))
                if old is not None and old.revoked_at is None:
                    self._adapters[(event.tenant_id, event.name)] = Adapter(
                        old.tenant_id, old.name, old.base_model, old.path, old.rank,
                        old.projects, old.version, old.registered_at, at,
                    )  # fmt: skip

    def get(self, tenant_id: str, name: str) -> Adapter | None:
        """The latest registration of the name, revoked or not (None: never registered)."""
        return self._adapters.get((tenant_id, name))

    def live(self, tenant_id: str, name: str) -> Adapter | None:
        found = self._adapters.get((tenant_id, name))
        return found if found is not None and found.revoked_at is None else None

    def visible(self, tenant_id: str, name: str, project_id: str | None) -> Adapter | None:
        """The adapter a key of this tenant and project may ask for by `name`, or None, exactly
        as for a name that was never registered (another tenant's, a revoked one, one kept to
        other projects)."""
        found = self.live(tenant_id, name)
        return found if found is not None and found.visible_to(project_id) else None

    def of_tenant(self, tenant_id: str) -> list[Adapter]:
        return sorted(
            (a for (t, _), a in self._adapters.items() if t == tenant_id), key=lambda a: a.name
        )


# --- decide ------------------------------------------------------------------------------------


def decide_adapter(
    book: AdapterBook, command: AdapterCommand, *, unknown_projects: tuple[str, ...] = ()
) -> tuple[Event, ...]:
    """The events of an adapter command (the caller has checked the tenant, that the base model
    has a KV profile and that the name is no catalogue model's; `unknown_projects`: those named
    that are not the tenant's). A repeat that changes nothing: ()."""
    match command:
        case RegisterAdapter():
            _check_name(command.name)
            check_text(command.path, "path", max_chars=MAX_PATH_CHARS)
            if not command.path.startswith("/"):
                raise DomainError(
                    "bad_path", "the adapter's path is absolute: every replica reads it as is",
                    field="path",
                )  # fmt: skip
            if not 1 <= command.rank <= MAX_RANK:
                raise DomainError("bad_rank", f"rank is within [1, {MAX_RANK}]", field="rank")
            projects = tuple(sorted(set(command.projects)))
            if len(projects) > MAX_PROJECTS:
                raise DomainError(
                    "too_many_projects", f"at most {MAX_PROJECTS} projects", field="projects"
                )
            if unknown_projects:
                raise DomainError(
                    "unknown_project", f"no project {unknown_projects[0]!r} in tenant "
                    f"{command.tenant_id!r}", field="projects",
                )  # fmt: skip
            old = book.get(command.tenant_id, command.name)
            live = book.live(command.tenant_id, command.name)
            if live is not None and (live.base_model, live.path, live.rank, live.projects) == (
                command.base_model,
                command.path,
                command.rank,
                frozenset(projects),
            ):
                return ()
            count = sum(1 for a in book.of_tenant(command.tenant_id) if a.revoked_at is None)
            if live is None and count >= MAX_ADAPTERS_PER_TENANT:
                raise DomainError(
                    "too_many_adapters",
                    f"a tenant has at most {MAX_ADAPTERS_PER_TENANT} adapters; revoke one first",
                    field="name",
                )
            version = 1 if old is None else old.version + 1
            return (
                AdapterRegistered(
                    command.tenant_id, command.name, command.base_model, command.path,
                    command.rank, ",".join(projects), version,
                ),
            )  # fmt: skip
        case RevokeAdapter():
            if book.get(command.tenant_id, command.name) is None:
                raise DomainError(
                    "unknown_adapter", f"no adapter {command.name!r} in tenant "
                    f"{command.tenant_id!r}", field="name",
                )  # fmt: skip
            if book.live(command.tenant_id, command.name) is None:
                return ()
            return (AdapterRevoked(command.tenant_id, command.name),)


def _check_name(name: str) -> None:
    if not ADAPTER_NAME.fullmatch(name):
        raise DomainError(
            "bad_adapter_name", f"adapter name {name[:70]!r} must match {ADAPTER_NAME.pattern}",
            field="name",
        )  # fmt: skip
