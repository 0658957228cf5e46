"""What the path view (`domain.governance.budgets.PathView`) keeps of agent runs, beside the
money of a path's levels: per run, its calls, those in flight, its cost in the run's one
currency (reserved and posted) and its tool calls, folded from its calls' events; the runs this
edge started itself (their RunStarted may not be folded into the control view yet); and the
first dimension a call was refused for, so the exhaustion is recorded once. `PathView.runs`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tollgate_llm.domain.runs.state import Run

__all__ = ["RunBook", "RunKey", "RunUsage"]

RunKey = tuple[str, str]  # (tenant, run id)


@dataclass(slots=True)
class RunUsage:
    """A run's consumption, folded from its calls' events."""

    calls: int = 0
    in_flight: int = 0
    reserved_micros: int = 0
    posted_micros: int = 0
    tool_calls: int = 0
    exhausted: str | None = None  # the first dimension a call was refused for
    # The currency of the micro-units above: a run is billed in one currency, its first
    # call's (`path_admission` refuses a call priced in another).
    currency: str | None = None

    @property
    def cost_micros(self) -> int:
        return self.reserved_micros + self.posted_micros


class RunBook:
    def __init__(self) -> None:
        self._usage: dict[RunKey, RunUsage] = {}
        self._started: dict[RunKey, Run] = {}  # runs this edge started itself

    # --- what a decision reads ----------------------------------------------------------------

    def usage(self, tenant_id: str, run_id: str) -> RunUsage:
        return self._usage.get((tenant_id, run_id)) or RunUsage()

    def has(self, tenant_id: str, run_id: str) -> bool:
        """Whether a call of the run was counted here (else the next one starts it)."""
        return (tenant_id, run_id) in self._usage

    def started(self, tenant_id: str, run_id: str) -> Run | None:
        """A run this view started (its RunStarted may not be folded into the control view
        yet)."""
        return self._started.get((tenant_id, run_id))

    def mark_exhausted(self, tenant_id: str, run_id: str, dimension: str) -> bool:
        """True the first time a run's call is refused (so it is recorded once per run)."""
        run = self._of((tenant_id, run_id))
        if run.exhausted is not None:
            return False
        run.exhausted = dimension
        return True

    def note(self, run: Run) -> None:
        self._started.setdefault((run.tenant_id, run.run_id), run)

    # --- a call's life, as the path view folds it ---------------------------------------------

    def called(self, key: RunKey, currency: str, reserved_micros: int) -> bool:
        """A call admitted: counted, in flight, its money reserved when it is priced in the
        run's currency (the first call's). True: its money counts in the run."""
        run = self._of(key)
        run.calls += 1
        run.in_flight += 1
        if run.currency is None:
            run.currency = currency
        if run.currency != currency:
            return False
        run.reserved_micros += reserved_micros
        return True

    def unreserve(self, key: RunKey, micros: int) -> None:
        self._usage[key].reserved_micros -= micros

    def post(self, key: RunKey, micros: int) -> None:
        self._usage[key].posted_micros += micros

    def tools(self, key: RunKey, tool_calls: int) -> None:
        self._usage[key].tool_calls += tool_calls

    def voided(self, key: RunKey) -> None:
        """A call's admission voided: it was not a call of the run."""
        run = self._usage.get(key)
        if run is not None:
            run.calls -= 1

    def released(self, key: RunKey) -> None:
        """A call ended: no longer in flight."""
        run = self._usage.get(key)
        if run is not None:
            run.in_flight -= 1

    def _of(self, key: RunKey) -> RunUsage:
        run = self._usage.get(key)
        if run is None:
            run = self._usage[key] = RunUsage()
        return run
