"""The simulated engine's tokenizer: a deterministic word splitter, not a real BPE.

A word piece is a run of word characters (one token per started four characters) or one
punctuation character. The gateway's estimator uses the same count; billing never does.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from typing import Any

_PIECE_RE = re.compile(r"\w+|[^\w\s]")
# Chat-template overhead: <|im_start|> role \n ... <|im_end|> per message, plus the generation
# prompt "<|im_start|>assistant\n" that add_generation_prompt appends.
TEMPLATE_TOKENS_PER_MESSAGE = 4
GENERATION_PROMPT_TOKENS = 3
VOCAB_SIZE = 151_000
_SPECIAL_BASE = 150_000  # ids of template tokens; text ids stay below this


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def count_text_tokens(text: str) -> int:
    n = 0
    for piece in _PIECE_RE.findall(text):
        n += (len(piece) + 3) // 4
    return n


def count_prompt_tokens(messages: Sequence[Any]) -> int:
    """Prompt tokens the simulator charges for `messages` (chat template included). Pure."""
    n = GENERATION_PROMPT_TOKENS
    for message in messages:
        n += TEMPLATE_TOKENS_PER_MESSAGE + count_text_tokens(_message_text(message))
    return n


def text_token_ids(text: str, out: list[int]) -> None:
    for piece in _PIECE_RE.findall(text):
        raw = piece.encode()
        for i in range(0, len(piece), 4):
            out.append(zlib.crc32(raw[i : i + 4], i) % _SPECIAL_BASE)


def prompt_token_ids(messages: Sequence[Any]) -> list[int]:
    """The token ids behind `count_prompt_tokens` (same length), used for prefix-cache hashing."""
    ids: list[int] = []
    for message in messages:
        role = message.get("role", "") if isinstance(message, dict) else ""
        ids.append(_SPECIAL_BASE)
        ids.append(_SPECIAL_BASE + 10 + zlib.crc32(str(role).encode()) % 100)
        ids.append(_SPECIAL_BASE + 1)
        text_token_ids(_message_text(message), ids)
        ids.append(_SPECIAL_BASE + 2)
    ids.extend((_SPECIAL_BASE, _SPECIAL_BASE + 11, _SPECIAL_BASE + 1))
    return ids
