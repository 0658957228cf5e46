"""What an edge knows of what is admitted, as one facade over its three folded views: the
organization's quota (`domain.quota.QuotaView`), every level below it and the runs
(`domain.governance.budgets.PathView`), and other edges' flex work
(`domain.remote_flex.RemoteFlex`).

Each change of an admission goes to all of them at once, here, in the one order that was
measured and tested: a caller never keeps them in step by hand (the edge used to, in five
places). Pure: the instants arrive with the calls.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from tollgate_llm.domain import admission
from tollgate_llm.domain.control_plane.state import Limits
from tollgate_llm.domain.cost import Price
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.governance.budgets import PathView
from tollgate_llm.domain.governance.state import PathPolicy
from tollgate_llm.domain.quota import QuotaView
from tollgate_llm.domain.remote_flex import RemoteFlex

__all__ = ["AdmissionViews"]


class AdmissionViews:
    """`charge` decides and takes an admission everywhere (or nowhere), `void` and `withdraw`
    undo one that capacity refused, `refund` trues one up at its end, `apply` folds the log,
    `prune` forgets what aged out."""

    __slots__ = ("quota", "paths", "others_flex")

    def __init__(self, quota: QuotaView, paths: PathView, others_flex: RemoteFlex) -> None:
        self.quota = quota
        self.paths = paths
        self.others_flex = others_flex

    def folded_types(self) -> frozenset[str]:
        """What `apply` folds: a follower of the log need read no other event type."""
        return (
            self.quota.folded_types() | self.paths.folded_types()
            | self.others_flex.folded_types()
        )

    def apply(self, record: Recorded) -> None:
        """Fold one event read back from the log. The edge's own events come back too: the
        views have already counted them and skip them."""
        self.quota.apply(record)
        self.paths.apply(record)
        self.others_flex.apply(record)

    def charge(
        self, cmd: admission.ReserveQuota, limits: Limits, path: PathPolicy | None,
        price: Callable[[], Price], policy: admission.AdmissionPolicy,
    ) -> admission.Admitted | admission.Rejected:  # fmt: skip
        """The quota decision, charged where it admits. A tenant with nothing set below its
        plan, and a call outside a run (`path` None), is decided by the organization's limits
        alone and pays nothing for the hierarchy (nor for the price lookup: `price` is only
        called on a path)."""
        if path is None:
            return admission.decide(self.quota, cmd, limits, policy=policy)
        return admission.decide_on_path(
            self.quota, self.paths, cmd, limits, path, price(), policy=policy
        )

    def void(self, request_id: str) -> None:
        """Undo an admission that did not go through: every charge back."""
        self.quota.void(request_id)
        self.paths.void(request_id)

    def withdraw(self, request_id: str) -> None:
        """Void and forget, so that the same request may be decided again (for another model)."""
        self.quota.withdraw(request_id)
        self.paths.withdraw(request_id)

    def refund(
        self, request_id: str, used_tokens: int, now: datetime,
        bill: Callable[[], tuple[int, int]],
    ) -> None:  # fmt: skip
        """A request ended having used `used_tokens`: the quota gets the rest of its reservation
        back, and where the hierarchy holds it, every level's reservation becomes `bill()`:
        (amount in micro-units, tool calls), only worked out there."""
        self.quota.refund(request_id, used_tokens, now)
        if self.paths.knows(request_id):
            amount_micros, tool_calls = bill()
            self.paths.finish(request_id, used_tokens, amount_micros, tool_calls, now)

    def prune(self, now: datetime) -> None:
        """Forget what has aged out of every window."""
        self.quota.prune(now)
        self.paths.prune(now)
