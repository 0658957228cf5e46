"""A TCP proxy for the network-fault tests, run in a thread of its own: it forwards between its
clients and one upstream, and `mode` says what the network does meanwhile — `pass`, `latency`
(each chunk held `delay_s`), `blackhole` (nothing forwarded, held until the mode changes: what
TCP does across a short partition) or `reset` (every open connection aborted with an RST, and
new ones too)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading


class FaultyProxy:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.upstream = (host, upstream_port)
        self.mode = "pass"
        self.delay_s = 0.2
        self.resets = 0
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        sock = socket.socket()
        sock.bind((host, 0))
        self.port = sock.getsockname()[1]
        self._sock = sock
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._client, sock=self._sock))
        self._loop.run_forever()
        server.close()

    def set_mode(self, mode: str) -> None:
        self.mode = mode
        if mode == "reset":
            self._loop.call_soon_threadsafe(self._reset_all)

    def _reset_all(self) -> None:
        for writer in list(self._writers):
            _abort(writer)
            self.resets += 1
        self._writers.clear()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "reset":
            _abort(writer)
            self.resets += 1
            return
        self._writers.add(writer)  # before the upstream connects: a close meanwhile aborts it
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            self._writers.discard(writer)
            _abort(writer)
            return
        if writer not in self._writers:  # reset or closed while connecting
            _abort(up_writer)
            return
        self._writers.add(up_writer)
        # Either side's end ends both: a half-open pair would keep a PostgreSQL backend (maybe
        # inside a transaction, holding its locks) alive after its client is gone.
        pipes = [asyncio.ensure_future(self._pipe(reader, up_writer)),
                 asyncio.ensure_future(self._pipe(up_reader, writer))]  # fmt: skip
        _, pending = await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        if pending:  # the other side's own close, passed on as a FIN, gets a moment to arrive
            await asyncio.wait(pending, timeout=1.0)
        for w in (writer, up_writer):
            self._writers.discard(w)
            _abort(w)
        for pipe in pipes:
            pipe.cancel()
        await asyncio.gather(*pipes, return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                while self.mode == "blackhole":
                    await asyncio.sleep(0.05)
                if self.mode == "latency":
                    await asyncio.sleep(self.delay_s)
                if writer.is_closing():
                    return
                writer.write(data)
                await writer.drain()
            if not writer.is_closing() and writer.can_write_eof():
                writer.write_eof()

    def close(self) -> None:
        """Aborts every open connection, then stops: a stopped loop would otherwise keep its
        sockets open, and a PostgreSQL backend behind one (perhaps inside a transaction, holding
        its locks) would live on until the test process ends."""

        def shut() -> None:
            for writer in list(self._writers):
                _abort(writer)
            self._writers.clear()
            # After the aborts' own callbacks, which close the sockets.
            self._loop.call_soon(self._loop.stop)

        self._loop.call_soon_threadsafe(shut)
        self._thread.join(5)


def _abort(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:  # SO_LINGER 0: close() sends an RST, not a FIN
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
