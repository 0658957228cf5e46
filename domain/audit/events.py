"""The audit trail's one fact, `ChangeAudited`, and who can be its actor.

One `ChangeAudited` closes every control-plane command, in the same stream and the same append
as the facts it audits (so a change without its audit record cannot be committed, nor the
reverse). The actor lives here, once per command, rather than in each fact or in the envelope:
the facts stay what `decide` answers (the domain never learns who asked, and an idempotent repeat
still compares equal), a command of three facts has one actor and one diff, and the events table
and its hot request path gain no column.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Final

from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.text import check_text

# key: an admin API key's id; operator: the CLI's --actor (TOLLGATE_ACTOR) or the OS user@host;
# system: Tollgate itself (the demo `tollgate serve` seeds).
ACTOR_KINDS: Final = ("key", "operator", "system")
MAX_ACTOR_CHARS: Final = 200
# What one old or new value may hold once rendered (the longest a command accepts is a replica
# URL, 2,048): a bound that keeps an audit record's size stated, whatever a later fact carries.
MAX_VALUE_CHARS: Final = 2_048


@dataclass(frozen=True, slots=True)
class Actor:
    """Who made a control-plane change."""

    kind: str
    name: str

    def __post_init__(self) -> None:
        if self.kind not in ACTOR_KINDS:
            raise DomainError("bad_actor", f"actor kind not in {ACTOR_KINDS}", field="actor")
        check_text(self.name, "actor", max_chars=MAX_ACTOR_CHARS)
        if self.name.strip() != self.name:
            raise DomainError("bad_actor", "'actor' has surrounding spaces", field="actor")


@dataclass(frozen=True, slots=True)
class AuditedChange:
    """One value a command changed: `subject` names the thing (`limits model=*`, `key key_1`),
    `field` its attribute; `old` None: it had none (a new thing, or the plan's default)."""

    subject: str
    field: str
    old: str | None
    new: str | None


@dataclass(frozen=True, slots=True)
class ChangeAudited(Event):
    """The audit record of one command: its actor, the command's name, what changed, and `seal`,
    the stream's hash chain through every event before it and this record (domain/audit/chain.py).
    """

    EVENT_TYPE: ClassVar[str] = "ChangeAudited"
    actor_kind: str
    actor: str
    command: str
    changes: tuple[AuditedChange, ...]
    seal: str = ""  # 64 hex; empty only while the record is being sealed
