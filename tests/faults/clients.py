"""The client side of the network-fault tests: one chat completion, streamed or not, recorded as
an operation that ended ok, failed or unknown (the connection broke before the client could
tell), with the engine count the client was shown. The final read resolves the unknowns."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx


@dataclass
class Operation:
    stream: bool
    outcome: str = "unknown"  # ok / failed / unknown
    request_id: str | None = None
    completion_tokens: int | None = None  # the engine count the client was shown


def chat(base: str, headers: dict[str, str], op: Operation, body: dict[str, object]) -> None:
    """Send `body` (its `stream` set from the operation) and record how it ended in `op`."""
    body = {**body, "stream": op.stream}
    if op.stream:
        body["stream_options"] = {"include_usage": True}
    try:
        with (
            httpx.Client(timeout=httpx.Timeout(30, connect=5)) as client,
            client.stream(
                "POST", f"{base}/v1/chat/completions", headers=headers, json=body
            ) as r,
        ):
            op.request_id = r.headers.get("x-request-id")
            if r.status_code != 200:
                r.read()
                op.outcome = "failed"
                return
            if not op.stream:
                r.read()
                op.completion_tokens = r.json()["usage"]["completion_tokens"]
                op.outcome = "ok"
                return
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            if lines[-1] != "data: [DONE]" or any('"error"' in x[:20] for x in lines):
                op.outcome = "failed"
                return
            usage = json.loads(lines[-2][6:]).get("usage") or {}
            op.completion_tokens = usage.get("completion_tokens")
            op.outcome = "ok"
    except httpx.HTTPError:
        op.outcome = "unknown"
