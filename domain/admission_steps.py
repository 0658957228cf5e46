"""The steps of an admission beside the quota decision (`domain.admission`), each a pure
decision the edge's `Admission` service (api/services/admission.py) applies in order: which run
a call belongs to, what a capacity refusal says, which other models a tenant consented to, whether a
request may go to one, and how much KV the router is asked to hold for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from tollgate_llm.domain.capacity import Refusal, UnknownModel
from tollgate_llm.domain.cost import Estimate
from tollgate_llm.domain.governance.budgets import PathView
from tollgate_llm.domain.governance.state import Hierarchy
from tollgate_llm.domain.runs.state import Run

__all__ = ["capacity_detail", "fallback_models", "kv_tokens", "may_fall_back", "resolve_run"]


def resolve_run(
    tree: Hierarchy, paths: PathView, tenant_id: str, key_id: str, run_id: str | None,
    now: datetime,
) -> Run | None:  # fmt: skip
    """The run a call names: as recorded (POST /v1/runs), as this edge started it, or new,
    started by this call under its project's run policy (`implicit`: its RunStarted is recorded
    once it is admitted). Runs are looked up in the caller's own tenant only."""
    if run_id is None:
        return None
    run = tree.run(tenant_id, run_id)  # (in force: `Hierarchy.run` applies the policy)
    if run is not None:
        return run
    run = paths.runs.started(tenant_id, run_id)
    if run is not None:
        return tree.in_force(run)
    project = tree.project_of_key(tenant_id, key_id)
    return Run(tenant_id, run_id, project, tree.run_policy(tenant_id, project), now,
               implicit=True)  # fmt: skip


def capacity_detail(refused: Refusal | UnknownModel) -> str:
    """Why no replica took a request, as its refusal records it."""
    return "no replica serves it" if isinstance(refused, UnknownModel) else refused.detail


def may_fall_back(service_tier: str) -> bool:
    """Flex takes idle capacity or nothing: never another model (its refusal is OpenAI's flex
    429, not billed). Every other request may go to a model its tenant consented to."""
    return service_tier != "flex"


def fallback_models(model: str, consented: Iterable[str | None]) -> list[str]:
    """The consented models on sale (`None`: not on sale) other than `model`, in order."""
    return [m for m in consented if m is not None and m != model]


def kv_tokens(estimate: Estimate) -> int:
    """What the router counts against a replica for the request: its prompt and the output it
    reserved."""
    return estimate.prompt_tokens + estimate.reserved_output_tokens
