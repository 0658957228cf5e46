"""End users: the caller's own customers (OpenAI's `user` / `safety_identifier`, or the
`X-Tollgate-End-User` header), each a level of its own below its project, bounded by the
project's per-end-user limits and daily budget (`tollgate limits set --project P
--per-end-user`). The level rides the one reservation mechanism (`domain.governance.budgets.
PathView`) like every other level, so it is reserved at admission and settled at the end with
no overshoot under concurrency.

An identifier is never kept: only `end_user_hash`, an HMAC keyed by the tenant's own secret
salt, so that one tenant's "alice" is unrelated to another's and a hash tells nothing to
whoever does not hold the key.

Bound: a project tracks at most `MAX_END_USERS_PER_PROJECT` end users a budget day
(`EndUserRoster`). Past it, an end user not yet tracked that day is reserved at the project's
one overflow level, where the per-end-user limits apply to all such end users together. No
tracked end user is ever evicted, so rotating identifiers cannot reset anyone's budget: past
the bound, new identities only share one end user's allowance. The roster starts afresh with
each budget day (per-end-user budgets are daily).
"""

from __future__ import annotations

import hmac
from hashlib import sha256
from typing import Final

from tollgate_llm.domain.governance.state import Hierarchy, Level, LevelRule, PathPolicy

__all__ = [
    "END_USER", "END_USER_LIMIT_FIELDS", "MAX_END_USER_CHARS", "MAX_END_USERS_PER_PROJECT",
    "OVERFLOW", "EndUserRoster", "end_user_hash", "end_user_level_id", "on_path",
]  # fmt: skip

END_USER: Final = "end_user"  # the level kind (its limits are set at level_id = the project)
# What a project may bound each of its end users by, besides a daily budget: a rate. A
# per-request cap (max_context, max_output) would be the same for every end user, so it is the
# project's to set; the KV in flight is the fleet's concern, not one customer's.
END_USER_LIMIT_FIELDS: Final = ("rpm", "tpm")
# OpenAI documents no bound on `user`; 256 characters holds any id, email or UUID a tenant uses.
MAX_END_USER_CHARS: Final = 256
# End users tracked per project and budget day: 10,000 × (a 32-character hash, two buckets and
# two spend entries) is a few MB per project at most, and covers the daily active customers of
# all but the largest tenants' single project.
MAX_END_USERS_PER_PROJECT: Final = 10_000
OVERFLOW: Final = "overflow"
_HASH_CHARS: Final = 32  # 128 bits of HMAC-SHA256: no collision among any tenant's end users
_DOMAIN: Final = b"tollgate end user\x00"  # this hash is not the same as any other use of the key


def end_user_hash(tenant_key: str, identifier: str) -> str:
    """The identifier as Tollgate records it: HMAC-SHA256 keyed by the tenant's secret (its
    `cache_salt`, drawn at registration and never shown), hex, 32 characters. "" for none."""
    if not identifier:
        return ""
    key = _DOMAIN + tenant_key.encode()
    return hmac.new(key, identifier.encode(), sha256).hexdigest()[:_HASH_CHARS]


def end_user_level_id(project_id: str, slot: str) -> str:
    """The level id of an end user (or the overflow) of a project: "<project>/<hash>". A
    project's name never holds "/", so the project is the part before it."""
    return f"{project_id}/{slot}"


class EndUserRoster:
    """The end users a view has reserved for, per (tenant, project), for one budget day: who
    has a level of their own. Fed with every reservation (the edge's own and other edges', read
    from the log), so the edges agree on who is tracked within one propagation delay (two edges
    may each admit a new end user at the bound: the bound is exceeded by at most one per
    edge)."""

    __slots__ = ("max_per_project", "_days", "rolled")

    def __init__(self, max_per_project: int = MAX_END_USERS_PER_PROJECT) -> None:
        self.max_per_project = max_per_project
        self._days: dict[tuple[str, str], tuple[str, set[str]]] = {}
        # A project's day began since the view last forgot yesterday's end users
        # (`PathView.prune` then drops their buckets and spend entries).
        self.rolled = False

    def slot(self, tenant_id: str, project_id: str, day: str, end_user: str) -> str:
        """The level an end user's request is reserved at: its own while it is tracked or
        there is room, else the project's overflow."""
        found = self._days.get((tenant_id, project_id))
        if found is None or found[0] != day:
            return end_user
        tracked = found[1]
        if end_user in tracked or len(tracked) < self.max_per_project:
            return end_user
        return OVERFLOW

    def note(self, tenant_id: str, project_id: str, day: str, slot: str) -> None:
        """A reservation at `slot` on `day` (the overflow is not an end user)."""
        if slot == OVERFLOW:
            return
        key = (tenant_id, project_id)
        found = self._days.get(key)
        if found is None or found[0] < day:
            self.rolled = self.rolled or found is not None
            found = self._days[key] = (day, set())
        elif found[0] > day:
            return  # a late reservation of a day already over
        found[1].add(slot)

    def tracks(self, tenant_id: str, level_id: str) -> bool:
        """Whether an end-user level ("<project>/<slot>") is one of its project's current day
        (the overflow always is)."""
        project_id, _, slot = level_id.partition("/")
        found = self._days.get((tenant_id, project_id))
        return slot == OVERFLOW or (found is not None and slot in found[1])

    def tracked(self, tenant_id: str, project_id: str, day: str) -> int:
        found = self._days.get((tenant_id, project_id))
        return 0 if found is None or found[0] != day else len(found[1])


def on_path(
    path: PathPolicy | None, hierarchy: Hierarchy, roster: EndUserRoster, model: str,
    end_user: str,
) -> PathPolicy | None:  # fmt: skip
    """The request's path with its end user's level last (below the key), when it names an end
    user and its key's project sets per-end-user limits or a daily budget; else `path` as is.
    The end user's level is bounded by those (its own buckets and spend, or the overflow's)."""
    if path is None or not end_user or path.project_id is None:
        return path
    project_id = path.project_id
    tenant_id = path.tenant_id
    limits = hierarchy.level_limits(tenant_id, END_USER, project_id, model)
    budgets = tuple(
        budget for period, budget in sorted(
            hierarchy.level_budgets(tenant_id, END_USER, project_id).items()
        ) if period == "day"
    )  # fmt: skip
    if limits.empty and not budgets:
        return path
    slot = roster.slot(tenant_id, project_id, path.day, end_user)
    level_id = end_user_level_id(project_id, slot)
    key = (tenant_id, END_USER, level_id)
    rule = LevelRule(
        Level(END_USER, level_id, slot[:12]), None if limits.empty else limits, budgets, key
    )
    kv_keys = path.kv_keys + (key,) if limits.kv_gib_seconds is not None else path.kv_keys
    return path._replace(
        levels=path.levels + (rule,),
        level_keys=path.level_keys + (key,),
        kv_keys=kv_keys,
        max_context=_tightest(path.max_context, limits.max_context),
        max_output=_tightest(path.max_output, limits.max_output),
        plan=None,  # its checks are worked out per decision (PathView.state)
        end_user=slot,
    )


def _tightest(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else min(a, b)
