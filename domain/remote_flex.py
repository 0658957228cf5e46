"""Flex work other edges serve, by replica, folded from the shared log: what an edge may ask
them to preempt (`lifecycle.AskToPreempt`) when an interactive request needs the room.

An edge preempts its own flex requests directly (`capacity.preemption_plan` over the router's
own dispatches). Those of another edge it can only ask for, through the log, so it keeps this
fold of their admissions (service tier flex, another edge id), estimates, routes and ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from tollgate_llm.domain.envelope import Event, Recorded
from tollgate_llm.domain.requests.events import (
    TERMINAL_EVENTS,
    PreemptionRequested,
    RequestAdmitted,
    RequestEstimated,
    RequestRouted,
)

__all__ = ["RemoteFlex", "routes", "routes_to_read"]


@dataclass(slots=True)
class _Flex:
    tenant_id: str
    tokens: int = 0  # prompt + reserved output, as its edge estimated (what its router counted)
    replica_id: str | None = None
    asked: bool = False  # a preemption was asked for (by this edge or another)


class RemoteFlex:
    """Flex requests in flight on other edges. `preemptible(replica)` lists those no edge has
    asked to preempt yet, oldest first (the tuple `capacity.ReplicaLoad.flex` takes);
    `asked_tokens(replica)` is the KV of those asked for and not ended yet, which the router
    counts as free: their edge is aborting them."""

    def __init__(self, edge_id: str) -> None:
        self.edge_id = edge_id
        self._requests: dict[str, _Flex] = {}
        # replica id -> request id -> tokens, in routing order; only those not asked for.
        self._preemptible: dict[str, dict[str, int]] = {}
        self._asked: dict[str, int] = {}  # replica id -> tokens asked for, not ended yet
        self._handlers: dict[type[Event], Callable[[Recorded], None]] = {
            RequestAdmitted: self._on_admitted,
            RequestEstimated: self._on_estimated,
            RequestRouted: self._on_routed,
            PreemptionRequested: self._on_asked,
            **{kind: self._on_terminal for kind in TERMINAL_EVENTS},
        }

    def folded_types(self) -> frozenset[str]:
        """What a follower of the log must read for this view. RequestRouted is folded but not
        tailed (one per request of every edge): `routes_to_read` names the few streams whose
        route to read."""
        return frozenset(k.EVENT_TYPE for k in self._handlers if k is not RequestRouted)

    def apply(self, recorded: Recorded) -> None:
        handler = self._handlers.get(type(recorded.event))
        if handler is not None:
            handler(recorded)

    # --- what the router reads -------------------------------------------------------------

    def preemptible(self, replica_id: str) -> tuple[tuple[str, int], ...]:
        found = self._preemptible.get(replica_id)
        return tuple(found.items()) if found else ()

    def asked_tokens(self, replica_id: str) -> int:
        return self._asked.get(replica_id, 0)

    def tenant_of(self, request_id: str) -> str | None:
        flex = self._requests.get(request_id)
        return None if flex is None else flex.tenant_id

    def ask(self, request_id: str) -> bool:
        """This edge is asking for its preemption: it is no longer a candidate, and its KV is
        counted as being freed. False when it is unknown here or already asked for."""
        flex = self._requests.get(request_id)
        if flex is None or flex.asked:
            return False
        flex.asked = True
        if flex.replica_id is not None:
            self._preemptible.get(flex.replica_id, {}).pop(request_id, None)
            self._asked[flex.replica_id] = self._asked.get(flex.replica_id, 0) + flex.tokens
        return True

    # --- the fold ---------------------------------------------------------------------------

    def _on_admitted(self, recorded: Recorded) -> None:
        event = recorded.event
        assert isinstance(event, RequestAdmitted)
        if _remote_flex(event, self.edge_id) and event.request_id not in self._requests:
            self._requests[event.request_id] = _Flex(event.tenant_id)

    def _on_estimated(self, recorded: Recorded) -> None:
        event = recorded.event
        assert isinstance(event, RequestEstimated)
        flex = self._requests.get(event.request_id)
        if flex is not None and flex.replica_id is None:
            flex.tokens = event.reserved_tokens

    def _on_routed(self, recorded: Recorded) -> None:
        event = recorded.event
        assert isinstance(event, RequestRouted)
        flex = self._requests.get(event.request_id)
        if flex is None or flex.replica_id is not None:
            return
        flex.replica_id = event.replica_id
        if flex.asked:
            self._asked[event.replica_id] = self._asked.get(event.replica_id, 0) + flex.tokens
        else:
            self._preemptible.setdefault(event.replica_id, {})[event.request_id] = flex.tokens

    def _on_asked(self, recorded: Recorded) -> None:
        event = recorded.event
        assert isinstance(event, PreemptionRequested)
        self.ask(event.request_id)

    def _on_terminal(self, recorded: Recorded) -> None:
        request_id = recorded.stream_id
        flex = self._requests.pop(request_id, None)
        if flex is None or flex.replica_id is None:
            return
        replica = flex.replica_id
        if flex.asked:
            left = self._asked.get(replica, 0) - flex.tokens
            if left > 0:
                self._asked[replica] = left
            else:
                self._asked.pop(replica, None)
            return
        candidates = self._preemptible.get(replica)
        if candidates is not None:
            candidates.pop(request_id, None)
            if not candidates:
                del self._preemptible[replica]


def _remote_flex(event: RequestAdmitted, edge_id: str) -> bool:
    return event.service_tier == "flex" and event.edge_id != edge_id


def routes_to_read(records: Iterable[Recorded], edge_id: str) -> list[str]:
    """The request ids among `records` whose RequestRouted a follower must read for
    `RemoteFlex`: the flex admissions of other edges (their route is in the same commit)."""
    return [
        r.stream_id for r in records
        if type(r.event) is RequestAdmitted and _remote_flex(r.event, edge_id)
    ]  # fmt: skip


ROUTED: Final = RequestRouted.EVENT_TYPE


def routes(streams: Sequence[Sequence[Recorded]]) -> list[Recorded]:
    """The RequestRouted records of the streams read for `routes_to_read`."""
    return [r for stream in streams for r in stream if r.type == ROUTED]
