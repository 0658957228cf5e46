"""A batch as its stream folds it (`BatchState`), its statuses and completion windows.

A batch's items run as flex requests with their own request streams; the batch stream records
only which item ended how (by `custom_id`, with the request id that served it), so support can
replay an item by its request id and an item is recorded at most once whatever is retried.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

BATCH_PREFIX: Final = "batch-"
ENDPOINT: Final = "/v1/chat/completions"
ENDPOINTS: Final = frozenset({ENDPOINT})
# OpenAI's only window. Shorter ones ("30s", "5m") exist only when the server is started with
# them (tests, demos): `window_seconds(text, extra)`.
WINDOWS_S: Final = {"24h": 86_400}
WINDOW_PATTERN: Final = re.compile(r"([1-9][0-9]{0,4})([smh])")


STATUSES: Final = (
    "validating", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled",
    "failed",
)
ENDED: Final = frozenset({"completed", "expired", "cancelled", "failed"})


def batch_stream(batch_id: str) -> str:
    return BATCH_PREFIX + batch_id


def window_seconds(text: Any, extra: Iterable[str] = ()) -> int | None:
    """The completion window in seconds, or None if it is not one this server offers."""
    if not isinstance(text, str):
        return None
    if text in WINDOWS_S:
        return WINDOWS_S[text]
    if text not in extra:
        return None
    found = WINDOW_PATTERN.fullmatch(text)
    if found is None:
        return None
    return int(found[1]) * {"s": 1, "m": 60, "h": 3600}[found[2]]


@dataclass(frozen=True)
class BatchState:
    batch_id: str = ""
    status: str = "new"
    tenant_id: str = ""
    key_id: str = ""
    input_file_id: str = ""
    endpoint: str = ""
    completion_window: str = ""
    metadata_json: str = "{}"
    retention: str = ""  # "zero": its files are deleted once used (BatchCreated.retention)
    total: int = 0
    completed: int = 0
    failed: int = 0
    finished: frozenset[str] = frozenset()  # custom ids with an outcome
    finalizing_as: str = ""  # completed | expired, once finalizing
    output_file_id: str | None = None
    error_file_id: str | None = None
    error_code: str = ""
    error_message: str = ""
    created_at: datetime | None = None
    expires_at: datetime | None = None
    in_progress_at: datetime | None = None
    finalizing_at: datetime | None = None
    completed_at: datetime | None = None
    failed_at: datetime | None = None
    expired_at: datetime | None = None
    cancelling_at: datetime | None = None
    cancelled_at: datetime | None = None
    version: int = 0

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    @property
    def all_finished(self) -> bool:
        return self.completed + self.failed >= self.total
