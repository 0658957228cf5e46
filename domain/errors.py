"""The one error type of the domain: a command that breaks a rule, with the rule's name."""

from __future__ import annotations


class DomainError(Exception):
    """`rule` is a stable machine-readable name (e.g. "second_terminal"); `message` says why."""

    def __init__(self, rule: str, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.rule = rule
        self.message = message
        self.field = field


# A limit, a rate, a count or a price in micro-dollars per million tokens: far past any real
# one, and small enough that the sums the folds keep of them stay inside 64-bit integers.
MAX_QUANTITY = 10**12
# A spend budget in micro-dollars: a billion dollars a period.
MAX_AMOUNT_MICROS = 10**15


def check_quantity(
    name: str,
    value: int | None,
    *,
    negative: str = "negative_limit",
    field: str | None = None,
    most: int = MAX_QUANTITY,
) -> None:
    """`value` (None: not given) is a whole number from 0 to `most`, or a DomainError naming
    `field` (default `name`): `negative` below, "too_large" above."""
    if value is None:
        return
    field = field or name
    if value < 0:
        raise DomainError(negative, f"{name} must be non-negative, got {value}", field=field)
    if value > most:
        message = f"{name} must be at most {most:,}, got {value:,}"
        raise DomainError("too_large", message, field=field)
