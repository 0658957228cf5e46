"""The runs step of an admission: the run a call names (or starts), recorded when its first
call starts it, and recorded once exhausted when a call is refused on its budget."""

from __future__ import annotations

from tollgate_llm.api.ports import Clock
from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.recorder import Recorder
from tollgate_llm.domain.admission_steps import resolve_run
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.governance.decide import StartRun
from tollgate_llm.domain.governance.decide import decide as hierarchy_decide
from tollgate_llm.domain.runs.events import RunBudgetExhausted
from tollgate_llm.domain.runs.state import Run, run_stream
from tollgate_llm.domain.views import AdmissionViews

__all__ = ["RunSteps"]


class RunSteps:
    """Built by `Admission` from what it is given, so the edge's wiring stays as it is."""

    def __init__(
        self, *, control: ControlView, views: AdmissionViews, recorder: Recorder, clock: Clock
    ) -> None:
        self.control = control
        self.views = views
        self.recorder = recorder
        self.clock = clock

    def resolve(self, caller: Caller, run_id: str) -> Run | None:
        """The run `run_id` names for this caller (`domain.admission_steps.resolve_run`)."""
        return resolve_run(
            self.control.hierarchy, self.views.paths, caller.tenant_id, caller.key_id, run_id,
            self.clock(),
        )  # fmt: skip

    def started(self, run: Run) -> None:
        """Record the RunStarted of a run its first call started (at version 0: if another
        edge started it first, that one stands and this append is refused, which is counted)."""
        (event,) = hierarchy_decide(
            self.control.hierarchy,
            StartRun(run.tenant_id, run.run_id, run.project_id, run.limits, True),
        )
        self.recorder.fact(run_stream(run.tenant_id, run.run_id), run.tenant_id,
                           event, 0, run.started_at)  # fmt: skip

    def exhausted(self, run: Run, dimension: str, request_id: str) -> bool:
        """Record RunBudgetExhausted on the first refusal of `dimension` only (True then)."""
        if not self.views.paths.runs.mark_exhausted(run.tenant_id, run.run_id, dimension):
            return False
        event = RunBudgetExhausted(run.tenant_id, run.run_id, dimension, request_id)
        self.recorder.fact(run_stream(run.tenant_id, run.run_id), run.tenant_id, event, None)
        return True
