"""Every route's body is bounded while it is read (issue 27, item 1): three parallel 64 MiB
bodies, sent chunked without a length, to `POST /v1/runs` (limit 16 KiB) are refused with 413
and the edge's memory does not grow by their size; a declared length over the limit is refused
before the body is read; a body within its limit still reaches its route."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import FAST, MODEL, Server, auth, running_server

pytestmark = pytest.mark.e2e

MIB = 1024 * 1024


def _peak_rss_mib(pid: int) -> float:
    """The process's peak resident set (VmHWM): a body buffered and freed again shows here."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _chunks(total_mib: int) -> Iterator[bytes]:
    block = b"x" * MIB
    for _ in range(total_mib):
        yield block


def _send_big(base: str, key: str) -> int | str:
    try:
        r = httpx.post(
            f"{base}/v1/runs", content=_chunks(64), timeout=60,
            headers={**auth(key), "Content-Type": "application/json"},
        )  # fmt: skip
        return r.status_code
    except httpx.HTTPError as exc:  # the edge answered and closed while we still sent
        return type(exc).__name__


def test_large_bodies_are_refused_while_read_and_memory_stays_flat(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    with running_server(tmp_path_factory, "bodies", [(MODEL, FAST)]) as server:
        assert server.proc is not None
        key = server.keys["demo-standard"]
        # A fresh edge, one request served: its peak so far is its working size.
        httpx.get(f"{server.base}/v1/runs/run_x", headers=auth(key), timeout=30)
        before = _peak_rss_mib(server.proc.pid)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            outcomes = list(pool.map(lambda _: _send_big(server.base, key), range(3)))
        after = _peak_rss_mib(server.proc.pid)
    assert all(o == 413 or isinstance(o, str) for o in outcomes), outcomes
    # 192 MiB were offered; the edge kept at most 16 KiB of each.
    assert after - before < 32, (before, after)


def test_a_declared_length_over_the_limit_is_refused_before_the_body(server: Server) -> None:
    key = server.keys["demo-standard"]
    with httpx.Client(base_url=server.base, timeout=30) as client:
        request = client.build_request(
            "POST", "/v1/batches", content=b"{" + b" " * (128 * 1024) + b"}",
            headers={**auth(key), "Content-Type": "application/json"},
        )  # fmt: skip
        r = client.send(request)
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"
        ok = client.post("/v1/runs", json={"name": "small"}, headers=auth(key))
        assert ok.status_code != 413, ok.text
