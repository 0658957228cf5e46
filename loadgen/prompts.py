"""Prompts of a target token length.

The simulated engine counts one token per started four characters of each word, one per
punctuation character, 4 template tokens per message and 3 for the generation prompt
(`count_prompt_tokens` in engine_adapter/simulator/tokenizer.py). Every word here is exactly four
lowercase letters or hex digits, so a message of n words is n text tokens and a prompt of T tokens
is exact on the simulator (a real tokenizer will differ by a few percent; the shape is what
matters).

Each request starts with a unique 4-word nonce so that unrelated requests do not share
prefix-cache blocks (seed 002 §7: offline cache hit rates inflated by repeated synthetic prompts);
a class with `shared_prefix_tokens` sends a per-tenant system prompt that does hit the cache.
"""

from __future__ import annotations

import random
from typing import Any

TEMPLATE_TOKENS_PER_MESSAGE = 4
GENERATION_PROMPT_TOKENS = 3
_POOL_WORDS = 65_536


def _make_pool(seed: int = 20_261_129) -> str:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = ["".join(rng.choice(letters) for _ in range(4)) for _ in range(4_096)]
    return " ".join(rng.choice(vocab) for _ in range(_POOL_WORDS)) + " "


_POOL = _make_pool()  # every word is 4 characters + 1 space: word i starts at 5*i


def words(n: int, offset: int) -> str:
    """n pool words starting at word `offset` (wrapping), separated by single spaces."""
    if n <= 0:
        return ""
    offset %= _POOL_WORDS
    end = offset + n
    reps = end // _POOL_WORDS + 1
    text = _POOL * reps if reps > 1 else _POOL
    return text[5 * offset : 5 * end - 1]


def nonce_words(value: int) -> str:
    return " ".join(f"{(value >> (16 * i)) & 0xFFFF:04x}" for i in range(4))


def build_messages(target_tokens: int, rng: random.Random, shared_prefix_tokens: int = 0,
                   prefix_key: str = "") -> list[dict[str, Any]]:
    """Messages the simulated engine counts as exactly `target_tokens` (minimum 8 with one
    message; up to 4 words of it are the unique nonce)."""
    messages: list[dict[str, Any]] = []
    budget = target_tokens - GENERATION_PROMPT_TOKENS
    room = budget - shared_prefix_tokens
    if shared_prefix_tokens > 0 and room >= TEMPLATE_TOKENS_PER_MESSAGE * 2 + 4:
        key = sum(prefix_key.encode()) * 7919
        messages.append({"role": "system",
                         "content": words(shared_prefix_tokens, key)})
        budget -= TEMPLATE_TOKENS_PER_MESSAGE + shared_prefix_tokens
    n_words = max(1, budget - TEMPLATE_TOKENS_PER_MESSAGE)
    nonce = nonce_words(rng.getrandbits(64)).split()[: min(4, n_words)]
    body = words(n_words - len(nonce), rng.randrange(_POOL_WORDS))
    content = " ".join(nonce) + (f" {body}" if body else "")
    messages.append({"role": "user", "content": content})
    return messages


def expected_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """The simulator's count for messages built here (words of <= 4 characters)."""
    return GENERATION_PROMPT_TOKENS + sum(
        TEMPLATE_TOKENS_PER_MESSAGE + len(m["content"].split()) for m in messages
    )
