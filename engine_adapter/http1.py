"""A small keep-alive HTTP/1.1 client for the replica hot path.

One `asyncio.Protocol` per connection; httptools (the C parser uvicorn uses, already a dependency
through `uvicorn[standard]`) parses the response inside `data_received`, and the body goes
straight to the request's listener there. No stream reader, no task per read: a streamed
generation of 18 chunks costs 18 callbacks and one wake-up of the waiting task, where aiohttp's
`ClientResponse.content` costs 18 wake-ups and its Python reader layers (0.26 vs 0.43 ms of
client CPU per 16-token generation, measured; `python -m bench.upstream_client`).

It does only what a vLLM replica needs: POST with a body, a status, a body read as it arrives
(chunked or sized), keep-alive, half-close to abort. /metrics and /health stay on aiohttp.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from typing import Protocol
from urllib.parse import urlsplit

import httptools

from tollgate_llm.ledger import faults

# vLLM's uvicorn closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); a connection
# idle for longer than this is not reused, so a request never races the server's close.
IDLE_S = 4.0


class Listener(Protocol):
    """What one request's response is told, in order: status, body pieces, then one end."""

    def on_status(self, status: int) -> None: ...
    def on_body(self, data: bytes) -> None: ...
    def on_complete(self) -> None: ...
    def on_lost(self, reason: str, answered: bool) -> None: ...


class Connection(asyncio.Protocol):
    """One connection to the origin, one request at a time."""

    __slots__ = ("_pool", "_transport", "_parser", "_listener", "_answered", "closed",
                 "half_closed", "idle_since", "requests")  # fmt: skip

    def __init__(self, pool: Http1Pool) -> None:
        self._pool = pool
        self._transport: asyncio.Transport | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self._listener: Listener | None = None
        self._answered = False
        self.closed = False
        self.half_closed = False
        self.idle_since = 0.0
        self.requests = 0  # sent on this connection; > 1 means it was kept alive and reused

    # --- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    @faults.seam("engine.stream")
    def data_received(self, data: bytes) -> None:
        if self._parser is None:  # bytes nobody asked for: the connection is not reusable
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._lose(f"unparsable response: {exc}")
            self.close()

    def eof_received(self) -> bool:
        return False  # the server is done with the connection: close it

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.discard(self)
        self._lose(f"{type(exc).__name__}: {exc}" if exc is not None else "connection closed")

    # --- httptools callbacks -----------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self._answered = True
        if self._listener is not None and self._parser is not None:
            self._listener.on_status(self._parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self._listener is not None:
            self._listener.on_body(body)

    def on_message_complete(self) -> None:
        listener, parser = self._listener, self._parser
        self._listener = self._parser = None
        self.resume_reading()  # a kept-alive connection is read again by its next request
        keep = parser is not None and parser.should_keep_alive()
        if listener is not None:
            listener.on_complete()
        if keep and not self.half_closed and not self.closed:
            self._pool.release(self)
        else:
            self.close()

    # --- the request side --------------------------------------------------------------------

    def send(self, request: bytes, listener: Listener) -> None:
        assert self._transport is not None and self._listener is None
        self._listener = listener
        self._answered = False
        self.requests += 1
        self._parser = httptools.HttpResponseParser(self)
        self._transport.write(request)

    def half_close(self) -> None:
        """Send our FIN: a server reading EOF takes it as the client leaving (vLLM aborts the
        request), and may still send what it had written. Closes outright if it can't."""
        self.half_closed = True
        transport = self._transport
        if transport is not None and not self.closed and transport.can_write_eof():
            try:
                transport.write_eof()
                return
            except OSError:
                pass
        self.close()

    def pause_reading(self) -> None:
        """Stop reading the response (the reader's buffer is full): TCP's window then holds the
        server back."""
        transport = self._transport
        if transport is not None and not transport.is_closing() and transport.is_reading():
            transport.pause_reading()

    def resume_reading(self) -> None:
        transport = self._transport
        if transport is not None and not transport.is_closing() and not transport.is_reading():
            transport.resume_reading()

    def close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def forget(self, listener: Listener) -> None:
        """`listener` no longer wants callbacks (the caller gave up on it); the connection is
        closed since the rest of its response would be unread."""
        if self._listener is listener:
            self._listener = None
            self._parser = None
            self.close()

    def _lose(self, reason: str) -> None:
        listener, self._listener, self._parser = self._listener, None, None
        if listener is not None:
            listener.on_lost(reason, self._answered)


class Http1Pool:
    """Keep-alive connections to one origin (`http://host:port/prefix` or https)."""

    __slots__ = ("host", "port", "prefix", "authority", "connect_timeout_s", "_ssl", "_idle",
                 "_closed")  # fmt: skip

    def __init__(self, url: str, *, connect_timeout_s: float = 2.0) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        secure = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if secure else 80)
        self.prefix = parts.path.rstrip("/").encode()
        self.authority = parts.netloc.encode()
        self.connect_timeout_s = connect_timeout_s
        self._ssl = ssl.create_default_context() if secure else None
        self._idle: list[Connection] = []
        self._closed = False

    def request(self, method: bytes, path: bytes, headers: bytes, body: bytes) -> bytes:
        """The whole request; `headers` are complete `Name: value\\r\\n` lines."""
        return b"%s %s%s HTTP/1.1\r\nHost: %s\r\n%sContent-Length: %d\r\n\r\n%s" % (
            method, self.prefix, path, self.authority, headers, len(body), body,
        )  # fmt: skip

    async def acquire(self) -> Connection:
        """An idle kept-alive connection (most recently used first) or a new one. Raises
        OSError or TimeoutError when the origin can not be reached."""
        now = time.monotonic()
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_S:
                return conn
            conn.close()
        return await self.connect()

    async def connect(self) -> Connection:
        """A new connection."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            _, conn = await loop.create_connection(
                lambda: Connection(self), self.host, self.port, ssl=self._ssl
            )
        return conn

    def release(self, conn: Connection) -> None:
        if self._closed:  # the replica was removed or the fleet stopped meanwhile
            conn.close()
            return
        now = time.monotonic()
        conn.idle_since = now
        idle = self._idle
        while idle and now - idle[0].idle_since >= IDLE_S:  # the oldest go first
            idle.pop(0).close()
        idle.append(conn)

    def discard(self, conn: Connection) -> None:
        if conn in self._idle:
            self._idle.remove(conn)

    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    def close(self) -> None:
        """Close the idle connections; those in use close when their request ends."""
        self._closed = True
        while self._idle:
            self._idle.pop().close()


__all__ = ["IDLE_S", "Connection", "Http1Pool", "Listener"]
