"""The completions route's disconnect watch, under the server Tollgate ships (uvicorn with
httptools): it cancels the request when the client leaves, and when the response completes it
ends on its own (uvicorn answers the pending `receive` with http.disconnect), so it is never
cancelled itself: a cancelled task leaves a reference cycle for the garbage collector."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import aiohttp
import uvicorn

from tollgate_llm.api.http.app import _DisconnectWatch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _serve(app: Any, port: int) -> tuple[uvicorn.Server, asyncio.Task[None]]:
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, loop="none", http="httptools", lifespan="off",
        log_level="warning",
    )
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task


def test_the_watch_ends_with_the_response_and_fires_on_a_disconnect() -> None:
    watches: list[_DisconnectWatch] = []
    cancelled: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        watch = _DisconnectWatch(receive)
        watches.append(watch)
        try:
            if scope["path"] == "/slow":
                await asyncio.sleep(30)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
        except asyncio.CancelledError:
            cancelled.append(scope["path"])
            raise
        finally:
            watch.stop()

    async def main() -> None:
        port = _free_port()
        server, task = await _serve(app, port)
        try:
            async with aiohttp.ClientSession() as http:  # one keep-alive connection
                for _ in range(20):
                    async with http.get(f"http://127.0.0.1:{port}/fast") as resp:
                        assert await resp.read() == b"ok"
                await asyncio.sleep(0.05)
                assert len(watches) == 20
                assert all(w._task.done() and not w._task.cancelled() for w in watches)
                assert not any(w.fired for w in watches) and cancelled == []

                with_timeout = aiohttp.ClientTimeout(total=0.3)
                with contextlib.suppress(TimeoutError):  # the client gives up and leaves
                    await http.get(f"http://127.0.0.1:{port}/slow", timeout=with_timeout)
                for _ in range(100):
                    if cancelled:
                        break
                    await asyncio.sleep(0.02)
                assert cancelled == ["/slow"] and watches[-1].fired
        finally:
            server.should_exit = True
            await task

    asyncio.run(main())
