"""The faust consumer's two seeks (a rebalance's, to the saved offsets; the agent's, to a new
epoch's start) against a consumer that records where each partition was sought. No broker: the
seam is the interleaving of the two on the app's loop, which a broker makes rare (it lost one
event of 506 in a CI run of tests/integration/test_relay.py, for good)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from tollgate_llm.streams.codec import EPOCH_HEADER
from tollgate_llm.streams.faust_worker import RESEEK_S, FaustEventConsumer

TOPIC = "events"


@dataclass
class _Tp:
    topic: str
    partition: int

    def __hash__(self) -> int:
        return hash((self.topic, self.partition))


@dataclass
class _Message:
    partition: int
    offset: int
    epoch: int
    topic: str = TOPIC
    key: bytes = b"t"
    value: bytes = b"{}"

    @property
    def headers(self) -> list[tuple[str, bytes]]:
        return [(EPOCH_HEADER, str(self.epoch).encode())]


@dataclass
class _Event:
    message: _Message


@dataclass
class _Consumer:
    """Where each partition's next fetch starts; a seek takes a while, as a call into faust's
    consumer thread does, and says when it began."""

    position: dict[int, int] = field(default_factory=dict)
    seeking: asyncio.Event = field(default_factory=asyncio.Event)

    def assignment(self) -> set[_Tp]:
        return {_Tp(TOPIC, 0)}

    async def seek_wait(self, placed: dict[Any, int]) -> None:
        # No `seek`: faust's calls the client from the wrong thread (see _read_from).
        for tp, offset in placed.items():
            self.position[tp.partition] = offset
        self.seeking.set()
        await asyncio.sleep(0.05)


@dataclass
class _App:
    consumer: _Consumer


def _consumer(saved: int, saved_epoch: int) -> FaustEventConsumer:
    c = FaustEventConsumer.__new__(FaustEventConsumer)
    c.topic, c.name = TOPIC, "folds"
    c._resume, c._expected, c._epochs = {}, {}, {}
    c._seek_failure = None
    c._placing = asyncio.Lock()
    c._sought_at = {}
    c.seeks_again = 0
    c.assigned = set()
    c._app = _App(_Consumer())

    def targets(partitions: list[int], beginning: int) -> dict[int, int]:
        for p in partitions:
            c._epochs[p] = saved_epoch
        return {p: saved for p in partitions}

    c._seek_targets = targets  # type: ignore[method-assign]
    return c


def _fetch(c: FaustEventConsumer, epoch: int, count: int) -> list[_Event]:
    """What the next fetch of partition 0 returns: `count` messages from its position."""
    start = c._app.consumer.position[0]
    return [_Event(_Message(0, o, epoch)) for o in range(start, start + count)]


def test_a_rebalance_during_the_agents_seek_to_a_new_epoch_leaves_the_partition_readable(
    monkeypatch: Any,
) -> None:
    """The relay started epoch 2 and the group rebalanced before it recorded it: the rebalance
    places the partition at its saved offset of epoch 1 while the agent, which met epoch 2,
    seeks it to the start."""
    monkeypatch.setattr("tollgate_llm.streams.faust_worker._tp", _Tp)
    size = 45  # epoch 2's messages in the partition

    async def scenario() -> set[int]:
        c = _consumer(saved=40, saved_epoch=1)
        fake = c._app.consumer
        await c._seek_saved(fake)
        assert [m.offset for m in await c._take(_fetch(c, 1, 2))] == [40, 41]
        fake.seeking.clear()
        agent = asyncio.create_task(c._take([_Event(_Message(0, 42, 2))]))
        await fake.seeking.wait()
        await c._seek_saved(fake)
        assert not await agent
        taken: set[int] = set()
        for _ in range(4):  # fetches from wherever the partition was sought last
            taken |= {m.offset for m in await c._take(_fetch(c, 2, size - fake.position[0]))}
        return taken

    # Before the fix the agent waited for offset 0 with the partition at offset 40: nothing of
    # epoch 2 was ever taken again.
    assert asyncio.run(scenario()) == set(range(size))


def test_the_agents_seek_to_a_new_epoch_reads_the_partition_from_its_start(
    monkeypatch: Any,
) -> None:
    monkeypatch.setattr("tollgate_llm.streams.faust_worker._tp", _Tp)

    async def scenario() -> tuple[list[int], list[int]]:
        c = _consumer(saved=3, saved_epoch=1)
        fake = c._app.consumer
        await c._seek_saved(fake)
        first = await c._take(_fetch(c, 1, 2))  # offsets 3, 4 of epoch 1
        again = await c._take([_Event(_Message(0, 9, 2))])  # epoch 2 mid-partition: seek
        assert not again and fake.position[0] == 0
        after = await c._take(_fetch(c, 2, 4))
        return [m.offset for m in first], [m.offset for m in after]

    first, after = asyncio.run(scenario())
    assert first == [3, 4]
    assert after == [0, 1, 2, 3]


def test_a_new_epoch_shorter_than_the_saved_offset_is_read_from_its_first_message(
    monkeypatch: Any,
) -> None:
    """The rebalance placed the partition at its saved offset of epoch 1 (40), the broker had
    lost it and the relay re-published only 10 messages there (epoch 1 held copies of a retried
    step): the fetch resets to the start. Waiting for offset 40 stalled the partition until 31
    more events came to it."""
    monkeypatch.setattr("tollgate_llm.streams.faust_worker._tp", _Tp)

    async def scenario() -> list[int]:
        c = _consumer(saved=40, saved_epoch=1)
        fake = c._app.consumer
        await c._seek_saved(fake)
        fake.position[0] = 0  # out of range: the client resets to the earliest offset
        return [m.offset for m in await c._take(_fetch(c, 2, 10))]

    assert asyncio.run(scenario()) == list(range(10))


def test_a_message_of_a_void_epoch_queued_before_a_seek_is_not_taken(monkeypatch: Any) -> None:
    monkeypatch.setattr("tollgate_llm.streams.faust_worker._tp", _Tp)

    async def scenario() -> tuple[list[int], list[int]]:
        c = _consumer(saved=0, saved_epoch=2)
        fake = c._app.consumer
        await c._seek_saved(fake)
        first = [m.offset for m in await c._take(_fetch(c, 2, 5))]
        # Epoch 1's offset 45, fetched before the seek, comes after epoch 2's first five.
        stale = await c._take([_Event(_Message(0, 45, 1))])
        assert fake.position[0] == 0  # read again from the start, which claim makes harmless
        again = [m.offset for m in await c._take(_fetch(c, 2, 8))]
        return first, [m.offset for m in stale] + again

    first, after = asyncio.run(scenario())
    assert first == [0, 1, 2, 3, 4]
    assert after == list(range(8))


def test_a_gap_in_a_partitions_offsets_is_read_again_before_anything_after_it(
    monkeypatch: Any,
) -> None:
    """Offsets 3 and 4 never came (dropped between the client and the agent): taking 5 would
    move the saved order key past them, and they would never be applied."""
    monkeypatch.setattr("tollgate_llm.streams.faust_worker._tp", _Tp)

    async def scenario() -> tuple[list[int], list[int], list[int]]:
        c = _consumer(saved=0, saved_epoch=1)
        fake = c._app.consumer
        await c._seek_saved(fake)
        first = [m.offset for m in await c._take(_fetch(c, 1, 3))]
        gap = [m.offset for m in await c._take([_Event(_Message(0, 5, 1))])]
        assert fake.position[0] == 3
        again = [m.offset for m in await c._take(_fetch(c, 1, 4))]
        return first, gap, again

    first, gap, again = asyncio.run(scenario())
    assert (first, gap, again) == ([0, 1, 2], [], [3, 4, 5, 6])



def test_a_partition_whose_sought_messages_never_came_is_sought_again(monkeypatch: Any) -> None:
    """faust's fetch loop drops every message below a partition's read offset, and one message
    it handed on while the placement's seek ran set that offset back past the offset sought:
    the partition's messages from 0 on were dropped before the agent saw them (the broker-loss
    test, at start-up: 0 of a partition's events in 90 s)."""
    monkeypatch.setattr("tollgate_llm.streams.faust_worker._tp", _Tp)

    async def scenario() -> tuple[int, int, list[int]]:
        c = _consumer(saved=0, saved_epoch=1)
        fake = c._app.consumer
        await c._seek_saved(fake)
        fake.position[0] = 37  # where faust's dropping left the fetch
        await c.seek_again(time.monotonic())  # not waited long enough: left alone
        early = c.seeks_again
        await c.seek_again(time.monotonic() + RESEEK_S)
        taken = [m.offset for m in await c._take(_fetch(c, 1, 3))]
        await c.seek_again(time.monotonic() + 2 * RESEEK_S)  # nothing pending any more
        return early, c.seeks_again, taken

    early, later, taken = asyncio.run(scenario())
    assert (early, later, taken) == (0, 1, [0, 1, 2])
