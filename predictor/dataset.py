"""What the predictor learns from and is judged on: the admitted requests of the event log, each
with the shape admission saw and the engine's output count, replayed in time order through
`domain.prediction.History` so that every example's features are exactly those the edge
would have computed at its admission.

Read through the `EventStore` port (`read_all` over request streams), in pages; the requests
kept are bounded (`max_requests`, the most recent).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime

from tollgate_llm.domain.prediction import History, RequestShape
from tollgate_llm.domain.requests.events import (
    TERMINAL_EVENTS,
    TERMINAL_STATUS_OF,
    RequestAdmitted,
    RequestEstimated,
)
from tollgate_llm.ledger.store import EventStore

REQUEST_STREAMS = ("req_",)
PAGE = 5_000
# Every end of a request (domain.registry' one list): a request whose end the reader did not know
# stayed open forever, out of the data (preempted flex requests were).
_TERMINALS = TERMINAL_EVENTS


@dataclass(slots=True)
class LoggedRequest:
    """One admitted request as the log tells it."""

    request_id: str
    tier: str
    shape: RequestShape  # at = its admission instant
    reserved_output_tokens: int = 0
    kv_byte_seconds: int = 0
    tpot_us: int = 0
    predictor_version: str = ""
    estimated: bool = False
    terminal: str | None = None  # "completed" | "cancelled" | "failed" | "lease_expired"
    ended_at: datetime | None = None
    prompt_tokens: int = 0  # the engine's
    completion_tokens: int = 0

    @property
    def used_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Example:
    tenant_id: str
    at: datetime
    features: list[float]
    target: float  # ln(1 + output tokens) / 10
    censored: bool  # cancelled: the answer would have been at least this long
    request: LoggedRequest


def read_requests(
    store: EventStore,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    max_requests: int = 500_000,
    after_position: int = 0,
) -> list[LoggedRequest]:
    """The ended requests admitted in [since, until), in admission order: at most the
    `max_requests` most recent. Requests still in flight, or whose admission predates the log
    the store holds, are left out."""
    open_: dict[str, LoggedRequest] = {}
    done: deque[LoggedRequest] = deque(maxlen=max_requests)
    order: dict[str, int] = {}
    after = after_position
    while True:
        page = store.read_all(after, PAGE, REQUEST_STREAMS)
        if not page:
            break
        after = page[-1].position
        for r in page:
            event = r.event
            if isinstance(event, RequestAdmitted):
                at = r.occurred_at
                if (since is not None and at < since) or (until is not None and at >= until):
                    continue
                open_[event.request_id] = LoggedRequest(
                    event.request_id,
                    event.tier,
                    RequestShape(event.tenant_id, event.key_id, event.model, 0, 0, 0, -1, at),
                )
                order[event.request_id] = len(order)
            elif isinstance(event, RequestEstimated):
                req = open_.get(event.request_id)
                if req is not None:
                    s = req.shape
                    req.shape = RequestShape(
                        s.tenant_id, s.key_id, s.model, event.prompt_tokens,
                        event.output_cap_tokens or event.reserved_output_tokens,
                        event.message_count, event.system_prompt_bucket, s.at,
                    )  # fmt: skip
                    req.reserved_output_tokens = event.reserved_output_tokens
                    req.kv_byte_seconds = event.kv_byte_seconds
                    req.tpot_us = event.tpot_us
                    req.predictor_version = event.predictor_version
                    req.estimated = True
            elif isinstance(event, _TERMINALS):
                req = open_.pop(r.stream_id, None)
                if req is None or not req.estimated:
                    continue
                req.terminal = TERMINAL_STATUS_OF[type(event)]
                req.ended_at = r.occurred_at
                req.prompt_tokens = event.prompt_tokens
                req.completion_tokens = event.completion_tokens
                done.append(req)
    return sorted(done, key=lambda q: order[q.request_id])


def timeline(requests: Iterable[LoggedRequest]) -> Iterator[tuple[bool, LoggedRequest]]:
    """(is_end, request) in time order: each admission, and each end after it; at one
    instant ends come first (a request that ended by then is history for the next)."""
    items: list[tuple[datetime, int, int, LoggedRequest]] = []
    for i, q in enumerate(requests):
        items.append((q.shape.at, 1, i, q))
        if q.ended_at is not None:
            items.append((q.ended_at, 0, i, q))
    items.sort(key=lambda item: item[:3])
    for _, kind, _, q in items:
        yield kind == 0, q


def examples(requests: list[LoggedRequest], min_history: int) -> list[Example]:
    """One example per completed or cancelled request whose tenant had history enough at its
    admission, with the features `History` gave then. Failed, expired and preempted requests
    stopped for reasons of ours: they teach nothing about answer lengths and are left out."""
    history = History(min_history)
    out: list[Example] = []
    for is_end, q in timeline(requests):
        s = q.shape
        if is_end:
            if q.terminal == "completed":
                history.observe(
                    s.tenant_id, s.key_id, s.model, s.system_prompt_bucket, q.completion_tokens,
                    prompt_tokens=s.prompt_tokens,
                )  # fmt: skip
            continue
        if q.terminal not in ("completed", "cancelled"):
            continue
        features = history.features(s)
        if features is None:
            continue
        out.append(
            Example(
                s.tenant_id,
                s.at,
                features,
                math.log1p(q.completion_tokens) / 10.0,
                q.terminal == "cancelled",
                q,
            )  # fmt: skip
        )
    return out


def split_at(requests: list[LoggedRequest], holdout: float) -> datetime | None:
    """The admission instant from which the last `holdout` share of requests is held out."""
    if not requests or holdout <= 0:
        return None
    index = min(len(requests) - 1, int(len(requests) * (1 - holdout)))
    return requests[index].shape.at
