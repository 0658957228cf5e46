"""`tollgate predictor generate`: realistic traffic for training and judging the predictor, sent
over HTTP to a running Tollgate in front of simulated replicas, so that the event log holds
what the real path recorded.

Three tenants whose answer lengths differ the way real products do (every client sends
`max_tokens=4096` whatever it expects back, as SDK wrappers do):

- `chat`: six assistants (system prompts), each with its own typical answer length (median
  40 to 450 tokens), spread lognormally (σ 0.35) around it; one to four turns.
- `summarisation`: documents of 1,500-6,000 tokens (median 3,000) summarised to about 7 %
  of their length (σ 0.25); two system prompts.
- `agents`: an agent loop behind one system prompt (its tool definitions): most steps are
  short tool calls (median 60, σ 0.35); 15 % are final answers (median 600, σ 0.6), which
  makes the long tail nothing in the request's shape announces.

The answer length reaches the simulated model as an instruction in the last user message
("... in about N words"), which it follows with σ 0.15 (SimConfig.length_follow_sigma); the
predictor never sees prompt text, only the request's shape and the tenant's own history.
Everything is drawn from one `random.Random(seed)`: the same seed sends the same requests.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from tollgate_llm.loadgen.prompts import nonce_words, words

TENANT_KINDS = ("chat", "summarisation", "agents")
SHARES = {"chat": 0.45, "summarisation": 0.35, "agents": 0.20}  # of the requests
MAX_TOKENS = 4096
_CHAT_MEDIANS = (40, 90, 150, 220, 320, 450)


@dataclass(frozen=True)
class Planned:
    kind: str
    key_index: int
    messages: list[dict[str, Any]]
    asked_tokens: int


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


def _text(rng: random.Random, n_words: int) -> str:
    return nonce_words(rng.getrandbits(64)) + " " + words(max(1, n_words), rng.randrange(65_536))


def _system(kind: str, app: int, n_words: int) -> dict[str, Any]:
    # Fixed text per (kind, app): the same system prompt every time, as a product sends it.
    offset = 7919 * (TENANT_KINDS.index(kind) * 16 + app)
    return {"role": "system", "content": words(n_words, offset)}


def plan_request(kind: str, rng: random.Random) -> Planned:
    """One request of a tenant of `kind`, and the answer length its prompt asks for."""
    key_index = rng.randrange(2)
    if kind == "chat":
        app = rng.randrange(len(_CHAT_MEDIANS))
        asked = _lognormal(rng, _CHAT_MEDIANS[app], 0.35)
        turns = rng.randint(1, 4)
        messages = [_system(kind, app, 60 + 20 * app)]
        for _ in range(turns - 1):
            messages.append({"role": "user", "content": _text(rng, rng.randint(10, 80))})
            messages.append({"role": "assistant", "content": _text(rng, rng.randint(20, 200))})
        last = _text(rng, int(_lognormal(rng, 60, 0.6)) + 5)
    elif kind == "summarisation":
        app = rng.randrange(2)
        # At most 6,000: the document and its answer fit an 8k context.
        document = int(min(6_000, max(1_500, _lognormal(rng, 3_000, 0.4))))
        asked = 0.07 * document * math.exp(rng.gauss(0.0, 0.25))
        messages = [_system(kind, app, 40)]
        last = _text(rng, document)
    elif kind == "agents":
        steps = rng.randint(0, 6)
        final = rng.random() < 0.15
        asked = _lognormal(rng, 600, 0.6) if final else _lognormal(rng, 60, 0.35)
        messages = [_system(kind, 0, 600)]
        messages.append({"role": "user", "content": _text(rng, rng.randint(20, 120))})
        for _ in range(steps):
            messages.append({"role": "assistant", "content": _text(rng, rng.randint(20, 80))})
            messages.append({"role": "user", "content": _text(rng, rng.randint(50, 400))})
        last = None
    else:
        raise ValueError(f"unknown tenant kind {kind!r}")
    asked_tokens = int(min(MAX_TOKENS - 1, max(1, round(asked))))
    instruction = f"Answer in about {asked_tokens} words."
    if last is None:
        messages[-1] = {**messages[-1], "content": messages[-1]["content"] + " " + instruction}
    else:
        messages.append({"role": "user", "content": last + " " + instruction})
    return Planned(kind, key_index, messages, asked_tokens)


@dataclass
class Report:
    sent: int = 0
    statuses: Counter[int] | None = None
    output_tokens: dict[str, list[int]] | None = None
    seconds: float = 0.0


async def drive(
    url: str,
    keys: dict[str, list[str]],
    model: str,
    *,
    requests: int,
    rate_per_s: float,
    concurrency: int,
    seed: int,
    progress: Callable[[int], None] | None = None,
) -> Report:
    """Send `requests` requests, Poisson arrivals at `rate_per_s`, tenants by `SHARES`; at most
    `concurrency` in flight (an arrival waits for a slot: the rate is then lower, never the
    request dropped)."""
    rng = random.Random(seed)
    kinds = list(SHARES)
    weights = [SHARES[k] for k in kinds]
    report = Report(statuses=Counter(), output_tokens={k: [] for k in kinds})
    slots = asyncio.Semaphore(concurrency)
    loop = asyncio.get_running_loop()
    started = loop.time()
    tasks: set[asyncio.Task[None]] = set()
    async with httpx.AsyncClient(
        base_url=url, timeout=120, limits=httpx.Limits(max_connections=concurrency)
    ) as client:

        async def send(p: Planned) -> None:
            try:
                body = {"model": model, "messages": p.messages, "max_tokens": MAX_TOKENS,
                        "stream": False}  # fmt: skip
                r = await client.post(
                    "/v1/chat/completions", json=body,
                    headers={"Authorization": f"Bearer {keys[p.kind][p.key_index]}"},
                )  # fmt: skip
                assert report.statuses is not None and report.output_tokens is not None
                report.statuses[r.status_code] += 1
                if r.status_code == 200:
                    report.output_tokens[p.kind].append(r.json()["usage"]["completion_tokens"])
            except httpx.HTTPError:
                assert report.statuses is not None
                report.statuses[0] += 1
            finally:
                slots.release()

        due = started
        for i in range(requests):
            due += rng.expovariate(rate_per_s)
            planned = plan_request(rng.choices(kinds, weights)[0], rng)
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await slots.acquire()
            task = asyncio.create_task(send(planned))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            report.sent += 1
            if progress is not None and (i + 1) % 500 == 0:
                progress(i + 1)
        if tasks:
            await asyncio.gather(*tasks)
    report.seconds = loop.time() - started
    return report
