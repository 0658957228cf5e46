"""The replica hot path's own HTTP/1.1 client (engine_adapter/http1.py) and the exchanges built on
it, against raw socket servers that answer the way real servers sometimes do: bytes split at
every position, keep-alive connections the server closes, silence, sized and chunked bodies,
garbage. And `IteratorExchange` (the in-process engine's) with a fake engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest

from tollgate_llm.engine_adapter.exchange import IteratorExchange
from tollgate_llm.engine_adapter.vllm_http import (
    ReplicaHTTPError,
    ReplicaStreamBroken,
    ReplicaUnavailable,
    VLLMReplica,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def sse(*chunks: dict[str, Any], done: bool = True) -> bytes:
    body = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks)
    return body + (b"data: [DONE]\n\n" if done else b"")


def chunk(n: int, text: str = "x") -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
        "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n},
    }


def chunked(body: bytes, piece: int = 7, *, last: bool = True) -> bytes:
    """`body` in chunked transfer coding; `last` adds the terminating zero-size chunk."""
    out = b""
    for i in range(0, len(body), piece):
        part = body[i : i + piece]
        out += b"%x\r\n%s\r\n" % (len(part), part)
    return out + (b"0\r\n\r\n" if last else b"")


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request's body (Content-Length framed), or None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return await reader.readexactly(length)


def run(handler: Handler, test: Callable[[VLLMReplica, dict[str, int]], Awaitable[None]],
        **replica_kw: Any) -> None:  # fmt: skip
    async def main() -> None:
        seen = {"connections": 0}

        async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen["connections"] += 1
            try:
                await handler(reader, writer)
            finally:
                writer.close()

        server = await asyncio.start_server(counted, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        replica = VLLMReplica("raw", f"http://127.0.0.1:{port}", "m", **replica_kw)
        try:
            await test(replica, seen)
        finally:
            replica.close()
            server.close()

    asyncio.run(main())


async def collect(replica: VLLMReplica, rid: str = "r") -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = []
    exchange = await replica.open_chat({"messages": []}, request_id=rid, cache_salt="s")
    await exchange.run(got.append)
    return got


def test_frames_and_chunk_sizes_split_at_every_byte_are_reassembled() -> None:
    body = sse(chunk(1, "a"), chunk(2, "b\n\nc"), chunk(3, "é"))
    wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(body, 5)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader) is not None:
            for i in range(len(wire)):  # one byte per write, flushed: many tiny reads
                writer.write(wire[i : i + 1])
                await writer.drain()

    async def test(replica: VLLMReplica, seen: dict[str, int]) -> None:
        for rid in ("a", "b"):
            got = await collect(replica, rid)
            assert [c["choices"][0]["delta"]["content"] for c in got] == ["a", "b\n\nc", "é"]
        assert seen["connections"] == 1  # kept alive across both
        # A request still running when the replica is closed does not come back to the pool.
        running = await replica.open_chat({}, request_id="c", cache_salt="s")
        replica.close()
        await running.run(lambda _: None)
        assert replica.idle_connections == 0

    run(handler, test)


def test_sized_body_and_error_status_are_read_whole() -> None:
    error = orjson.dumps({"error": {"message": "bad max_tokens", "param": "max_tokens"}})

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader) is not None:
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(error))
            writer.write(error[:10])
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.write(error[10:])

    async def test(replica: VLLMReplica, seen: dict[str, int]) -> None:
        with pytest.raises(ReplicaHTTPError) as e:
            await collect(replica)
        assert e.value.status == 400 and e.value.body["error"]["param"] == "max_tokens"
        await asyncio.sleep(0)
        assert replica.idle_connections == 1  # a complete error answer keeps the connection

    run(handler, test)


def test_a_keep_alive_connection_the_server_closed_is_not_reused() -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(sse(chunk(1))), sse(chunk(1)))

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if await read_request(reader) is not None:
            writer.write(ok)
            await writer.drain()
        # and then the server closes the idle connection (as a keep-alive timeout does)

    async def test(replica: VLLMReplica, seen: dict[str, int]) -> None:
        assert len(await collect(replica, "1")) == 1
        await asyncio.sleep(0.05)  # the FIN arrives: the pool drops the connection
        assert replica.idle_connections == 0
        assert len(await collect(replica, "2")) == 1
        assert seen["connections"] == 2

    run(handler, test)


def test_silence_longer_than_the_read_timeout_breaks_the_stream_with_its_count() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(chunked(sse(chunk(1), chunk(2), done=False), last=False))
        await writer.drain()
        await asyncio.sleep(5)

    async def test(replica: VLLMReplica, seen: dict[str, int]) -> None:
        got: list[dict[str, Any]] = []
        exchange = await replica.open_chat({}, request_id="t", cache_salt="s")
        with pytest.raises(ReplicaStreamBroken) as e:
            await asyncio.wait_for(exchange.run(got.append), 3)
        assert e.value.reason == "read timeout" and e.value.last_usage is not None
        assert e.value.last_usage["completion_tokens"] == 2 and len(got) == 2

    run(handler, test, read_timeout_s=0.2)


def test_a_connection_cut_before_answering_is_unavailable_and_after_is_broken() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if b"X-Request-Id: nodone" in head:  # a clean end, but no [DONE]
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(chunked(sse(chunk(4), done=False)))
        elif b"X-Request-Id: cut" in head:  # cut inside the body
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(chunked(sse(chunk(5), done=False), last=False))
        elif b"X-Request-Id: garbage" in head:
            writer.write(b"this is not HTTP\r\n\r\n")
        await writer.drain()  # and the connection is closed ("gone": with no answer at all)

    async def test(replica: VLLMReplica, seen: dict[str, int]) -> None:
        with pytest.raises(ReplicaUnavailable):
            await collect(replica, "gone")
        with pytest.raises(ReplicaStreamBroken) as e:
            await collect(replica, "nodone")
        assert e.value.last_usage == chunk(4)["usage"]
        with pytest.raises(ReplicaStreamBroken) as e:
            await collect(replica, "cut")
        assert e.value.last_usage == chunk(5)["usage"]
        with pytest.raises(ReplicaUnavailable):
            await collect(replica, "garbage")
        assert seen["connections"] == 4 and replica.idle_connections == 0

    run(handler, test)


def test_a_reused_connection_lost_before_answering_is_retried_once_on_a_new_one() -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(sse(chunk(1))), sse(chunk(1)))

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Answers one request per connection; a second one on it finds the connection being
        # closed (what a keep-alive timeout racing a new request looks like to the client).
        if await read_request(reader) is not None:
            writer.write(ok)
            await writer.drain()
        await read_request(reader)

    async def test(replica: VLLMReplica, seen: dict[str, int]) -> None:
        for i in range(3):
            assert len(await collect(replica, str(i))) == 1
        assert seen["connections"] == 3  # the 2nd and 3rd requests each retried once

    run(handler, test)


def test_abort_half_closes_and_counts_what_the_server_still_sends() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(chunked(sse(chunk(1), done=False), last=False))
        await writer.drain()
        assert await reader.read() == b""  # the client's FIN: it left
        # what the engine had produced before it heard still goes out, then the close
        writer.write(chunked(sse(chunk(2), chunk(3), done=False), last=False))
        await writer.drain()

    async def test(replica: VLLMReplica, seen: dict[str, int]) -> None:
        exchange = await replica.open_chat({}, request_id="a", cache_salt="s")
        first = await anext(exchange)
        assert first["usage"]["completion_tokens"] == 1
        await exchange.abort(drain_s=2.0)
        assert exchange.ended and exchange.last_usage is not None
        assert exchange.last_usage["completion_tokens"] == 3
        assert replica.idle_connections == 0  # half-closed: never reused

    run(handler, test)


def test_a_failing_sink_stops_the_generation_and_reaches_the_caller() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(chunked(sse(chunk(1), done=False), last=False))
        await writer.drain()
        assert await reader.read() == b""  # the client dropped the connection

    async def test(replica: VLLMReplica, seen: dict[str, int]) -> None:
        exchange = await replica.open_chat({}, request_id="f", cache_salt="s")

        def sink(_: dict[str, Any]) -> None:
            raise KeyError("boom")

        with pytest.raises(KeyError):
            await asyncio.wait_for(exchange.run(sink), 2)

    run(handler, test)


def test_iterator_exchange_delivers_in_order_and_abort_cancels_the_engine() -> None:
    async def main() -> None:
        stopped = asyncio.Event()

        async def engine(n: int, hang: bool) -> AsyncIterator[dict[str, Any]]:
            try:
                for i in range(1, n + 1):
                    yield chunk(i)
                    await asyncio.sleep(0)
                if hang:
                    await asyncio.sleep(60)
            finally:
                stopped.set()

        whole = IteratorExchange(engine(5, hang=False))
        got: list[dict[str, Any]] = []
        await whole.run(got.append)
        assert [c["usage"]["completion_tokens"] for c in got] == [1, 2, 3, 4, 5]

        stopped.clear()
        hanging = IteratorExchange(engine(3, hang=True))
        assert (await anext(hanging))["usage"]["completion_tokens"] == 1
        await asyncio.sleep(0.01)
        await hanging.abort()
        assert stopped.is_set() and hanging.ended
        assert hanging.last_usage is not None and hanging.last_usage["completion_tokens"] == 3

        async def failing() -> AsyncIterator[dict[str, Any]]:
            yield chunk(1)
            raise RuntimeError("engine died")

        broken = IteratorExchange(failing())
        await broken.prime()
        assert (await anext(broken))["usage"]["completion_tokens"] == 1
        with pytest.raises(RuntimeError):
            await anext(broken)

    asyncio.run(main())
