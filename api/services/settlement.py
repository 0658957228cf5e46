"""The end of an admission: an ended request's reservations given back (the quota refunded,
every hierarchy level trued up with the bill's amount, the router's KV released, the output
predictor taught a completed request's length), or an admission that was not recorded voided."""

from __future__ import annotations

from datetime import datetime

from tollgate_llm.api.ports import Clock, Fleet, OutputPredictor
from tollgate_llm.api.services.recorder import Flight
from tollgate_llm.domain.control_plane.adapters import price_key_of
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.cost import amount_micros
from tollgate_llm.domain.requests.decide import Command, CompleteRequest, PreemptRequest
from tollgate_llm.domain.views import AdmissionViews

__all__ = ["Settlement"]


class Settlement:
    """Built by `Admission` from what it is given, so the edge's wiring stays as it is."""

    def __init__(
        self,
        *,
        control: ControlView,
        views: AdmissionViews,
        fleet: Fleet,
        predictor: OutputPredictor | None,
        clock: Clock,
    ) -> None:
        self.control = control
        self.views = views
        self.fleet = fleet
        self.predictor = predictor
        self.clock = clock

    def void(self, flight: Flight) -> None:
        """Its admission was not recorded, so nothing was admitted: the quota and the router's
        reservation are given back."""
        self.views.void(flight.request_id)
        self.fleet.release(flight.choice)

    def settle(self, flight: Flight, command: Command) -> None:
        """The request ended (`command`, its terminal): the predictor learns a completed
        request's length, the views get what it did not use back and the router its KV."""
        p = flight.progress
        if (
            flight.shape is not None
            and self.predictor is not None
            and isinstance(command, CompleteRequest)
        ):
            # Only a completed request's count is its natural length: a cancelled or failed
            # one stopped short, and would teach the history and the coverage to expect less.
            state = flight.state
            reserved = state.reserved_output_tokens if state.predictor_version else None
            self.predictor.observe(flight.shape, reserved, p.completion_tokens)
        # Preempted: our decision, so the tenant's quota gets all of the reservation back.
        preempted = isinstance(command, PreemptRequest)
        used = 0 if preempted else p.prompt_tokens + p.completion_tokens
        now = self.clock()
        self.views.refund(flight.request_id, used, now, lambda: self._bill(flight, now, preempted))
        self.fleet.release(flight.choice)

    def _bill(self, flight: Flight, now: datetime, preempted: bool) -> tuple[int, int]:
        """What the bill will say (amount, tool calls), for every level's true-up: the same
        engine counts at the price in force at admission for its service tier
        (`domain.requests`'s bill; a preempted request bills nothing), so the bill changes
        nothing."""
        p = flight.progress
        state = flight.state
        admitted_at = state.admitted_at or now
        price = self.control.price(
            flight.model, admitted_at, state.service_tier,
            price_key_of(state.tenant_id, state.adapter),
        )  # fmt: skip
        amount = 0 if preempted else amount_micros(
            price, p.prompt_tokens, p.completion_tokens, min(p.cached_tokens, p.prompt_tokens)
        )  # fmt: skip
        return amount, p.tool_calls
