"""A request as its stream folds it: `RequestState` and `INITIAL`."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.requests.events import LeaseProgress
from tollgate_llm.domain.types import Status

# Non-terminal statuses only move forward; a late or reordered fact never moves them back.
_RANK: Final = {"new": 0, "admitted": 1, "routed": 2, "streaming": 3}


@dataclass(frozen=True)
class RequestState:
    """A request as its events describe it. `version` is the stream_version of the last event of
    this stream applied (LeasesRenewed lives in the edge's stream and does not count)."""

    request_id: str = ""
    status: Status = "new"
    tenant_id: str = ""
    key_id: str = ""
    model: str = ""
    tier: str = ""
    edge_id: str = ""
    is_retry: bool = False
    reserved_tokens: int = 0
    kv_byte_seconds: int = 0
    prompt_tokens_est: int = 0
    output_cap_tokens: int = 0  # what the request may produce: the engine's max_tokens
    predictor_version: str = ""  # the output predictor behind the reservation, if any
    replica_id: str | None = None
    first_token: bool = False
    ttft_ms: int | None = None
    terminal: str | None = None  # the terminal event's type, e.g. "RequestCompleted"
    refunded: bool = False
    billed: bool = False
    amount_micros: int | None = None
    # Engine-authoritative counts, from the terminal event.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    admitted_at: datetime | None = None
    finished_at: datetime | None = None
    progress: LeaseProgress | None = None  # last engine counts an edge renewed the lease with
    downgraded_from: str | None = None  # the model asked for, when another one served it
    # Its place in the tenant's hierarchy and its agent run (BudgetReserved), when governed.
    workspace_id: str | None = None
    project_id: str | None = None
    run_id: str | None = None
    reserved_micros: int = 0
    reserved_currency: str = ""  # ISO 4217 of reserved_micros (its price's), when governed
    tool_calls: int = 0
    service_tier: str = "default"  # default (interactive) | flex
    batch_item: str = ""  # "<batch id>/<custom_id>" when a batch runs it
    adapter: str = ""  # the tenant's LoRA adapter it was served through (RequestAdmitted)
    end_user: str = ""  # the end user's keyed hash (RequestAdmitted); "" for none
    # Another edge asked for this flex request's preemption (PreemptionRequested): its edge id,
    # and the interactive request that needs the room. The first ask stands.
    preemption_requested_by: str = ""
    preemption_requested_for: str = ""
    # The router (domain.routing): the request's task class (RequestEstimated), the reference
    # model when the router chose another (RequestModelRouted), and the customer's feedback.
    task_class: str = ""
    routed_from: str = ""
    feedback_score_ppm: int | None = None
    feedback_label: str = ""
    version: int = 0

    @property
    def used_tokens(self) -> int:
        """What the tokens/min dimension actually consumed: engine prompt + completion tokens
        (cached prompt tokens still occupied the context, so they count)."""
        return self.prompt_tokens + self.completion_tokens

    @property
    def reserved_output_tokens(self) -> int:
        """The output tokens admission reserved: the output cap, or less when an output-length
        prediction narrowed it (never the engine's max_tokens: that is `output_cap_tokens`)."""
        return self.reserved_tokens - self.prompt_tokens_est

    @property
    def is_terminal(self) -> bool:
        return self.terminal is not None


_new_object = object.__new__
_set_attribute = object.__setattr__
_STATE_FIELDS: Final = frozenset(RequestState.__dataclass_fields__)
_FIELD_COUNT: Final = len(_STATE_FIELDS)


def _with(state: RequestState, **changes: Any) -> RequestState:
    # dataclasses.replace re-runs the frozen __init__ (~10 µs for this many fields); building the
    # new instance's dict in one merge is ~2 µs and is what keeps the folds cheap (filling an
    # empty instance dict key by key, then updating it, cost twice that: measured 4.2 against
    # 2.4 µs per copy in a request's chain of copies). The copy bypasses __init__, so a misspelt
    # field is caught here: it is the one key the merge adds to a full set of fields.
    fields = {**state.__dict__, **changes}
    if len(fields) != _FIELD_COUNT:
        unknown = ", ".join(sorted(set(changes) - _STATE_FIELDS))
        raise DomainError("unknown_field", f"RequestState has no field {unknown}")
    fresh: RequestState = _new_object(RequestState)
    _set_attribute(fresh, "__dict__", fields)
    return fresh


INITIAL: Final = RequestState()
