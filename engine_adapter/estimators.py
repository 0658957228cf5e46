"""Token estimators (the edge's `TokenEstimator` port) that need no model files.

`WordTokenEstimator` counts exactly what the simulated replica counts (its word splitter and chat
framing), so admission estimates equal the simulator's engine counts; in front of a real model
it is only an approximation, and the model's own tokenizer should be configured instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tollgate_llm.engine_adapter.simulator.tokenizer import count_prompt_tokens


class WordTokenEstimator:
    def prompt_tokens(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> int:
        return count_prompt_tokens(messages)
