"""A tenant's consents to be served by another model than the one it asked for: fallbacks
(`tollgate fallbacks allow`: another model when the one asked has no room) and the router
(`tollgate routing allow`: `auto` served by the cheapest good-enough model). Facts on the
tenant's stream, decided in `domain.control_plane.decide` and folded by `FallbackBook` and
`RoutingBook` (`ControlView.fallback_book`, `ControlView.routing_book`). Without a consent no
other model is ever served.
"""

from __future__ import annotations

from datetime import datetime
from typing import Final

from tollgate_llm.domain.control_plane.events import (
    FallbackAllowed,
    FallbackRevoked,
    RoutingAllowed,
    RoutingRevoked,
)
from tollgate_llm.domain.cost import base_model
from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.routing import RoutingPolicy

__all__ = ["CONSENT_EVENTS", "FALLBACK_EVENTS", "ROUTING_EVENTS", "FallbackBook", "RoutingBook"]

FALLBACK_EVENTS: Final = (FallbackAllowed, FallbackRevoked)
ROUTING_EVENTS: Final = (RoutingAllowed, RoutingRevoked)
CONSENT_EVENTS: Final = (*FALLBACK_EVENTS, *ROUTING_EVENTS)


class FallbackBook:
    """The models each tenant consented to be served instead of another, by (tenant, the model
    as named in the consent: a version or a base name), in the order consent was given."""

    def __init__(self) -> None:
        self._allowed: dict[tuple[str, str], list[str]] = {}

    def apply(self, event: Event) -> None:
        match event:
            case FallbackAllowed():
                allowed = self._allowed.setdefault((event.tenant_id, event.from_model), [])
                if event.to_model not in allowed:
                    allowed.append(event.to_model)
            case FallbackRevoked():
                allowed = self._allowed.get((event.tenant_id, event.from_model), [])
                if event.to_model in allowed:
                    allowed.remove(event.to_model)

    def given(self, tenant_id: str, from_model: str) -> tuple[str, ...]:
        """The consents given for exactly `from_model` (what a command is decided on)."""
        return tuple(self._allowed.get((tenant_id, from_model), ()))

    def fallbacks(self, tenant_id: str, model: str) -> tuple[str, ...]:
        """The models a tenant consented to be served instead of `model` (a version, or its
        base name), in the order it consented."""
        base = base_model(model)
        exact = self._allowed.get((tenant_id, model), [])
        wider = self._allowed.get((tenant_id, base), []) if base != model else []
        return tuple(dict.fromkeys([*exact, *wider]))


class RoutingBook:
    """Each tenant's consent to the router, by (tenant, project "" for the organization)."""

    def __init__(self) -> None:
        self._policies: dict[tuple[str, str], RoutingPolicy] = {}

    def apply(self, event: Event, at: datetime) -> None:
        match event:
            case RoutingAllowed():
                self._policies[(event.tenant_id, event.project_id)] = RoutingPolicy(
                    event.tenant_id, event.project_id, event.models, event.quality_bar_ppm,
                    event.exploration_ppm, event.on_capacity, at, event.route_reference,
                )  # fmt: skip
            case RoutingRevoked():
                self._policies.pop((event.tenant_id, event.project_id), None)

    def own(self, tenant_id: str, project_id: str) -> RoutingPolicy | None:
        """The consent given at exactly this level (project "": the organization's)."""
        return self._policies.get((tenant_id, project_id))

    def routing(self, tenant_id: str, project_id: str | None = None) -> RoutingPolicy | None:
        """The router consent in force for a request of `project_id` (None: the organization's
        key): the project's own, else the organization's, else None (nothing is routed)."""
        if project_id:
            own = self._policies.get((tenant_id, project_id))
            if own is not None:
                return own
        return self._policies.get((tenant_id, ""))

    def policies(self, tenant_id: str) -> list[RoutingPolicy]:
        return [p for (t, _), p in self._policies.items() if t == tenant_id]
