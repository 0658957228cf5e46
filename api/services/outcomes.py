"""How requests ended or were refused, as the live goodput counters and the log say it: the
same classification as `tollgate ledger goodput`, and refusals recorded one by one as many per
minute as the plan admits requests, the rest counted per key and window (`domain.refusals`)."""

from __future__ import annotations

from datetime import datetime

from tollgate_llm.api.metrics import Metrics
from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.recorder import Recorder
from tollgate_llm.domain import goodput
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.refusals import RefusalSampler
from tollgate_llm.domain.requests.decide import (
    CancelRequest,
    CompleteRequest,
    FailRequest,
    PreemptRequest,
    RejectRequest,
)
from tollgate_llm.domain.requests.events import RefusalsCounted
from tollgate_llm.ledger.ids import Clock

__all__ = ["Outcomes", "Terminal"]

Terminal = (
    CompleteRequest
    | CancelRequest
    | FailRequest
    | PreemptRequest
)


class Outcomes:
    def __init__(
        self, *, control: ControlView, metrics: Metrics, recorder: Recorder,
        refusals: RefusalSampler, clock: Clock,
    ) -> None:  # fmt: skip
        self.control = control
        self.metrics = metrics
        self.recorder = recorder
        # Which refusals are recorded one by one; the rest are counted per key and window.
        self.refusals = refusals
        self.clock = clock

    def count(
        self, tenant_id: str, tier: str, model: str, status: str, admitted_at: datetime,
        command: Terminal | None = None, reject_reason: str | None = None,
    ) -> None:
        """The live goodput counters: the same classification as `tollgate ledger goodput`,
        against the objective in force at the request's admission."""
        done = command if isinstance(command, CompleteRequest) else None
        found = goodput.outcome(
            status,
            self.control.slo(tier, admitted_at),
            ttft_ms=done.ttft_ms if done else None,
            tpot_us=done.tpot_us if done else None,
            reject_reason=reject_reason,
        )
        if found is not None:
            self.metrics.count_outcome(tenant_id, tier, model, found)

    def reject(
        self, request_id: str, caller: Caller, model: str, reason: str, retry_after_s: int,
        detail: str, is_retry: bool,
    ) -> None:
        self.metrics.rejected.labels(reason, caller.tier).inc()
        now = self.clock()
        self.count(
            caller.tenant_id, caller.tier, model, "rejected", now, reject_reason=reason
        )
        # An invalid request's model may be any name the client made up: counted as "".
        counted_model = "" if reason == "invalid" else model
        # As many in full per minute as the plan admits requests (domain.refusals).
        rpm = self.control.limits(caller.tenant_id, "*").rpm
        if not self.refusals.record_in_full(
            caller.key_id, caller.tenant_id, counted_model, caller.tier, reason, now, rpm
        ):
            return  # counted, recorded with the others of its window once that has closed
        self.recorder.reject(
            RejectRequest(
                request_id=request_id, tenant_id=caller.tenant_id, key_id=caller.key_id,
                model=model, tier=caller.tier, reason=reason,  # type: ignore[arg-type]
                retry_after_s=retry_after_s, detail=detail[:300], is_retry=is_retry,
            ),
            caller.tenant_id,
            now,
        )

    def record_counted_refusals(self, *, everything: bool = False) -> int:
        """One `RefusalsCounted` per key, window, model, tier and reason whose window has closed
        (`everything`: the open ones too, at shutdown); returns how many were recorded."""
        now = self.clock()
        counted = self.refusals.drain() if everything else self.refusals.closed(now)
        for c in counted:
            event = RefusalsCounted(
                c.tenant_id, c.key_id, c.model, c.tier, c.reason, c.window_start, c.window_s,
                c.count,
            )
            stream_id = "rfs_" + self.recorder.new_id().replace("-", "")
            self.recorder.fact(stream_id, c.tenant_id, event, 0, now)
        return len(counted)
