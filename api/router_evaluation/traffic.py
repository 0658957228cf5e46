"""Generated traffic with a known ground truth for `tollgate router evaluate`: each request is of
a task kind whose true quality on each model is set here, so which model is good enough for it
is known (the oracle), and the customer's feedback is drawn from that truth.

Seven task kinds, told apart at admission only by what a task class sees (the system prompt,
the prompt's length band, tools, the response format): a short FAQ answer and a JSON
extraction the small model does well; a summary it does a little above the bar; a schema
classification just under it; a tool-using agent and a long reasoning task it does badly.
Three tenants mix them differently. `drift_at`: from that share of the traffic on, extraction
prompts get harder for the small model (0.90 -> 0.60), as live prompts can be harder than the
ones the statistics were gathered on. Everything is drawn from one `random.Random(seed)`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from tollgate_llm.loadgen.prompts import nonce_words, words

SMALL = "llama-3.1-8b"
LARGE = "llama-3.1-70b"
MODELS = (SMALL, LARGE)
# The demo list prices (api/serve.py), per million tokens in micro-units: prompt, completion,
# cached.
PRICES = {SMALL: (150_000, 600_000, 75_000), LARGE: (900_000, 2_700_000, 450_000)}
# Each model's decode speed, for how long a request holds its KV: TTFT, then per output token.
SPEED_MS = {SMALL: (60, 12), LARGE: (200, 35)}


@dataclass(frozen=True)
class Kind:
    name: str
    app: int  # its system prompt (one per kind)
    prompt_words: int  # median of the user's part
    tools: bool
    response_format: str
    output_tokens: int  # median answer
    quality: tuple[float, float]  # true mean score on (SMALL, LARGE)


KINDS = (
    Kind("faq", 0, 60, False, "text", 80, (0.93, 0.96)),
    Kind("extract", 1, 400, False, "json_object", 60, (0.90, 0.95)),
    Kind("summarise", 2, 1_800, False, "text", 200, (0.87, 0.93)),
    Kind("classify", 3, 150, False, "json_schema", 20, (0.76, 0.94)),
    Kind("agent", 4, 600, True, "text", 120, (0.62, 0.90)),
    Kind("reasoning", 5, 5_000, False, "text", 500, (0.70, 0.88)),
    Kind("chat", 6, 150, False, "text", 250, (0.85, 0.91)),
)
DRIFTING = "extract"
DRIFTED_SMALL_QUALITY = 0.60
# Each tenant's mix of kinds (weights in KINDS' order).
TENANTS = {
    "eval-support": (40, 5, 5, 10, 0, 0, 40),
    "eval-docs": (5, 40, 35, 15, 0, 0, 5),
    "eval-agents": (5, 5, 0, 10, 45, 30, 5),
}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


@dataclass(frozen=True)
class Planned:
    at_s: float  # arrival, seconds from the start
    tenant: str
    kind: Kind
    body: dict[str, Any]  # the chat request, without its model
    output_tokens: int
    drifted: bool  # the ground truth after the drift

    def quality(self, model: str) -> float:
        """The true mean score of `model` on this request (`model`: a base name)."""
        small, large = self.kind.quality
        if self.drifted and self.kind.name == DRIFTING:
            small = DRIFTED_SMALL_QUALITY
        return small if model == SMALL else large

    def good_enough(self, bar: float) -> str:
        """The oracle's model: the cheapest whose true quality meets the bar."""
        return SMALL if self.quality(SMALL) >= bar else LARGE


def generate(requests: int, rate_per_s: float, seed: int, drift_at: float | None) -> list[Planned]:
    rng = random.Random(seed)
    tenants = list(TENANTS)
    at = 0.0
    out = []
    for i in range(requests):
        at += rng.expovariate(rate_per_s)
        tenant = rng.choice(tenants)
        kind = rng.choices(KINDS, TENANTS[tenant])[0]
        answer = max(1, round(kind.output_tokens * math.exp(rng.gauss(0.0, 0.5))))
        drifted = drift_at is not None and i >= drift_at * requests
        out.append(Planned(at, tenant, kind, _body(kind, rng), answer, drifted))
    return out


def _body(kind: Kind, rng: random.Random) -> dict[str, Any]:
    # The same system prompt for every request of a kind, as a product sends it.
    system = words(40 + 10 * kind.app, 7919 * (kind.app + 1))
    n = max(5, round(kind.prompt_words * math.exp(rng.gauss(0.0, 0.3))))
    user = nonce_words(rng.getrandbits(64)) + " " + words(n, rng.randrange(65_536))
    body: dict[str, Any] = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 4 * kind.output_tokens,
    }
    if kind.tools:
        body["tools"] = TOOLS
    if kind.response_format == "json_schema":
        schema = {"name": "label", "schema": {"type": "object"}}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif kind.response_format != "text":
        body["response_format"] = {"type": kind.response_format}
    return body
