"""The one error type of the domain: a command that breaks a rule, with the rule's name."""

from __future__ import annotations


class DomainError(Exception):
    """`rule` is a stable machine-readable name (e.g. "second_terminal"); `message` says why."""

    def __init__(self, rule: str, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.rule = rule
        self.message = message
        self.field = field
