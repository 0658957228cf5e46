"""Which tier the fault tests run in: the fast one (`./dev test`, CI) or the long one
(`./dev reliability`, TOLLGATE_RELIABILITY=long), which runs the same tests with the issue's
full counts and adds the soak."""

from __future__ import annotations

import os

LONG = os.environ.get("TOLLGATE_RELIABILITY") == "long"


def pick(fast: int, long: int) -> int:
    return long if LONG else fast


def safeguards(on: object, off: object) -> list[object]:
    """The parameters of a test that runs with its safeguard on, and off in the long tier only
    (the end-to-end ones: each off run costs a server and its minute, and the fast tier's budget
    is minutes; the unit and integration twins run off in both tiers)."""
    return [on, off] if LONG else [on]
