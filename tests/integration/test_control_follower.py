"""The control-plane follower (`ControlLog.follow`): it applies what the control streams gain
and moves its position to the end of the log, so each poll reads only what was appended since
the last one."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from tests.integration.test_fold_worker import _request
from tollgate_llm.domain.control_plane.events import PriceSet
from tollgate_llm.ledger.control import ControlLog
from tollgate_llm.ledger.store import NewEvent, SqlEventStore

MODEL = "llama-3.1-8b-2026-05"


def _set_price(store: SqlEventStore, micros: int) -> None:
    at = datetime.now(UTC) - timedelta(seconds=1)
    stream = f"prices-{MODEL}"
    new = NewEvent(str(uuid.uuid4()), stream, "", at, PriceSet(MODEL, micros, micros, 0, at))
    store.append(stream, None, [new])


def test_the_follower_applies_control_records_and_moves_to_the_end(store: SqlEventStore) -> None:
    log = ControlLog(store)
    control = log.view
    _set_price(store, 100_000)
    _request(store)
    position = log.follow()
    assert position == store.last_position()
    assert control.price(MODEL, datetime.now(UTC)).prompt_micros_per_mtok == 100_000

    # Only request events since: the position still moves to the end (a poll that stayed at
    # the last control record would scan these again and again).
    for _ in range(3):
        _request(store)
    moved = log.follow()
    assert moved == store.last_position() > position

    _set_price(store, 250_000)
    _request(store)
    assert log.follow() == store.last_position()
    assert control.price(MODEL, datetime.now(UTC)).prompt_micros_per_mtok == 250_000
